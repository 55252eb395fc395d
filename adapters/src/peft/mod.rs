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
//! Scaling is `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`, computed in f64; alpha and
//! scaling must be finite as f32, and so must `scaling * b` (computed in f32, as the device
//! stores it) for every value of every lora_B.
//!
//! What an untrusted config can cost is capped: see [`MAX_CONFIG_BYTES`] and the constants
//! after it.
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

use crate::tensors::{self, Weights};
use crate::validated::ManifestEntry;
use crate::{AdapterError, AdapterLimits, BaseShape, LoraAdapter, Manifest, TargetModule};
use config::PeftConfig;
pub use config::{MAX_CONFIG_BYTES, MAX_LIST_ENTRIES, MAX_PATTERN_ENTRIES, MAX_PATTERN_LEN, MAX_REGEX_BYTES, MAX_REGEX_DFA_BYTES, MAX_TOTAL_REGEX_BYTES};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
pub const PICKLE_FILE: &str = "adapter_model.bin";

impl LoraAdapter {
    /// Reads and validates the PEFT adapter in `dir` against `base`. See the [module
    /// documentation](self) for what is accepted; anything else is an [`AdapterError`] naming
    /// the file and the key or tensor at fault.
    pub fn load(dir: &Path, base: &BaseShape, limits: &AdapterLimits) -> Result<LoraAdapter, AdapterError> {
        Self::load_peft(dir, base, limits).map(|(adapter, _)| adapter)
    }

    /// [`Self::load`], also returning the [`Manifest`] of what was validated: the tensor names
    /// the file uses and each module's rank, alpha and scaling. Written next to the files with
    /// [`Manifest::write`], it lets [`Self::load_validated`] load the adapter again without
    /// reading the config.
    pub fn load_with_manifest(dir: &Path, base: &BaseShape, limits: &AdapterLimits) -> Result<(LoraAdapter, Manifest), AdapterError> {
        let (adapter, entries) = Self::load_peft(dir, base, limits)?;
        let manifest = Manifest::new(&adapter, entries);
        Ok((adapter, manifest))
    }

    fn load_peft(dir: &Path, base: &BaseShape, limits: &AdapterLimits) -> Result<(LoraAdapter, Vec<ManifestEntry>), AdapterError> {
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
        let bytes = tensors::read_capped(&cfg_path, MAX_CONFIG_BYTES, |size| AdapterError::ConfigJson {
            path: cfg_path.clone(),
            reason: format!("{size} bytes, more than the limit of {MAX_CONFIG_BYTES}"),
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| AdapterError::ConfigJson { path: cfg_path.clone(), reason: format!("not UTF-8: {e}") })?;
        let config = PeftConfig::parse(&cfg_path, text)?;

        let bytes = tensors::read_weights(&st_path, limits)?;
        Self::from_parts(&cfg_path, &config, &st_path, &bytes, base, limits)
    }

    /// The adapter in the weights `bytes` read from `path`, with the manifest entry of each
    /// module.
    fn from_parts(
        cfg_path: &Path,
        config: &PeftConfig,
        path: &Path,
        bytes: &[u8],
        base: &BaseShape,
        limits: &AdapterLimits,
    ) -> Result<(LoraAdapter, Vec<ManifestEntry>), AdapterError> {
        let weights = Weights::parse(path, bytes, base, limits)?;

        // (layer, module) -> tensor names of A and B.
        let mut found: BTreeMap<(usize, TargetModule), [Option<String>; 2]> = BTreeMap::new();
        let mut names: Vec<&str> = weights.st.names();
        names.sort();
        for name in names {
            let (layer, module, half) = tensors::parse_tensor_name(name).map_err(|reason| AdapterError::tensor(path, name, reason))?;
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
        let mut entries = Vec::with_capacity(found.len());
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
            let full = patterns::full_name(layer, module);
            let m = weights.module(layer, module, &a_name, &b_name, |rank| config.scaling(cfg_path, &full, rank, &a_name, path))?;
            entries.push(ManifestEntry::new(&m, a_name, b_name));
            modules.push(m);
        }
        Ok((LoraAdapter::from_modules(modules, config.use_rslora), entries))
    }
}

impl PeftConfig {
    /// `(alpha, scaling)` as f32 for the module called `full`, whose lora_A (`a_name` in the
    /// weights file `st_path`) has rank `rank`: checks that rank against `rank_pattern` and
    /// applies `alpha_pattern`, `lora_alpha` and `use_rslora`.
    fn scaling(&self, cfg_path: &Path, full: &str, rank: usize, a_name: &str, st_path: &Path) -> Result<(f32, f32), AdapterError> {
        if let Some(p) = patterns::first_match(&self.rank_pattern, full)
            && p.value != rank as f64
        {
            return Err(AdapterError::config(
                cfg_path,
                &format!("rank_pattern.{}", p.key),
                format!("gives rank {} for `{full}`, but tensor `{a_name}` in {} has rank {rank}", p.value, st_path.display()),
            ));
        }
        let pattern = patterns::first_match(&self.alpha_pattern, full);
        let alpha = pattern.map_or(self.lora_alpha, |p| p.value);
        let scaling = if self.use_rslora { alpha / (rank as f64).sqrt() } else { alpha / rank as f64 };
        if !(alpha as f32).is_finite() || !(scaling as f32).is_finite() {
            let key = pattern.map_or_else(|| "lora_alpha".to_string(), |p| format!("alpha_pattern.{}", p.key));
            return Err(AdapterError::config(
                cfg_path,
                &key,
                format!("alpha {alpha:?} for `{full}` (rank {rank}, scaling {scaling:?}) is out of the range of f32"),
            ));
        }
        Ok((alpha as f32, scaling as f32))
    }
}
