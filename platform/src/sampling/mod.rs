//! Token sampling over host logits, with the parameters OpenAI and vLLM clients send.
//!
//! Processing order for one step (the order vLLM uses):
//! 1. raw logprobs are taken from the unmodified logits (log-softmax of the model's output);
//! 2. repetition penalty (prompt and generated tokens), then frequency and presence penalties
//!    (generated tokens);
//! 3. temperature (below [`GREEDY_TEMPERATURE`] the step is greedy: argmax, ties to the lowest id);
//! 4. min-p, then top-k, then top-p, each on what the previous filter kept;
//! 5. one draw from the remaining tokens' softmax.
//!
//! Stop strings live in [`stop`].

mod math;
mod rng;
mod sampler;
pub mod stop;
#[cfg(test)]
mod tests;

pub(crate) use rng::{Xoshiro256, splitmix64};
pub use sampler::{Sample, Sampler};
pub use stop::{StopOutcome, StopStrings};

/// Temperatures below this are treated as 0 (greedy), as in vLLM.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// The most alternatives a request may ask logprobs for.
pub const MAX_LOGPROBS: usize = 20;

/// Per-request sampling parameters. Fields missing from JSON take their [`Default`] value.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy decoding (argmax; ties go to the lowest token id).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns the filter off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 is off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0 is off.
    pub min_p: f32,
    /// Over prompt and generated tokens: positive logits are divided by it, negative ones
    /// multiplied (HF / vLLM semantics); 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token generated so far (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted from a generated token's logit once per time it was generated (OpenAI).
    pub frequency_penalty: f32,
    /// `Some`: the same seed gives the same tokens for the same logits, on any machine.
    /// `None`: the generator is seeded from OS entropy.
    pub seed: Option<u64>,
    /// `Some(n)`: also return the `n` most likely alternatives with their logprobs (n may be 0).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

/// A parameter outside its allowed range. The message is meant for the API user.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("`{field}` must be {expected}; given: {given}")]
pub struct SamplingError {
    /// The offending parameter's name as the API spells it.
    pub field: &'static str,
    /// The allowed range, in words.
    pub expected: &'static str,
    /// The value that was given.
    pub given: String,
}

impl SamplingParams {
    /// Deterministic argmax decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Whether this request decodes greedily (also the fallback for a NaN temperature).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE
    }

    /// Checks every parameter's range; the first violation is reported.
    pub fn validate(&self) -> Result<(), SamplingError> {
        fn bad(field: &'static str, expected: &'static str, given: impl ToString) -> SamplingError {
            SamplingError { field, expected, given: given.to_string() }
        }
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(bad("temperature", "a finite number >= 0", t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", "in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", "in [0, 1]", self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(bad("repetition_penalty", "a finite number > 0", r));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(bad("presence_penalty", "in [-2, 2]", self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty));
        }
        if let Some(n) = self.logprobs
            && n > MAX_LOGPROBS
        {
            return Err(bad("logprobs", "at most 20", n));
        }
        Ok(())
    }
}
