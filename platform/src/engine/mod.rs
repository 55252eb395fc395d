//! One device's generation loop: pick the step's tokens, run the forward, sample, emit.
//!
//! Continuous batching at iteration level: every step carries one token for each decoding
//! sequence plus prompt chunks of prefilling ones, up to a token budget, so new requests join
//! while others are mid-generation. A sequence is admitted only when the page pool can hold its
//! longest possible length, so an admitted sequence always finishes.
//!
//! Requests may name a LoRA adapter. A sequence waits until its adapter is resident in the page
//! pool (loads run on loader threads; the step only places what is ready), then pins it for as
//! long as it runs. Sequences with different adapters, and without one, share every forward:
//! the model adds each token's LoRA delta through the batched LoRA kernels.

mod batch;
pub mod scoring;
mod sequence;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use loraplex_kernels::{Backend, KernelError, NO_ADAPTER};

use crate::memory::{
    AdapterLoader, AdapterRef, AdapterResidency, BlockTable, DevicePool, LoaderConfig, PoolStats, Residency, ResidencyEvent, ResidentRows,
};
use crate::model::{LoraBatch, Model};
use crate::request::{FinishReason, RequestError, ValidRequest};
use crate::sampling::Sampler;
use crate::tokenizer::{Tokenizer, TokenizerError};

use batch::{Chunk, HostBatch};
use sequence::Sequence;
pub use sequence::{SeqId, TokenEvent};

/// Limits of the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block (page).
    pub block_size: usize,
    /// Bytes of device memory for KV pages.
    pub pool_bytes: usize,
    /// Most tokens one forward carries (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Most sequences generating at once.
    pub max_running: usize,
    /// The host tier of adapters and its loader threads.
    pub adapters: LoaderConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { block_size: 16, pool_bytes: 1 << 30, max_batch_tokens: 2048, max_running: 256, adapters: LoaderConfig::default() }
    }
}

/// Errors of a step. A request error refers to one request; the others fail the whole step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("the request needs {needed} pool pages but the pool has only {total}; raise --pool-mb")]
    TooLargeForPool { needed: usize, total: usize },
    #[error("{0}")]
    Adapter(Arc<str>),
    #[error("sequence {}: {error}", seq.0)]
    Failed { seq: SeqId, error: Arc<str> },
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
    pub error: Arc<str>,
}

pub struct Engine<B: Backend> {
    model: Arc<Model<B>>,
    tokenizer: Arc<Tokenizer>,
    mem: DevicePool<B>,
    adapters: AdapterResidency,
    config: EngineConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
    failures: Vec<Failure>,
    residency_events: Vec<ResidencyEvent>,
}

impl<B: Backend> Engine<B> {
    pub fn new(model: Arc<Model<B>>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self, EngineError> {
        if config.block_size == 0 || config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(EngineError::Config(format!("block size, batch tokens and running sequences must be positive: {config:?}")));
        }
        let layout = model.kv_layout(config.block_size);
        let mem = DevicePool::with_bytes(model.backend().as_ref(), layout, config.pool_bytes)?;
        let loader = AdapterLoader::new(&config.adapters, model.base_shape(), mem.page_elems()).map_err(EngineError::Loader)?;
        let adapters = AdapterResidency::new(loader, model.config().num_layers);
        Ok(Self {
            model,
            tokenizer,
            mem,
            adapters,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            failures: Vec::new(),
            residency_events: Vec::new(),
        })
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.mem.pages.stats()
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
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request; its tokens come out of later [`Engine::step`]s.
    pub fn add(&mut self, request: ValidRequest) -> Result<SeqId, EngineError> {
        let req = request.into_inner();
        let blocks = BlockTable::new(&self.mem.pages, self.config.block_size);
        let needed = blocks.blocks_for(req.prompt.len() + req.stop.max_new_tokens);
        let total = self.mem.pages.stats().total;
        if needed > total {
            return Err(EngineError::TooLargeForPool { needed, total });
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        if let Some(adapter) = &req.adapter
            && let Residency::Failed(e) = self.adapters.request(adapter)
        {
            return Err(EngineError::Adapter(e));
        }
        let sampler = Sampler::new(req.sampling, &req.prompt);
        let eos = self.eos_ids();
        self.waiting.push_back(Sequence::new(id, req.prompt, sampler, req.stop, eos, blocks, req.adapter));
        Ok(id)
    }

    /// End-of-sequence ids: the tokenizer's (its config and generation_config.json) and the
    /// model config's, which is where they live when generation_config.json is absent.
    fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.tokenizer.eos_token_ids().to_vec();
        for &id in &self.model.config().eos_token_ids {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// Removes a sequence wherever it is; its pages are freed at once. False if unknown.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| s.id != id);
        self.running.retain(|s| s.id != id);
        before != self.waiting.len() + self.running.len()
    }

    /// Runs one iteration: a forward over this step's tokens, then one sampled token for every
    /// sequence whose prompt is fully in the cache.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>, EngineError> {
        self.poll_adapters()?;
        self.admit();
        let mut budget = self.config.max_batch_tokens;
        // Decodes first (one token each), then prompt chunks in arrival order.
        let mut plan: Vec<(usize, usize)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.computed >= s.prompt_len && budget > 0 {
                plan.push((i, 1));
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.computed < s.prompt_len && budget > 0 {
                let n = (s.prompt_len - s.computed).min(budget);
                plan.push((i, n));
                budget -= n;
            }
        }
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let chunks: Vec<Chunk<'_>> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                Chunk {
                    tokens: &s.tokens[s.computed..s.computed + n],
                    start: s.computed,
                    slots: (s.computed..s.computed + n).map(|p| s.blocks.slot(p)).collect(),
                    pages: s.blocks.pages(),
                    wants_logits: s.computed + n == s.tokens.len(),
                }
            })
            .collect();
        let host = HostBatch::build(&chunks);
        let backend = self.model.backend().clone();
        let batch = host.upload(backend.as_ref())?;
        let lora = self.lora_batch(&plan)?;
        let logits = self.model.forward(&batch, lora.as_ref(), &mut self.mem.buffer, &self.mem.layout)?;
        let vocab = self.model.config().vocab_size;
        // When every sequence wants the plain argmax, only the chosen ids leave the device.
        let argmax_only = plan.iter().all(|&(i, n)| {
            let s = &self.running[i];
            s.computed + n < s.tokens.len() || s.wants_argmax_only()
        });
        let chosen = if argmax_only { backend.argmax_rows(&logits, vocab)? } else { Vec::new() };
        if argmax_only && chosen.len() != host.logit_rows.len() {
            return Err(EngineError::DeviceOutput { expected: host.logit_rows.len(), got: chosen.len() });
        }
        let mut chosen = chosen.into_iter();
        let host_logits = if argmax_only { Vec::new() } else { backend.download_f32(&logits)? };
        let mut rows = host_logits.chunks_exact(vocab);
        let mut events = Vec::with_capacity(host.logit_rows.len());
        for &(i, n) in &plan {
            let s = &mut self.running[i];
            s.computed += n;
            if s.computed < s.tokens.len() {
                continue;
            }
            let event = if argmax_only {
                let token = chosen.next().unwrap_or_default();
                s.take_argmax(token, &self.tokenizer)?
            } else {
                let mut row = rows.next().map(<[f32]>::to_vec).unwrap_or_default();
                s.sample(&mut row, &self.tokenizer)?
            };
            events.push(event);
        }
        let finished: Vec<SeqId> = events.iter().filter(|e| e.finish.is_some()).map(|e| e.seq).collect();
        self.running.retain(|s| !finished.contains(&s.id));
        Ok(events)
    }

    /// Takes finished adapter loads, places what fits, and drops the waiting sequences whose
    /// adapter failed. When nothing runs, waits briefly for a load instead of spinning.
    fn poll_adapters(&mut self) -> Result<(), EngineError> {
        let backend = self.model.backend().clone();
        if self.running.is_empty() && !self.waiting.is_empty() {
            self.adapters.poll_wait(backend.as_ref(), &mut self.mem, Duration::from_millis(10))?;
        } else {
            self.adapters.poll(backend.as_ref(), &mut self.mem)?;
        }
        for event in self.adapters.take_events() {
            if let ResidencyEvent::Failed { key, error } = &event {
                self.fail_waiting(|s| s.adapter.as_ref().is_some_and(|a| a.key == *key), error);
            }
            self.residency_events.push(event);
        }
        Ok(())
    }

    fn fail_waiting(&mut self, matches: impl Fn(&Sequence) -> bool, error: &Arc<str>) {
        let failures = &mut self.failures;
        self.waiting.retain(|s| {
            let hit = matches(s);
            if hit {
                failures.push(Failure { seq: s.id, error: error.clone() });
            }
            !hit
        });
    }

    /// Moves waiting sequences into the running set while their whole length fits in the pool.
    /// A sequence whose adapter is not resident yet is passed over (and its adapter requested),
    /// so it never holds up the others; memory is given in arrival order.
    fn admit(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() < self.config.max_running {
            let s = &self.waiting[i];
            let lora = match &s.adapter {
                None => None,
                Some(adapter) => match self.adapters.pin(&adapter.key) {
                    Some(pinned) => Some(pinned),
                    None => {
                        if let Residency::Failed(error) = self.adapters.request(adapter) {
                            let seq = s.id;
                            self.waiting.remove(i);
                            self.failures.push(Failure { seq, error });
                        } else {
                            i += 1;
                        }
                        continue;
                    }
                },
            };
            let max_len = s.max_len();
            let total = self.mem.pages.stats().total;
            let needed = s.blocks.blocks_for(max_len) + lora.as_ref().map_or(0, |(_, r)| r.num_pages());
            let Some(s) = self.waiting.get_mut(i) else { break };
            if needed > total || (!s.blocks.reserve(max_len) && self.running.is_empty()) {
                // Nothing running will free pages: this sequence can never start.
                let available = self.mem.pages.available();
                let error = format!("needs {needed} pool pages; {available} of {total} can be made free; raise --pool-mb");
                let seq = s.id;
                self.waiting.remove(i);
                self.failures.push(Failure { seq, error: error.into() });
                continue;
            }
            if s.blocks.capacity() < max_len {
                break;
            }
            s.lora = lora;
            if let Some(s) = self.waiting.remove(i) {
                self.running.push(s);
            }
        }
        self.fail_unplaceable();
    }

    /// With nothing running, no page will be freed by itself: a staged adapter that does not fit
    /// in what can be made free never will.
    fn fail_unplaceable(&mut self) {
        if !self.running.is_empty() || self.waiting.is_empty() {
            return;
        }
        let available = self.mem.pages.available();
        let stuck: Vec<(Arc<str>, usize)> = self
            .waiting
            .iter()
            .filter_map(|s| s.adapter.as_ref())
            .filter_map(|a| self.adapters.staged_pages(&a.key).map(|n| (a.key.clone(), n)))
            .filter(|&(_, n)| n > available)
            .collect();
        for (key, n) in stuck {
            let error: Arc<str> =
                format!("adapter {key} needs {n} pool pages; only {available} can be made free (the rest are held); raise --pool-mb").into();
            self.fail_waiting(|s| s.adapter.as_ref().is_some_and(|a| a.key == key), &error);
        }
    }

    /// The LoRA tables of this step's sequences: one slot per distinct adapter.
    fn lora_batch(&self, plan: &[(usize, usize)]) -> Result<Option<LoraBatch<B>>, EngineError> {
        let mut slots: HashMap<&str, u32> = HashMap::new();
        let mut adapters: Vec<&ResidentRows> = Vec::new();
        let mut token_slots = Vec::new();
        for &(i, n) in plan {
            let slot = match &self.running[i].lora {
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
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>, EngineError> {
        let mut done: std::collections::BTreeMap<SeqId, Completion> = Default::default();
        let mut open: std::collections::HashMap<SeqId, Completion> = Default::default();
        for s in self.waiting.iter().chain(&self.running) {
            open.insert(s.id, Completion {
                seq: s.id,
                prompt_tokens: s.prompt_len,
                tokens: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                logprobs: Vec::new(),
            });
        }
        while self.has_work() {
            let events = self.step()?;
            if let Some(f) = self.failures.first() {
                return Err(EngineError::Failed { seq: f.seq, error: f.error.clone() });
            }
            for e in events {
                let Some(c) = open.get_mut(&e.seq) else { continue };
                c.tokens.push(e.token);
                c.text.push_str(&e.text);
                c.logprobs.push(TokenLogprobs { token: e.token, logprob: e.logprob, top: e.top_logprobs });
                if let Some(reason) = e.finish {
                    c.finish_reason = reason;
                    if let Some(c) = open.remove(&e.seq) {
                        done.insert(e.seq, c);
                    }
                }
            }
        }
        Ok(done.into_values().collect())
    }
}
