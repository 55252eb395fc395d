//! Random LoRA adapters in the HuggingFace PEFT layout, for a synthesized model.
//!
//! Each adapter is a directory with an `adapter_config.json` as PEFT writes it and an f32
//! `adapter_model.safetensors` with `lora_A` (`[r, in]`) and `lora_B` (`[out, r]`) for every
//! decoder layer and targeted projection. Unlike a freshly initialised PEFT adapter, `lora_B`
//! is not zero, so the adapter changes what the model computes.
//!
//! Sizes: with `lora_alpha = 2r` the scaling is 2. `A` is uniform in `±1/sqrt(in)`, like the
//! base weights' `1/sqrt(in)` standard deviation (see `weights.rs`), and `B` is uniform in a
//! range chosen so that the largest singular value of the delta `2·B·A` is about
//! [`DELTA_SPECTRAL_RATIO`] times the base weight's: enough to change greedy decoding of a
//! synthesized model, not enough to let activations run away.
//!
//! Values depend only on the seed and the adapter's index: each adapter gets its own seed,
//! and every tensor is generated in fixed-size blocks with their own random streams, exactly
//! like the model's weights, so the bytes do not depend on the number of threads.

use std::path::{Path, PathBuf};

use loraplex_adapters::{BaseShape, TargetModule};
use serde_json::json;

use super::weights::{self, FileDType, Init, TensorSpec};
use super::{ModelDims, SynthError, io_err, to_json};
use crate::sampling::splitmix64;

/// Which projections of each decoder layer the adapters adapt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AdapterTargets {
    /// The query and value projections (`q_proj`, `v_proj`), PEFT's default for Llama.
    Qv,
    /// The four attention projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`), as S-LoRA's
    /// experiments adapt Llama.
    Qkvo,
    /// All seven projections: `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
    /// `up_proj` and `down_proj`.
    All,
}

impl AdapterTargets {
    /// The targeted modules, in [`TargetModule::ALL`] order.
    pub(crate) fn modules(self) -> &'static [TargetModule] {
        match self {
            AdapterTargets::Qv => &[TargetModule::Q, TargetModule::V],
            AdapterTargets::Qkvo => &[TargetModule::Q, TargetModule::K, TargetModule::V, TargetModule::O],
            AdapterTargets::All => &TargetModule::ALL,
        }
    }

    /// The short name used in directory names and on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            AdapterTargets::Qv => "qv",
            AdapterTargets::Qkvo => "qkvo",
            AdapterTargets::All => "all",
        }
    }
}

/// What adapters [`synthesize_adapters`] writes, for which model, and where.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterSynthOptions {
    /// Directory that will hold one sub-directory per adapter; created if needed, and files of
    /// the same names are replaced.
    pub out: PathBuf,
    /// The model the adapters are for.
    pub dims: ModelDims,
    /// Number of adapters.
    pub count: usize,
    /// Ranks, cycled: adapter `i` gets `ranks[i % ranks.len()]`.
    pub ranks: Vec<usize>,
    /// The projections every adapter adapts.
    pub targets: AdapterTargets,
    /// Seeds the weights; adapter `i` draws from a stream derived from `(seed, i)`.
    pub seed: u64,
    /// Element type of the saved weights (adapters trained in bf16 are saved in bf16).
    pub dtype: FileDType,
}

/// Largest singular value of `scaling·B·A` relative to the base weight's.
pub(crate) const DELTA_SPECTRAL_RATIO: f64 = 0.4;

/// `lora_alpha / r` of every synthesized adapter.
pub(crate) const SCALING: usize = 2;

/// Mixed into the seed so that adapter streams stay apart from the model's.
const ADAPTER_SALT: u64 = 0x4C6F_5241_2D41_4450;

/// The model's projection shapes, as the adapter loader validates them.
pub(crate) fn base_shape(d: &ModelDims) -> BaseShape {
    BaseShape::llama(d.hidden_size, d.intermediate_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.num_hidden_layers)
}

/// Refuses options that cannot give valid adapters. Nothing is checked when `count` is 0, as
/// nothing is written then.
pub(crate) fn check_adapter_options(opts: &AdapterSynthOptions) -> Result<(), SynthError> {
    if opts.count == 0 {
        return Ok(());
    }
    let bad = |msg: String| Err(SynthError::Options(msg));
    if opts.ranks.is_empty() {
        return bad(format!("{} adapters requested but no ranks given", opts.count));
    }
    let shape = base_shape(&opts.dims);
    for &rank in &opts.ranks {
        if rank == 0 {
            return bad("adapter rank 0: ranks must be at least 1".into());
        }
        for &m in opts.targets.modules() {
            let (inp, out) = shape.dims(m);
            if rank > inp.min(out) {
                return bad(format!(
                    "adapter rank {rank} is larger than {} allows: it maps {inp} to {out} \
                     features, so ranks can be at most {}",
                    m.hf_name(),
                    inp.min(out)
                ));
            }
        }
    }
    Ok(())
}

/// The directory name of adapter `index`: `lora-007-r16-all`.
fn dir_name(index: usize, rank: usize, targets: AdapterTargets) -> String {
    format!("lora-{index:03}-r{rank}-{}", targets.name())
}

/// The seed of adapter `index`'s tensors.
fn adapter_seed(seed: u64, index: usize) -> u64 {
    let mut s = seed ^ ADAPTER_SALT;
    let mut t = splitmix64(&mut s) ^ index as u64;
    splitmix64(&mut t)
}

/// Half-width of `lora_B`'s uniform range for a projection from `inp` to `out` features, with
/// `lora_A` uniform in `±1/sqrt(inp)`.
///
/// An `m×n` matrix of independent entries of standard deviation `σ` has its largest singular
/// value near `σ·(√m + √n)`. The base weight (`σ = 1/√in`) gives `(√out + √in)/√in`. The rows
/// of `A` (`σ = 1/√(3·in)`, `r` rows of `in` values) are nearly orthogonal with norm `1/√3`, so
/// `B·A` has about `1/√3` times the largest singular value of `B`, `σ_B·(√out + √r)`, where
/// `σ_B = half/√3`.
fn b_half_width(inp: usize, out: usize, rank: usize) -> f64 {
    let (i, o, r) = (inp as f64, out as f64, rank as f64);
    let base = (o.sqrt() + i.sqrt()) / i.sqrt();
    3.0 * DELTA_SPECTRAL_RATIO * base / (SCALING as f64 * (o.sqrt() + r.sqrt()))
}

/// The `lora_A` and `lora_B` tensors of one adapter, sorted by name.
fn adapter_specs(shape: &BaseShape, rank: usize, targets: AdapterTargets) -> Vec<TensorSpec> {
    let mut specs = Vec::new();
    for layer in 0..shape.num_layers {
        for &m in targets.modules() {
            let (inp, out) = shape.dims(m);
            let a_half = 1.0 / (inp as f64).sqrt();
            let b_half = b_half_width(inp, out, rank);
            let prefix = format!("base_model.model.model.layers.{layer}.{}.{}", m.hf_parent(), m.hf_name());
            specs.push(TensorSpec { name: format!("{prefix}.lora_A.weight"), shape: vec![rank, inp], init: Init::Uniform { lo: -a_half, hi: a_half } });
            specs.push(TensorSpec { name: format!("{prefix}.lora_B.weight"), shape: vec![out, rank], init: Init::Uniform { lo: -b_half, hi: b_half } });
        }
    }
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    specs
}

/// `adapter_config.json` with the keys PEFT writes for a LoRA adapter.
fn config_json(d: &ModelDims, rank: usize, targets: AdapterTargets) -> serde_json::Value {
    let target_modules: Vec<&str> = targets.modules().iter().map(|m| m.hf_name()).collect();
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": format!(
            "loraplex-synth-llama-h{}-l{}-v{}",
            d.hidden_size, d.num_hidden_layers, d.vocab_size
        ),
        "bias": "none",
        "exclude_modules": null,
        "fan_in_fan_out": false,
        "inference_mode": true,
        // PEFT's switch for a random (non-zero) lora_B, which is what these adapters have.
        "init_lora_weights": false,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": SCALING * rank,
        "lora_bias": false,
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": null,
        "target_modules": target_modules,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": false,
    })
}

/// Writes one adapter into `dir`.
fn write_adapter(dir: &Path, opts: &AdapterSynthOptions, shape: &BaseShape, index: usize, rank: usize) -> Result<(), SynthError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config = dir.join("adapter_config.json");
    let text = to_json(&config_json(&opts.dims, rank, opts.targets));
    std::fs::write(&config, text).map_err(io_err(&config))?;
    let specs = adapter_specs(shape, rank, opts.targets);
    let weights_path = dir.join("adapter_model.safetensors");
    weights::write_tensors(&weights_path, &specs, adapter_seed(opts.seed, index), opts.dtype)?;
    Ok(())
}

/// Writes `opts.count` random LoRA adapters for the model `opts.dims`, adapter `i` into
/// `opts.out/lora-{i:03}-r{rank}-{qv|all}`, and returns those directories in order.
///
/// Every adapter loads with `loraplex_adapters::LoraAdapter::load` against the model's shape.
/// Options that cannot give such adapters (no ranks, a rank of 0, a rank above
/// `min(in, out)` of a targeted projection) are refused with [`SynthError::Options`] before
/// anything is written.
pub fn synthesize_adapters(opts: &AdapterSynthOptions) -> Result<Vec<PathBuf>, SynthError> {
    check_adapter_options(opts)?;
    let shape = base_shape(&opts.dims);
    let mut dirs = Vec::with_capacity(opts.count);
    for index in 0..opts.count {
        let rank = opts.ranks[index % opts.ranks.len()];
        let dir = opts.out.join(dir_name(index, rank, opts.targets));
        write_adapter(&dir, opts, &shape, index, rank)?;
        dirs.push(dir);
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests;
