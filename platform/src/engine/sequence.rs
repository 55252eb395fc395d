//! One sequence's state inside the engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use loraplex_kernels::RowLogprobs;

use crate::grammar::{CompiledGrammar, Constraint, GrammarError, TokenMask};
use crate::memory::{AdapterRef, BlockHash, BlockTable, PagePin, ResidentAdapter};
use crate::request::{FinishReason, SeqId, StopConditions};
use crate::sampling::{Sample, Sampler};

/// What one step produced for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub seq: SeqId,
    pub token: u32,
    /// The token's logprob under the model's raw distribution; `None` when the token was picked
    /// by a device argmax (plain greedy without logprobs asked for).
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set when the engine ended the sequence with this token: an end-of-sequence or stop
    /// token (`Stop`), or its length limit. Stop strings are the consumer's (see [`super::text`]).
    pub finish: Option<FinishReason>,
    /// With the first event of a sequence: its prompt, its cache hits and its waits, all known
    /// by then. Its completion tokens are the events its consumer keeps.
    pub usage: Option<SeqUsage>,
}

/// What one sequence used before its first token, reported with that token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqUsage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (or from a sibling sample) instead of
    /// being computed.
    pub cached_prompt_tokens: usize,
    /// From being queued to being first started.
    pub queue_time: Duration,
    /// From being queued to its first token.
    pub time_to_first_token: Duration,
}

pub(super) struct Sequence {
    pub id: SeqId,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    pub blocks: BlockTable,
    /// The adapter this sequence runs with, if any.
    pub adapter: Option<AdapterRef>,
    /// Its pages, pinned while the sequence runs.
    pub lora: Option<(PagePin, Arc<ResidentAdapter>)>,
    /// The prefix cache namespace (the tenant unless the caller chose one).
    pub namespace: Arc<str>,
    /// The root of its blocks' names, set when it starts with prefix caching on.
    pub root: Option<BlockHash>,
    /// Names of its full blocks whose K/V are computed, in order.
    pub hashes: Vec<BlockHash>,
    /// Tokens whose K/V it found already computed when it last started.
    pub reused: usize,
    /// Sibling samples still to be split off once the prompt is computed: their ids and
    /// samplers.
    pub forks: Vec<(SeqId, Sampler)>,
    pub queued_at: Instant,
    pub started_at: Option<Instant>,
    first_token: Option<(Instant, usize)>,
    sampler: Sampler,
    stop: StopConditions,
    eos: Vec<u32>,
    /// What its text must match, and where in it the text is; samples start their own.
    grammar: Option<CompiledGrammar>,
    pub constraint: Option<Constraint>,
    /// The mask for its next token, computed while the step's forward ran.
    pub next_mask: Option<Result<TokenMask, GrammarError>>,
}

impl crate::scheduler::Schedulable for Sequence {
    fn id(&self) -> SeqId {
        self.id
    }

    fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    fn computed(&self) -> usize {
        self.computed
    }
}

impl Sequence {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        sampler: Sampler,
        stop: StopConditions,
        eos: Vec<u32>,
        blocks: BlockTable,
        adapter: Option<AdapterRef>,
        namespace: Arc<str>,
        grammar: Option<CompiledGrammar>,
    ) -> Self {
        let constraint = grammar.as_ref().map(CompiledGrammar::start);
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks,
            adapter,
            lora: None,
            namespace,
            root: None,
            hashes: Vec::new(),
            reused: 0,
            forks: Vec::new(),
            queued_at: Instant::now(),
            started_at: None,
            first_token: None,
            sampler,
            stop,
            eos,
            grammar,
            constraint,
            next_mask: None,
        }
    }

    /// A sibling sample of this sequence, split off once its prompt is computed: the same
    /// prompt, adapter and limits, its own sampler and id, and `blocks` (the prompt's blocks,
    /// shared or copied) holding `computed` tokens.
    pub fn fork(&self, id: SeqId, sampler: Sampler, blocks: BlockTable, computed: usize) -> Self {
        Self {
            id,
            tokens: self.tokens[..self.prompt_len].to_vec(),
            prompt_len: self.prompt_len,
            computed,
            blocks,
            adapter: self.adapter.clone(),
            lora: self.lora.as_ref().map(|(pin, rows)| (pin.clone(), rows.clone())),
            namespace: self.namespace.clone(),
            root: self.root,
            hashes: self.hashes.iter().take(computed / self.blocks.block_size()).copied().collect(),
            reused: self.reused.max(computed),
            forks: Vec::new(),
            queued_at: self.queued_at,
            started_at: self.started_at,
            first_token: None,
            sampler,
            stop: self.stop.clone(),
            eos: self.eos.clone(),
            grammar: self.grammar.clone(),
            constraint: self.grammar.as_ref().map(CompiledGrammar::start),
            next_mask: None,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The most tokens this sequence can ever hold.
    pub fn max_len(&self) -> usize {
        self.prompt_len + self.stop.max_new_tokens as usize
    }

    /// Whether the next token is the plain argmax of the logits (see [`Sampler::is_plain_argmax`];
    /// with `logprobs_on_device`, the logprobs asked for come with the token). A sequence with a
    /// grammar never does: its mask comes first (and a lost matcher fails in
    /// [`Sequence::sample`] instead of falling back to the plain argmax).
    pub fn wants_argmax_only(&self, logprobs_on_device: bool) -> bool {
        self.grammar.is_none() && self.sampler.is_plain_argmax(logprobs_on_device)
    }

    /// How many alternatives its request asked logprobs for, if it did.
    pub fn logprobs(&self) -> Option<usize> {
        self.sampler.logprobs()
    }

    /// The stop strings its consumer cuts its text at.
    pub fn stop_strings(&self) -> &[String] {
        &self.stop.stop_strings
    }

    /// Samples the next token from this sequence's logits (only among the tokens its grammar
    /// allows, when it has one) and applies the stop conditions.
    pub fn sample(&mut self, logits: &mut [f32]) -> Result<TokenEvent, GrammarError> {
        if self.grammar.is_some() && self.constraint.is_none() {
            return Err(GrammarError::Generation("its grammar's matcher was lost".into()));
        }
        if let Some(c) = &mut self.constraint {
            let mask = match self.next_mask.take() {
                Some(mask) => mask?,
                None => c.mask()?,
            };
            mask.apply(logits);
            if !logits.iter().any(|l| l.is_finite()) {
                return Err(GrammarError::Generation("no token the grammar allows is in the model's vocabulary".into()));
            }
        }
        let Sample { token, logprob, top_logprobs } = self.sampler.sample(logits);
        if let Some(c) = &mut self.constraint {
            c.accept(token)?;
        }
        Ok(self.accept(token, Some(logprob), top_logprobs))
    }

    /// The settings for drawing this sequence's next token on the device
    /// ([`crate::sampling::Sampler::device_draw`]), when it has no grammar and the draw is one
    /// the device makes; takes one number from its random stream.
    /// The device then gives the logprobs asked for too.
    pub fn device_draw(&mut self) -> Option<loraplex_kernels::SampleParams> {
        if self.grammar.is_some() {
            return None;
        }
        self.sampler.device_draw()
    }

    /// Takes a token drawn on the device with [`Sequence::device_draw`]'s settings, with the
    /// logprobs the device gave when they were asked for.
    pub fn take_device_draw(&mut self, token: u32, logprobs: Option<&RowLogprobs>) -> TokenEvent {
        self.sampler.record_device_draw(token);
        self.accept_with(token, logprobs)
    }

    /// Takes a token a device argmax chose (only when [`Sequence::wants_argmax_only`]), with the
    /// logprobs the device gave when they were asked for.
    pub fn take_argmax(&mut self, token: u32, logprobs: Option<&RowLogprobs>) -> TokenEvent {
        self.sampler.record_argmax(token);
        self.accept_with(token, logprobs)
    }

    fn accept_with(&mut self, token: u32, logprobs: Option<&RowLogprobs>) -> TokenEvent {
        match logprobs {
            Some(l) => self.accept(token, Some(l.logprob), l.top.clone()),
            None => self.accept(token, None, Vec::new()),
        }
    }

    /// Appends the chosen token and applies the token-level stop conditions.
    fn accept(&mut self, token: u32, logprob: Option<f32>, top_logprobs: Vec<(u32, f32)>) -> TokenEvent {
        let usage = if self.first_token.is_none() {
            self.first_token = Some((Instant::now(), self.reused.min(self.prompt_len)));
            Some(self.usage())
        } else {
            None
        };
        self.tokens.push(token);
        // A grammar's end is the end of the text, `ignore_eos` or not.
        let ends = self.eos.contains(&token) && (!self.stop.ignore_eos || self.constraint.is_some());
        let finish = if ends || self.stop.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.generated() >= self.stop.max_new_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        };
        TokenEvent { seq: self.id, token, logprob, top_logprobs, finish, usage }
    }

    fn usage(&self) -> SeqUsage {
        let (first, cached) = self.first_token.unwrap_or((Instant::now(), 0));
        let started = self.started_at.unwrap_or(first);
        SeqUsage {
            prompt_tokens: self.prompt_len,
            cached_prompt_tokens: cached,
            queue_time: started.saturating_duration_since(self.queued_at),
            time_to_first_token: first.saturating_duration_since(self.queued_at),
        }
    }
}
