//! HuggingFace PEFT LoRA adapters: an `adapter_config.json` and an `adapter_model.safetensors`.
//!
//! What is accepted:
//! - tensors named `base_model.model.model.layers.<L>.<self_attn|mlp>.<module>.lora_A.weight`
//!   (`[r, in]`) and `...lora_B.weight` (`[out, r]`), optionally with the adapter name
//!   `default` before `weight` (`...lora_A.default.weight`); `<module>` one of the seven
//!   projections under its own parent (`q_proj` under `self_attn`, `up_proj` under `mlp`, ...);
//! - f32, f16 and bf16 data, converted to f32; values must be finite;
//! - `target_modules` as a list (exact name or dot-suffix), a regex string (full match), or
//!   `"all-linear"`; `exclude_modules`; `layers_to_transform` with `layers_pattern`;
//! - `rank_pattern`/`alpha_pattern`: the first key in file order whose regex
//!   `^(?:.*\.)?(?:KEY)$` matches the full module name (`model.layers.3.self_attn.q_proj`)
//!   gives its rank/alpha (the key is grouped, so `q_proj|v_proj` means either module);
//! - unknown config keys are ignored.
//!
//! Ranks are read from the lora_A shape. A matching `rank_pattern` entry must agree with it; the
//! default `r` is not checked against the tensors (some tools do not keep it up to date).
//! Scaling is `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`.
//!
//! Consistency between config and tensors is strict in both directions: a tensor for a module
//! the config does not select is refused, and so is a selected module of the base model with no
//! tensors. PEFT saves A and B for every module it adapted, so a gap means the file is damaged
//! or was made for a different base (for example one with more layers).

mod config;
mod json;
mod patterns;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::{AdapterError, AdapterLimits, BaseShape, LoraAdapter, LoraModule, TargetModule};
use config::PeftConfig;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
pub const PICKLE_FILE: &str = "adapter_model.bin";

const PREFIX: &str = "base_model.model.model.layers.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    A,
    B,
}

/// Splits a tensor name into (layer, module, A or B); `Err` says why the name is refused.
fn parse_tensor_name(name: &str) -> Result<(usize, TargetModule, Half), String> {
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

/// The tensor's data as f32, checking dtype, shape and finiteness.
fn read_f32(path: &Path, name: &str, st: &SafeTensors<'_>, rows: usize, cols: usize) -> Result<Vec<f32>, AdapterError> {
    let err = |reason: String| AdapterError::tensor(path, name, reason);
    let view = st.tensor(name).map_err(|e| err(e.to_string()))?;
    if view.shape() != [rows, cols] {
        return Err(err(format!("shape {:?}, expected [{rows}, {cols}]", view.shape())));
    }
    let n = rows * cols;
    let data = view.data();
    let width = match view.dtype() {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            return Err(err(format!("dtype {other:?} is not supported (f32, f16 and bf16 are)")));
        }
    };
    if data.len() != n * width {
        return Err(err(format!("{} data bytes for {n} values of {width} bytes", data.len())));
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

impl LoraAdapter {
    /// Reads and validates the PEFT adapter in `dir` against `base`. See the [module
    /// documentation](self) for what is accepted; anything else is an [`AdapterError`] naming
    /// the file and the key or tensor at fault.
    pub fn load(dir: &Path, base: &BaseShape, limits: &AdapterLimits) -> Result<LoraAdapter, AdapterError> {
        let cfg_path = dir.join(CONFIG_FILE);
        let st_path = dir.join(WEIGHTS_FILE);
        if !st_path.is_file() {
            let pickle = dir.join(PICKLE_FILE);
            if pickle.exists() {
                return Err(AdapterError::PickleCheckpoint { path: pickle });
            }
            return Err(AdapterError::MissingFile { path: st_path, what: "adapter weights" });
        }
        if !cfg_path.is_file() {
            return Err(AdapterError::MissingFile { path: cfg_path, what: "adapter config" });
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|source| AdapterError::Io { path: cfg_path.clone(), source })?;
        let config = PeftConfig::parse(&cfg_path, &text)?;

        let size = std::fs::metadata(&st_path).map_err(|source| AdapterError::Io { path: st_path.clone(), source })?.len();
        if size > limits.max_file_bytes {
            return Err(AdapterError::Safetensors { path: st_path, reason: format!("{size} bytes exceeds the limit of {} bytes", limits.max_file_bytes) });
        }
        let bytes = std::fs::read(&st_path).map_err(|source| AdapterError::Io { path: st_path.clone(), source })?;
        Self::from_parts(&cfg_path, &config, &st_path, &bytes, base, limits)
    }

    fn from_parts(
        cfg_path: &Path,
        config: &PeftConfig,
        path: &Path,
        bytes: &[u8],
        base: &BaseShape,
        limits: &AdapterLimits,
    ) -> Result<LoraAdapter, AdapterError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| AdapterError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;

        // (layer, module) -> tensor names of A and B.
        let mut found: BTreeMap<(usize, TargetModule), [Option<String>; 2]> = BTreeMap::new();
        let mut names: Vec<&str> = st.names();
        names.sort();
        for name in names {
            let (layer, module, half) = parse_tensor_name(name).map_err(|reason| AdapterError::tensor(path, name, reason))?;
            if layer >= base.num_layers {
                return Err(AdapterError::tensor(path, name, format!("layer {layer} does not exist: the base model has {} layers", base.num_layers)));
            }
            let full = patterns::full_name(layer, module);
            if !config.selects(&full) {
                return Err(AdapterError::tensor(
                    path,
                    name,
                    format!("module `{full}` is not selected by {} (target_modules / exclude_modules / layers_to_transform)", cfg_path.display()),
                ));
            }
            let slot = &mut found.entry((layer, module)).or_default()[half as usize];
            if let Some(other) = slot {
                return Err(AdapterError::tensor(path, name, format!("duplicates `{other}`")));
            }
            *slot = Some(name.to_string());
        }
        if found.is_empty() {
            return Err(AdapterError::Safetensors { path: path.to_path_buf(), reason: "no LoRA tensors in the file".to_string() });
        }
        for layer in 0..base.num_layers {
            for module in TargetModule::ALL {
                let full = patterns::full_name(layer, module);
                if config.selects(&full) && !found.contains_key(&(layer, module)) {
                    return Err(AdapterError::Safetensors {
                        path: path.to_path_buf(),
                        reason: format!("no lora_A/lora_B tensors for `{full}`, which {} selects", cfg_path.display()),
                    });
                }
            }
        }

        let mut modules = Vec::with_capacity(found.len());
        for ((layer, module), [a_name, b_name]) in found {
            let (a_name, b_name) = match (a_name, b_name) {
                (Some(a), Some(b)) => (a, b),
                (Some(a), None) => {
                    return Err(AdapterError::tensor(path, &a, "lora_A without its lora_B"));
                }
                (None, Some(b)) => {
                    return Err(AdapterError::tensor(path, &b, "lora_B without its lora_A"));
                }
                (None, None) => continue,
            };
            let (in_f, out_f) = base.dims(module);
            let full = patterns::full_name(layer, module);
            let a_view = st.tensor(&a_name).map_err(|e| AdapterError::tensor(path, &a_name, e.to_string()))?;
            let rank = match a_view.shape() {
                &[r, i] if i == in_f => r,
                &[_, i] => {
                    return Err(AdapterError::tensor(
                        path,
                        &a_name,
                        format!("in_features {i} does not match the base `{}` input size {in_f}", module.hf_name()),
                    ));
                }
                s => {
                    return Err(AdapterError::tensor(path, &a_name, format!("shape {s:?} is not [r, in]")));
                }
            };
            if rank == 0 {
                return Err(AdapterError::tensor(path, &a_name, "rank 0"));
            }
            if rank > limits.max_rank {
                return Err(AdapterError::tensor(path, &a_name, format!("rank {rank} exceeds the limit of {}", limits.max_rank)));
            }
            let b_shape = st.tensor(&b_name).map_err(|e| AdapterError::tensor(path, &b_name, e.to_string()))?.shape().to_vec();
            if b_shape != [out_f, rank] {
                return Err(AdapterError::tensor(
                    path,
                    &b_name,
                    format!("shape {b_shape:?}, expected [{out_f}, {rank}] (base `{}` output size, lora_A rank)", module.hf_name()),
                ));
            }
            if let Some(p) = patterns::first_match(&config.rank_pattern, &full)
                && p.value != rank as f64
            {
                return Err(AdapterError::config(
                    cfg_path,
                    &format!("rank_pattern.{}", p.key),
                    format!("gives rank {} for `{full}`, but tensor `{a_name}` in {} has rank {rank}", p.value, path.display()),
                ));
            }
            let alpha = patterns::first_match(&config.alpha_pattern, &full).map_or(config.lora_alpha, |p| p.value);
            let scaling = if config.use_rslora { alpha / (rank as f64).sqrt() } else { alpha / rank as f64 };
            let a = read_f32(path, &a_name, &st, rank, in_f)?;
            let b = read_f32(path, &b_name, &st, out_f, rank)?;
            modules.push(LoraModule { layer, module, rank, alpha: alpha as f32, scaling: scaling as f32, in_features: in_f, out_features: out_f, a, b });
        }
        Ok(LoraAdapter::from_modules(modules, config.use_rslora))
    }
}
