//! A linear layer: `y = x · Wᵀ (+ b)`.

use loraplex_adapters::TargetModule;
use loraplex_kernels::{Backend, KernelError};

use super::ModelError;
use super::lora::{LoraContext, LoraSite};
use super::weights::{Checkpoint, TensorData};

/// One linear projection of the model.
///
/// Layers that an adapter can target know which module they are (`module`; the layer index comes
/// with the [`LoraContext`]): they are decorated with the batch's LoRA deltas, added on top of
/// the base output by the batched LoRA kernels.
pub struct Linear<B: Backend> {
    pub module: Option<TargetModule>,
    pub in_features: usize,
    pub out_features: usize,
    weight: B::Weight,
    bias: Option<B::Buffer>,
}

impl<B: Backend> Linear<B> {
    /// Loads `{prefix}.weight` (`[out, in]`) and, when `with_bias`, `{prefix}.bias` (`[out]`).
    pub fn load(
        backend: &B,
        checkpoint: &Checkpoint,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        with_bias: bool,
        module: Option<TargetModule>,
    ) -> Result<Self, ModelError> {
        // Kept in the checkpoint's element type: a backend that computes on half-precision
        // weights reads half the bytes per token.
        let w = checkpoint.tensor_data(&format!("{prefix}.weight"), &[out_features, in_features])?;
        let weight = backend.load_weight_data(w.as_weight(), out_features, in_features)?;
        let bias = if with_bias {
            let b = checkpoint.tensor_f32(&format!("{prefix}.bias"), &[out_features])?;
            Some(backend.upload_f32(&b)?)
        } else {
            None
        };
        Ok(Self { module, in_features, out_features, weight, bias })
    }

    /// Builds a layer from host data already in memory (`[out, in]`).
    pub fn from_host(backend: &B, w: &[f32], out_features: usize, in_features: usize, module: Option<TargetModule>) -> Result<Self, ModelError> {
        Ok(Self { module, in_features, out_features, weight: backend.load_weight(w, out_features, in_features)?, bias: None })
    }

    /// `out[rows, out_features] = x[rows, in_features] · Wᵀ (+ b)`, plus the LoRA delta of each
    /// row's adapter when `lora` is given and this layer is a target module.
    pub fn forward(&self, backend: &B, x: &B::Buffer, out: &mut B::Buffer, rows: usize, lora: Option<&LoraContext<'_, B>>) -> Result<(), KernelError> {
        let matmul = |out: &mut B::Buffer| backend.matmul(x, &self.weight, self.bias.as_ref(), out, rows);
        match (self.module, lora) {
            (Some(module), Some(l)) if l.batch.targets(l.layer, module) => {
                let site = LoraSite { layer: l.layer, module, in_features: self.in_features, out_features: self.out_features, tokens: rows };
                if backend.overlaps() {
                    return l.batch.beside(backend, l.pool, x, &[site], out, matmul, |out, deltas| backend.add_assign(out, deltas[0]));
                }
                matmul(out)?;
                l.batch.apply(backend, l.pool, &site, x, out)
            }
            _ => matmul(out),
        }
    }
}

/// Several projections of the same input in one weight, their rows concatenated at load
/// (`[Σ out, in]`): one matmul instead of several (q/k/v, gate/up). Each part keeps its module,
/// so LoRA deltas are added per part, as on separate layers.
pub struct FusedLinear<B: Backend> {
    pub in_features: usize,
    /// Each part's module and width, in the order of the output's columns.
    pub parts: Vec<(TargetModule, usize)>,
    weight: B::Weight,
    bias: Option<B::Buffer>,
}

impl<B: Backend> FusedLinear<B> {
    /// Loads `{prefix}.weight` of each part (`[out, in]`) and, when `with_bias`, its bias, and
    /// concatenates them. Parts stored in one element type stay in it; parts of mixed types are
    /// widened to f32 (exact).
    pub fn load(backend: &B, checkpoint: &Checkpoint, parts: &[(&str, usize, TargetModule)], in_features: usize, with_bias: bool) -> Result<Self, ModelError> {
        let mut data = Vec::with_capacity(parts.len());
        for &(prefix, out, _) in parts {
            data.push(checkpoint.tensor_data(&format!("{prefix}.weight"), &[out, in_features])?);
        }
        let out_features: usize = parts.iter().map(|p| p.1).sum();
        let weight = backend.load_weight_data(concat(data).as_weight(), out_features, in_features)?;
        let bias = if with_bias {
            let mut b = Vec::with_capacity(out_features);
            for &(prefix, out, _) in parts {
                b.extend(checkpoint.tensor_f32(&format!("{prefix}.bias"), &[out])?);
            }
            Some(backend.upload_f32(&b)?)
        } else {
            None
        };
        Ok(Self { in_features, parts: parts.iter().map(|&(_, out, m)| (m, out)).collect(), weight, bias })
    }

    /// The fused output's row length.
    pub fn out_features(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// `fused[rows, Σ out] = x · Wᵀ (+ b)`, with no LoRA: for a caller that reads the parts from
    /// the fused output itself.
    pub fn matmul(&self, backend: &B, x: &B::Buffer, fused: &mut B::Buffer, rows: usize) -> Result<(), KernelError> {
        backend.matmul(x, &self.weight, self.bias.as_ref(), fused, rows)
    }

    /// Whether some adapter of the batch adds a delta to one of the parts at this layer.
    pub fn has_lora(&self, lora: Option<&LoraContext<'_, B>>) -> bool {
        lora.is_some_and(|l| self.parts.iter().any(|&(m, _)| l.batch.targets(l.layer, m)))
    }

    /// Copies each part's columns of `fused` into its buffer of `outs`.
    fn split(&self, backend: &B, fused: &B::Buffer, outs: &mut [&mut B::Buffer], rows: usize) -> Result<(), KernelError> {
        let mut split: Vec<(&mut B::Buffer, usize)> = outs.iter_mut().zip(&self.parts).map(|(o, &(_, w))| (&mut **o, w)).collect();
        backend.split_columns(fused, rows, &mut split)
    }

    /// The fused matmul into `fused`, its columns split into `outs` (one per part, `[rows, out]`),
    /// then each part's LoRA delta added: the same values as one [`Linear`] per part.
    pub fn forward_split(
        &self,
        backend: &B,
        x: &B::Buffer,
        fused: &mut B::Buffer,
        outs: &mut [&mut B::Buffer],
        rows: usize,
        lora: Option<&LoraContext<'_, B>>,
    ) -> Result<(), KernelError> {
        if outs.len() != self.parts.len() {
            return Err(KernelError::Shape { op: "fused_linear", detail: format!("{} outputs for {} parts", outs.len(), self.parts.len()) });
        }
        if let Some(l) = lora.filter(|&l| backend.overlaps() && self.has_lora(Some(l))) {
            let sites: Vec<LoraSite> = self
                .parts
                .iter()
                .map(|&(module, out_features)| LoraSite { layer: l.layer, module, in_features: self.in_features, out_features, tokens: rows })
                .collect();
            let base = |fused: &mut B::Buffer| self.matmul(backend, x, fused, rows);
            return l.batch.beside(backend, l.pool, x, &sites, fused, base, |fused, deltas| {
                self.split(backend, fused, outs, rows)?;
                for (out, delta) in outs.iter_mut().zip(deltas) {
                    backend.add_assign(out, delta)?;
                }
                Ok(())
            });
        }
        self.matmul(backend, x, fused, rows)?;
        self.split(backend, fused, outs, rows)?;
        if let Some(l) = lora {
            for (out, &(module, out_features)) in outs.iter_mut().zip(&self.parts) {
                let site = LoraSite { layer: l.layer, module, in_features: self.in_features, out_features, tokens: rows };
                l.batch.apply(backend, l.pool, &site, x, out)?;
            }
        }
        Ok(())
    }
}

/// The parts' values one after the other, in their shared element type, or widened to f32 when
/// their types differ.
fn concat(mut parts: Vec<TensorData>) -> TensorData {
    if parts.len() == 1 {
        return parts.remove(0);
    }
    let mut all = parts.into_iter();
    let first = all.next().unwrap_or(TensorData::F32(Vec::new()));
    all.fold(first, |acc, p| match (acc, p) {
        (TensorData::Bf16(mut a), TensorData::Bf16(b)) => {
            a.extend(b);
            TensorData::Bf16(a)
        }
        (TensorData::F16(mut a), TensorData::F16(b)) => {
            a.extend(b);
            TensorData::F16(a)
        }
        (TensorData::F32(mut a), TensorData::F32(b)) => {
            a.extend(b);
            TensorData::F32(a)
        }
        (a, b) => {
            let mut wide = a.as_weight().to_f32();
            wide.extend(b.as_weight().to_f32());
            TensorData::F32(wide)
        }
    })
}
