//! LoRA adapters as artifacts.
//!
//! This crate will hold PEFT parsing, validation against a base model, rank/alpha patterns,
//! packing into the page pool's row layout and the blob store. For now it only names the
//! projections an adapter can target, which the model already uses to label its linear layers.
#![forbid(unsafe_code)]

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
    pub const ALL: [TargetModule; 7] = [
        TargetModule::Q,
        TargetModule::K,
        TargetModule::V,
        TargetModule::O,
        TargetModule::Gate,
        TargetModule::Up,
        TargetModule::Down,
    ];

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
    }
}
