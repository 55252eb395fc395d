//! A loaded, validated LoRA adapter: f32 A/B matrices per (layer, module).

use std::collections::BTreeMap;

use crate::TargetModule;

/// Bounds an adapter must respect to be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterLimits {
    /// Largest rank accepted for any module.
    pub max_rank: usize,
    /// Largest `adapter_model.safetensors` accepted, in bytes (checked before reading it).
    pub max_file_bytes: u64,
}

impl Default for AdapterLimits {
    fn default() -> Self {
        AdapterLimits { max_rank: 256, max_file_bytes: 8 << 30 }
    }
}

/// The LoRA delta on one projection of one layer: `W x + scaling * B (A x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModule {
    pub layer: usize,
    pub module: TargetModule,
    pub rank: usize,
    /// The effective alpha (after `alpha_pattern`).
    pub alpha: f32,
    /// `alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA; computed in f64, stored as f32.
    pub scaling: f32,
    pub in_features: usize,
    pub out_features: usize,
    /// `[rank, in_features]`, row-major.
    pub a: Vec<f32>,
    /// `[out_features, rank]`, row-major.
    pub b: Vec<f32>,
}

/// A validated adapter. Entries are kept sorted by `(layer, module)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub(crate) modules: BTreeMap<(usize, TargetModule), LoraModule>,
    pub(crate) use_rslora: bool,
}

impl LoraAdapter {
    /// Builds an adapter from entries that are already validated by the caller (tests, other
    /// formats). Later entries for the same (layer, module) replace earlier ones.
    pub fn from_modules(modules: impl IntoIterator<Item = LoraModule>, use_rslora: bool) -> Self {
        let modules = modules.into_iter().map(|m| ((m.layer, m.module), m)).collect();
        LoraAdapter { modules, use_rslora }
    }

    /// The entry for `(layer, module)`, if that projection is adapted.
    pub fn get(&self, layer: usize, module: TargetModule) -> Option<&LoraModule> {
        self.modules.get(&(layer, module))
    }

    /// All entries, sorted by layer, then module (in [`TargetModule::ALL`] order).
    pub fn modules(&self) -> impl ExactSizeIterator<Item = &LoraModule> + '_ {
        self.modules.values()
    }

    /// Number of adapted (layer, module) pairs.
    pub fn len(&self) -> usize {
        self.modules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }

    /// Whether the config asked for rsLoRA scaling (already folded into each `scaling`).
    pub fn use_rslora(&self) -> bool {
        self.use_rslora
    }

    /// The distinct target modules adapted in at least one layer, in [`TargetModule::ALL`] order.
    pub fn target_modules(&self) -> Vec<TargetModule> {
        TargetModule::ALL.into_iter().filter(|&m| self.modules.keys().any(|&(_, mm)| mm == m)).collect()
    }

    /// Sum of the ranks over all entries: the number of A rows (and B columns) to store.
    pub fn total_rank_rows(&self) -> usize {
        self.modules.values().map(|m| m.rank).sum()
    }

    /// Bytes of f32 weight data held (A and B of every entry).
    pub fn bytes(&self) -> usize {
        self.modules.values().map(|m| (m.a.len() + m.b.len()) * size_of::<f32>()).sum()
    }

    /// See [`crate::hash::content_hash`].
    pub fn content_hash(&self) -> [u8; 32] {
        crate::hash::content_hash(self)
    }

    /// [`Self::content_hash`] as 64 lowercase hex digits.
    pub fn content_hash_hex(&self) -> String {
        crate::hash::to_hex(&self.content_hash())
    }
}
