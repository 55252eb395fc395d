//! The per-sequence sampler: penalties, temperature, min-p / top-k / top-p, one seeded draw.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use super::{SamplingParams, Xoshiro256};

/// One sampled token with its logprobs under the model's raw distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The chosen token id.
    pub token: u32,
    /// log-softmax of the unmodified logits at `token` (before penalties and temperature).
    pub logprob: f32,
    /// The `n` most likely tokens of the raw distribution when `logprobs: Some(n)` was asked
    /// for, most likely first (ties: lower id first). Empty otherwise.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Samples the tokens of one sequence. Owns the random generator and the token history that the
/// penalties need, so create one per sequence and feed it every step's logits in order.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
    /// Prompt and generated tokens: the repetition penalty's domain.
    seen: HashSet<u32>,
    /// How often each token was generated: presence and frequency penalties.
    counts: HashMap<u32, u32>,
    /// (id, logit before penalties) of the entries the penalties changed this step.
    saved: Vec<(u32, f32)>,
    /// Candidate (logit, id) pairs, kept between steps so the buffer is allocated once.
    cands: Vec<(f32, u32)>,
}

/// Initial window of the top-p search; most distributions reach `top_p` well within it.
const TOP_P_FIRST_WINDOW: usize = 256;

/// Descending logit, then ascending id: the total order every filter uses, so that ties are
/// resolved the same way regardless of how the candidates happen to be arranged. Logits are
/// NaN-free here; -0 and +0 compare equal, as they do for greedy's argmax.
pub(super) fn by_rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// Unnormalized probability of logit `x` given the maximum `m` and 1/temperature.
#[inline]
fn weight(x: f32, m: f32, inv_t: f32) -> f32 {
    let d = x - m;
    if d == f32::NEG_INFINITY {
        0.0
    } else {
        (d * inv_t).exp()
    }
}

/// Replaces NaN by -inf and +inf by `f32::MAX`, so every later comparison and subtraction is
/// well defined. Returns the maximum.
fn sanitize(logits: &mut [f32]) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for x in logits.iter_mut() {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
        max = max.max(*x);
    }
    max
}

/// `ln(sum(exp(x - max)))`, accumulated in f64.
fn log_sum_exp_shifted(logits: &[f32], max: f32) -> f64 {
    let sum: f64 = logits.iter().map(|&x| weight(x, max, 1.0) as f64).sum();
    sum.ln()
}

/// The `n` largest logits as (logit, id), largest first, lower id first among equals.
fn top_n(logits: &[f32], n: usize) -> Vec<(f32, u32)> {
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &x) in logits.iter().enumerate() {
        if top.len() == n && x <= top[n - 1].0 {
            continue;
        }
        // Ids arrive in increasing order, so an equal logit already present keeps its place.
        let at = top.partition_point(|e| e.0 >= x);
        top.insert(at, (x, i as u32));
        top.truncate(n);
    }
    top
}

/// Argmax with ties going to the lowest id (what `torch.argmax` returns).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_x = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x > best_x {
            best = i;
            best_x = x;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler for a sequence whose prompt is `prompt` (used by the repetition penalty).
    ///
    /// `params` should have passed [`SamplingParams::validate`]; out-of-range values do not
    /// panic, but the tokens they produce are unspecified.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            rng: Xoshiro256::seed_from_u64(seed),
            params,
            seen,
            counts: HashMap::new(),
            saved: Vec::new(),
            cands: Vec::new(),
        }
    }

    /// The parameters this sampler was created with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one value per vocabulary entry) and records it as
    /// generated, for the penalties of later steps.
    ///
    /// `logits` is used as scratch: afterwards NaN entries read -inf, +inf entries read
    /// `f32::MAX`, and the penalized entries hold their penalized values. Temperature is not
    /// applied in place. If no logit is finite the result is token 0 with logprob -inf.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sample {
        if logits.is_empty() {
            return Sample {
                token: 0,
                logprob: f32::NEG_INFINITY,
                top_logprobs: Vec::new(),
            };
        }
        let raw_max = sanitize(logits);
        let ln_z = log_sum_exp_shifted(logits, raw_max);
        let raw_logprob = |x: f32| -> f32 {
            if raw_max == f32::NEG_INFINITY {
                f32::NEG_INFINITY
            } else {
                ((x - raw_max) as f64 - ln_z) as f32
            }
        };
        let top_logprobs = match self.params.logprobs {
            Some(n) => top_n(logits, n)
                .into_iter()
                .map(|(x, id)| (id, raw_logprob(x)))
                .collect(),
            None => Vec::new(),
        };

        self.apply_penalties(logits);
        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.draw(logits)
        };

        let raw = self
            .saved
            .iter()
            .find(|(id, _)| *id == token)
            .map_or(logits[token as usize], |&(_, x)| x);
        self.record(token);
        Sample {
            token,
            logprob: raw_logprob(raw),
            top_logprobs,
        }
    }

    fn record(&mut self, token: u32) {
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Repetition penalty over prompt and output, then frequency and presence over the output.
    /// The raw value of every entry touched is saved for the logprob of the sampled token.
    fn apply_penalties(&mut self, logits: &mut [f32]) {
        self.saved.clear();
        let rep = self.params.repetition_penalty;
        if rep != 1.0 {
            for &id in &self.seen {
                if let Some(x) = logits.get_mut(id as usize) {
                    self.saved.push((id, *x));
                    *x = if *x > 0.0 { *x / rep } else { *x * rep };
                    *x = clean(*x);
                }
            }
        }
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            for (&id, &count) in &self.counts {
                if let Some(x) = logits.get_mut(id as usize) {
                    if rep == 1.0 {
                        self.saved.push((id, *x));
                    }
                    *x -= freq * count as f32;
                    *x -= pres;
                    *x = clean(*x);
                }
            }
        }
    }

    /// A random draw after temperature, min-p, top-k and top-p.
    ///
    /// The result depends only on the set of tokens the filters keep and on one uniform
    /// number: the draw walks the kept tokens in id order whatever order the selection
    /// algorithms left them in, so results do not depend on the standard library's sorting.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            return 0;
        }
        let inv_t = 1.0 / p.temperature;
        let top_k = (p.top_k > 0 && p.top_k < logits.len()).then_some(p.top_k);
        let top_p = p.top_p < 1.0;
        let min_p = p.min_p > 0.0;
        let u = self.rng.next_f64();

        if top_k.is_none() && !top_p && !min_p {
            let it = logits.iter().enumerate().map(|(i, &x)| (x, i as u32));
            let z: f64 = it.clone().map(|(x, _)| weight(x, m, inv_t) as f64).sum();
            return pick(it, u * z, m, inv_t).unwrap_or_else(|| argmax(logits));
        }

        let cands = &mut self.cands;
        cands.clear();
        let ln_min_p = if min_p {
            p.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|&(_, &x)| x > f32::NEG_INFINITY && (x - m) * inv_t >= ln_min_p)
                .map(|(i, &x)| (x, i as u32)),
        );
        // `cands` is in id order here and stays so unless a filter below reorders it.
        let mut reordered = false;
        if let Some(k) = top_k
            && k < cands.len()
        {
            cands.select_nth_unstable_by(k - 1, by_rank);
            cands.truncate(k);
            cands.sort_unstable_by(by_rank);
            reordered = true;
        }
        if top_p && cands.len() > 1 {
            // Total mass, summed in a canonical order (by id, or by rank after top-k).
            let z: f64 = cands.iter().map(|c| weight(c.0, m, inv_t) as f64).sum();
            let keep = top_p_prefix(cands, p.top_p as f64 * z, m, inv_t, reordered);
            cands.truncate(keep);
            reordered = true;
        }
        if reordered {
            cands.sort_unstable_by_key(|c| c.1);
        }
        let z: f64 = cands.iter().map(|c| weight(c.0, m, inv_t) as f64).sum();
        pick(cands.iter().copied(), u * z, m, inv_t).unwrap_or_else(|| argmax(logits))
    }
}

/// NaN (from out-of-range parameters) becomes -inf and overflow is clamped, as in `sanitize`.
fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

/// The first candidate at which the running weight exceeds `target`; if rounding leaves the
/// target unreached, the last candidate with positive weight. `None` when all weights are 0.
fn pick(cands: impl Iterator<Item = (f32, u32)>, target: f64, m: f32, inv_t: f32) -> Option<u32> {
    let mut cum = 0.0f64;
    let mut last = None;
    for (x, id) in cands {
        let w = weight(x, m, inv_t);
        if w > 0.0 {
            cum += w as f64;
            last = Some(id);
            if cum > target {
                return last;
            }
        }
    }
    last
}

/// How many of the best-ranked candidates top-p keeps: the shortest prefix (in rank order)
/// whose mass reaches `target`, at least one. Leaves that prefix sorted by rank at the front.
///
/// Avoids a full sort: the best `window` candidates are selected in linear time and only they
/// are sorted; the window grows until it holds enough mass. Prefix sums are always taken in
/// rank order, so the answer does not depend on the window sizes tried.
pub(super) fn top_p_prefix(
    cands: &mut [(f32, u32)],
    target: f64,
    m: f32,
    inv_t: f32,
    sorted: bool,
) -> usize {
    let len = cands.len();
    let mut window = if sorted {
        len
    } else {
        TOP_P_FIRST_WINDOW.min(len)
    };
    loop {
        if !sorted {
            if window < len {
                cands.select_nth_unstable_by(window - 1, by_rank);
            }
            cands[..window].sort_unstable_by(by_rank);
        }
        let mut cum = 0.0f64;
        for (j, c) in cands[..window].iter().enumerate() {
            cum += weight(c.0, m, inv_t) as f64;
            if cum >= target {
                return j + 1;
            }
        }
        if window == len {
            return len;
        }
        window = window.saturating_mul(8).min(len);
    }
}
