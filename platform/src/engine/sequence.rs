//! One sequence's state inside the engine.

use std::sync::Arc;

use crate::memory::{AdapterRef, BlockTable, PagePin, ResidentAdapter};
use crate::request::{FinishReason, StopConditions};
use crate::sampling::{Sample, Sampler, StopStrings};
use crate::tokenizer::{DecodeStream, Tokenizer, TokenizerError};

/// Identifies a sequence for as long as the engine holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// What one step produced for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub seq: SeqId,
    pub token: u32,
    /// Text this token completed (empty while a character or a possible stop string is pending).
    pub text: String,
    /// The token's logprob under the model's raw distribution; `None` when the token was picked
    /// by a device argmax (plain greedy without logprobs asked for).
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    pub finish: Option<FinishReason>,
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
    sampler: Sampler,
    stop: StopConditions,
    eos: Vec<u32>,
    detok: DecodeStream,
    stop_strings: StopStrings,
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
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        sampler: Sampler,
        stop: StopConditions,
        eos: Vec<u32>,
        blocks: BlockTable,
        adapter: Option<AdapterRef>,
    ) -> Self {
        let stop_strings = StopStrings::new(stop.stop_strings.clone());
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks,
            adapter,
            lora: None,
            sampler,
            stop,
            eos,
            detok: DecodeStream::new(true),
            stop_strings,
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The most tokens this sequence can ever hold.
    pub fn max_len(&self) -> usize {
        self.prompt_len + self.stop.max_new_tokens
    }

    /// Whether the next token is the plain argmax of the logits (see [`Sampler::is_plain_argmax`]).
    pub fn wants_argmax_only(&self) -> bool {
        self.sampler.is_plain_argmax()
    }

    /// Samples the next token from this sequence's logits and applies the stop conditions.
    pub fn sample(&mut self, logits: &mut [f32], tokenizer: &Tokenizer) -> Result<TokenEvent, TokenizerError> {
        let Sample { token, logprob, top_logprobs } = self.sampler.sample(logits);
        self.accept(token, Some(logprob), top_logprobs, tokenizer)
    }

    /// Takes a token a device argmax chose (only when [`Sequence::wants_argmax_only`]).
    pub fn take_argmax(&mut self, token: u32, tokenizer: &Tokenizer) -> Result<TokenEvent, TokenizerError> {
        self.sampler.record_argmax(token);
        self.accept(token, None, Vec::new(), tokenizer)
    }

    /// Appends the chosen token and applies the stop conditions.
    fn accept(&mut self, token: u32, logprob: Option<f32>, top_logprobs: Vec<(u32, f32)>, tokenizer: &Tokenizer) -> Result<TokenEvent, TokenizerError> {
        self.tokens.push(token);
        let mut finish = None;
        let mut text = String::new();
        if (!self.stop.ignore_eos && self.eos.contains(&token)) || self.stop.stop_token_ids.contains(&token) {
            finish = Some(FinishReason::Stop);
        } else {
            if let Some(piece) = self.detok.push(tokenizer, token)? {
                let outcome = self.stop_strings.push(&piece);
                text = outcome.emit;
                if outcome.stopped.is_some() {
                    finish = Some(FinishReason::Stop);
                }
            }
            if finish.is_none() && self.generated() >= self.stop.max_new_tokens {
                finish = Some(FinishReason::Length);
            }
        }
        if finish.is_some() {
            self.flush_into(&mut text, tokenizer, &mut finish)?;
        }
        Ok(TokenEvent { seq: self.id, token, text, logprob, top_logprobs, finish })
    }

    /// At the end of the sequence: releases text held back for incomplete characters or
    /// possible stop strings, still cutting at a stop string if the tail completes one. After a
    /// stop string matched, nothing more is emitted.
    fn flush_into(&mut self, text: &mut String, tokenizer: &Tokenizer, finish: &mut Option<FinishReason>) -> Result<(), TokenizerError> {
        if let Some(tail) = self.detok.finish(tokenizer)? {
            let outcome = self.stop_strings.push(&tail);
            text.push_str(&outcome.emit);
            if outcome.stopped.is_some() {
                *finish = Some(FinishReason::Stop);
                return Ok(());
            }
        }
        text.push_str(&self.stop_strings.finish());
        Ok(())
    }
}
