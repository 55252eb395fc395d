//! Reading LoRA weights out of an `adapter_model.safetensors` and checking them against the base
//! model. Shared by the two ways an adapter is loaded: the PEFT path ([`crate::peft`]), which
//! finds the tensors and their scaling through `adapter_config.json`, and the manifest path
//! ([`crate::validated`]), which finds them through the manifest written at upload.

use std::io::Read;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::{AdapterError, AdapterLimits, BaseShape, LoraModule, TargetModule};

pub(crate) const PREFIX: &str = "base_model.model.model.layers.";

/// Which matrix of a LoRA pair a tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    A,
    B,
}

/// Splits a tensor name into (layer, module, A or B); `Err` says why the name is refused.
pub(crate) fn parse_tensor_name(name: &str) -> Result<(usize, TargetModule, Half), String> {
    let refuse = || {
        format!(
            "not a LoRA weight of a decoder projection: expected \
             `{PREFIX}<L>.<self_attn|mlp>.<q|k|v|o|gate|up|down>_proj.lora_<A|B>[.default].weight` \
             (embeddings, lm_head, norms and biases are not supported)"
        )
    };
    let rest = name.strip_prefix(PREFIX).ok_or_else(refuse)?;
    let parts: Vec<&str> = rest.split('.').collect();
    let (layer, parent, module, half) = match parts.as_slice() {
        [layer, parent, module, half, "weight"] | [layer, parent, module, half, "default", "weight"] => (*layer, *parent, *module, *half),
        [_, _, _, "lora_A" | "lora_B", adapter, "weight"] => {
            return Err(format!("adapter name `{adapter}`: only a single adapter, saved as `default` or unnamed, is supported"));
        }
        _ => return Err(refuse()),
    };
    let layer: usize = layer.parse().ok().filter(|_| layer.bytes().all(|b| b.is_ascii_digit())).ok_or_else(refuse)?;
    let module = TargetModule::from_hf_name(module).ok_or_else(refuse)?;
    if module.hf_parent() != parent {
        return Err(refuse());
    }
    let half = match half {
        "lora_A" => Half::A,
        "lora_B" => Half::B,
        _ => return Err(refuse()),
    };
    Ok((layer, module, half))
}

/// Reads the whole file at `path` unless it is longer than `cap` bytes, in which case the error
/// is `too_big(size)`. The size is checked before anything is read, and again while reading, so
/// a file that grows in the meantime is not read past the cap.
pub(crate) fn read_capped(path: &Path, cap: u64, too_big: impl FnOnce(u64) -> AdapterError) -> Result<Vec<u8>, AdapterError> {
    let io = |source| AdapterError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    if size > cap {
        return Err(too_big(size));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > cap {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The bytes of the weights file at `path`, refused above `limits.max_file_bytes`.
pub(crate) fn read_weights(path: &Path, limits: &AdapterLimits) -> Result<Vec<u8>, AdapterError> {
    read_capped(path, limits.max_file_bytes, |size| AdapterError::Safetensors {
        path: path.to_path_buf(),
        reason: format!("{size} bytes exceeds the limit of {} bytes", limits.max_file_bytes),
    })
}

/// The weights file being read, and what its tensors are checked against.
pub(crate) struct Weights<'a> {
    pub path: &'a Path,
    pub st: SafeTensors<'a>,
    pub base: &'a BaseShape,
    pub limits: &'a AdapterLimits,
}

impl<'a> Weights<'a> {
    /// Parses the safetensors header of `bytes`, read from `path`.
    pub(crate) fn parse(path: &'a Path, bytes: &'a [u8], base: &'a BaseShape, limits: &'a AdapterLimits) -> Result<Self, AdapterError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| AdapterError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
        Ok(Weights { path, st, base, limits })
    }

    /// Reads and checks the lora_A/lora_B pair of `(layer, module)`, named `a_name` and `b_name`
    /// in the file:
    /// - `layer` exists in the base model;
    /// - lora_A is `[r, in]` with `in` the base's input size and `0 < r <= max_rank`; lora_B is
    ///   `[out, r]` with `out` the base's output size;
    /// - `scaling(r)` applies the caller's rules for that rank (`rank_pattern`, the manifest's
    ///   rank, alpha) and gives `(alpha, scaling)`, or the error to return;
    /// - the data is f32, f16 or bf16, every value is finite, and so is every `scaling * b`
    ///   computed in f32: that product is what the device stores.
    pub(crate) fn module(
        &self,
        layer: usize,
        module: TargetModule,
        a_name: &str,
        b_name: &str,
        scaling: impl FnOnce(usize) -> Result<(f32, f32), AdapterError>,
    ) -> Result<LoraModule, AdapterError> {
        let (path, base) = (self.path, self.base);
        if layer >= base.num_layers {
            return Err(AdapterError::tensor(path, a_name, format!("layer {layer} does not exist: the base model has {} layers", base.num_layers)));
        }
        let (in_f, out_f) = base.dims(module);
        let a_view = self.st.tensor(a_name).map_err(|e| AdapterError::tensor(path, a_name, e.to_string()))?;
        let rank = match a_view.shape() {
            &[r, i] if i == in_f => r,
            &[_, i] => {
                return Err(AdapterError::tensor(path, a_name, format!("in_features {i} does not match the base `{}` input size {in_f}", module.hf_name())));
            }
            s => {
                return Err(AdapterError::tensor(path, a_name, format!("shape {s:?} is not [r, in]")));
            }
        };
        if rank == 0 {
            return Err(AdapterError::tensor(path, a_name, "rank 0"));
        }
        if rank > self.limits.max_rank {
            return Err(AdapterError::tensor(path, a_name, format!("rank {rank} exceeds the limit of {}", self.limits.max_rank)));
        }
        let b_shape = self.st.tensor(b_name).map_err(|e| AdapterError::tensor(path, b_name, e.to_string()))?.shape().to_vec();
        if b_shape != [out_f, rank] {
            return Err(AdapterError::tensor(
                path,
                b_name,
                format!("shape {b_shape:?}, expected [{out_f}, {rank}] (base `{}` output size, lora_A rank)", module.hf_name()),
            ));
        }
        let (alpha, scaling) = scaling(rank)?;
        if !scaling.is_finite() {
            // The callers refuse this with their own key; kept here so no path stores it.
            return Err(AdapterError::tensor(path, b_name, format!("scaling {scaling:?} is not finite")));
        }
        let a = self.read_f32(a_name, rank, in_f)?;
        let b = self.read_f32(b_name, out_f, rank)?;
        if let Some(i) = b.iter().position(|&v| !(scaling * v).is_finite()) {
            return Err(AdapterError::tensor(path, b_name, format!("value {:?} at flat index {i} times the scaling {scaling:?} is not finite in f32", b[i])));
        }
        let gain = gain(&a, in_f, &b, rank, scaling);
        if gain.is_nan() || gain > f64::from(MAX_GAIN) {
            return Err(AdapterError::tensor(
                path,
                b_name,
                format!(
                    "with lora_A it can amplify an input {gain:.3e} times (the largest row sum of |lora_A| times the largest row sum of |scaling * lora_B|); at most {MAX_GAIN:e} is accepted: trained adapters are far below it, and past it a forward can overflow"
                ),
            ));
        }
        Ok(LoraModule { layer, module, rank, alpha, scaling, in_features: in_f, out_features: out_f, a, b })
    }

    /// The tensor's data as f32, checking dtype, shape and finiteness.
    fn read_f32(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, AdapterError> {
        let err = |reason: String| AdapterError::tensor(self.path, name, reason);
        let view = self.st.tensor(name).map_err(|e| err(e.to_string()))?;
        if view.shape() != [rows, cols] {
            return Err(err(format!("shape {:?}, expected [{rows}, {cols}]", view.shape())));
        }
        let data = view.data();
        let width = match view.dtype() {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(err(format!("dtype {other:?} is not supported (f32, f16 and bf16 are)")));
            }
        };
        let n = rows.checked_mul(cols).and_then(|n| n.checked_mul(width));
        if n != Some(data.len()) {
            return Err(err(format!("{} data bytes for {rows}x{cols} values of {width} bytes", data.len())));
        }
        let out: Vec<f32> = match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        };
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(err(format!("value {} at flat index {i} is not finite", out[i])));
        }
        Ok(out)
    }
}

/// The most one module's delta may amplify its input: for every input `x` and output row,
/// `|scaling * B A x| <= gain * max|x|`, with `gain` the largest row sum of `|A|` times the largest
/// row sum of `|scaling * B|` (the infinity norms). Trained adapters measure in the tens to
/// thousands; past this bound a hidden state of ordinary size (up to about 1e4) could grow past
/// 1e10 in one layer, and a few layers on overflow bf16 and f32. A finite check alone lets
/// weights of 1e18 through, whose output is all one token with no log-probabilities.
pub const MAX_GAIN: f32 = 1e6;

/// The gain of `scaling * B A` (see [`MAX_GAIN`]): `a` is `[rank, in_f]`, `b` is `[out, rank]`,
/// row-major; in f64, so it cannot overflow itself.
fn gain(a: &[f32], in_f: usize, b: &[f32], rank: usize, scaling: f32) -> f64 {
    let row_max = |m: &[f32], width: usize| m.chunks(width.max(1)).map(|row| row.iter().map(|v| f64::from(v.abs())).sum::<f64>()).fold(0.0f64, f64::max);
    row_max(a, in_f) * row_max(b, rank) * f64::from(scaling.abs())
}
