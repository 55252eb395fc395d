//! Benchmarks behind `loraplex bench`. Each prints a table, writes a JSON report, and compares
//! what it measured against limits measured on the same machine in the same run.

pub mod cluster;
pub mod engine;
pub mod http;
pub mod kernels;
pub mod lora;
pub mod noisy;
pub mod runtime;
pub mod server;
pub mod slora;
pub mod structured;

use std::path::{Path, PathBuf};

use crate::config::HubArgs;
use crate::model::ModelConfig;
use crate::model::source::ModelSpec;
use crate::synth::{self, ModelDims, Preset};

/// The model a benchmark measures: `model` if given (a hub id fetched through `hub`), else
/// one of `preset`'s size synthesized under `scratch`. Returns its path (a directory or a GGUF
/// file) and how the report names it.
pub(crate) fn model_dir(
    model: Option<&ModelSpec>,
    hub: &HubArgs,
    preset: Preset,
    dtype: synth::FileDType,
    kv_heads: Option<usize>,
    scratch: &Path,
) -> anyhow::Result<(PathBuf, String)> {
    if let Some(spec) = model {
        let resolved = hub.resolve(spec)?;
        return Ok((resolved.files.path().to_path_buf(), spec.to_string()));
    }
    eprintln!("synthesizing the {preset:?} model in {dtype:?} ...");
    let out = scratch.join("model");
    synth::synthesize_model(&synth::SynthOptions { out: out.clone(), preset, seed: 0, dtype, kv_heads })?;
    Ok((out, format!("synth {preset:?} {dtype:?}").to_lowercase()))
}

/// CUDA device `ordinal` for a benchmark, computing in `compute`, its kernels compiled: `what`
/// names the benchmark in the error when CUDA is not usable here.
pub(crate) fn open_cuda(ordinal: usize, compute: loraplex_kernels::DType, what: &str) -> anyhow::Result<loraplex_kernels::cuda::CudaBackend> {
    use loraplex_kernels::cuda;
    cuda::probe().map_err(|why| anyhow::anyhow!("{what} needs CUDA, which is not usable here: {why}"))?;
    Ok(cuda::CudaBackend::open(ordinal, compute)?)
}

/// The KV page type a benchmark runs `backend` with: bf16 where it computes in bf16 (its
/// attention reads pages of its own type), f32 otherwise.
pub(crate) fn native_kv_dtype<B: loraplex_kernels::Memory>(backend: &B) -> loraplex_kernels::RowDType {
    match backend.compute_dtype() {
        loraplex_kernels::DType::Bf16 => loraplex_kernels::RowDType::Bf16,
        _ => loraplex_kernels::RowDType::F32,
    }
}

/// The synthesis dimensions of a loaded model, so adapters can be made for any checkpoint.
pub(crate) fn dims_of(c: &ModelConfig) -> ModelDims {
    ModelDims {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_layers,
        num_attention_heads: c.num_heads,
        num_key_value_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        max_position_embeddings: c.max_position_embeddings,
        rope_theta: c.rope_theta,
        rms_norm_eps: c.rms_norm_eps as f64,
    }
}

pub(crate) fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    // Deterministic, varied ids; ids below 5 are special tokens in synthesized vocabularies.
    (0..len).map(|i| (5 + (i * 7919 + salt * 104_729) % (vocab - 5)) as u32).collect()
}

/// The `q`-quantile by nearest rank.
pub(crate) fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The machine a benchmark ran on, printed and written with its figures.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Machine {
    pub cpu: String,
    pub cores: usize,
    /// The instruction set the CPU kernels run with here (and how bf16 weights are multiplied,
    /// when not exactly).
    pub isa: String,
}

impl Machine {
    pub fn here() -> Machine {
        Machine::with_kernels(loraplex_kernels::cpu::Path::detect().name().to_string())
    }

    /// This machine, its CPU kernels described as `isa`.
    pub fn with_kernels(isa: String) -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().map_or_else(|| "unknown".into(), |s| cpu_name(&s));
        Machine { cpu, cores: std::thread::available_parallelism().map_or(1, |n| n.get()), isa }
    }
}

/// The CPU's model name from `/proc/cpuinfo`, with its family and model numbers where given: a
/// virtual machine's name ("AMD EPYC") is the same for generations that differ twofold.
fn cpu_name(cpuinfo: &str) -> String {
    let field = |key: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let name = field("model name").unwrap_or_else(|| "unknown".into());
    match (field("cpu family"), field("model")) {
        (Some(family), Some(model)) => format!("{name} (family {family}, model {model})"),
        _ => name,
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, {} cores, {} kernels", self.cpu, self.cores, self.isa)
    }
}

/// Adapter indices drawn with probability proportional to `1 / (k + 1)^s`.
pub(crate) fn zipf_draws(n: usize, s: f64, count: usize, seed: u64) -> Vec<usize> {
    let mut cdf = Vec::with_capacity(n);
    let mut total = 0.0;
    for k in 0..n {
        total += 1.0 / ((k + 1) as f64).powf(s);
        cdf.push(total);
    }
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let u = rand::Rng::random::<f64>(&mut rng) * total;
            cdf.partition_point(|&c| c < u).min(n - 1)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_is_named_with_its_family_and_model() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n";
        assert_eq!(super::cpu_name(info), "AMD EPYC (family 26, model 2)");
        assert_eq!(super::cpu_name("model name : Neoverse-V1\n"), "Neoverse-V1");
        assert_eq!(super::cpu_name(""), "unknown");
    }
}
