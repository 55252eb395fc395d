//! One device's generation loop: pick the step's tokens, run the forward, sample, emit.
//!
//! Continuous batching at iteration level: every step carries one token for each decoding
//! sequence plus prompt chunks of prefilling ones, up to a token budget, so new requests join
//! while others are mid-generation. A sequence is admitted only when the page pool can hold its
//! longest possible length, so an admitted sequence always finishes.

mod batch;
pub mod scoring;
mod sequence;

use std::collections::VecDeque;
use std::sync::Arc;

use loraplex_kernels::{Backend, KernelError};

use crate::memory::{BlockTable, KvCache, PoolStats};
use crate::model::Model;
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { block_size: 16, pool_bytes: 1 << 30, max_batch_tokens: 2048, max_running: 256 }
    }
}

/// Errors of a step. A request error refers to one request; the others fail the whole step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("the request needs {needed} KV pages but the pool has only {total}; raise --pool-mb")]
    TooLargeForPool { needed: usize, total: usize },
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

pub struct Engine<B: Backend> {
    model: Arc<Model<B>>,
    tokenizer: Arc<Tokenizer>,
    kv: KvCache<B>,
    config: EngineConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
}

impl<B: Backend> Engine<B> {
    pub fn new(model: Arc<Model<B>>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self, EngineError> {
        if config.block_size == 0 || config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(EngineError::Config(format!("block size, batch tokens and running sequences must be positive: {config:?}")));
        }
        let layout = model.kv_layout(config.block_size);
        let kv = KvCache::with_bytes(model.backend().as_ref(), layout, config.pool_bytes)?;
        Ok(Self { model, tokenizer, kv, config, waiting: VecDeque::new(), running: Vec::new(), next_id: 0 })
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.kv.pool.stats()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request; its tokens come out of later [`Engine::step`]s.
    pub fn add(&mut self, request: ValidRequest) -> Result<SeqId, EngineError> {
        let req = request.into_inner();
        let blocks = BlockTable::new(&self.kv.pool, self.config.block_size);
        let needed = blocks.blocks_for(req.prompt.len() + req.stop.max_new_tokens);
        let total = self.kv.pool.stats().total;
        if needed > total {
            return Err(EngineError::TooLargeForPool { needed, total });
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let sampler = Sampler::new(req.sampling, &req.prompt);
        let eos = self.eos_ids();
        self.waiting.push_back(Sequence::new(id, req.prompt, sampler, req.stop, eos, blocks));
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
        let logits = self.model.forward(&batch, &mut self.kv.buffer, &self.kv.layout)?;
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

    /// Moves waiting sequences into the running set while their whole length fits in the pool.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(s) = self.waiting.front_mut() else { break };
            let max_len = s.max_len();
            if !s.blocks.reserve(max_len) {
                break;
            }
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
            }
        }
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
            for e in self.step()? {
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
