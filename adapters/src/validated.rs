//! Parsed and validated once, at upload; later loads use what was validated.
//!
//! [`LoraAdapter::load_with_manifest`] runs the full PEFT validation and describes its outcome as
//! a [`Manifest`]: for each adapted (layer, module) its rank, alpha, scaling and the names of its
//! lora_A and lora_B tensors in `adapter_model.safetensors`, plus the adapter's content hash.
//! [`Manifest::write`] stores it as [`MANIFEST_FILE`] next to the weights.
//!
//! [`LoraAdapter::load_validated`] loads the adapter again from the manifest and the weights
//! only: `adapter_config.json` is not read and no regex is compiled. Everything the manifest
//! says is still checked against the weights and the base model with the same code as the PEFT
//! path (shapes, rank limit, file size, dtypes, finiteness, the scaled lora_B), every tensor of
//! the file must be listed, and the result must hash to the recorded content hash, so what is
//! loaded is exactly what was validated, or an error.
//!
//! The manifest is JSON with a fixed schema (unknown fields are refused):
//!
//! ```json
//! {"format_version": 1, "use_rslora": false, "content_hash": "<64 hex digits>",
//!  "modules": [{"layer": 0, "module": "q_proj", "rank": 8, "alpha": 16.0, "scaling": 2.0,
//!               "lora_a": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
//!               "lora_b": "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}]}
//! ```
//!
//! `alpha` and `scaling` are the f32 values the adapter uses, written as the f64 numbers they
//! equal, so that reading them back gives the same f32 bits. Only `scaling` reaches the
//! computation, and the content hash covers it; `alpha` and `use_rslora` (already folded into
//! each scaling) are descriptive and are returned as the manifest states them.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::peft::WEIGHTS_FILE;
use crate::tensors::{self, Half, Weights};
use crate::{AdapterError, AdapterLimits, BaseShape, LoraAdapter, LoraModule, TargetModule};

/// The manifest's file name, next to `adapter_model.safetensors`.
pub const MANIFEST_FILE: &str = "loraplex_adapter.json";
/// The only `format_version` written and read.
pub const MANIFEST_FORMAT: u32 = 1;
/// Largest manifest read, in bytes.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// What [`LoraAdapter::load_with_manifest`] validated; see the [module documentation](self).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format_version: u32,
    /// Whether the config asked for rsLoRA (already folded into each `scaling`).
    pub use_rslora: bool,
    /// One entry per adapted (layer, module), sorted by layer, then module.
    pub modules: Vec<ManifestEntry>,
    /// [`LoraAdapter::content_hash_hex`] of the validated adapter.
    pub content_hash: String,
}

/// One adapted (layer, module) of a [`Manifest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestEntry {
    pub layer: usize,
    /// The HF module name ([`TargetModule::hf_name`]).
    pub module: String,
    pub rank: usize,
    /// The effective alpha (see [`LoraModule::alpha`]).
    #[serde(with = "exact_f32")]
    pub alpha: f32,
    /// See [`LoraModule::scaling`].
    #[serde(with = "exact_f32")]
    pub scaling: f32,
    /// The name of the lora_A tensor in `adapter_model.safetensors`, as the file spells it.
    pub lora_a: String,
    /// The same for lora_B.
    pub lora_b: String,
}

/// An f32 written as the f64 it equals: JSON readers parse f64 (nearly) exactly, and rounding
/// the result to f32 gives back the same bits.
mod exact_f32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(f64::from(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        f64::deserialize(d).map(|v| v as f32)
    }
}

impl ManifestEntry {
    /// The entry describing `m`, whose tensors are called `lora_a` and `lora_b` in the file.
    pub(crate) fn new(m: &LoraModule, lora_a: String, lora_b: String) -> Self {
        ManifestEntry { layer: m.layer, module: m.module.hf_name().to_string(), rank: m.rank, alpha: m.alpha, scaling: m.scaling, lora_a, lora_b }
    }
}

impl Manifest {
    /// The manifest of `adapter`, whose modules `entries` describe (in the same order).
    pub(crate) fn new(adapter: &LoraAdapter, entries: Vec<ManifestEntry>) -> Self {
        Manifest { format_version: MANIFEST_FORMAT, use_rslora: adapter.use_rslora(), modules: entries, content_hash: adapter.content_hash_hex() }
    }

    /// Writes the manifest to `dir`/[`MANIFEST_FILE`] atomically: into a temporary file in
    /// `dir`, flushed to disk, then renamed over the manifest, so that a reader sees the old
    /// manifest or the new one, never part of one.
    pub fn write(&self, dir: &Path) -> Result<(), AdapterError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!(".{MANIFEST_FILE}.{}.{}.tmp", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let written = serde_json::to_vec_pretty(self).map_err(std::io::Error::other).and_then(|text| {
            let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            file.write_all(&text)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)
        });
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(AdapterError::Io { path, source });
        }
        // Make the rename itself durable where the platform allows syncing a directory.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Reads `dir`/[`MANIFEST_FILE`]: at most [`MAX_MANIFEST_BYTES`], the fixed schema, format
    /// [`MANIFEST_FORMAT`]. What it says is checked by [`LoraAdapter::load_validated`].
    pub fn read(dir: &Path) -> Result<Manifest, AdapterError> {
        let path = dir.join(MANIFEST_FILE);
        if !path.is_file() {
            return Err(AdapterError::MissingFile { path, what: "adapter manifest" });
        }
        let bytes = tensors::read_capped(&path, MAX_MANIFEST_BYTES, |size| AdapterError::ConfigJson {
            path: path.clone(),
            reason: format!("{size} bytes, more than the limit of {MAX_MANIFEST_BYTES}"),
        })?;
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| AdapterError::ConfigJson { path: path.clone(), reason: e.to_string() })?;
        if manifest.format_version != MANIFEST_FORMAT {
            return Err(AdapterError::config(&path, "format_version", format!("{} is not supported (only {MANIFEST_FORMAT} is)", manifest.format_version)));
        }
        Ok(manifest)
    }
}

impl LoraAdapter {
    /// Loads the adapter in `dir` from its [`MANIFEST_FILE`] and `adapter_model.safetensors`,
    /// as [`Self::load_with_manifest`] validated it: see the [module documentation](self).
    /// Gives what [`Self::load`] gives for the same directory, or an error; a missing manifest
    /// is [`AdapterError::MissingFile`].
    pub fn load_validated(dir: &Path, base: &BaseShape, limits: &AdapterLimits) -> Result<LoraAdapter, AdapterError> {
        let manifest = Manifest::read(dir)?;
        let mf_path = dir.join(MANIFEST_FILE);
        let st_path = dir.join(WEIGHTS_FILE);
        if !st_path.is_file() {
            return Err(AdapterError::MissingFile { path: st_path, what: "adapter weights" });
        }
        let bytes = tensors::read_weights(&st_path, limits)?;
        let weights = Weights::parse(&st_path, &bytes, base, limits)?;

        if manifest.modules.is_empty() {
            return Err(AdapterError::config(&mf_path, "modules", "no modules"));
        }
        // (layer, module) -> index of its entry.
        let mut seen: BTreeMap<(usize, TargetModule), usize> = BTreeMap::new();
        let mut modules = Vec::with_capacity(manifest.modules.len());
        for (i, e) in manifest.modules.iter().enumerate() {
            let key = |field: &str| format!("modules[{i}].{field}");
            let module = TargetModule::from_hf_name(&e.module)
                .ok_or_else(|| AdapterError::config(&mf_path, &key("module"), format!("{:?} is not one of the seven projections", e.module)))?;
            if let Some(j) = seen.insert((e.layer, module), i) {
                return Err(AdapterError::config(
                    &mf_path,
                    &format!("modules[{i}]"),
                    format!("layer {} {} is listed twice, also as modules[{j}]", e.layer, e.module),
                ));
            }
            for (field, name, half) in [("lora_a", &e.lora_a, Half::A), ("lora_b", &e.lora_b, Half::B)] {
                match tensors::parse_tensor_name(name) {
                    Ok(parsed) if parsed == (e.layer, module, half) => {}
                    _ => {
                        return Err(AdapterError::config(
                            &mf_path,
                            &key(field),
                            format!("{name:?} is not the lora_{half:?} tensor of layer {} {}", e.layer, e.module),
                        ));
                    }
                }
            }
            let m = weights.module(e.layer, module, &e.lora_a, &e.lora_b, |rank| {
                if rank != e.rank {
                    return Err(AdapterError::config(
                        &mf_path,
                        &key("rank"),
                        format!("{}, but tensor `{}` in {} has rank {rank}", e.rank, e.lora_a, st_path.display()),
                    ));
                }
                if !e.alpha.is_finite() || !e.scaling.is_finite() {
                    return Err(AdapterError::config(
                        &mf_path,
                        &key("scaling"),
                        format!("alpha {:?} and scaling {:?} must be finite f32 values", e.alpha, e.scaling),
                    ));
                }
                Ok((e.alpha, e.scaling))
            })?;
            modules.push(m);
        }
        let listed: HashSet<&str> = manifest.modules.iter().flat_map(|e| [e.lora_a.as_str(), e.lora_b.as_str()]).collect();
        let mut names = weights.st.names();
        names.sort();
        if let Some(extra) = names.into_iter().find(|n| !listed.contains(n)) {
            return Err(AdapterError::tensor(&st_path, extra, format!("not listed in {}", mf_path.display())));
        }

        let adapter = LoraAdapter::from_modules(modules, manifest.use_rslora);
        let hash = adapter.content_hash_hex();
        if hash != manifest.content_hash {
            return Err(AdapterError::config(
                &mf_path,
                "content_hash",
                format!("{:?} was recorded, but the weights of {} with the manifest's scalings hash to {hash}", manifest.content_hash, st_path.display()),
            ));
        }
        Ok(adapter)
    }
}
