//! `loraplex bench lora`: decode throughput with many adapters in one batch, against the base
//! model alone and against serving one adapter at a time; and how long an adapter takes to
//! become resident from disk and from host memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use loraplex_kernels::cpu::CpuBackend;
use loraplex_kernels::{Backend, Memory};
use serde::Serialize;

use super::{dims_of, prompt};
use crate::config::{BenchLoraArgs, Device};
use crate::engine::{Engine, EngineConfig, SeqId};
use crate::memory::{AdapterLoader, AdapterRef, AdapterResidency, DevicePool, LoaderConfig, Residency, ResidencyEvent, Tier};
use crate::model::{self, Model};
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::synth::{self, AdapterSynthOptions, AdapterTargets, FileDType};
use crate::tokenizer::Tokenizer;

/// (c) distinct adapters against (a) the base model alone.
const DISTINCT_VS_BASE_TARGET: f64 = 0.9;
/// (c) distinct adapters batched against (d) one adapter at a time.
const DISTINCT_VS_NAIVE_TARGET: f64 = 12.0;
/// Untimed decode steps before the timed ones.
const WARMUP: usize = 2;
/// (e) the same distinct-adapter batch through the serving runtime against (c) the engine's
/// step timing.
const RUNTIME_VS_STEPS_TARGET: f64 = 0.9;

#[derive(Debug, Serialize)]
struct Scenario {
    name: &'static str,
    description: String,
    tokens_per_s: f64,
    /// Median time of one decode step (for the naive scenario: of one round over all groups).
    step_ms: f64,
    /// Mean time of one decode step over the timed steps (for the runtime: its window over
    /// the tokens streamed in it, the same as `step_ms`).
    mean_step_ms: f64,
}

#[derive(Debug, Serialize)]
struct ResidencyTimes {
    tier: Tier,
    samples: usize,
    median_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: super::Machine,
    /// `cpu`, or the GPU's name.
    device: String,
    model: String,
    threads: usize,
    /// Rounds of (a), (b), (c) and (e); each scenario is its median round.
    rounds: usize,
    batch: usize,
    rank: usize,
    adapter_dtype: FileDType,
    context: usize,
    adapter_mb: f64,
    scenarios: Vec<Scenario>,
    distinct_over_base: f64,
    distinct_over_naive: f64,
    runtime_over_steps: f64,
    /// (e) against (c)'s mean step instead of its median: both figures then average over
    /// every step, the slow ones included.
    runtime_over_mean_steps: f64,
    /// The share of (e)'s run, from the first request to the last token, that its worker spent
    /// inside engine steps; the rest is the runtime's own time between steps.
    runtime_time_in_steps: f64,
    one_over_base: f64,
    residency: Vec<ResidencyTimes>,
    targets: Targets,
}

#[derive(Debug, Serialize)]
struct Targets {
    distinct_over_base: f64,
    distinct_over_naive: f64,
    runtime_over_steps: f64,
}

pub fn run(args: &BenchLoraArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.threads)?;
    ensure!(args.batch > 0 && args.steps > 0 && args.rank > 0, "--batch, --steps and --rank must be positive");
    let tmp = tempfile::tempdir().context("creating a directory for the synthesized model and adapters")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, args.kv_heads, tmp.path())?;
    match args.device {
        Device::Cpu => {
            let backend = args.matmul_dtype.cpu_backend();
            let kernels = backend.describe();
            measure(Arc::new(backend), "cpu".into(), kernels, &dir, source, tmp.path(), args)
        }
        Device::Cuda(n) => {
            let compute = args.matmul_dtype.cuda_compute();
            let g = super::open_cuda(n.unwrap_or(0), compute, &format!("bench lora --device {}", args.device))?;
            let name = g.device_name();
            measure(Arc::new(g), name, CpuBackend::new().describe(), &dir, source, tmp.path(), args)
        }
        Device::Auto => anyhow::bail!("bench lora measures one named device: use --device cpu, cuda or cuda:N"),
    }
}

fn measure<B: Backend>(
    backend: Arc<B>,
    device: String,
    kernels: String,
    dir: &std::path::Path,
    source: String,
    tmp: &std::path::Path,
    args: &BenchLoraArgs,
) -> anyhow::Result<()> {
    eprintln!("loading {source} onto {device} ...");
    let model = Arc::new(model::load(backend, dir)?);
    let tokenizer = Arc::new(Tokenizer::open(dir)?);
    // Adapters for the batch, plus fresh ones for the residency timings (never loaded before).
    let timed = 8;
    eprintln!("synthesizing {} rank-{} adapters on all seven modules ...", args.batch + timed, args.rank);
    let synth_adapters = |dir: &str, count: usize, dtype: FileDType| -> anyhow::Result<Vec<AdapterRef>> {
        let dirs = synth::synthesize_adapters(&AdapterSynthOptions {
            out: tmp.join(dir),
            dims: dims_of(model.config()),
            count,
            ranks: vec![args.rank],
            targets: AdapterTargets::All,
            seed: 1,
            dtype,
        })?;
        Ok(dirs.iter().map(|d| AdapterRef::new(d.display().to_string(), d)).collect())
    };
    let refs = synth_adapters("adapters", args.batch + timed, args.adapter_dtype)?;
    let (batch_refs, timed_refs) = refs.split_at(args.batch);

    let bench = Bench { model: &model, tokenizer: &tokenizer, args };
    let distinct: Vec<Option<AdapterRef>> = batch_refs.iter().cloned().map(Some).collect();
    let rounds = args.rounds.max(1);
    let (mut base, mut one, mut many, mut runtime, mut in_steps) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        eprintln!("(a) base model, batch {}, round {round} of {rounds} ...", args.batch);
        base.push(bench.batched("base", "base model only".into(), &vec![None; args.batch])?);
        eprintln!("(b) one adapter for every row, round {round} of {rounds} ...");
        one.push(bench.batched("one", "one adapter for all rows".into(), &vec![Some(batch_refs[0].clone()); args.batch])?);
        eprintln!("(c) {} distinct adapters, round {round} of {rounds} ...", args.batch);
        many.push(bench.batched("distinct", format!("{} distinct adapters, one per row", args.batch), &distinct)?);
        eprintln!("(e) {} distinct adapters through the serving runtime, round {round} of {rounds} ...", args.batch);
        let (scenario, share) = bench.through_runtime(&distinct)?;
        runtime.push(scenario);
        in_steps.push(share);
    }
    let runtime_time_in_steps = super::quantile(&in_steps, 0.5);
    let mut scenarios: Vec<Scenario> = [base, one, many, runtime].into_iter().map(median_round).collect();
    eprintln!("(d) one adapter at a time ...");
    scenarios.push(bench.naive(batch_refs)?);
    if args.adapter_dtype != FileDType::F32 {
        eprintln!("(c') {} distinct f32 adapters ...", args.batch);
        let f32_refs: Vec<Option<AdapterRef>> = synth_adapters("adapters-f32", args.batch, FileDType::F32)?.into_iter().map(Some).collect();
        scenarios.push(bench.batched("distinct-f32", format!("{} distinct adapters saved in f32", args.batch), &f32_refs)?);
    }

    eprintln!("adapter residency times ...");
    let residency = residency_times(&model, timed_refs)?;
    let rate = |name: &str| scenarios.iter().find(|s| s.name == name).map_or(f64::NAN, |s| s.tokens_per_s);
    // Bytes the kernels stream per adapter: its packed rows as stored in the pool.
    let adapter_mb = {
        let adapter = loraplex_adapters::LoraAdapter::load(&batch_refs[0].dir, &model.base_shape(), &Default::default())?;
        let packed = loraplex_adapters::PackedAdapter::pack(
            &adapter,
            model.kv_layout(16, super::native_kv_dtype(model.backend().as_ref())).page_elems(),
            loraplex_kernels::LORA_ROW_ALIGN,
        )?;
        (packed.bytes() - packed.unused() * 4) as f64 / 1e6
    };
    let report = Report {
        machine: super::Machine::with_kernels(kernels),
        device,
        model: source,
        threads: rayon::current_num_threads(),
        rounds,
        batch: args.batch,
        rank: args.rank,
        adapter_dtype: args.adapter_dtype,
        context: args.context,
        adapter_mb,
        distinct_over_base: rate("distinct") / rate("base"),
        distinct_over_naive: rate("distinct") / rate("naive"),
        runtime_over_steps: rate("runtime") / rate("distinct"),
        runtime_over_mean_steps: {
            let mean_rate = scenarios.iter().find(|s| s.name == "distinct").map_or(f64::NAN, |s| args.batch as f64 / s.mean_step_ms * 1e3);
            rate("runtime") / mean_rate
        },
        runtime_time_in_steps,
        one_over_base: rate("one") / rate("base"),
        scenarios,
        residency,
        targets: Targets {
            distinct_over_base: DISTINCT_VS_BASE_TARGET,
            distinct_over_naive: DISTINCT_VS_NAIVE_TARGET,
            runtime_over_steps: RUNTIME_VS_STEPS_TARGET,
        },
    };
    print_report(&report);
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    Ok(())
}

struct Bench<'a, B: Backend> {
    model: &'a Arc<Model<B>>,
    tokenizer: &'a Arc<Tokenizer>,
    args: &'a BenchLoraArgs,
}

impl<B: Backend> Bench<'_, B> {
    fn config(&self) -> EngineConfig {
        EngineConfig {
            pool_bytes: self.args.pool_mb << 20,
            max_batch_tokens: self.args.context * 8,
            max_running: self.args.batch,
            kv_dtype: super::native_kv_dtype(self.model.backend().as_ref()),
            ..EngineConfig::default()
        }
    }

    fn engine(&self) -> anyhow::Result<Engine<B>> {
        Ok(Engine::new(self.model.clone(), self.tokenizer.clone(), self.config())?)
    }

    fn request(&self, i: usize, adapter: Option<AdapterRef>, new_tokens: usize) -> anyhow::Result<crate::request::ValidRequest> {
        let c = self.model.config();
        let stop = StopConditions { max_new_tokens: u32::try_from(new_tokens)?, ignore_eos: true, ..Default::default() };
        let req =
            GenerationRequest { prompt: prompt(self.args.context, c.vocab_size, i), sampling: SamplingParams::greedy(), stop, adapter, n: 1, grammar: None };
        Ok(req.validate(c)?)
    }

    /// (c)'s batch through the serving runtime (the actor that `generate --batch` and `serve`
    /// drive: detokenization, stop handling and event streaming included), timed from when
    /// every request has taken its warm-up steps to when the first one ends: every token of
    /// every request streamed in that window, over its length. Also the share of the whole run
    /// (first request to last token) that the worker spent inside engine steps.
    fn through_runtime(&self, rows: &[Option<AdapterRef>]) -> anyhow::Result<(Scenario, f64)> {
        let runtime = crate::runtime::Runtime::start(vec![self.model.clone()], self.tokenizer.clone(), self.config())?;
        for a in rows.iter().flatten() {
            runtime.load_adapter_blocking(a, false, Duration::from_secs(120))?;
        }
        let new_tokens = runtime_tokens(self.args.steps, rows.len());
        let before = runtime.stats_blocking();
        let submitted = Instant::now();
        let mut handles = Vec::with_capacity(rows.len());
        for (i, adapter) in rows.iter().enumerate() {
            handles.push(runtime.submit_blocking_valid(self.request(i, adapter.clone(), new_tokens)?, Default::default())?);
        }
        // One thread per stream, stamping each token as it arrives.
        let stamps: Vec<Vec<Instant>> = std::thread::scope(|scope| {
            let readers: Vec<_> = handles
                .into_iter()
                .map(|mut h| {
                    scope.spawn(move || -> anyhow::Result<Vec<Instant>> {
                        let mut times = Vec::new();
                        while let Some(event) = h.next_blocking() {
                            match event {
                                crate::actors::Event::Token(_) => times.push(Instant::now()),
                                crate::actors::Event::Done(_) => break,
                                crate::actors::Event::Error(e) => anyhow::bail!("a request failed: {e}"),
                            }
                        }
                        Ok(times)
                    })
                })
                .collect();
            readers.into_iter().map(|r| r.join().map_err(|_| anyhow::anyhow!("a stream reader panicked"))?).collect::<anyhow::Result<Vec<_>>>()
        })?;
        let step_ns = |stats: &[crate::runtime::WorkerStats]| -> u64 { stats.iter().map(|w| w.step_time.host_ns()).sum() };
        let in_steps = step_ns(&runtime.stats_blocking()).saturating_sub(step_ns(&before)) as f64 / 1e9;
        runtime.shutdown();
        ensure!(stamps.iter().all(|t| t.len() == new_tokens), "a request ended early");
        let last = stamps.iter().flatten().max().context("no tokens")?;
        let time_in_steps = in_steps / (*last - submitted).as_secs_f64();
        let start = stamps.iter().map(|t| t[WARMUP]).max().context("no requests")?;
        let end = stamps.iter().map(|t| t[new_tokens - 1]).min().context("no requests")?;
        ensure!(end > start, "no window where every request was decoding; raise --steps");
        let tokens = stamps.iter().flatten().filter(|&&t| t > start && t <= end).count();
        let secs = (end - start).as_secs_f64();
        let rate = tokens as f64 / secs;
        let scenario = Scenario {
            name: "runtime",
            description: format!("(c) through the serving runtime, {tokens} tokens in {:.0} ms", secs * 1e3),
            tokens_per_s: rate,
            step_ms: rows.len() as f64 / rate * 1e3,
            mean_step_ms: rows.len() as f64 / rate * 1e3,
        };
        Ok((scenario, time_in_steps))
    }

    /// Makes every adapter of `rows` resident before timing, so that only compute is measured.
    fn make_resident(&self, engine: &mut Engine<B>, rows: &[Option<AdapterRef>]) -> anyhow::Result<()> {
        for a in rows.iter().flatten() {
            engine.load_adapter(a)?;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while rows.iter().flatten().any(|a| engine.adapters().status(&a.key) != Residency::Resident) {
            ensure!(Instant::now() < deadline, "adapters did not become resident; raise --pool-mb");
            for a in rows.iter().flatten() {
                engine.prefetch(a);
            }
            engine.step()?;
        }
        Ok(())
    }

    fn add(&self, engine: &mut Engine<B>, rows: &[Option<AdapterRef>], new_tokens: usize) -> anyhow::Result<Vec<SeqId>> {
        let mut ids = Vec::new();
        for (i, adapter) in rows.iter().enumerate() {
            ids.push(engine.add(self.request(i, adapter.clone(), new_tokens)?)?);
        }
        Ok(ids)
    }

    /// Prefills every row, takes the warm-up steps, then times every decode step while all
    /// rows are still decoding (the steps up to the one that ends the first row): the median
    /// step and the mean one. The rows' lengths set the contexts the steps run at.
    fn decode_steps(&self, engine: &mut Engine<B>, rows: usize) -> anyhow::Result<(f64, f64)> {
        let mut started = std::collections::HashSet::new();
        while started.len() < rows {
            for e in engine.step()? {
                started.insert(e.seq);
            }
            ensure!(engine.take_failures().is_empty(), "a request failed");
        }
        for _ in 0..WARMUP {
            engine.step()?;
        }
        let mut times = Vec::new();
        loop {
            let t = Instant::now();
            let events = engine.step()?;
            let dt = t.elapsed().as_secs_f64();
            ensure!(engine.take_failures().is_empty(), "a request failed");
            if events.len() < rows {
                break;
            }
            times.push(dt);
            if events.iter().any(|e| e.finish.is_some()) {
                break;
            }
        }
        ensure!(times.len() >= self.args.steps, "only {} decode steps with every row running; raise the rows' lengths", times.len());
        while engine.has_work() {
            engine.step()?;
        }
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        times.sort_by(f64::total_cmp);
        Ok((times[times.len() / 2], mean))
    }

    /// All rows decoding together in one batch.
    fn batched(&self, name: &'static str, description: String, rows: &[Option<AdapterRef>]) -> anyhow::Result<Scenario> {
        let mut engine = self.engine()?;
        self.make_resident(&mut engine, rows)?;
        // As long as (e)'s requests, so that the timed steps run at the contexts of (e)'s window.
        let new_tokens = runtime_tokens(self.args.steps, rows.len());
        self.add(&mut engine, rows, new_tokens)?;
        let (step, mean) = self.decode_steps(&mut engine, rows.len())?;
        Ok(Scenario { name, description, tokens_per_s: rows.len() as f64 / step, step_ms: step * 1e3, mean_step_ms: mean * 1e3 })
    }

    /// The naive way: the requests grouped by adapter, each group decoded on its own, one
    /// adapter at a time. A round gives every request one token and costs one step per group.
    fn naive(&self, adapters: &[AdapterRef]) -> anyhow::Result<Scenario> {
        let mut engine = self.engine()?;
        let rows: Vec<Option<AdapterRef>> = adapters.iter().cloned().map(Some).collect();
        self.make_resident(&mut engine, &rows)?;
        let (mut round, mut mean_round) = (0.0, 0.0);
        for group in adapters.chunk_by(|a, b| a.key == b.key) {
            let rows: Vec<Option<AdapterRef>> = group.iter().cloned().map(Some).collect();
            self.add(&mut engine, &rows, WARMUP + self.args.steps + 2)?;
            let (step, mean) = self.decode_steps(&mut engine, rows.len())?;
            round += step;
            mean_round += mean;
        }
        Ok(Scenario {
            name: "naive",
            description: format!("{} adapters served one at a time", adapters.len()),
            tokens_per_s: adapters.len() as f64 / round,
            step_ms: round * 1e3,
            mean_step_ms: mean_round * 1e3,
        })
    }
}

/// The round of median throughput.
fn median_round(mut rounds: Vec<Scenario>) -> Scenario {
    rounds.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    rounds.swap_remove(rounds.len() / 2)
}

/// Tokens each request of (e) asks for, and (c)'s rows as well: every row still prefilling
/// when the first starts decoding needs headroom beyond the steps timed.
fn runtime_tokens(steps: usize, rows: usize) -> usize {
    WARMUP + 2 * steps + rows + 1
}

/// Times "requested" to "resident" for adapters never loaded before (from disk: read,
/// validate, pack on a loader thread, then copy into pool pages), and again after they were
/// evicted from the pool while still in host memory.
fn residency_times<B: Backend>(model: &Model<B>, adapters: &[AdapterRef]) -> anyhow::Result<Vec<ResidencyTimes>> {
    let backend = model.backend().clone();
    let layout = model.kv_layout(16, super::native_kv_dtype(backend.as_ref()));
    let mut mem = DevicePool::with_bytes(backend.as_ref(), layout, 256 << 20)?;
    let loader = AdapterLoader::new(&LoaderConfig::default(), model.base_shape(), layout.page_elems())?;
    let mut res = AdapterResidency::new(loader, model.config().num_layers, usize::MAX);
    let mut disk = Vec::new();
    let mut host = Vec::new();
    for a in adapters {
        for tier in [Tier::Disk, Tier::Host] {
            if tier == Tier::Host {
                // Evict it from the pool: it stays in host memory.
                let all = mem.pages.stats().total;
                drop(mem.pages.lease(all).context("evicting the adapter")?);
            }
            res.request(a);
            let deadline = Instant::now() + Duration::from_secs(60);
            let waited = loop {
                res.poll_wait(backend.as_ref(), &mut mem, Duration::from_millis(1))?;
                if let Some(ResidencyEvent::Resident { from, waited, .. }) = res.take_events().into_iter().next() {
                    ensure!(from == tier, "expected the adapter to come from {tier:?}, it came from {from:?}");
                    break waited;
                }
                if let Residency::Failed(e) = res.status(&a.key) {
                    anyhow::bail!("{e}");
                }
                ensure!(Instant::now() < deadline, "adapter {} did not become resident", a.key);
            };
            let ms = waited.as_secs_f64() * 1e3;
            if tier == Tier::Disk { disk.push(ms) } else { host.push(ms) }
        }
    }
    let summary = |tier, mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        ResidencyTimes { tier, samples: v.len(), median_ms: v[v.len() / 2], max_ms: v[v.len() - 1] }
    };
    Ok(vec![summary(Tier::Disk, disk), summary(Tier::Host, host)])
}

fn print_report(r: &Report) {
    println!("machine: {}; device: {}", r.machine, r.device);
    println!(
        "model: {}, {} threads; batch {} decode at context {}; rank-{} {:?} adapters on all seven modules ({:.1} MB of rows each); (a), (b), (c), (e): median of {} rounds",
        r.model, r.threads, r.batch, r.context, r.rank, r.adapter_dtype, r.adapter_mb, r.rounds
    );
    println!("{:<12} {:>10} {:>10} {:>10}", "scenario", "tokens/s", "step ms", "mean ms");
    for s in &r.scenarios {
        println!("{:<12} {:>10.1} {:>10.2} {:>10.2}  {}", s.name, s.tokens_per_s, s.step_ms, s.mean_step_ms, s.description);
    }
    println!("(b)/(a) one adapter vs base: {:.3}", r.one_over_base);
    println!("target: (c)/(a) distinct vs base >= {:.2}: {:.3}", r.targets.distinct_over_base, r.distinct_over_base);
    println!("target: (c)/(d) distinct vs naive >= {:.1}: {:.1}", r.targets.distinct_over_naive, r.distinct_over_naive);
    println!("target: (e)/(c) serving runtime vs engine steps >= {:.2}: {:.3}", r.targets.runtime_over_steps, r.runtime_over_steps);
    println!(
        "(e)/(c) against (c)'s mean step: {:.3}; (e)'s worker spent {:.1}% of its run inside engine steps",
        r.runtime_over_mean_steps,
        r.runtime_time_in_steps * 100.0
    );
    for t in &r.residency {
        println!("requested -> resident from {:?}: median {:.2} ms, max {:.2} ms over {} adapters", t.tier, t.median_ms, t.max_ms, t.samples);
    }
}
