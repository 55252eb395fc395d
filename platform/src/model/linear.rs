//! A linear layer: `y = x · Wᵀ (+ b)`.

use loraplex_adapters::TargetModule;
use loraplex_kernels::{Backend, KernelError};

use super::ModelError;
use super::lora::{LoraContext, LoraSite};
use super::weights::Checkpoint;

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
        backend.matmul(x, &self.weight, self.bias.as_ref(), out, rows)?;
        match (self.module, lora) {
            (Some(module), Some(l)) => {
                let site = LoraSite { layer: l.layer, module, in_features: self.in_features, out_features: self.out_features, tokens: rows };
                l.batch.apply(backend, l.pool, &site, x, out)
            }
            _ => Ok(()),
        }
    }
}
