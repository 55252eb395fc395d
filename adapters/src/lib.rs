//! LoRA adapters as artifacts.
//!
//! - [`TargetModule`]: the projections of a decoder layer an adapter can target.
//! - [`BaseShape`]: the base model's layer count and projection shapes, to validate against.
//! - [`LoraAdapter::load`]: reads a HuggingFace PEFT adapter directory (`adapter_config.json` +
//!   `adapter_model.safetensors`), resolves ranks, alphas and scalings with PEFT's rules and
//!   checks every tensor against the base shape (see [`peft`]).
//! - [`LoraAdapter::load_with_manifest`], [`Manifest::write`], [`LoraAdapter::load_validated`]:
//!   validate once at upload, record what was validated, and load it again later from that
//!   record without re-reading the config (see [`validated`]).
//! - [`LoraAdapter::content_hash`]: SHA-256 over the canonical weights (see [`hash`]).
//! - [`PackedAdapter::pack`]: the adapter as rank rows in page images, for the device pool.
#![forbid(unsafe_code)]

mod adapter;
mod error;
pub mod hash;
mod pack;
pub mod peft;
#[cfg(test)]
mod proptests;
mod shape;
mod tensors;
#[cfg(test)]
mod testutil;
pub mod validated;

pub use adapter::{AdapterLimits, LoraAdapter, LoraModule};
pub use error::AdapterError;
pub use pack::{PackError, PackedAdapter, PackedEntry, RowStorage};
pub use shape::BaseShape;
pub use tensors::MAX_GAIN;
pub use validated::{MANIFEST_FILE, Manifest, ManifestEntry};

/// A linear projection of a Llama-family decoder layer: the places a LoRA delta can be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TargetModule {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl TargetModule {
    pub const ALL: [TargetModule; 7] =
        [TargetModule::Q, TargetModule::K, TargetModule::V, TargetModule::O, TargetModule::Gate, TargetModule::Up, TargetModule::Down];

    /// The module's name in HuggingFace checkpoints and PEFT configs (`q_proj`, ...).
    pub fn hf_name(self) -> &'static str {
        match self {
            TargetModule::Q => "q_proj",
            TargetModule::K => "k_proj",
            TargetModule::V => "v_proj",
            TargetModule::O => "o_proj",
            TargetModule::Gate => "gate_proj",
            TargetModule::Up => "up_proj",
            TargetModule::Down => "down_proj",
        }
    }

    /// Position in [`Self::ALL`]: `Q` is 0, `Down` is 6.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The submodule of a decoder layer that holds this projection (`self_attn` or `mlp`).
    pub fn hf_parent(self) -> &'static str {
        match self {
            TargetModule::Q | TargetModule::K | TargetModule::V | TargetModule::O => "self_attn",
            TargetModule::Gate | TargetModule::Up | TargetModule::Down => "mlp",
        }
    }

    /// Parses an HF module name; `None` for anything that is not one of the seven projections.
    pub fn from_hf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.hf_name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for m in TargetModule::ALL {
            assert_eq!(TargetModule::from_hf_name(m.hf_name()), Some(m));
        }
        assert_eq!(TargetModule::from_hf_name("lm_head"), None);
        for (i, m) in TargetModule::ALL.into_iter().enumerate() {
            assert_eq!(m.index(), i);
        }
    }
}
