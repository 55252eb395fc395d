//! The base model's side of adapter validation: how many decoder layers there are and the
//! `(in_features, out_features)` of each projection an adapter may target.

use crate::TargetModule;

/// Dimensions an adapter is validated against. Plain data: the caller builds it from its own
/// model configuration. Every decoder layer is assumed to have the same projection shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BaseShape {
    /// Number of decoder layers; adapter layer indices must be below it.
    pub num_layers: usize,
    /// `(in_features, out_features)` per module, indexed by [`TargetModule::index`].
    pub dims: [(usize, usize); 7],
}

impl BaseShape {
    /// General constructor: `dims` gives `(in_features, out_features)` for each module.
    pub fn new(num_layers: usize, dims: impl Fn(TargetModule) -> (usize, usize)) -> Self {
        BaseShape { num_layers, dims: TargetModule::ALL.map(dims) }
    }

    /// A Llama-family decoder (Llama, Mistral, Qwen2, ...): grouped-query attention with
    /// `num_heads` query heads and `num_kv_heads` key/value heads of `head_dim` each, and a
    /// gated MLP of width `intermediate`.
    pub fn llama(hidden: usize, intermediate: usize, num_heads: usize, num_kv_heads: usize, head_dim: usize, num_layers: usize) -> Self {
        let q = num_heads * head_dim;
        let kv = num_kv_heads * head_dim;
        Self::new(num_layers, |m| match m {
            TargetModule::Q => (hidden, q),
            TargetModule::K | TargetModule::V => (hidden, kv),
            TargetModule::O => (q, hidden),
            TargetModule::Gate | TargetModule::Up => (hidden, intermediate),
            TargetModule::Down => (intermediate, hidden),
        })
    }

    /// `(in_features, out_features)` of `module`.
    pub fn dims(&self, module: TargetModule) -> (usize, usize) {
        self.dims[module.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_dims_follow_gqa_layout() {
        let s = BaseShape::llama(128, 344, 8, 2, 16, 4);
        assert_eq!(s.num_layers, 4);
        assert_eq!(s.dims(TargetModule::Q), (128, 128));
        assert_eq!(s.dims(TargetModule::K), (128, 32));
        assert_eq!(s.dims(TargetModule::V), (128, 32));
        assert_eq!(s.dims(TargetModule::O), (128, 128));
        assert_eq!(s.dims(TargetModule::Gate), (128, 344));
        assert_eq!(s.dims(TargetModule::Up), (128, 344));
        assert_eq!(s.dims(TargetModule::Down), (344, 128));
    }
}
