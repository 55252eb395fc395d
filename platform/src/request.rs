//! Generation requests: what a caller asks for, and the validated form the engine accepts.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::memory::AdapterRef;
use crate::model::ModelConfig;
use crate::sampling::{SamplingError, SamplingParams};

/// Identifies a sequence for as long as an engine holds it (below both the engine and the
/// scheduler, which both name sequences by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// When a sequence stops, besides its end-of-sequence tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopConditions {
    /// At most this many tokens are generated.
    pub max_new_tokens: u32,
    /// Extra token ids that end the sequence (not shown in its text).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the sequence; the text stops before the first one found.
    pub stop_strings: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for StopConditions {
    fn default() -> Self {
        Self { max_new_tokens: 16, stop_token_ids: Vec::new(), stop_strings: Vec::new(), ignore_eos: false }
    }
}

/// A request to continue one prompt, with the base model or one LoRA adapter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopConditions,
    /// The adapter to apply; `None` runs the base model. Resolved by the caller (a path, or a
    /// tenant's adapter version), so it is not part of the wire form.
    #[serde(skip)]
    pub adapter: Option<AdapterRef>,
    /// Independent samples of the prompt; they share its KV blocks. Sample `i` of a seeded
    /// request draws with seed `seed + i`.
    #[serde(default = "one")]
    pub n: u32,
    /// What the output must match (structured output), compiled; each sample runs its own copy.
    #[serde(skip)]
    pub grammar: Option<crate::grammar::CompiledGrammar>,
}

fn one() -> u32 {
    1
}

/// The most samples one request may ask for.
pub const MAX_SAMPLES: u32 = 128;

/// Why the sequence ended, with OpenAI's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A request the caller got wrong. Messages are for the caller.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the model's context length is {context} tokens")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("the prompt ({prompt} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's context length of {context} tokens")]
    ExceedsContext { prompt: usize, max_new_tokens: u32, context: usize },
    #[error("`max_new_tokens` must be at least 1")]
    ZeroMaxTokens,
    #[error("`n` must be between 1 and {max}, got {n}")]
    Samples { n: u32, max: u32 },
    #[error(
        "the request needs up to {needed} pages of the device pool for its prompt and {samples} sample(s) of up to {max_new_tokens} tokens, \
         but at most {usable} can ever be given to requests; lower max_tokens or n"
    )]
    TooLargeForPool { needed: usize, usable: usize, samples: u32, max_new_tokens: u32 },
    #[error("token id {id} is outside the model's vocabulary of {vocab} tokens")]
    TokenOutOfVocab { id: u32, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
}

/// Why one sequence could not run or go on. The request ends with it; other sequences in the
/// batch are not affected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeqError {
    /// The pool cannot give the sequence the pages it needs (the rest are held or in use) and
    /// will not by itself: a capacity problem, worth a retry later.
    #[error("the device pool cannot hold this request now: it needs {needed} pages and {available} can be made free")]
    PoolExhausted { needed: usize, available: usize },
    /// Its adapter could not be brought into the pool (the message names the file and tensor
    /// or key at fault).
    #[error("the adapter could not be loaded: {0}")]
    AdapterFailed(Arc<str>),
    /// The sequence failed inside a step (detokenizing or sampling its output).
    #[error("generation failed: {0}")]
    Failed(Arc<str>),
    /// Its grammar could not go on (a per-step limit of the request's own grammar).
    #[error("{0}")]
    Grammar(Arc<str>),
}

/// A request checked against the model. Only this type reaches the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest(GenerationRequest);

impl ValidRequest {
    pub fn get(&self) -> &GenerationRequest {
        &self.0
    }

    pub fn into_inner(self) -> GenerationRequest {
        self.0
    }
}

impl GenerationRequest {
    /// Pool pages the request may need at most, with `block_size` tokens per page: its prompt's
    /// blocks, and for each sample its generated tokens' blocks plus the partly filled last
    /// prompt block (copied for each sample). Saturates rather than overflows.
    pub fn max_pages(&self, block_size: usize) -> usize {
        let bs = block_size.max(1);
        let prompt = self.prompt.len().div_ceil(bs);
        let per_sample = (self.stop.max_new_tokens as usize).div_ceil(bs).saturating_add(1);
        prompt.saturating_add(per_sample.saturating_mul(self.n.max(1) as usize))
    }

    /// Checks the request against the model's vocabulary and context length.
    pub fn validate(self, model: &ModelConfig) -> Result<ValidRequest, RequestError> {
        let context = model.max_position_embeddings;
        let prompt = self.prompt.len();
        if prompt == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        if prompt > context {
            return Err(RequestError::PromptTooLong { prompt, context });
        }
        if self.stop.max_new_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        if self.n == 0 || self.n > MAX_SAMPLES {
            return Err(RequestError::Samples { n: self.n, max: MAX_SAMPLES });
        }
        if prompt.checked_add(self.stop.max_new_tokens as usize).is_none_or(|total| total > context) {
            return Err(RequestError::ExceedsContext { prompt, max_new_tokens: self.stop.max_new_tokens, context });
        }
        let vocab = model.vocab_size;
        if let Some(&id) = self.prompt.iter().chain(&self.stop.stop_token_ids).find(|&&id| id as usize >= vocab) {
            return Err(RequestError::TokenOutOfVocab { id, vocab });
        }
        self.sampling.validate()?;
        Ok(ValidRequest(self))
    }
}
