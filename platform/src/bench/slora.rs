//! `loraplex bench slora`: S-LoRA's synthetic workload (Sheng et al., 2023, section 7) against
//! the serving runtime, and against transformers + PEFT on the same traces.
//!
//! Each phase serves `n` adapters (ranks cycled over `--ranks`, the q, k, v and o projections,
//! bf16 rows) whose popularity follows a Zipf law; requests arrive as a Poisson process, with
//! prompt and output lengths drawn uniformly (8 to 512 tokens by default). The offered rate is
//! `--load` times the capacity the run measures first (a closed batch drained as fast as the
//! runtime goes), the same for every phase and both systems, so each system runs saturated and
//! its throughput is what it completes within the phase's `--duration`.
//!
//! Every adapter is in host memory before a phase's clock starts (S-LoRA keeps all adapters in
//! main memory); the pool then holds what it has room for and swaps the rest in per request.
//!
//! The PEFT baseline (`peft_slora.py`) is what S-LoRA compares against: one base model with
//! PEFT adapters loaded on first use, serving in arrival order by batching waiting requests of
//! the oldest one's adapter, switching adapters between batches.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use loraplex_kernels::Backend;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::{dims_of, prompt, quantile, zipf_draws};
use crate::config::{BenchSloraArgs, Device};
use crate::engine::EngineConfig;
use crate::memory::{AdapterRef, LoaderConfig};
use crate::model::{self, Model};
use crate::request::{GenerationRequest, StopConditions, ValidRequest};
use crate::runtime::{RequestHandle, Runtime};
use crate::sampling::SamplingParams;
use crate::scheduler::Placement;
use crate::synth::{self, AdapterSynthOptions, AdapterTargets, FileDType};
use crate::tokenizer::Tokenizer;

/// loraplex over PEFT at 5 adapters (S-LoRA: 8.05 against 0.87 requests/s).
pub const VS_PEFT_FEW_TARGET: f64 = 10.0;
/// loraplex over PEFT at 100 adapters (S-LoRA: 7.29 against 0.24).
pub const VS_PEFT_MANY_TARGET: f64 = 30.0;
/// loraplex at the most adapters over loraplex at the fewest.
pub const SCALE_TARGET: f64 = 0.85;

/// One request of a trace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TraceRequest {
    /// Seconds from the phase's start.
    pub arrival_s: f64,
    /// Index of its adapter among the phase's.
    pub adapter: usize,
    pub prompt_ids: Vec<u32>,
    pub output_len: usize,
}

/// What one trace draws from.
#[derive(Debug, Clone)]
pub struct Workload {
    pub alpha: f64,
    pub input_len: (usize, usize),
    pub output_len: (usize, usize),
}

/// Poisson arrivals at `rate` per second over `duration` seconds, each request for one of
/// `adapters` adapters (Zipf with exponent `alpha`), lengths uniform in the workload's ranges.
pub fn trace(adapters: usize, rate: f64, duration: f64, w: &Workload, vocab: usize, seed: u64) -> Vec<TraceRequest> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut arrivals = Vec::new();
    let mut t = 0.0;
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        if t >= duration {
            break;
        }
        arrivals.push(t);
    }
    let picks = zipf_draws(adapters, w.alpha, arrivals.len(), seed ^ 0x5107a);
    arrivals
        .into_iter()
        .zip(picks)
        .enumerate()
        .map(|(i, (arrival_s, adapter))| {
            let len = rng.random_range(w.input_len.0..=w.input_len.1);
            TraceRequest {
                arrival_s,
                adapter,
                prompt_ids: prompt(len, vocab, i + seed as usize * 7919),
                output_len: rng.random_range(w.output_len.0..=w.output_len.1),
            }
        })
        .collect()
}

/// The mean output length of a trace's requests.
pub fn mean_output(requests: &[TraceRequest]) -> f64 {
    requests.iter().map(|r| r.output_len as f64).sum::<f64>() / requests.len().max(1) as f64
}

/// One system's run of one trace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    pub system: String,
    pub adapters: usize,
    pub duration_s: f64,
    /// Requests that arrived within the duration.
    pub arrived: usize,
    /// Requests that completed within it.
    pub completed: usize,
    pub failed: usize,
    pub throughput_rps: f64,
    /// Output tokens of the completed requests, per second.
    pub tokens_per_s: f64,
    /// Every output token generated within the duration, per second, those of requests still
    /// running at its end included (a saturated system that shares its batch among many
    /// requests completes few of them in a short window, yet generates as many tokens).
    pub streamed_tokens_per_s: f64,
    /// `streamed_tokens_per_s` over the trace's mean output length: requests per second as
    /// the window's tokens amount to.
    pub equivalent_rps: f64,
    /// Arrival to completion, over the completed requests.
    pub mean_latency_s: Option<f64>,
    pub p99_latency_s: Option<f64>,
}

/// Both systems' throughput on one trace, as requests per second of the tokens each generated
/// within the window.
#[derive(Debug, Serialize)]
struct Comparison {
    adapters: usize,
    loraplex_rps: f64,
    peft_rps: Option<f64>,
    /// loraplex over PEFT.
    speedup: Option<f64>,
    target: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: super::Machine,
    device: String,
    model: String,
    ranks: Vec<usize>,
    adapter_files: usize,
    alpha: f64,
    input_len: Vec<usize>,
    output_len: Vec<usize>,
    duration_s: f64,
    capacity_rps: Option<f64>,
    offered_rps: f64,
    phases: Vec<Phase>,
    peft_errors: Vec<String>,
    comparisons: Vec<Comparison>,
    /// loraplex at the most adapters over loraplex at the fewest.
    scale: f64,
    scale_target: f64,
}

pub fn run(args: &BenchSloraArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.threads)?;
    ensure!(!args.adapters.is_empty() && args.adapters.iter().all(|&n| n > 0), "--adapters needs positive counts");
    ensure!(!args.ranks.is_empty() && args.adapter_files > 0, "--ranks and --adapter-files must not be empty");
    ensure!(args.input_len.len() == 2 && 0 < args.input_len[0] && args.input_len[0] <= args.input_len[1], "--input-len is a range LO,HI of positive lengths");
    ensure!(
        args.output_len.len() == 2 && 0 < args.output_len[0] && args.output_len[0] <= args.output_len[1],
        "--output-len is a range LO,HI of positive lengths"
    );
    ensure!(args.duration > 0.0 && args.load > 0.0 && args.rate.is_none_or(|r| r > 0.0), "--duration, --load and --rate must be positive");
    let tmp = tempfile::tempdir().context("creating a directory for the synthesized model and adapters")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, args.kv_heads, tmp.path())?;
    match args.device {
        Device::Cpu => {
            let backend = args.matmul_dtype.cpu_backend();
            let kernels = backend.describe();
            measure(Arc::new(backend), kernels, &dir, source, tmp.path(), args)
        }
        Device::Cuda(n) => {
            let g = super::open_cuda(n.unwrap_or(0), args.matmul_dtype.cuda_compute(), &format!("bench slora --device {}", args.device))?;
            measure(Arc::new(g), loraplex_kernels::cpu::CpuBackend::new().describe(), &dir, source, tmp.path(), args)
        }
        Device::Auto => anyhow::bail!("bench slora measures one named device: use --device cpu, cuda or cuda:N"),
    }
}

fn measure<B: Backend>(backend: Arc<B>, kernels: String, dir: &Path, source: String, tmp: &Path, args: &BenchSloraArgs) -> anyhow::Result<()> {
    let device = backend.device_name();
    let compute = backend.compute_dtype();
    eprintln!("loading {source} onto {device} ...");
    let model = Arc::new(model::load(backend, dir)?);
    let tokenizer = Arc::new(Tokenizer::open(dir)?);
    let most = args.adapters.iter().copied().max().unwrap_or(1);
    let files = args.adapter_files.min(most);
    eprintln!("synthesizing {files} adapter(s) of ranks {:?} on q, k, v and o ...", args.ranks);
    let dirs = synth::synthesize_adapters(&AdapterSynthOptions {
        out: tmp.join("adapters"),
        dims: dims_of(model.config()),
        count: files,
        ranks: args.ranks.clone(),
        targets: AdapterTargets::Qkvo,
        seed: 3,
        dtype: FileDType::Bf16,
    })?;
    let workload = Workload { alpha: args.alpha, input_len: (args.input_len[0], args.input_len[1]), output_len: (args.output_len[0], args.output_len[1]) };
    let bench = Bench { model: &model, tokenizer: &tokenizer, args, dirs: &dirs, model_dir: dir };
    let vocab = model.config().vocab_size;

    let (capacity, offered) = match args.rate {
        Some(rate) => (None, rate),
        None => {
            let n = args.adapters[0];
            let count = args.max_running.clamp(8, 128);
            eprintln!("capacity: {count} requests over {n} adapters at once ...");
            // All at once: a closed batch drained as fast as the runtime goes.
            let cal: Vec<TraceRequest> =
                trace(n, 4.0 * count as f64, 1.0, &workload, vocab, 1).into_iter().take(count).map(|r| TraceRequest { arrival_s: 0.0, ..r }).collect();
            ensure!(cal.len() == count, "the capacity trace has {} requests, not {count}", cal.len());
            let phase = bench.serve(n, &cal, f64::INFINITY)?;
            let capacity = phase.throughput_rps;
            eprintln!("capacity {capacity:.2} requests/s; offering {:.2}", capacity * args.load);
            (Some(capacity), capacity * args.load)
        }
    };

    let mut phases = Vec::new();
    let mut peft_errors = Vec::new();
    let mut comparisons = Vec::new();
    let traces: Vec<Vec<TraceRequest>> = args.adapters.iter().map(|&n| trace(n, offered, args.duration, &workload, vocab, 100 + n as u64)).collect();
    // The PEFT runs come first: the device memory this process has used for a runtime's pool
    // stays reserved by it for reuse, out of another process's reach.
    let mut pefts = Vec::new();
    for (&n, requests) in args.adapters.iter().zip(&traces) {
        let mut peft = None;
        if let Some(python) = &args.peft_python
            && n <= args.peft_max_adapters
        {
            eprintln!("{n} adapters: {} requests over {} s, transformers + PEFT ...", requests.len(), args.duration);
            match bench.peft(python, n, requests, compute, tmp) {
                Ok(p) => {
                    print_phase(&p);
                    peft = Some(p);
                }
                Err(e) => {
                    eprintln!("the PEFT baseline failed at {n} adapters: {e:#}");
                    peft_errors.push(format!("{n} adapters: {e:#}"));
                }
            }
        }
        pefts.push(peft);
    }
    for ((&n, requests), peft) in args.adapters.iter().zip(&traces).zip(pefts) {
        eprintln!("{n} adapters: {} requests over {} s, loraplex ...", requests.len(), args.duration);
        let ours = bench.serve(n, requests, args.duration)?;
        print_phase(&ours);
        let target = match n {
            n if n <= 5 => Some(VS_PEFT_FEW_TARGET),
            n if n >= 100 => Some(VS_PEFT_MANY_TARGET),
            _ => None,
        };
        comparisons.push(Comparison {
            adapters: n,
            loraplex_rps: ours.equivalent_rps,
            peft_rps: peft.as_ref().map(|p| p.equivalent_rps),
            speedup: peft.as_ref().map(|p| ours.equivalent_rps / p.equivalent_rps),
            target: peft.as_ref().and(target),
        });
        phases.push(ours);
        phases.extend(peft);
    }
    let ours: Vec<&Phase> = phases.iter().filter(|p| p.system == "loraplex").collect();
    let fewest = ours.iter().min_by_key(|p| p.adapters).map_or(f64::NAN, |p| p.equivalent_rps);
    let most = ours.iter().max_by_key(|p| p.adapters).map_or(f64::NAN, |p| p.equivalent_rps);
    let report = Report {
        machine: super::Machine::with_kernels(kernels),
        device,
        model: source,
        ranks: args.ranks.clone(),
        adapter_files: files,
        alpha: args.alpha,
        input_len: args.input_len.clone(),
        output_len: args.output_len.clone(),
        duration_s: args.duration,
        capacity_rps: capacity,
        offered_rps: offered,
        phases,
        peft_errors,
        comparisons,
        scale: most / fewest,
        scale_target: SCALE_TARGET,
    };
    print_report(&report);
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    ensure!(report.peft_errors.is_empty(), "the PEFT baseline failed: {}", report.peft_errors.join("; "));
    Ok(())
}

fn print_phase(p: &Phase) {
    println!(
        "{:>8} {:>5} adapters: {:>4} arrived, {:>4} completed ({} failed) in {:.0} s: {:.2} requests/s completed, {:.0} tokens/s generated ({:.2} requests/s), latency mean {:.2} s p99 {:.2} s",
        p.system,
        p.adapters,
        p.arrived,
        p.completed,
        p.failed,
        p.duration_s,
        p.throughput_rps,
        p.streamed_tokens_per_s,
        p.equivalent_rps,
        p.mean_latency_s.unwrap_or(f64::NAN),
        p.p99_latency_s.unwrap_or(f64::NAN)
    );
}

fn print_report(r: &Report) {
    println!("{}; device: {}", r.machine, r.device);
    println!(
        "model: {}; ranks {:?} on q/k/v/o ({} adapter files), Zipf {}, inputs {:?}, outputs {:?}; offered {:.2} requests/s{}",
        r.model,
        r.ranks,
        r.adapter_files,
        r.alpha,
        r.input_len,
        r.output_len,
        r.offered_rps,
        r.capacity_rps.map_or(String::new(), |c| format!(" ({:.2}x the measured capacity {c:.2})", r.offered_rps / c))
    );
    for c in &r.comparisons {
        match (c.peft_rps, c.speedup) {
            (Some(p), Some(s)) => println!(
                "{:>5} adapters: loraplex {:.2} requests/s, PEFT {p:.3}: {s:.1}x{}",
                c.adapters,
                c.loraplex_rps,
                c.target.map_or(String::new(), |t| format!(" (target >= {t:.0}x)"))
            ),
            _ => println!("{:>5} adapters: loraplex {:.2} requests/s", c.adapters, c.loraplex_rps),
        }
    }
    println!("target: loraplex at the most adapters / at the fewest >= {:.2}: {:.3}", r.scale_target, r.scale);
}

struct Bench<'a, B: Backend> {
    model: &'a Arc<Model<B>>,
    tokenizer: &'a Arc<Tokenizer>,
    args: &'a BenchSloraArgs,
    dirs: &'a [PathBuf],
    model_dir: &'a Path,
}

impl<B: Backend> Bench<'_, B> {
    /// The phase's adapters: adapter `i` is file `i % files` under its own name.
    fn refs(&self, n: usize) -> Vec<AdapterRef> {
        (0..n).map(|i| AdapterRef::new(format!("slora/{i}"), &self.dirs[i % self.dirs.len()])).collect()
    }

    fn file_bytes(dir: &Path) -> u64 {
        std::fs::metadata(dir.join("adapter_model.safetensors")).map_or(0, |m| m.len())
    }

    fn config(&self, refs: &[AdapterRef]) -> EngineConfig {
        // Every adapter fits in host memory, as S-LoRA keeps them.
        let host: u64 = refs.iter().map(|r| Self::file_bytes(&r.dir)).sum::<u64>().saturating_mul(5) / 4 + (64 << 20);
        EngineConfig {
            pool_bytes: self.args.pool_mb << 20,
            max_running: self.args.max_running,
            kv_dtype: super::native_kv_dtype(self.model.backend().as_ref()),
            adapters: LoaderConfig { host_cache_bytes: host, threads: self.args.adapter_loaders.max(1), ..LoaderConfig::default() },
            ..EngineConfig::default()
        }
    }

    fn request(&self, r: &TraceRequest, adapter: &AdapterRef) -> anyhow::Result<ValidRequest> {
        let stop = StopConditions { max_new_tokens: u32::try_from(r.output_len)?, ignore_eos: true, ..Default::default() };
        let req =
            GenerationRequest { prompt: r.prompt_ids.clone(), sampling: SamplingParams::greedy(), stop, adapter: Some(adapter.clone()), n: 1, grammar: None };
        Ok(req.validate(self.model.config())?)
    }

    /// Reads every adapter once, so all are in host memory (and as many as fit in the pool)
    /// before the clock starts: a handful at a time, their disk loads in parallel.
    fn prewarm(&self, rt: &Runtime<B>, refs: &[AdapterRef], config: &EngineConfig) -> anyhow::Result<()> {
        let largest = refs.iter().map(|r| Self::file_bytes(&r.dir)).max().unwrap_or(1).max(1);
        let room = (config.pool_bytes as u64 / (4 * largest)).max(1) as usize;
        let chunk = room.min(2 * config.adapters.threads).max(1);
        for group in refs.chunks(chunk) {
            for a in group {
                futures::executor::block_on(rt.load_adapter(a.clone(), None));
            }
            for a in group {
                rt.load_adapter_blocking(a, false, Duration::from_secs(300)).map_err(|e| anyhow::anyhow!("loading {}: {e}", a.key))?;
            }
        }
        Ok(())
    }

    /// Serves `requests` (over the first `n` adapters) at their arrival times; counts what
    /// completes within `duration` seconds (or, when infinite, everything: the time to drain).
    fn serve(&self, n: usize, requests: &[TraceRequest], duration: f64) -> anyhow::Result<Phase> {
        let refs = self.refs(n);
        let config = self.config(&refs);
        let rt = Runtime::start(vec![self.model.clone()], self.tokenizer.clone(), config.clone())?;
        self.prewarm(&rt, &refs, &config)?;
        let valid = requests.iter().map(|r| self.request(r, &refs[r.adapter])).collect::<anyhow::Result<Vec<_>>>()?;
        let mut valid = valid.into_iter();
        let mut live: Vec<(usize, RequestHandle)> = Vec::new();
        let (mut latencies, mut tokens, mut failed, mut streamed) = (Vec::new(), 0usize, 0usize, 0usize);
        let mut next = 0;
        let start = Instant::now();
        let end = if duration.is_finite() { Some(start + Duration::from_secs_f64(duration)) } else { None };
        loop {
            let now = Instant::now();
            if end.is_some_and(|e| now >= e) {
                break;
            }
            let elapsed = (now - start).as_secs_f64();
            while next < requests.len() && requests[next].arrival_s <= elapsed {
                let Some(req) = valid.next() else { break };
                live.push((next, rt.submit_detached(req, Placement::default())));
                next += 1;
            }
            let mut moved = false;
            live.retain_mut(|(i, h)| {
                while let Some(event) = h.try_next() {
                    moved = true;
                    match event {
                        crate::actors::Event::Token(_) => streamed += 1,
                        crate::actors::Event::Done(usage) => {
                            latencies.push(start.elapsed().as_secs_f64() - requests[*i].arrival_s);
                            tokens += usage.completion_tokens;
                            return false;
                        }
                        crate::actors::Event::Error(_) => {
                            failed += 1;
                            return false;
                        }
                    }
                }
                true
            });
            if end.is_none() && next == requests.len() && live.is_empty() {
                break;
            }
            if !moved {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        let secs = match end {
            Some(_) => duration,
            None => start.elapsed().as_secs_f64(),
        };
        rt.shutdown();
        let completed = latencies.len();
        Ok(Phase {
            system: "loraplex".into(),
            adapters: n,
            duration_s: secs,
            arrived: next,
            completed,
            failed,
            throughput_rps: completed as f64 / secs,
            tokens_per_s: tokens as f64 / secs,
            streamed_tokens_per_s: streamed as f64 / secs,
            equivalent_rps: streamed as f64 / secs / mean_output(requests),
            mean_latency_s: (completed > 0).then(|| latencies.iter().sum::<f64>() / completed as f64),
            p99_latency_s: (completed > 0).then(|| quantile(&latencies, 0.99)),
        })
    }

    /// The same trace through transformers + PEFT (`peft_slora.py`) on the same device.
    fn peft(&self, python: &Path, n: usize, requests: &[TraceRequest], compute: loraplex_kernels::DType, tmp: &Path) -> anyhow::Result<Phase> {
        #[derive(Serialize)]
        struct TraceFile<'a> {
            model: String,
            dtype: String,
            adapters: Vec<String>,
            duration_s: f64,
            max_batch: usize,
            requests: &'a [TraceRequest],
        }
        let file = TraceFile {
            model: self.model_dir.display().to_string(),
            dtype: compute.to_string(),
            adapters: self.refs(n).iter().map(|r| r.dir.display().to_string()).collect(),
            duration_s: self.args.duration,
            max_batch: self.args.peft_max_batch,
            requests,
        };
        let trace_path = tmp.join(format!("trace-{n}.json"));
        let out_path = tmp.join(format!("peft-{n}.json"));
        let script = tmp.join("peft_slora.py");
        std::fs::write(&trace_path, serde_json::to_vec(&file)?)?;
        if !script.exists() {
            std::fs::write(&script, include_str!("peft_slora.py"))?;
        }
        let status = std::process::Command::new(python)
            .arg(&script)
            .arg(&trace_path)
            .arg(&out_path)
            .status()
            .with_context(|| format!("running {}", python.display()))?;
        ensure!(status.success(), "{} {} exited with {status}", python.display(), script.display());
        let text = std::fs::read_to_string(&out_path).with_context(|| format!("reading {}", out_path.display()))?;
        Ok(serde_json::from_str(&text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_have_poisson_arrivals_zipf_adapters_and_lengths_in_range() {
        let w = Workload { alpha: 1.0, input_len: (8, 512), output_len: (8, 64) };
        let t = trace(100, 50.0, 60.0, &w, 1000, 9);
        // About 3,000 arrivals (50/s over 60 s), in order, inside the duration.
        assert!((2700..3300).contains(&t.len()), "{} arrivals", t.len());
        assert!(t.windows(2).all(|p| p[0].arrival_s <= p[1].arrival_s) && t.last().unwrap().arrival_s < 60.0);
        let gaps: Vec<f64> = t.windows(2).map(|p| p[1].arrival_s - p[0].arrival_s).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        // Exponential gaps: mean 1/rate, standard deviation equal to the mean.
        assert!((mean - 0.02).abs() < 0.002 && (var.sqrt() / mean - 1.0).abs() < 0.1, "gaps mean {mean} sd {}", var.sqrt());
        assert!(t.iter().all(|r| (8..=512).contains(&r.prompt_ids.len()) && (8..=64).contains(&r.output_len) && r.adapter < 100));
        assert!(t.iter().all(|r| r.prompt_ids.iter().all(|&id| (id as usize) < 1000)));
        // Zipf: adapter 0 about twice as popular as adapter 1, and far more than the tail.
        let count = |a: usize| t.iter().filter(|r| r.adapter == a).count();
        assert!(count(0) > count(1) && count(0) > 10 * count(99).max(1), "{} {} {}", count(0), count(1), count(99));
        assert_eq!(t, trace(100, 50.0, 60.0, &w, 1000, 9), "a trace is a function of its seed");
    }

    /// The whole bench at a small size: capacity first, then each phase serves its trace with
    /// every request completing or still running at the end, none failing.
    #[test]
    fn the_bench_serves_each_phase_and_reports_it() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("slora.json");
        let args = BenchSloraArgs {
            preset: crate::synth::Preset::Tiny,
            model_dtype: FileDType::F32,
            matmul_dtype: crate::config::MatmulDType::F32,
            model: None,
            hub: Default::default(),
            kv_heads: None,
            device: Device::Cpu,
            adapters: vec![2, 12],
            ranks: vec![4, 8],
            adapter_files: 5,
            alpha: 1.0,
            input_len: vec![8, 40],
            output_len: vec![4, 16],
            duration: 1.0,
            rate: None,
            load: 0.5,
            pool_mb: 64,
            max_running: 16,
            adapter_loaders: 2,
            peft_python: None,
            peft_max_adapters: 100,
            peft_max_batch: 16,
            out: out.clone(),
            threads: None,
        };
        run(&args).unwrap();
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let capacity = report["capacity_rps"].as_f64().unwrap();
        assert!(capacity > 0.0 && (report["offered_rps"].as_f64().unwrap() - capacity / 2.0).abs() < 1e-9);
        let phases = report["phases"].as_array().unwrap();
        assert_eq!(phases.len(), 2);
        for (p, n) in phases.iter().zip([2, 12]) {
            assert_eq!((p["system"].as_str(), p["adapters"].as_u64()), (Some("loraplex"), Some(n)));
            // At half the capacity nearly everything that arrived completes within the second.
            let (arrived, completed) = (p["arrived"].as_u64().unwrap(), p["completed"].as_u64().unwrap());
            assert!(arrived > 0 && completed > 0 && completed <= arrived, "{p}");
            assert_eq!(p["failed"].as_u64(), Some(0), "{p}");
        }
        assert!(report["scale"].as_f64().unwrap() > 0.0);
    }
}
