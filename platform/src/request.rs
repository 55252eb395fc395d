//! Generation requests: what a caller asks for, and the validated form the engine accepts.

use serde::{Deserialize, Serialize};

use crate::memory::AdapterRef;
use crate::model::ModelConfig;
use crate::sampling::{SamplingError, SamplingParams};

/// When a sequence stops, besides its end-of-sequence tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopConditions {
    /// At most this many tokens are generated.
    pub max_new_tokens: usize,
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
    pub n: usize,
}

fn one() -> usize {
    1
}

/// The most samples one request may ask for.
pub const MAX_SAMPLES: usize = 128;

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
    ExceedsContext { prompt: usize, max_new_tokens: usize, context: usize },
    #[error("`max_new_tokens` must be at least 1")]
    ZeroMaxTokens,
    #[error("`n` must be between 1 and {max}, got {n}")]
    Samples { n: usize, max: usize },
    #[error("token id {id} is outside the model's vocabulary of {vocab} tokens")]
    TokenOutOfVocab { id: u32, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
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
        if prompt + self.stop.max_new_tokens > context {
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
