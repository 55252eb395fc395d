//! `loraplex bench runtime`: the serving runtime under four workloads, each through the
//! library API (actors, scheduler, pool) as a server would drive it.
//!
//! - **fairness**: tenant B sends a steady stream at a fraction of the capacity the run
//!   measures first, alone and then while tenant A floods the server with many times B's
//!   traffic; B's p99 time to first token against B's when alone.
//! - **prefix**: requests sharing a long system prompt; time to first token when the prompt's
//!   blocks are cached against when they are not.
//! - **churn**: many adapters with Zipf popularity and a pool with room for a tenth of them;
//!   throughput against the same requests with every adapter resident.
//! - **preemption**: a batch whose KV needs twice the pool; every request completes, with the
//!   same output as with a pool large enough.
//!
//! Every scenario is a function of its options, so the tests run each at a small size and
//! check what it must guarantee (outputs, completions, hits), not its speed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use loraplex_adapters::{LoraAdapter, PackedAdapter};
use loraplex_kernels::LORA_ROW_ALIGN;
use loraplex_kernels::cpu::CpuBackend;
use serde::Serialize;

use super::{dims_of, prompt, quantile, zipf_draws};
use crate::config::BenchRuntimeArgs;
use crate::engine::EngineConfig;
use crate::memory::{AdapterRef, LoaderConfig};
use crate::model::{self, Model};
use crate::request::{GenerationRequest, StopConditions, ValidRequest};
use crate::runtime::{Event, Output, RequestHandle, Runtime, Usage};
use crate::sampling::SamplingParams;
use crate::scheduler::{Placement, TenantId};
use crate::synth::{self, AdapterSynthOptions, AdapterTargets, FileDType};
use crate::tokenizer::Tokenizer;

/// B's p99 time to first token with A flooding, over B's p99 alone.
pub const FAIRNESS_TARGET: f64 = 1.5;
/// Time to first token on a prefix hit over a miss.
pub const PREFIX_TARGET: f64 = 0.2;
/// Throughput with adapter churn over all adapters resident.
pub const CHURN_TARGET: f64 = 0.7;

/// The model every scenario runs on.
pub struct Setup {
    pub model: Arc<Model<CpuBackend>>,
    pub tokenizer: Arc<Tokenizer>,
    /// Where scenarios write adapters.
    pub scratch: PathBuf,
}

impl Setup {
    fn runtime(&self, config: EngineConfig) -> anyhow::Result<Runtime<CpuBackend>> {
        Ok(Runtime::start(vec![self.model.clone()], self.tokenizer.clone(), config)?)
    }

    fn request(&self, prompt: Vec<u32>, max_new_tokens: usize, sampling: SamplingParams, adapter: Option<AdapterRef>) -> anyhow::Result<ValidRequest> {
        let stop = StopConditions { max_new_tokens: u32::try_from(max_new_tokens)?, ignore_eos: true, ..Default::default() };
        Ok(GenerationRequest { prompt, sampling, stop, adapter, n: 1, grammar: None }.validate(self.model.config())?)
    }

    fn vocab(&self) -> usize {
        self.model.config().vocab_size
    }

    /// Pool pages one request of `tokens` tokens needs.
    fn blocks(&self, config: &EngineConfig, tokens: usize) -> usize {
        tokens.div_ceil(config.block_size)
    }

    fn page_bytes(&self, config: &EngineConfig) -> usize {
        config.kv_layout(&self.model).page_bytes()
    }
}

/// Reads a handle to its end.
fn finish(handle: RequestHandle) -> anyhow::Result<Output> {
    handle.collect_blocking().map_err(|e| anyhow::anyhow!("a request failed: {e}"))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// Fairness

#[derive(Debug, Clone)]
pub struct FairnessOptions {
    pub engine: EngineConfig,
    pub prompt: usize,
    pub max_new_tokens: usize,
    /// B's requests, one every `b_interval`.
    pub b_requests: usize,
    pub b_interval: Duration,
    /// A sends this many requests for each of B's, evenly spread.
    pub a_factor: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct FairnessResult {
    pub max_running: usize,
    pub max_batch_tokens: usize,
    pub prompt: usize,
    pub max_new_tokens: usize,
    pub b_requests: usize,
    /// Requests per second: what A sent, and what the server completed (A and B) while B's
    /// stream ran; A's share is half of the latter.
    pub a_offered_per_s: f64,
    pub served_per_s: f64,
    pub a_over_share: f64,
    pub a_requests_sent: usize,
    /// A's requests that completed while B's stream ran.
    pub a_completed: usize,
    pub b_alone_p50_ms: f64,
    pub b_alone_p99_ms: f64,
    pub b_loaded_p50_ms: f64,
    pub b_loaded_p99_ms: f64,
    /// B's queue time (submission to first start) with A flooding.
    pub b_loaded_queue_p50_ms: f64,
    pub b_loaded_queue_p99_ms: f64,
    /// A's median time to first token under its own flood, over its requests that completed
    /// (the earliest ones: it leaves out the backlog).
    pub a_p50_ms: f64,
    /// How long A's oldest request with no token yet at the end had waited (0: none).
    pub a_oldest_waiting_ms: f64,
    /// Whether B's requests went ahead of A's backlog: an A request sent before B's last one
    /// had no token yet when every B request had completed (a first-come scheduler
    /// would have started it first).
    pub b_overtook_a: bool,
    pub ratio: f64,
    pub target: f64,
    /// Every B request completed with all its tokens in both runs.
    pub b_all_completed: bool,
}

/// B alone, then B with A's flood: per phase, B's times to first token.
pub fn fairness(setup: &Setup, opts: &FairnessOptions) -> anyhow::Result<FairnessResult> {
    ensure!(opts.b_requests > 0 && opts.a_factor > 0, "fairness needs B requests and A's factor");
    let alone = fairness_phase(setup, opts, false)?;
    let loaded = fairness_phase(setup, opts, true)?;
    let ttft = |us: &[Usage]| us.iter().map(|u| ms(u.time_to_first_token)).collect::<Vec<f64>>();
    let (b_alone, b_loaded, a) = (ttft(&alone.b), ttft(&loaded.b), ttft(&loaded.a));
    let complete = |us: &[Usage]| us.len() == opts.b_requests && us.iter().all(|u| u.completion_tokens == opts.max_new_tokens);
    let p99_alone = quantile(&b_alone, 0.99);
    let p99_loaded = quantile(&b_loaded, 0.99);
    let served_per_s = (loaded.a.len() + loaded.b.len()) as f64 / loaded.seconds;
    let a_offered_per_s = loaded.a_sent as f64 / loaded.seconds;
    Ok(FairnessResult {
        max_running: opts.engine.max_running,
        max_batch_tokens: opts.engine.max_batch_tokens,
        prompt: opts.prompt,
        max_new_tokens: opts.max_new_tokens,
        a_offered_per_s,
        served_per_s,
        a_over_share: a_offered_per_s / (served_per_s / 2.0),
        b_requests: opts.b_requests,
        a_requests_sent: loaded.a_sent,
        a_completed: loaded.a.len(),
        b_alone_p50_ms: quantile(&b_alone, 0.5),
        b_alone_p99_ms: p99_alone,
        b_loaded_p50_ms: quantile(&b_loaded, 0.5),
        b_loaded_p99_ms: p99_loaded,
        b_loaded_queue_p50_ms: quantile(&loaded.b.iter().map(|u| ms(u.queue_time)).collect::<Vec<_>>(), 0.5),
        b_loaded_queue_p99_ms: quantile(&loaded.b.iter().map(|u| ms(u.queue_time)).collect::<Vec<_>>(), 0.99),
        a_p50_ms: quantile(&a, 0.5),
        a_oldest_waiting_ms: loaded.a_oldest_waiting.map_or(0.0, |(age, _)| ms(age)),
        b_overtook_a: loaded.a_oldest_waiting.is_some_and(|(_, before_b_last)| before_b_last),
        ratio: p99_loaded / p99_alone,
        target: FAIRNESS_TARGET,
        b_all_completed: complete(&alone.b) && complete(&loaded.b),
    })
}

/// Requests per second the runtime completes of the fairness scenario's requests (its engine
/// settings, prompt and new tokens) with the server kept full: twice `max_running` in flight,
/// each completion replaced by a new request; the first `max_running` completions warm up and
/// the next `requests` are timed.
pub fn fairness_capacity(setup: &Setup, opts: &FairnessOptions, requests: usize) -> anyhow::Result<f64> {
    ensure!(requests > 0, "the capacity needs requests to time");
    let rt = setup.runtime(opts.engine.clone())?;
    let tenant = Placement::tenant(TenantId::new("capacity"), 1.0);
    let submit = |i: usize| -> anyhow::Result<RequestHandle> {
        let req = setup.request(prompt(opts.prompt, setup.vocab(), 3_000_000 + i), opts.max_new_tokens, SamplingParams::greedy(), None)?;
        Ok(rt.submit_detached(req, tenant.clone()))
    };
    let warm = opts.engine.max_running.max(1);
    let mut in_flight = std::collections::VecDeque::new();
    let mut next = 0;
    while in_flight.len() < 2 * warm {
        in_flight.push_back(submit(next)?);
        next += 1;
    }
    let mut done = 0;
    let mut start = Instant::now();
    while done < warm + requests {
        // Requests of one tenant and one shape complete in about the order they were sent.
        finish(in_flight.pop_front().context("no request in flight")?)?;
        done += 1;
        if done == warm {
            start = Instant::now();
        }
        in_flight.push_back(submit(next)?);
        next += 1;
    }
    let rate = requests as f64 / start.elapsed().as_secs_f64();
    // The requests still in flight are cancelled with their handles.
    drop(in_flight);
    rt.shutdown();
    Ok(rate)
}

struct Phase {
    b: Vec<Usage>,
    a: Vec<Usage>,
    a_sent: usize,
    /// A's oldest request with no token yet at the end: how long it had waited, and whether it was
    /// sent before B's last request.
    a_oldest_waiting: Option<(Duration, bool)>,
    /// From the first request to B's last completion.
    seconds: f64,
}

fn fairness_phase(setup: &Setup, opts: &FairnessOptions, flood: bool) -> anyhow::Result<Phase> {
    let rt = setup.runtime(opts.engine.clone())?;
    let (a, b) = (Placement::tenant(TenantId::new("tenant-a"), 1.0), Placement::tenant(TenantId::new("tenant-b"), 1.0));
    let a_every = opts.b_interval / opts.a_factor as u32;
    // Untimed: the first requests of a fresh runtime pay for cold caches.
    for i in 0..2 {
        let req = setup.request(prompt(opts.prompt, setup.vocab(), 2_000_000 + i), opts.max_new_tokens, SamplingParams::greedy(), None)?;
        finish(rt.submit_detached(req, b.clone()))?;
    }
    let start = Instant::now();
    let mut b_handles = Vec::new();
    let mut a_handles = Vec::new();
    let (mut next_b, mut next_a) = (0usize, 0usize);
    // Open loop: requests go out on schedule whatever the server is doing.
    while next_b < opts.b_requests {
        let b_at = opts.b_interval * next_b as u32;
        let a_at = a_every * next_a as u32;
        let (at, is_b) = if !flood || b_at <= a_at { (b_at, true) } else { (a_at, false) };
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        if is_b {
            let req = setup.request(prompt(opts.prompt, setup.vocab(), 1_000_000 + next_b), opts.max_new_tokens, SamplingParams::greedy(), None)?;
            b_handles.push(rt.submit_detached(req, b.clone()));
            next_b += 1;
        } else {
            let req = setup.request(prompt(opts.prompt, setup.vocab(), next_a), opts.max_new_tokens, SamplingParams::greedy(), None)?;
            a_handles.push((Instant::now(), rt.submit_detached(req, a.clone())));
            next_a += 1;
        }
    }
    let b_last_sent = start.elapsed();
    let mut b_usage = Vec::new();
    for h in b_handles {
        b_usage.push(finish(h)?.usage);
    }
    let end = Instant::now();
    let seconds = (end - start).as_secs_f64();
    // A's requests that are done by now, and the oldest one not started; the rest are
    // cancelled with their handles.
    let mut a_usage = Vec::new();
    let mut a_oldest_waiting = None;
    for (sent, mut h) in a_handles {
        let mut started = false;
        while let Some(e) = h.try_next() {
            started = true;
            if let Event::Done(u) = e {
                a_usage.push(u);
            }
        }
        if !started && a_oldest_waiting.is_none() {
            a_oldest_waiting = Some((end - sent, sent - start < b_last_sent));
        }
    }
    rt.shutdown();
    Ok(Phase { b: b_usage, a: a_usage, a_sent: next_a, a_oldest_waiting, seconds })
}

// ---------------------------------------------------------------------------------------------
// Prefix

#[derive(Debug, Clone)]
pub struct PrefixOptions {
    pub engine: EngineConfig,
    /// Tokens of the shared system prompt.
    pub system: usize,
    /// Tokens of each request's own part after it.
    pub suffix: usize,
    pub max_new_tokens: usize,
    /// Requests timed per case.
    pub requests: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefixResult {
    pub requests: usize,
    pub miss_p50_ms: f64,
    pub hit_p50_ms: f64,
    pub ratio: f64,
    pub target: f64,
    /// Prompt tokens each hit found cached.
    pub hit_cached_tokens: Vec<usize>,
    /// A prompt replayed as a hit gave the tokens it gave as a miss.
    pub hit_equals_miss: bool,
}

/// One request at a time, so that only the prefill is timed: misses (each with a system prompt
/// never seen), then hits (one system prompt, seen once before, new suffixes).
pub fn prefix(setup: &Setup, opts: &PrefixOptions) -> anyhow::Result<PrefixResult> {
    ensure!(opts.requests > 0, "prefix needs requests");
    let rt = setup.runtime(opts.engine.clone())?;
    let tenant = Placement::tenant(TenantId::new("tenant"), 1.0);
    let vocab = setup.vocab();
    let full = |system: usize, suffix: usize| {
        let mut p = prompt(opts.system, vocab, system);
        p.extend(prompt(opts.suffix, vocab, 500_000 + suffix));
        p
    };
    let run = |p: Vec<u32>| -> anyhow::Result<Output> {
        let req = setup.request(p, opts.max_new_tokens, SamplingParams::greedy(), None)?;
        finish(rt.submit_blocking_valid(req, tenant.clone())?)
    };
    let mut misses = Vec::new();
    let mut first_miss = None;
    for i in 0..opts.requests {
        let out = run(full(1 + i, i))?;
        ensure!(out.usage.cached_prompt_tokens == 0, "a first-seen system prompt hit the cache");
        misses.push(ms(out.usage.time_to_first_token));
        first_miss.get_or_insert(out);
    }
    let mut hits = Vec::new();
    let mut cached = Vec::new();
    for i in 0..opts.requests {
        let out = run(full(1, 1000 + i))?;
        hits.push(ms(out.usage.time_to_first_token));
        cached.push(out.usage.cached_prompt_tokens);
    }
    let replay = run(full(1, 0))?;
    rt.shutdown();
    let first_miss = first_miss.context("no miss")?;
    let (miss, hit) = (quantile(&misses, 0.5), quantile(&hits, 0.5));
    Ok(PrefixResult {
        requests: opts.requests,
        miss_p50_ms: miss,
        hit_p50_ms: hit,
        ratio: hit / miss,
        target: PREFIX_TARGET,
        hit_cached_tokens: cached,
        hit_equals_miss: replay.samples[0].tokens == first_miss.samples[0].tokens && replay.usage.cached_prompt_tokens > 0,
    })
}

// ---------------------------------------------------------------------------------------------
// Adapter churn

#[derive(Debug, Clone)]
pub struct ChurnOptions {
    pub engine: EngineConfig,
    pub adapters: usize,
    /// Adapters the constrained pool has room for (besides the running batch's KV).
    pub room: usize,
    pub rank: usize,
    pub requests: usize,
    pub prompt: usize,
    pub max_new_tokens: usize,
    /// Zipf exponent of adapter popularity.
    pub zipf: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChurnResult {
    pub adapters: usize,
    pub room: usize,
    pub requests: usize,
    pub distinct_adapters_requested: usize,
    pub adapter_pages: usize,
    pub resident_tokens_per_s: f64,
    pub churn_tokens_per_s: f64,
    pub ratio: f64,
    pub target: f64,
    /// Adapter and prefix entries evicted in the constrained run.
    pub evictions: u64,
    /// Both runs gave every request the same tokens.
    pub outputs_equal: bool,
}

pub fn churn(setup: &Setup, opts: &ChurnOptions) -> anyhow::Result<ChurnResult> {
    ensure!(opts.adapters > 0 && opts.room > 0 && opts.requests > 0, "churn needs adapters, room and requests");
    let dirs = synth::synthesize_adapters(&AdapterSynthOptions {
        out: setup.scratch.join("churn-adapters"),
        dims: dims_of(setup.model.config()),
        count: opts.adapters,
        ranks: vec![opts.rank],
        targets: AdapterTargets::Qv,
        seed: 7,
        dtype: FileDType::Bf16,
    })?;
    let refs: Vec<AdapterRef> = dirs.iter().enumerate().map(|(i, d)| AdapterRef::new(format!("churn/{i}@1"), d)).collect();
    let page_elems = opts.engine.kv_layout(&setup.model).page_elems();
    let adapter = LoraAdapter::load(&refs[0].dir, &setup.model.base_shape(), &Default::default())?;
    let adapter_pages = PackedAdapter::pack(&adapter, page_elems, LORA_ROW_ALIGN)?.num_pages();
    let kv_pages = opts.engine.max_running.min(opts.requests) * setup.blocks(&opts.engine, opts.prompt + opts.max_new_tokens);
    let page_bytes = setup.page_bytes(&opts.engine);
    let host = LoaderConfig { host_cache_bytes: 16 << 30, ..opts.engine.adapters.clone() };
    let sized =
        |adapters: usize| EngineConfig { pool_bytes: (kv_pages + adapters * adapter_pages) * page_bytes, adapters: host.clone(), ..opts.engine.clone() };
    // The all-resident run pins every adapter: pins get the share of the pool they need, and
    // requests keep their pages (plus the rounding of that share).
    let pinned = |adapters: usize| {
        let pins = adapters * adapter_pages;
        let total = pins + kv_pages + (pins + kv_pages) / 50 + 2;
        EngineConfig { pool_bytes: total * page_bytes, pinned_percent: (pins * 100).div_ceil(total) as u32, ..sized(adapters) }
    };

    let draws = zipf_draws(opts.adapters, opts.zipf, opts.requests, 11);
    let distinct = draws.iter().collect::<std::collections::HashSet<_>>().len();
    let requests: Vec<(Vec<u32>, AdapterRef)> = draws.iter().enumerate().map(|(i, &a)| (prompt(opts.prompt, setup.vocab(), i), refs[a].clone())).collect();

    // Every adapter resident, held in the pool, before the clock starts.
    let rt = setup.runtime(pinned(opts.adapters))?;
    for a in &refs {
        rt.load_adapter_blocking(a, true, Duration::from_secs(120)).map_err(|e| anyhow::anyhow!("loading {}: {e}", a.key))?;
    }
    let (resident_rate, resident_out, _) = churn_run(setup, &rt, &requests, opts)?;
    rt.shutdown();

    // Room for `room` adapters: the host tier is warm (every adapter was read once, as in a
    // server that has been up), the pool is not.
    let rt = setup.runtime(sized(opts.room))?;
    for a in &refs {
        rt.load_adapter_blocking(a, false, Duration::from_secs(120)).map_err(|e| anyhow::anyhow!("loading {}: {e}", a.key))?;
    }
    let (churn_rate, churn_out, evictions) = churn_run(setup, &rt, &requests, opts)?;
    rt.shutdown();
    Ok(ChurnResult {
        adapters: opts.adapters,
        room: opts.room,
        requests: opts.requests,
        distinct_adapters_requested: distinct,
        adapter_pages,
        resident_tokens_per_s: resident_rate,
        churn_tokens_per_s: churn_rate,
        ratio: churn_rate / resident_rate,
        target: CHURN_TARGET,
        evictions,
        outputs_equal: resident_out == churn_out,
    })
}

/// Submits every request at once; tokens per second over the whole run, each request's
/// tokens, and the pool's evictions during the run.
fn churn_run(setup: &Setup, rt: &Runtime<CpuBackend>, requests: &[(Vec<u32>, AdapterRef)], opts: &ChurnOptions) -> anyhow::Result<(f64, Vec<Vec<u32>>, u64)> {
    let before = rt.stats_blocking().first().map_or(0, |s| s.pool.evictions);
    let start = Instant::now();
    let mut handles = Vec::new();
    for (p, a) in requests {
        let req = setup.request(p.clone(), opts.max_new_tokens, SamplingParams::greedy(), Some(a.clone()))?;
        handles.push(rt.submit_detached(req, Placement::default()));
    }
    let mut outputs = Vec::new();
    let mut tokens = 0;
    for h in handles {
        let out = finish(h)?;
        tokens += out.usage.completion_tokens;
        outputs.push(out.samples.into_iter().next().map(|s| s.tokens).unwrap_or_default());
    }
    let elapsed = start.elapsed().as_secs_f64();
    let after = rt.stats_blocking().first().map_or(0, |s| s.pool.evictions);
    Ok((tokens as f64 / elapsed, outputs, after - before))
}

// ---------------------------------------------------------------------------------------------
// Preemption

#[derive(Debug, Clone)]
pub struct PreemptionOptions {
    pub engine: EngineConfig,
    pub requests: usize,
    pub prompt: usize,
    pub max_new_tokens: usize,
    /// The constrained pool, as a fraction of the pages the whole batch needs.
    pub fraction: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PreemptionResult {
    pub requests: usize,
    pub pages_needed: usize,
    pub pages_given: usize,
    pub preemptions: u64,
    pub all_completed: bool,
    pub outputs_equal: bool,
    pub full_tokens_per_s: f64,
    pub constrained_tokens_per_s: f64,
}

pub fn preemption(setup: &Setup, opts: &PreemptionOptions) -> anyhow::Result<PreemptionResult> {
    ensure!(opts.requests > 0 && opts.fraction > 0.0, "preemption needs requests and a positive fraction");
    let per_request = setup.blocks(&opts.engine, opts.prompt + opts.max_new_tokens);
    let needed = opts.requests * per_request;
    let given = ((needed as f64 * opts.fraction) as usize).max(per_request);
    let page_bytes = setup.page_bytes(&opts.engine);
    let base = EngineConfig { max_running: opts.requests, ..opts.engine.clone() };
    let run = |pages: usize| -> anyhow::Result<(Vec<Vec<u32>>, f64, u64, bool)> {
        let rt = setup.runtime(EngineConfig { pool_bytes: pages * page_bytes, ..base.clone() })?;
        let start = Instant::now();
        let mut handles = Vec::new();
        for i in 0..opts.requests {
            let sampling = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(i as u64), ..SamplingParams::greedy() };
            let req = setup.request(prompt(opts.prompt, setup.vocab(), i), opts.max_new_tokens, sampling, None)?;
            handles.push(rt.submit_detached(req, Placement::default()));
        }
        let mut outs = Vec::new();
        let mut complete = true;
        let mut tokens = 0;
        for h in handles {
            let out = finish(h)?;
            complete &= out.usage.completion_tokens == opts.max_new_tokens;
            tokens += out.usage.completion_tokens;
            outs.push(out.samples.into_iter().next().map(|s| s.tokens).unwrap_or_default());
        }
        let rate = tokens as f64 / start.elapsed().as_secs_f64();
        let preemptions = rt.stats_blocking().iter().map(|s| s.preemptions).sum();
        rt.shutdown();
        Ok((outs, rate, preemptions, complete))
    };
    let (full, full_rate, _, full_complete) = run(needed)?;
    let (constrained, constrained_rate, preemptions, constrained_complete) = run(given)?;
    Ok(PreemptionResult {
        requests: opts.requests,
        pages_needed: needed,
        pages_given: given,
        preemptions,
        all_completed: full_complete && constrained_complete,
        outputs_equal: full == constrained,
        full_tokens_per_s: full_rate,
        constrained_tokens_per_s: constrained_rate,
    })
}

// ---------------------------------------------------------------------------------------------
// The command

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    threads: usize,
    /// Fairness: the requests per second measured with the server kept full, and the fraction
    /// of it B offered.
    fairness_capacity_per_s: Option<f64>,
    fairness_b_fraction: f64,
    fairness: Option<FairnessResult>,
    prefix: Option<PrefixResult>,
    churn: Option<ChurnResult>,
    preemption: Option<PreemptionResult>,
}

pub fn run(args: &BenchRuntimeArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.threads)?;
    let tmp = tempfile::tempdir().context("creating a scratch directory")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, None, tmp.path())?;
    let setup = load_setup(args.matmul_dtype.cpu_backend(), &dir, tmp.path())?;
    let engine =
        EngineConfig { max_batch_tokens: args.max_batch_tokens, max_running: args.max_running, pool_bytes: args.pool_mb << 20, ..EngineConfig::default() };
    let want = |name: &str| args.scenarios.iter().any(|s| s == name || s == "all");
    for s in &args.scenarios {
        if !["all", "fairness", "prefix", "churn", "preemption"].contains(&s.as_str()) {
            bail!("unknown scenario {s:?}: choose from fairness, prefix, churn, preemption, all");
        }
    }
    ensure!(args.b_fraction > 0.0 && args.b_fraction <= 1.0, "--b-fraction must be in (0, 1]; given {}", args.b_fraction);
    let mut report = Report {
        model: source,
        threads: rayon::current_num_threads(),
        fairness_capacity_per_s: None,
        fairness_b_fraction: args.b_fraction,
        fairness: None,
        prefix: None,
        churn: None,
        preemption: None,
    };
    if want("fairness") {
        let mut opts = FairnessOptions {
            engine: EngineConfig { max_running: args.fairness_max_running, max_batch_tokens: args.fairness_batch_tokens, ..engine.clone() },
            prompt: args.fairness_prompt,
            max_new_tokens: args.max_new_tokens,
            b_requests: args.b_requests,
            b_interval: Duration::ZERO,
            a_factor: args.a_factor,
        };
        eprintln!("fairness: capacity with the server kept full ...");
        let capacity = fairness_capacity(&setup, &opts, 4 * args.fairness_max_running.max(1))?;
        opts.b_interval = Duration::from_secs_f64(1.0 / (capacity * args.b_fraction));
        let b_interval_ms = ms(opts.b_interval);
        println!("fairness: capacity {capacity:.2} req/s; B offers {:.0}% of it", args.b_fraction * 100.0);
        report.fairness_capacity_per_s = Some(capacity);
        eprintln!("fairness: tenant B alone, then with tenant A sending {}x as much ...", args.a_factor);
        let r = fairness(&setup, &opts)?;
        println!(
            "fairness: {} running, {} tokens/step, {}-token prompts, {} new tokens; B 1 request / {:.0} ms; A offered {:.1} req/s, the server completed {:.1} req/s: A sent {:.1}x its share",
            r.max_running, r.max_batch_tokens, r.prompt, r.max_new_tokens, b_interval_ms, r.a_offered_per_s, r.served_per_s, r.a_over_share
        );
        println!(
            "fairness: B's time to first token alone p50 {:.1} ms p99 {:.1} ms; with A flooding p50 {:.1} ms p99 {:.1} ms (queued p50 {:.1} p99 {:.1}); A's completed p50 {:.1} ms, its oldest request with no token yet had waited {:.1} ms{}",
            r.b_alone_p50_ms,
            r.b_alone_p99_ms,
            r.b_loaded_p50_ms,
            r.b_loaded_p99_ms,
            r.b_loaded_queue_p50_ms,
            r.b_loaded_queue_p99_ms,
            r.a_p50_ms,
            r.a_oldest_waiting_ms,
            if r.b_overtook_a { " (B went ahead of it)" } else { "" }
        );
        println!("fairness: B p99 with A / alone = {:.2}x, target <= {:.1}x", r.ratio, r.target);
        report.fairness = Some(r);
    }
    if want("prefix") {
        eprintln!("prefix: {}-token system prompt, misses then hits ...", args.system_prompt);
        let opts = PrefixOptions { engine: engine.clone(), system: args.system_prompt, suffix: 32, max_new_tokens: 8, requests: 8 };
        let r = prefix(&setup, &opts)?;
        println!(
            "prefix: TTFT miss p50 {:.1} ms, hit p50 {:.1} ms ({} tokens cached): {:.3}x, target <= {:.1}x; replayed prompt equal: {}",
            r.miss_p50_ms,
            r.hit_p50_ms,
            r.hit_cached_tokens.first().copied().unwrap_or(0),
            r.ratio,
            r.target,
            r.hit_equals_miss
        );
        report.prefix = Some(r);
    }
    if want("churn") {
        eprintln!("churn: {} adapters, Zipf({}), pool room for {} ...", args.adapters, args.zipf, args.adapter_room);
        let opts = ChurnOptions {
            engine: engine.clone(),
            adapters: args.adapters,
            room: args.adapter_room,
            rank: args.rank,
            requests: args.churn_requests,
            prompt: args.prompt,
            max_new_tokens: args.max_new_tokens,
            zipf: args.zipf,
        };
        let r = churn(&setup, &opts)?;
        println!(
            "churn: all resident {:.1} tok/s, room for {} {:.1} tok/s ({} distinct adapters, {} evictions): {:.3}x, target >= {:.1}x; outputs equal: {}",
            r.resident_tokens_per_s, r.room, r.churn_tokens_per_s, r.distinct_adapters_requested, r.evictions, r.ratio, r.target, r.outputs_equal
        );
        report.churn = Some(r);
    }
    if want("preemption") {
        eprintln!("preemption: pool at 50% of the batch's needs ...");
        let opts = PreemptionOptions { engine: engine.clone(), requests: 32, prompt: args.prompt, max_new_tokens: args.max_new_tokens * 2, fraction: 0.5 };
        let r = preemption(&setup, &opts)?;
        println!(
            "preemption: {} of {} pages, {} preemptions; all completed: {}, outputs equal the unconstrained run: {} ({:.1} vs {:.1} tok/s)",
            r.pages_given, r.pages_needed, r.preemptions, r.all_completed, r.outputs_equal, r.constrained_tokens_per_s, r.full_tokens_per_s
        );
        report.preemption = Some(r);
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    Ok(())
}

/// Loads a model directory onto `backend` for the scenarios; `scratch` receives synthesized
/// adapters.
pub fn load_setup(backend: CpuBackend, dir: &Path, scratch: &Path) -> anyhow::Result<Setup> {
    let model = Arc::new(model::load(Arc::new(backend), dir)?);
    let tokenizer = Arc::new(Tokenizer::open(dir)?);
    Ok(Setup { model, tokenizer, scratch: scratch.to_path_buf() })
}
