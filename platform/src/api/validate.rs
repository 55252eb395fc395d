//! One validation for every inference route: the OpenAI and LoRAX endpoints translate their
//! bodies into [`Knobs`] and [`Prompt`]s, and everything they ask for is checked here, against
//! the same limits.
//!
//! Checks come in order of cost. [`Knobs::check`] and [`check_prompts`] only look at what was
//! sent (counts, lengths, ranges, bytes) and run before the request is admitted; a prompt longer
//! in bytes than the context could ever hold is refused there, before it is tokenized.
//! [`tokenize`] then runs on the blocking pool, and [`Knobs::request`] checks the token counts.
//! Every count a client sends is an unsigned 32-bit value at most, and every sum of them is
//! checked.

use super::{ApiError, AppState};
use crate::request::{GenerationRequest, MAX_SAMPLES, StopConditions};
use crate::sampling::{MAX_LOGPROBS, SamplingParams};
use crate::tokenizer::ChatMessage;

/// The most prompts one request may carry.
pub const MAX_PROMPTS: usize = 64;
/// The most stop strings one request may give, and the longest one, in bytes.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// The most messages of one chat request.
pub const MAX_MESSAGES: usize = 2048;
/// The most tool calls one message may carry.
pub const MAX_TOOL_CALLS: usize = 128;
/// The roles a chat message may have.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// The sampling and stopping fields every route accepts, in one vocabulary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Knobs {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// -1 or 0: off.
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub n: Option<u32>,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: bool,
    /// Alternatives per token to report logprobs for (`Some(0)`: the chosen token's only).
    pub logprobs: Option<u32>,
}

/// How many tokens a request generates when it does not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultMax {
    Tokens(u32),
    /// What is left of the context after the prompt (chat).
    RestOfContext,
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::Invalid(msg.into())
}

impl Knobs {
    /// Samples per prompt.
    pub fn samples(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    fn sampling(&self) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(invalid(format!("`top_k` must be -1 (off) or positive; given: {k}"))),
        };
        let d = SamplingParams::default();
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed,
            logprobs: self.logprobs.map(|n| n as usize),
        };
        params.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(params)
    }

    /// What can be checked without the prompt: `n`, `max_tokens`, the stop strings, the
    /// sampling ranges and logprobs.
    pub fn check(&self) -> Result<(), ApiError> {
        let n = self.samples();
        if n == 0 || n > MAX_SAMPLES {
            return Err(invalid(format!("`n` must be between 1 and {MAX_SAMPLES}; given: {n}")));
        }
        if self.max_tokens == Some(0) {
            return Err(invalid("`max_tokens` must be at least 1"));
        }
        if let Some(l) = self.logprobs
            && l as usize > MAX_LOGPROBS
        {
            return Err(invalid(format!("`logprobs` must be at most {MAX_LOGPROBS}; given: {l}")));
        }
        if self.stop.len() > MAX_STOPS {
            return Err(invalid(format!("at most {MAX_STOPS} stop strings; given: {}", self.stop.len())));
        }
        for s in &self.stop {
            if s.is_empty() {
                return Err(invalid("stop strings must not be empty"));
            }
            if s.len() > MAX_STOP_BYTES {
                return Err(invalid(format!("a stop string may have at most {MAX_STOP_BYTES} bytes; given: {}", s.len())));
            }
        }
        self.sampling().map(drop)
    }

    /// The generation request for one tokenized prompt (its adapter is set by the caller).
    pub fn request(&self, prompt: Vec<u32>, default_max: DefaultMax, context: usize) -> Result<GenerationRequest, ApiError> {
        let max_new_tokens = match (self.max_tokens, default_max) {
            (Some(m), _) | (None, DefaultMax::Tokens(m)) => m,
            (None, DefaultMax::RestOfContext) => u32::try_from(context.saturating_sub(prompt.len())).unwrap_or(u32::MAX).max(1),
        };
        Ok(GenerationRequest {
            prompt,
            sampling: self.sampling()?,
            stop: StopConditions { max_new_tokens, stop_token_ids: Vec::new(), stop_strings: self.stop.clone(), ignore_eos: self.ignore_eos },
            adapter: None,
            n: self.samples(),
            grammar: None,
        })
    }
}

/// One prompt, as sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    /// Rendered with the model's chat template, with the request's tools if it offers any.
    Chat(Vec<ChatMessage>, Option<std::sync::Arc<super::tools::ToolSet>>),
}

/// What prompts may be.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    /// The model's context, in tokens.
    pub context: usize,
    /// The most bytes of text that could ever fit the context (see
    /// [`crate::tokenizer::Tokenizer::longest_token_bytes`]).
    pub max_bytes: usize,
}

/// The cheap checks of the prompts: their number, and their size in tokens (token ids) or in
/// bytes (text and chat messages, before any tokenizing); chat roles.
pub fn check_prompts(prompts: &[Prompt], limits: &PromptLimits) -> Result<(), ApiError> {
    if prompts.is_empty() {
        return Err(invalid("the prompt is empty"));
    }
    if prompts.len() > MAX_PROMPTS {
        return Err(invalid(format!("at most {MAX_PROMPTS} prompts per request; given: {}", prompts.len())));
    }
    let too_long = |bytes: usize| {
        invalid(format!(
            "the prompt has {bytes} bytes, more than the model's context of {} tokens could ever hold ({} bytes at most)",
            limits.context, limits.max_bytes
        ))
    };
    for p in prompts {
        match p {
            Prompt::Text(s) if s.is_empty() => return Err(invalid("the prompt is empty")),
            Prompt::Text(s) if s.len() > limits.max_bytes => return Err(too_long(s.len())),
            Prompt::Ids(ids) if ids.is_empty() => return Err(invalid("the prompt is empty")),
            Prompt::Ids(ids) if ids.len() > limits.context => {
                return Err(invalid(format!("the prompt has {} tokens; the model's context length is {} tokens", ids.len(), limits.context)));
            }
            Prompt::Chat(messages, _) => {
                if messages.is_empty() {
                    return Err(invalid("`messages` must not be empty"));
                }
                if messages.len() > MAX_MESSAGES {
                    return Err(invalid(format!("at most {MAX_MESSAGES} messages; given: {}", messages.len())));
                }
                let mut bytes = 0usize;
                for m in messages {
                    if !CHAT_ROLES.contains(&m.role.as_str()) {
                        let role: String = m.role.chars().take(32).collect();
                        return Err(invalid(format!("message role {role:?} is not one of {}", CHAT_ROLES.join(", "))));
                    }
                    bytes = bytes.saturating_add(m.content.len()).saturating_add(m.role.len());
                    if m.tool_calls.as_ref().is_some_and(|c| c.len() > MAX_TOOL_CALLS) {
                        return Err(invalid(format!("a message may carry at most {MAX_TOOL_CALLS} tool calls")));
                    }
                }
                if bytes > limits.max_bytes {
                    return Err(too_long(bytes));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Bytes per token of context a text may have before its head alone is tokenized first.
const PROBE_BYTES_PER_TOKEN: usize = 4;
/// Tokens a cut through a word can add to a head's count.
const PROBE_SLACK: usize = 16;

/// Tokenizes `text`, refusing it cheaply when it cannot fit `context`: a text longer than a
/// few bytes per token of context has its head tokenized first, and when the head alone has
/// more tokens than the context, the rest is never tokenized.
fn encode_bounded(tokenizer: &crate::tokenizer::Tokenizer, text: &str, special: bool, context: usize) -> Result<Vec<u32>, ApiError> {
    let fail = |e: crate::tokenizer::TokenizerError| invalid(format!("the prompt could not be tokenized: {e}"));
    let probe = context.saturating_mul(PROBE_BYTES_PER_TOKEN);
    if text.len() > probe {
        let mut end = probe;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let head = tokenizer.encode(&text[..end], special).map_err(fail)?;
        if head.len() > context.saturating_add(PROBE_SLACK) {
            return Err(invalid(format!(
                "the prompt has more than {} tokens in its first {end} bytes; the model's context length is {context} tokens",
                head.len() - PROBE_SLACK
            )));
        }
    }
    tokenizer.encode(text, special).map_err(fail)
}

/// The prompts as token ids: text is tokenized and chats rendered on the blocking pool.
pub async fn tokenize(state: &AppState, prompts: Vec<Prompt>) -> Result<Vec<Vec<u32>>, ApiError> {
    if prompts.iter().all(|p| matches!(p, Prompt::Ids(_))) {
        return Ok(prompts.into_iter().map(|p| if let Prompt::Ids(ids) = p { ids } else { Vec::new() }).collect());
    }
    let tokenizer = state.tokenizer.clone();
    let context = state.prompt_limits.context;
    state
        .blocking
        .run(move || {
            prompts
                .into_iter()
                .map(|p| match p {
                    Prompt::Ids(ids) => Ok(ids),
                    Prompt::Text(s) => encode_bounded(&tokenizer, &s, true, context),
                    Prompt::Chat(m, tools) => {
                        let (text, marked) = super::tools::render(&tokenizer, m, tools.as_deref())
                            .map_err(|e| invalid(format!("the messages could not be rendered with the model's chat template: {e}")))?;
                        if marked.is_empty() {
                            return encode_bounded(&tokenizer, &text, false, context);
                        }
                        // Special tokens' strings the client wrote are text (see `tokenizer::literal`).
                        tokenizer.encode_marked(&text, &marked, context.saturating_add(PROBE_SLACK)).map_err(|e| match e {
                            crate::tokenizer::TokenizerError::TooLong { tokens, .. } => {
                                invalid(format!("the prompt has more than {tokens} tokens; the model's context length is {context} tokens"))
                            }
                            e => invalid(format!("the prompt could not be tokenized: {e}")),
                        })
                    }
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await?
}

/// Tokens a request may use at most: its prompts plus `n` samples of `max_new_tokens` each,
/// for the tokens-per-minute reservation. Checked: saturates at `u64::MAX` (which no limit
/// admits).
pub fn token_budget(requests: &[GenerationRequest]) -> u64 {
    requests.iter().fold(0u64, |sum, r| {
        let generated = u64::from(r.n).saturating_mul(u64::from(r.stop.max_new_tokens));
        sum.saturating_add(r.prompt.len() as u64).saturating_add(generated)
    })
}

#[cfg(test)]
mod tests;
