//! One device's generation loop: pick the step's tokens, run the forward, sample, emit.
//!
//! Continuous batching at iteration level, decided by the [`crate::scheduler`]: every step
//! carries one token for each decoding sequence plus prompt chunks of prefilling ones, up to a
//! token budget, so new requests join while others are mid-generation; tenants share by their
//! weights. KV blocks are taken as sequences grow; when the pool cannot give a running sequence
//! its next block, the latest, lowest-priority sequence gives its pages back and recomputes them
//! when it resumes, with the same output.
//!
//! Requests may name a LoRA adapter. A sequence waits until its adapter is resident in the page
//! pool (loads run on loader threads; the step only places what is ready), then pins it for as
//! long as it runs. Sequences with different adapters, and without one, share every forward:
//! the model adds each token's LoRA delta through the batched LoRA kernels.

mod batch;
mod pick;
pub mod scoring;
mod sequence;
pub mod text;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use loraplex_kernels::{Backend, KernelError, KvLayout, NO_ADAPTER, RowDType};

use crate::memory::{
    AdapterLoader, AdapterRef, AdapterResidency, BlockHash, BlockTable, DevicePool, LoaderConfig, LoaderPool, PoolStats, PrefixCache, PrefixStats, Residency,
    ResidencyEvent, ResidentRows,
};
use crate::model::{LoraBatch, Model};
use crate::request::{FinishReason, RequestError, SeqError, ValidRequest};
use crate::sampling::Sampler;
use crate::scheduler::{Placement, Readiness, Scheduler, SchedulerConfig, StepMemory};
use crate::tokenizer::{Tokenizer, TokenizerError};

pub use crate::request::SeqId;
use batch::{Chunk, HostBatch};
use pick::{Way, fetch_rows, take_tokens};
use sequence::Sequence;
pub use sequence::{SeqUsage, TokenEvent};
pub use text::{SeqText, TextPiece};

/// Limits of the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (page).
    pub block_size: usize,
    /// How K and V values are stored in the pool (bf16: half the bytes per token, rounded once
    /// on write). The backend must support it ([`loraplex_kernels::Memory::supports_kv_dtype`]).
    pub kv_dtype: RowDType,
    /// Bytes of device memory for KV pages.
    pub pool_bytes: usize,
    /// Most tokens one forward carries (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Most sequences generating at once.
    pub max_running: usize,
    /// The host tier of adapters and its loader threads.
    pub adapters: LoaderConfig,
    /// Keep full KV blocks for later requests with the same prefix.
    pub prefix_cache: bool,
    /// Percent of the pool one tenant's idle cached prefix blocks may hold under pressure:
    /// beyond it they are evicted first (100: one LRU for every tenant).
    pub prefix_tenant_percent: u32,
    /// Percent of the pool's pages that adapter pins (loads that hold an adapter) may take
    /// together; the rest is for requests, which are refused at admission if they could need
    /// more than it.
    pub pinned_percent: u32,
    /// What attending to one cached token costs relative to a token's other work, for the
    /// step's cost budget (see [`SchedulerConfig::cost`]); `None`: from the model's shapes and
    /// how fast the backend's attention runs.
    pub attention_cost: Option<f64>,
    /// See [`SchedulerConfig::shared_slowdown`].
    pub shared_slowdown: Option<f64>,
    /// See [`SchedulerConfig::defer_decodes`].
    pub defer_decodes: Option<f64>,
    /// See [`SchedulerConfig::step_overhead`].
    pub step_overhead: Option<f64>,
}

impl EngineConfig {
    /// The layout of one pool page for `model` under this configuration.
    pub fn kv_layout<B: Backend>(&self, model: &Model<B>) -> KvLayout {
        model.kv_layout(self.block_size, self.kv_dtype)
    }

    /// Pages of the pool that pins may take, of `total`.
    pub fn max_pinned_pages(&self, total: usize) -> usize {
        total.saturating_mul(self.pinned_percent.min(100) as usize) / 100
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_dtype: RowDType::F32,
            pool_bytes: 1 << 30,
            max_batch_tokens: 2048,
            max_running: 256,
            adapters: LoaderConfig::default(),
            prefix_cache: true,
            prefix_tenant_percent: 25,
            pinned_percent: 0,
            attention_cost: None,
            shared_slowdown: Some(0.25),
            defer_decodes: Some(0.5),
            step_overhead: None,
        }
    }
}

/// Errors of the engine. A request error or an adapter failure refers to one request; the
/// others fail the whole step (the device cannot be trusted any more).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("the adapter could not be loaded: {0}")]
    Adapter(Arc<str>),
    #[error("sequence {}: {error}", seq.0)]
    Failed { seq: SeqId, error: SeqError },
    #[error("starting the adapter loader: {0}")]
    Loader(std::io::Error),
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("the device returned {got} sampled tokens for {expected} sequences")]
    DeviceOutput { expected: usize, got: usize },
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// A finished sequence, as collected by [`Engine::run_to_completion`].
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub seq: SeqId,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Per generated token: its logprob (when known) and the top alternatives, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    pub usage: Option<SeqUsage>,
}

/// The logprobs reported with one generated token.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    pub token: u32,
    /// `None` when the token came from a device argmax (no logprobs were asked for).
    pub logprob: Option<f32>,
    /// The most likely alternatives with their logprobs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A sequence the engine had to drop, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub seq: SeqId,
    pub error: SeqError,
}

pub struct Engine<B: Backend> {
    model: Arc<Model<B>>,
    tokenizer: Arc<Tokenizer>,
    mem: DevicePool<B>,
    adapters: AdapterResidency,
    prefix: PrefixCache,
    config: EngineConfig,
    sched: Scheduler<Sequence>,
    next_id: u64,
    failures: Vec<Failure>,
    residency_events: Vec<ResidencyEvent>,
    /// Sequences sent back to their queue to free pages, since the engine started.
    preemptions: u64,
    grammar_time: GrammarTime,
    step_time: StepTime,
    /// Draw plain sampled rows with the backend's `sample_rows` (see [`Engine::set_device_sampling`]).
    device_sampling: bool,
}

/// Where the host time of the engine's steps went, since it started (steps that ran a forward).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTime {
    pub steps: u64,
    /// Polling adapters and scheduling.
    pub schedule_ns: u64,
    /// Building and uploading the batch and its LoRA metadata.
    pub prepare_ns: u64,
    /// The forward call: queuing its kernels (on the CPU backend, running them).
    pub forward_ns: u64,
    /// From the forward's return until the sampled tokens (or logits) were on the host: on a
    /// device, the wait for queued kernels plus sampling.
    pub finish_ns: u64,
    /// Logits rows whose token the backend drew (only the ids left it).
    pub drawn_rows: u64,
    /// Logits rows copied to the host to be sampled there.
    pub copied_rows: u64,
    /// Rows whose logprobs the backend computed (only the token's and the top few left it).
    pub logprob_rows: u64,
}

impl StepTime {
    /// The steps' host time in all: scheduling, preparing, the forward and finishing.
    pub fn host_ns(&self) -> u64 {
        self.schedule_ns + self.prepare_ns + self.forward_ns + self.finish_ns
    }
}

/// What structured output has cost the engine's steps, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GrammarTime {
    /// Steps in which at least one row computed a mask.
    pub steps: u64,
    /// Masks computed.
    pub masks: u64,
    /// Time the masks took, on their own thread.
    pub mask_ns: u64,
    /// Time steps waited for masks after their forward had finished.
    pub wait_ns: u64,
}

impl<B: Backend> Engine<B> {
    /// What structured output has cost the steps so far.
    pub fn grammar_time(&self) -> GrammarTime {
        self.grammar_time
    }

    /// Where the steps' host time went so far.
    pub fn step_time(&self) -> StepTime {
        self.step_time
    }

    /// Whether rows with a plain draw (temperature, top-k, top-p; no seed, penalties, min-p,
    /// logprobs or grammar) are drawn by the backend's `sample_rows`, so that only their token
    /// ids reach the host. On by default where that spares copying logits (a GPU), off on the
    /// CPU, where the host's sampler runs either way.
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on;
    }

    pub fn new(model: Arc<Model<B>>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self, EngineError> {
        Self::with_host_tier(model, tokenizer, config, None)
    }

    /// An engine whose adapters come through `host` (a host tier shared with other devices),
    /// or through a host tier of its own when `None`.
    pub fn with_host_tier(model: Arc<Model<B>>, tokenizer: Arc<Tokenizer>, config: EngineConfig, host: Option<Arc<LoaderPool>>) -> Result<Self, EngineError> {
        if config.block_size == 0 || config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(EngineError::Config(format!("block size, batch tokens and running sequences must be positive: {config:?}")));
        }
        if !model.backend().supports_kv_dtype(config.kv_dtype) {
            return Err(EngineError::Config(format!("{} cannot keep KV pages in {}", model.backend().device_name(), config.kv_dtype.dtype())));
        }
        let layout = config.kv_layout(&model);
        let mem = DevicePool::with_bytes(model.backend().as_ref(), layout, config.pool_bytes)?;
        mem.pages.set_tenant_share((config.prefix_tenant_percent < 100).then_some(config.prefix_tenant_percent));
        let loader = match host {
            Some(pool) => AdapterLoader::on(pool),
            None => AdapterLoader::new(&config.adapters, model.base_shape(), mem.page_elems()).map_err(EngineError::Loader)?,
        };
        let pinnable = config.max_pinned_pages(mem.pages.stats().total);
        let attention_cost =
            config.attention_cost.unwrap_or_else(|| model.config().attention_flops_per_key() / model.backend().attention_efficiency().max(1e-3));
        let adapters = AdapterResidency::new(loader, model.config().num_layers, pinnable);
        let device_sampling = model.backend().draws_on_device();
        Ok(Self {
            model,
            tokenizer,
            mem,
            adapters,
            prefix: PrefixCache::new(),
            sched: Scheduler::new(SchedulerConfig {
                max_batch_tokens: config.max_batch_tokens,
                max_running: config.max_running,
                attention_cost,
                shared_slowdown: config.shared_slowdown,
                defer_decodes: config.defer_decodes,
                step_overhead: config.step_overhead,
                ..SchedulerConfig::default()
            }),
            config,
            next_id: 0,
            failures: Vec::new(),
            residency_events: Vec::new(),
            preemptions: 0,
            grammar_time: GrammarTime::default(),
            device_sampling,
            step_time: StepTime::default(),
        })
    }

    /// Sequences preempted (pages given up, recomputed later) since the engine started.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// A step's fixed time in units of a token's cost, as the scheduler uses it (see
    /// [`SchedulerConfig::step_overhead`]).
    pub fn step_overhead(&self) -> f64 {
        self.sched.step_overhead()
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.mem.pages.stats()
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix.stats()
    }

    /// The adapters resident in this device's pool.
    pub fn resident_adapters(&self) -> Vec<Arc<str>> {
        self.adapters.resident_keys()
    }

    /// Pages of the pool that requests can always have: all but the share pins may take.
    pub fn usable_pages(&self) -> usize {
        let total = self.mem.pages.stats().total;
        total - self.config.max_pinned_pages(total)
    }

    /// Sequences running and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.sched.running_len(), self.sched.waiting_len())
    }

    /// The device's adapters: residency, prefetch, holds.
    pub fn adapters(&mut self) -> &mut AdapterResidency {
        &mut self.adapters
    }

    /// Starts bringing an adapter into the pool ahead of the requests that need it.
    pub fn prefetch(&mut self, adapter: &AdapterRef) -> Residency {
        self.adapters.request(adapter)
    }

    /// Waits until `adapter` is loaded and validated (at least in host memory), or reports why
    /// it cannot be. For command-line use, before any request is queued.
    pub fn load_adapter(&mut self, adapter: &AdapterRef) -> Result<Residency, EngineError> {
        loop {
            let backend = self.model.backend().clone();
            self.adapters.poll_wait(backend.as_ref(), &mut self.mem, Duration::from_millis(50))?;
            let events = self.adapters.take_events();
            self.residency_events.extend(events);
            match self.adapters.request(adapter) {
                Residency::Failed(e) => return Err(EngineError::Adapter(e)),
                Residency::Loading => continue,
                other => return Ok(other),
            }
        }
    }

    /// Residency changes since the last call (adapters that became resident, and how long
    /// they took; loads that failed).
    pub fn take_residency_events(&mut self) -> Vec<ResidencyEvent> {
        std::mem::take(&mut self.residency_events)
    }

    /// Sequences dropped since the last call (their adapter could not be loaded, or they can
    /// never fit in the pool).
    pub fn take_failures(&mut self) -> Vec<Failure> {
        std::mem::take(&mut self.failures)
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Queues a request for the default tenant; its tokens come out of later [`Engine::step`]s.
    pub fn add(&mut self, request: ValidRequest) -> Result<SeqId, EngineError> {
        self.add_placed(request, Placement::default())
    }

    /// Queues a request in its tenant's queue, in its priority class. A request for `n`
    /// samples gets the ids `id .. id + n`; the samples split off once the prompt is computed,
    /// sharing its KV blocks.
    pub fn add_placed(&mut self, request: ValidRequest, placement: Placement) -> Result<SeqId, EngineError> {
        let req = request.into_inner();
        let blocks = BlockTable::new(&self.mem.pages, self.config.block_size);
        let (needed, usable) = (req.max_pages(self.config.block_size), self.usable_pages());
        if needed > usable {
            return Err(RequestError::TooLargeForPool { needed, usable, samples: req.n, max_new_tokens: req.stop.max_new_tokens }.into());
        }
        if let Some(adapter) = &req.adapter
            && let Residency::Failed(e) = self.adapters.request(adapter)
        {
            return Err(EngineError::Adapter(e));
        }
        let id = SeqId(self.next_id);
        self.next_id += u64::from(req.n.max(1));
        let forks = (1..req.n)
            .map(|i| {
                let mut params = req.sampling.clone();
                params.seed = params.seed.map(|seed| seed.wrapping_add(u64::from(i)));
                (SeqId(id.0 + u64::from(i)), Sampler::new(params, &req.prompt))
            })
            .collect();
        let sampler = Sampler::new(req.sampling, &req.prompt);
        let eos = self.eos_ids();
        let mut seq = Sequence::new(id, req.prompt, sampler, req.stop, eos, blocks, req.adapter, placement.namespace(), req.grammar);
        seq.forks = forks;
        self.sched.enqueue(seq, placement);
        Ok(id)
    }

    fn eos_ids(&self) -> Vec<u32> {
        end_tokens(&self.tokenizer, self.model.config())
    }

    /// Removes a sequence wherever it is; its pages are freed at once. False if unknown.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        self.sched.cancel(id).is_some()
    }

    /// Runs one iteration: a forward over this step's tokens, then one sampled token for every
    /// sequence whose tokens are all in the cache.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let backend = Arc::clone(self.model.backend());
        backend.run_step(|| self.step_here())
    }

    fn step_here(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        let entered = std::time::Instant::now();
        self.poll_adapters()?;
        self.fail_unplaceable();
        let prefix = self.config.prefix_cache.then_some(&mut self.prefix);
        let mut memory = EngineMemory { pool: &self.mem, adapters: &mut self.adapters, prefix };
        let plan = self.sched.schedule(&mut memory);
        for (s, error) in plan.failed {
            self.failures.push(Failure { seq: s.id, error });
        }
        self.preemptions += plan.preempted.len() as u64;
        if plan.chunks.is_empty() {
            return Ok(Vec::new());
        }
        let (plan, cost, began) = (plan.chunks, plan.cost, std::time::Instant::now());
        let chunks: Vec<Chunk<'_>> = plan
            .iter()
            .filter_map(|&(id, n)| self.sched.get(id).map(|s| (s, n)))
            .map(|(s, n)| Chunk {
                tokens: &s.tokens[s.computed..s.computed + n],
                start: s.computed,
                slots: (s.computed..s.computed + n).map(|p| s.blocks.slot(p)).collect(),
                pages: s.blocks.pages(),
                wants_logits: s.computed + n == s.tokens.len(),
            })
            .collect();
        let host = HostBatch::build(&chunks);
        let backend = self.model.backend().clone();
        let batch = host.upload(backend.as_ref())?;
        let lora = self.lora_batch(&plan)?;
        // The grammars of the rows that sample this step compute their masks on another
        // thread while the forward runs.
        let mut constrained = Vec::new();
        for &(id, n) in &plan {
            if let Some(s) = self.sched.get_mut(id)
                && s.computed + n == s.tokens.len()
                && let Some(c) = s.constraint.take()
            {
                constrained.push((id, c));
            }
        }
        let forward_began = std::time::Instant::now();
        let (logits, masked, forward_done) = if constrained.is_empty() {
            let logits = self.model.forward(&batch, lora.as_ref(), &mut self.mem.buffer, &self.mem.layout);
            (logits, Vec::new(), std::time::Instant::now())
        } else {
            let (model, mem) = (&self.model, &mut self.mem);
            let count = constrained.len() as u64;
            // Both sides go to the kernels' pool: while the forward's kernels run on this
            // thread, another takes the masks, and takes kernel work again once they are done;
            // no thread is started per step, and no core waits on a thread it does not know.
            let (forward, masks) = rayon::join(
                || {
                    let logits = model.forward(&batch, lora.as_ref(), &mut mem.buffer, &mem.layout);
                    (logits, std::time::Instant::now())
                },
                move || {
                    let began = std::time::Instant::now();
                    let masks = constrained
                        .into_iter()
                        .map(|(id, mut c)| {
                            let mask = c.mask();
                            (id, c, mask)
                        })
                        .collect::<Vec<_>>();
                    (masks, began.elapsed(), std::time::Instant::now())
                },
            );
            let ((logits, forward_done), (masked, took, masks_done)) = (forward, masks);
            let (mask_ns, wait_ns) = (took.as_nanos() as u64, masks_done.saturating_duration_since(forward_done).as_nanos() as u64);
            let t = &mut self.grammar_time;
            t.steps += 1;
            t.masks += count;
            t.mask_ns += mask_ns;
            t.wait_ns += wait_ns;
            (logits, masked, forward_done)
        };
        for (id, c, mask) in masked {
            if let Some(s) = self.sched.get_mut(id) {
                s.constraint = Some(c);
                s.next_mask = Some(mask);
            }
        }

        let logits = logits?;
        let vocab = self.model.config().vocab_size;
        // How each logits row (one per sequence whose tokens are all computed, in plan order)
        // becomes a token: only chosen ids leave the device for argmax and device-drawn rows.
        let mut ways = Vec::with_capacity(host.logit_rows.len());
        for &(id, n) in &plan {
            let Some(s) = self.sched.get_mut(id) else { continue };
            if s.computed + n < s.tokens.len() {
                continue;
            }
            // A device that draws tokens gives their logprobs too: only those cross to the host.
            ways.push(if s.wants_argmax_only(self.device_sampling) {
                Way::Argmax(s.logprobs())
            } else if self.device_sampling && s.forks.is_empty() {
                let logprobs = s.logprobs();
                s.device_draw().map_or(Way::Host, |p| Way::Device(p, logprobs))
            } else {
                Way::Host
            });
        }
        if ways.len() != host.logit_rows.len() {
            return Err(EngineError::DeviceOutput { expected: host.logit_rows.len(), got: ways.len() });
        }
        let fetched = fetch_rows(backend.as_ref(), &logits, vocab, &ways)?;
        // The step's results are on the host: it has run.
        self.sched.observe_step(cost, began.elapsed().as_secs_f64());
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        let t = &mut self.step_time;
        t.steps += 1;
        t.schedule_ns += ns(began.saturating_duration_since(entered));
        t.prepare_ns += ns(forward_began.saturating_duration_since(began));
        t.forward_ns += ns(forward_done.saturating_duration_since(forward_began));
        t.finish_ns += ns(forward_done.elapsed());
        t.drawn_rows += ways.iter().filter(|w| matches!(w, Way::Device(..))).count() as u64;
        t.logprob_rows += ways.iter().filter(|w| matches!(w, Way::Argmax(Some(_)) | Way::Device(_, Some(_)))).count() as u64;
        t.copied_rows += ways.iter().filter(|w| matches!(w, Way::Host)).count() as u64;
        let mut picks = fetched.picks(&ways, vocab).into_iter();
        let mut events = Vec::with_capacity(host.logit_rows.len());
        for &(id, n) in &plan {
            let Some(s) = self.sched.get_mut(id) else { continue };
            s.computed += n;
            if self.config.prefix_cache {
                publish_blocks(s, &mut self.prefix);
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let prefix = self.config.prefix_cache.then_some(&mut self.prefix);
            let mut samples = if s.forks.is_empty() { Vec::new() } else { split_samples(s, &mut self.mem, backend.as_ref(), prefix)? };
            let Some(pick) = picks.next() else {
                return Err(EngineError::DeviceOutput { expected: host.logit_rows.len(), got: events.len() });
            };
            // A sequence that fails here (its grammar cannot go on) ends alone: its samples are
            // dropped with it and the rest of the batch goes on.
            let sample_events = match take_tokens(s, &mut samples, pick) {
                Ok(out) => out,
                Err(e) => {
                    self.failures.push(Failure { seq: id, error: SeqError::Grammar(e.to_string().into()) });
                    self.sched.finish(id);
                    continue;
                }
            };
            let finished = sample_events[0].finish.is_some();
            for c in samples {
                let done = sample_events.iter().any(|e| e.seq == c.id && e.finish.is_some());
                if !done {
                    // A running parent always takes its samples; dropping one would only lose it.
                    let _ = self.sched.fork(id, c);
                }
            }
            if finished {
                // Dropping the sequence returns its pages and unpins its adapter.
                self.sched.finish(id);
            }
            events.extend(sample_events);
        }
        Ok(events)
    }

    /// Takes finished adapter loads and places what fits, without waiting (for callers that
    /// load adapters while no request runs).
    pub fn poll_adapters_now(&mut self) -> Result<(), EngineError> {
        let backend = self.model.backend().clone();
        self.adapters.poll(backend.as_ref(), &mut self.mem)?;
        let events = self.adapters.take_events();
        self.residency_events.extend(events);
        Ok(())
    }

    /// Takes finished adapter loads and places what fits. When nothing runs, waits briefly for
    /// a load instead of spinning. Requests whose adapter failed are dropped by the scheduler.
    fn poll_adapters(&mut self) -> Result<(), EngineError> {
        if self.sched.running_len() > 0 || self.sched.waiting_len() == 0 {
            return self.poll_adapters_now();
        }
        let backend = self.model.backend().clone();
        self.adapters.poll_wait(backend.as_ref(), &mut self.mem, Duration::from_millis(10))?;
        let events = self.adapters.take_events();
        self.residency_events.extend(events);
        Ok(())
    }

    /// With nothing running, no page will be freed by itself: a staged adapter that does not fit
    /// in what can be made free never will.
    fn fail_unplaceable(&mut self) {
        if self.sched.running_len() > 0 || self.sched.waiting_len() == 0 {
            return;
        }
        let available = self.mem.pages.available();
        let adapters = &self.adapters;
        let stuck = |s: &Sequence| s.adapter.as_ref().and_then(|a| adapters.staged_pages(&a.key).filter(|&n| n > available).map(|n| (a.key.clone(), n)));
        for s in self.sched.remove_waiting_where(|s| stuck(s).is_some()) {
            if let Some((_, needed)) = stuck(&s) {
                self.failures.push(Failure { seq: s.id, error: SeqError::PoolExhausted { needed, available } });
            }
        }
    }

    /// The LoRA tables of this step's sequences: one slot per distinct adapter.
    fn lora_batch(&self, plan: &[(SeqId, usize)]) -> Result<Option<LoraBatch<B>>, EngineError> {
        let mut slots: HashMap<&str, u32> = HashMap::new();
        let mut adapters: Vec<&ResidentRows> = Vec::new();
        let mut token_slots = Vec::new();
        for &(id, n) in plan {
            let slot = match self.sched.get(id).and_then(|s| s.lora.as_ref()) {
                None => NO_ADAPTER,
                Some((_, r)) => *slots.entry(&r.key).or_insert_with(|| {
                    adapters.push(&r.rows);
                    adapters.len() as u32 - 1
                }),
            };
            token_slots.extend(std::iter::repeat_n(slot, n));
        }
        let per_row = plan.iter().all(|&(_, n)| n == 1);
        let backend = self.model.backend();
        Ok(LoraBatch::build(backend.as_ref(), &adapters, &token_slots, per_row, self.model.config().num_layers)?)
    }

    /// Steps until every queued sequence has finished; returns them in the order they were added.
    /// Text is made between steps, on this thread; a sequence a stop string ended is cancelled
    /// before the next step.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>, EngineError> {
        let mut done: std::collections::BTreeMap<SeqId, Completion> = Default::default();
        let mut open: std::collections::HashMap<SeqId, (Completion, SeqText)> = Default::default();
        for s in self.sched.all() {
            for id in std::iter::once(s.id).chain(s.forks.iter().map(|f| f.0)) {
                let c = Completion {
                    seq: id,
                    prompt_tokens: s.prompt_len,
                    tokens: Vec::new(),
                    text: String::new(),
                    finish_reason: FinishReason::Length,
                    logprobs: Vec::new(),
                    usage: None,
                };
                open.insert(id, (c, SeqText::new(s.stop_strings().to_vec())));
            }
        }
        while self.has_work() {
            let events = self.step()?;
            if let Some(f) = self.failures.first() {
                return Err(EngineError::Failed { seq: f.seq, error: f.error.clone() });
            }
            for e in events {
                let Some((c, text)) = open.get_mut(&e.seq) else { continue };
                let piece = text
                    .push(&self.tokenizer, e.token, e.finish)
                    .map_err(|t| EngineError::Failed { seq: e.seq, error: SeqError::Failed(t.to_string().into()) })?;
                let Some(piece) = piece else { continue };
                c.tokens.push(e.token);
                c.text.push_str(&piece.text);
                c.logprobs.push(TokenLogprobs { token: e.token, logprob: e.logprob, top: e.top_logprobs });
                c.usage = e.usage.or(c.usage);
                if let Some(reason) = piece.finish {
                    c.finish_reason = reason;
                    if piece.cut {
                        self.cancel(e.seq);
                    }
                    if let Some((c, _)) = open.remove(&e.seq) {
                        done.insert(e.seq, c);
                    }
                }
            }
        }
        Ok(done.into_values().collect())
    }
}

/// End-of-sequence ids: the tokenizer's (its config and generation_config.json) and the model
/// config's, which is where they live when generation_config.json is absent.
pub fn end_tokens(tokenizer: &Tokenizer, config: &crate::model::ModelConfig) -> Vec<u32> {
    let mut ids = tokenizer.eos_token_ids().to_vec();
    for &id in &config.eos_token_ids {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Names the sequence's newly completed full blocks and offers them to the prefix cache
/// (unless a resident block of the same name is there already).
fn publish_blocks(s: &mut Sequence, cache: &mut PrefixCache) {
    let Some(root) = s.root else { return };
    let bs = s.blocks.block_size();
    while s.hashes.len() < s.computed / bs {
        let b = s.hashes.len();
        let name = s.hashes.last().copied().unwrap_or(root).next(&s.tokens[b * bs..(b + 1) * bs]);
        s.hashes.push(name);
        if !s.blocks.is_shared(b)
            && !cache.contains(&name)
            && let Some(entry) = s.blocks.share(b, Some(&s.namespace))
        {
            let _ = cache.insert(name, entry);
        }
    }
}

/// Splits the other samples off a sequence whose prompt was just computed. They share its full
/// prompt blocks; the partly filled last block, which each of them writes next, is copied for
/// each (when the pool has no page for the copy, that sample recomputes the block's tokens).
fn split_samples<B: Backend>(
    s: &mut Sequence,
    mem: &mut DevicePool<B>,
    backend: &B,
    mut prefix: Option<&mut PrefixCache>,
) -> Result<Vec<Sequence>, EngineError> {
    let bs = mem.layout.block_size;
    let full = s.prompt_len / bs;
    for i in 0..full {
        if let Some(entry) = s.blocks.share(i, Some(&s.namespace)) {
            // Named blocks join the cache; others live as long as the samples holding them.
            if let (Some(cache), Some(name)) = (prefix.as_deref_mut(), s.hashes.get(i)) {
                let _ = cache.insert(*name, entry);
            }
        }
    }
    let page_elems = mem.page_elems();
    let mut samples = Vec::with_capacity(s.forks.len());
    for (id, sampler) in std::mem::take(&mut s.forks) {
        let mut blocks = BlockTable::new(&mem.pages, bs);
        for i in 0..full {
            let Some(pin) = s.blocks.pin_of(i) else { break };
            blocks.push_shared(s.blocks.pages()[i], pin);
        }
        let mut computed = blocks.len() * bs;
        if blocks.len() == full {
            if full * bs == s.prompt_len {
                computed = s.prompt_len;
            } else if blocks.reserve(s.prompt_len) {
                let (src, dst) = (s.blocks.pages()[full] as usize, blocks.pages()[full] as usize);
                backend.copy_within(&mut mem.buffer, src * page_elems, dst * page_elems, page_elems)?;
                computed = s.prompt_len;
            }
        }
        samples.push(s.fork(id, sampler, blocks, computed));
    }
    Ok(samples)
}

/// The scheduler's view of the page pool, the adapters and the prefix cache: where it asks
/// for room.
struct EngineMemory<'a, B: Backend> {
    pool: &'a DevicePool<B>,
    adapters: &'a mut AdapterResidency,
    /// `None` with prefix caching off.
    prefix: Option<&'a mut PrefixCache>,
}

impl<B: Backend> EngineMemory<'_, B> {
    /// Starts a sequence on the longest run of its blocks found in the prefix cache, leaving
    /// at least its last token to compute (its logits are needed).
    fn reuse_prefix(&mut self, seq: &mut Sequence) {
        let Some(cache) = self.prefix.as_deref_mut() else { return };
        let adapter = seq.lora.as_ref().map(|(_, r)| (&*r.key, r.content_hash.as_str()));
        let root = BlockHash::root(&seq.namespace, adapter);
        let bs = seq.blocks.block_size();
        let names = BlockHash::chain(root, &seq.tokens, bs, (seq.tokens.len() - 1) / bs);
        let found = cache.lookup(&names);
        let reused = found.len();
        for (page, pin) in found {
            seq.blocks.push_shared(page, pin);
        }
        seq.root = Some(root);
        seq.hashes = names[..reused].to_vec();
        seq.computed = reused * bs;
        seq.reused = seq.computed;
    }
}

impl<B: Backend> StepMemory<Sequence> for EngineMemory<'_, B> {
    fn readiness(&mut self, seq: &Sequence) -> Readiness {
        let Some(adapter) = &seq.adapter else { return Readiness::Ready };
        match self.adapters.request(adapter) {
            Residency::Resident => Readiness::Ready,
            Residency::Failed(error) => Readiness::Failed(SeqError::AdapterFailed(error)),
            _ => Readiness::Waiting,
        }
    }

    fn start(&mut self, seq: &mut Sequence, alone: bool) -> Result<bool, SeqError> {
        if let Some(adapter) = &seq.adapter {
            match self.adapters.pin(&adapter.key) {
                Some(pinned) => seq.lora = Some(pinned),
                None => return Ok(false),
            }
        }
        if seq.blocks.is_empty() {
            self.reuse_prefix(seq);
        }
        seq.started_at.get_or_insert_with(std::time::Instant::now);
        let needed = seq.blocks.blocks_for(seq.max_len()) - seq.blocks.len();
        let available = self.pool.pages.available();
        if alone && needed > available {
            self.release(seq);
            return Err(SeqError::PoolExhausted { needed, available });
        }
        Ok(true)
    }

    fn grow(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        seq.blocks.reserve(tokens)
    }

    fn release(&mut self, seq: &mut Sequence) {
        seq.blocks = BlockTable::new(&self.pool.pages, self.pool.layout.block_size);
        seq.lora = None;
        seq.computed = 0;
        seq.root = None;
        seq.hashes.clear();
        seq.reused = 0;
    }

    fn prefetch(&mut self, seq: &Sequence) {
        if let Some(adapter) = &seq.adapter {
            self.adapters.request(adapter);
        }
    }
}

#[cfg(test)]
mod tests;
