//! Which modules a config selects, and which `rank_pattern`/`alpha_pattern` entry applies to a
//! module: PEFT's matching rules on full module names such as `model.layers.3.self_attn.q_proj`.

use super::config::{Exclude, Pattern, PeftConfig, Targets};
use crate::TargetModule;

/// The module's name inside the causal-LM model, as PEFT matches it (without the
/// `base_model.model.` prefix of saved tensor names).
pub(crate) fn full_name(layer: usize, module: TargetModule) -> String {
    format!("model.layers.{layer}.{}.{}", module.hf_parent(), module.hf_name())
}

/// A list entry selects `name` when it equals it or is a dot-separated suffix of it.
fn name_matches(name: &str, key: &str) -> bool {
    name == key || (name.len() > key.len() && name.ends_with(key) && name[..name.len() - key.len()].ends_with('.'))
}

impl PeftConfig {
    /// Whether PEFT would put a LoRA layer on the module called `name`.
    ///
    /// Mirrors `check_target_module_exists`: `exclude_modules` wins; a regex `target_modules`
    /// must match the whole name; a list entry must equal the name (then `layers_to_transform`
    /// does not apply) or be its dot-suffix, in which case the layer index found through
    /// `layers_pattern` must be one of `layers_to_transform`.
    pub(crate) fn selects(&self, name: &str) -> bool {
        let excluded = match &self.exclude {
            Exclude::Nothing => false,
            Exclude::Regex(re) => re.is_match(name),
            Exclude::Names(keys) => keys.iter().any(|k| name_matches(name, k)),
        };
        if excluded {
            return false;
        }
        let all_linear: Vec<String>;
        let keys = match &self.targets {
            Targets::Regex(re) => return re.is_match(name),
            Targets::Names(keys) => keys,
            Targets::AllLinear => {
                all_linear = TargetModule::ALL.iter().map(|m| m.hf_name().to_string()).collect();
                &all_linear
            }
        };
        if keys.iter().any(|k| k == name) {
            return true;
        }
        if !keys.iter().any(|k| name_matches(name, k)) {
            return false;
        }
        let Some(layers) = &self.layers else {
            return true;
        };
        match self.layer_index(name) {
            Some(idx) => layers.contains(&idx),
            None => false,
        }
    }

    /// The layer index PEFT reads from a module name for `layers_to_transform`: through the
    /// first `layers_pattern` regex that matches (all compiled at parse time).
    fn layer_index(&self, name: &str) -> Option<u64> {
        self.layer_index.iter().find_map(|re| re.captures(name)?.get(1)?.as_str().parse().ok())
    }
}

/// The first pattern, in the order the config file lists them, whose key matches `name`.
pub(crate) fn first_match<'a>(patterns: &'a [Pattern], name: &str) -> Option<&'a Pattern> {
    patterns.iter().find(|p| p.re.is_match(name))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn cfg(json: &str) -> PeftConfig {
        PeftConfig::parse(Path::new("adapter_config.json"), json).unwrap()
    }

    #[test]
    fn list_entries_match_dot_suffixes_only() {
        let c = cfg(r#"{"target_modules": ["q_proj", "mlp.up_proj"]}"#);
        assert!(c.selects("model.layers.0.self_attn.q_proj"));
        assert!(c.selects("model.layers.2.mlp.up_proj"));
        assert!(!c.selects("model.layers.0.self_attn.k_proj"));
        // `xq_proj` ends with `q_proj` but not with `.q_proj`.
        assert!(!c.selects("model.layers.0.self_attn.xq_proj"));
    }

    #[test]
    fn layers_to_transform_restricts_suffix_matches() {
        let c = cfg(r#"{"target_modules": ["q_proj"], "layers_to_transform": [1, 3]}"#);
        let picked: Vec<usize> = (0..4).filter(|&l| c.selects(&full_name(l, TargetModule::Q))).collect();
        assert_eq!(picked, [1, 3]);
        let c = cfg(r#"{"target_modules": ["q_proj"], "layers_to_transform": 2, "layers_pattern": "layers"}"#);
        let picked: Vec<usize> = (0..4).filter(|&l| c.selects(&full_name(l, TargetModule::Q))).collect();
        assert_eq!(picked, [2]);
        // A layers_pattern that is not in the name selects nothing.
        let c = cfg(r#"{"target_modules": ["q_proj"], "layers_to_transform": 2, "layers_pattern": "h"}"#);
        assert!((0..4).all(|l| !c.selects(&full_name(l, TargetModule::Q))));
    }

    #[test]
    fn regex_targets_must_match_the_whole_name() {
        let c = cfg(r#"{"target_modules": ".*\\.(q|v)_proj"}"#);
        assert!(c.selects("model.layers.0.self_attn.q_proj"));
        assert!(c.selects("model.layers.3.self_attn.v_proj"));
        assert!(!c.selects("model.layers.3.self_attn.o_proj"));
        let c = cfg(r#"{"target_modules": "q_proj"}"#);
        assert!(!c.selects("model.layers.0.self_attn.q_proj"), "a regex is a full match, not a suffix");
    }

    #[test]
    fn exclude_modules_wins() {
        let c = cfg(r#"{"target_modules": "all-linear", "exclude_modules": ["mlp.down_proj"]}"#);
        assert!(c.selects("model.layers.0.mlp.up_proj"));
        assert!(!c.selects("model.layers.0.mlp.down_proj"));
    }

    #[test]
    fn first_pattern_in_file_order_wins() {
        let c = cfg(r#"{"target_modules": ["q_proj"], "rank_pattern": {"q_proj": 4, "layers.1.self_attn.q_proj": 2}}"#);
        let name = full_name(1, TargetModule::Q);
        assert_eq!(first_match(&c.rank_pattern, &name).map(|p| p.value), Some(4.0));
        let c = cfg(r#"{"target_modules": ["q_proj"], "rank_pattern": {"layers.1.self_attn.q_proj": 2, "q_proj": 4}}"#);
        assert_eq!(first_match(&c.rank_pattern, &name).map(|p| p.value), Some(2.0));
        assert_eq!(first_match(&c.rank_pattern, &full_name(0, TargetModule::Q)).map(|p| p.value), Some(4.0));
        // Keys match at a dot boundary only.
        assert!(first_match(&c.rank_pattern, "model.layers.11.self_attn.q_proj").is_some_and(|p| p.value == 4.0));
    }
}
