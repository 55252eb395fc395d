//! The per-sequence sampler: penalties, temperature, min-p / top-k / top-p, one seeded draw.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet};

use loraplex_kernels::SampleParams;

use super::{SamplingParams, Xoshiro256, math};

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
    /// Scratch kept between steps so that vocabulary-sized buffers are allocated once.
    scratch: Scratch,
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Candidate (logit, id) pairs.
    cands: Vec<(f32, u32)>,
    /// Unnormalized probabilities, parallel to the logits or to `cands`.
    weights: Vec<f32>,
    /// Probability mass per top-p bin.
    bins: Vec<f64>,
    /// (logit, id, weight) of the candidates in the bin where top-p's cut falls.
    boundary: Vec<(f32, u32, f32)>,
    /// Storage of the top-k heap.
    heap: Vec<WorstFirst>,
}

/// A candidate ordered so that a max-heap keeps the worst-ranked one on top.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct WorstFirst(f32, u32);

impl Eq for WorstFirst {}

impl PartialOrd for WorstFirst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for WorstFirst {
    fn cmp(&self, other: &Self) -> Ordering {
        by_rank(&(self.0, self.1), &(other.0, other.1))
    }
}

/// Up to this `top_k` the best tokens are found with a heap in one pass over the logits;
/// larger values select among all candidates instead.
const TOP_K_HEAP_MAX: usize = 4096;

/// Below this many candidates top-p simply sorts them.
const TOP_P_SORT_MAX: usize = 2048;
/// Top-p bins per unit of scaled logit (`(x - max) / temperature`): the weights in one bin are
/// within a factor e^(1/32) of each other.
const TOP_P_BINS_PER_UNIT: f32 = 32.0;
/// Bins cover scaled logits down to -88 (weights below e^-87 are 0); one more takes the rest.
const TOP_P_BINS: usize = 88 * 32 + 1;

/// Descending logit, then ascending id: the total order every filter uses, so that ties are
/// resolved the same way regardless of how the candidates happen to be arranged. Logits are
/// NaN-free here; -0 and +0 compare equal, as they do for greedy's argmax.
pub(super) fn by_rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

// Logits are sanitized first (NaN to -inf, +inf to `f32::MAX`), so every later comparison and
// subtraction is well defined; argmax ties go to the lowest id (what `torch.argmax` returns).
use math::{argmax, clean, sanitize};

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

impl Sampler {
    /// A sampler for a sequence whose prompt is `prompt` (used by the repetition penalty).
    ///
    /// `params` should have passed [`SamplingParams::validate`]; out-of-range values do not
    /// panic, but the tokens they produce are unspecified.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let seen = if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Self { rng: Xoshiro256::seed_from_u64(seed), params, seen, counts: HashMap::new(), saved: Vec::new(), scratch: Scratch::default() }
    }

    /// The parameters this sampler was created with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the next token is exactly the argmax of the raw logits (greedy, no penalties; no
    /// logprobs asked for, unless `logprobs_elsewhere`: the caller gets them with the token). A
    /// device's argmax may then stand in for [`Sampler::sample`], followed by
    /// [`Sampler::record_argmax`]; both pick the first maximum and ignore NaN.
    pub fn is_plain_argmax(&self, logprobs_elsewhere: bool) -> bool {
        let p = &self.params;
        p.is_greedy() && (p.logprobs.is_none() || logprobs_elsewhere) && !self.penalized()
    }

    /// How many alternatives the request asked logprobs for, if it did.
    pub fn logprobs(&self) -> Option<usize> {
        self.params.logprobs
    }

    /// Whether a penalty (repetition, presence, frequency) changes the logits.
    fn penalized(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// Records a token chosen outside [`Sampler::sample`] (see [`Sampler::is_plain_argmax`]).
    pub fn record_argmax(&mut self, token: u32) {
        self.record(token);
    }

    /// The settings of this row's next draw on the device, taking its uniform from this
    /// sampler's stream, when the device's draw is the one asked for: temperature, top-k and
    /// top-p only (no min-p or penalties), for a request without a seed. The logprobs asked for
    /// are the device's to give with the token. A seeded request is drawn here on the host,
    /// where the same seed gives the same tokens for the same logits on every machine.
    pub fn device_draw(&mut self) -> Option<SampleParams> {
        let p = &self.params;
        let plain = !p.is_greedy() && p.seed.is_none() && p.min_p == 0.0 && !self.penalized();
        let top_k = u32::try_from(p.top_k).ok()?;
        if !(plain && p.temperature.is_finite() && p.top_p > 0.0 && p.top_p <= 1.0) {
            return None;
        }
        // [0, 1) in f32: a draw that rounds up to 1 takes the largest f32 below it.
        let uniform = (self.rng.next_f64() as f32).min(1.0 - f32::EPSILON / 2.0);
        Some(SampleParams { temperature: p.temperature, top_k, top_p: p.top_p, uniform })
    }

    /// Records a token drawn on the device with [`Sampler::device_draw`]'s settings.
    pub fn record_device_draw(&mut self, token: u32) {
        self.record(token);
    }

    /// Chooses the next token from `logits` (one value per vocabulary entry) and records it as
    /// generated, for the penalties of later steps.
    ///
    /// `logits` is used as scratch: afterwards NaN entries read -inf, +inf entries read
    /// `f32::MAX`, and the penalized entries hold their penalized values. Temperature is not
    /// applied in place. If no logit is finite the result is token 0 with logprob -inf.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sample {
        sanitize(logits);
        let raw_max = math::max(logits);
        if raw_max == f32::NEG_INFINITY {
            // Nothing to choose from (or an empty vocabulary): a fixed answer.
            self.record(0);
            return Sample {
                token: 0,
                logprob: f32::NEG_INFINITY,
                top_logprobs: self.params.logprobs.map_or_else(Vec::new, |n| (0..n.min(logits.len()) as u32).map(|id| (id, f32::NEG_INFINITY)).collect()),
            };
        }
        let weights = &mut self.scratch.weights;
        math::fill_weights(weights, logits, raw_max, 1.0);
        let ln_z = libm::log(math::sum(weights));
        let raw_logprob = |x: f32| ((x - raw_max) as f64 - ln_z) as f32;
        let top_logprobs = match self.params.logprobs {
            Some(n) => top_n(logits, n).into_iter().map(|(x, id)| (id, raw_logprob(x))).collect(),
            None => Vec::new(),
        };

        self.apply_penalties(logits);
        let token = if self.params.is_greedy() { argmax(logits) } else { self.draw(logits) };

        let raw = self.saved.iter().find(|(id, _)| *id == token).map_or(logits[token as usize], |&(_, x)| x);
        self.record(token);
        Sample { token, logprob: raw_logprob(raw), top_logprobs }
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
                    *x = clean(if *x > 0.0 { *x / rep } else { *x * rep });
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
    /// algorithms left them in, and all arithmetic is fixed by this module, so results do not
    /// depend on the standard library's sorting or the platform's math library.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let Scratch { cands, weights, bins, boundary, heap } = &mut self.scratch;
        let m = math::max(logits);
        if m == f32::NEG_INFINITY {
            return 0;
        }
        let inv_t = 1.0 / p.temperature;
        let top_k = (p.top_k > 0 && p.top_k < logits.len()).then_some(p.top_k);
        let top_p = p.top_p < 1.0;
        let min_p = p.min_p > 0.0;
        let u = self.rng.next_f64();

        if top_k.is_none() && !top_p && !min_p {
            math::fill_weights(weights, logits, m, inv_t);
            let i = math::pick(weights, u * math::sum(weights));
            return i.map_or_else(|| argmax(logits), |i| i as u32);
        }

        let ln_min_p = if min_p { libm::logf(p.min_p) } else { f32::NEG_INFINITY };
        let passes = |x: f32| x > f32::NEG_INFINITY && (x - m) * inv_t >= ln_min_p;
        cands.clear();
        if let Some(k) = top_k {
            if k <= TOP_K_HEAP_MAX {
                best_k(logits, k, passes, heap, cands);
            } else {
                cands.extend(ids_where(logits, passes));
                if k < cands.len() {
                    cands.select_nth_unstable_by(k - 1, by_rank);
                    cands.truncate(k);
                }
            }
            cands.sort_unstable_by(by_rank);
            if top_p {
                // The top-k candidates are sorted by rank: the cut is a walk down them.
                math::fill_weights_of(weights, cands, m, inv_t);
                let target = p.top_p as f64 * math::sum(weights);
                let mut cum = 0.0f64;
                let keep = weights
                    .iter()
                    .position(|&w| {
                        cum += w as f64;
                        cum >= target
                    })
                    .map_or(cands.len(), |j| j + 1);
                cands.truncate(keep);
            }
            // The draw walks the candidates in id order.
            cands.sort_unstable_by_key(|c| c.1);
        } else {
            cands.extend(ids_where(logits, passes));
        }
        math::fill_weights_of(weights, cands, m, inv_t);
        if top_p
            && top_k.is_none()
            && let Some(cut) = top_p_cut(cands, weights, p.top_p as f64, m, inv_t, bins, boundary)
        {
            // Drop what ranks below the cut (the same test as `by_rank`, spelled out for speed).
            for (w, c) in weights.iter_mut().zip(cands.iter()) {
                if c.0 < cut.0 || (c.0 == cut.0 && c.1 > cut.1) {
                    *w = 0.0;
                }
            }
        }
        match math::pick(weights, u * math::sum(weights)) {
            Some(i) => cands[i].1,
            None => argmax(logits),
        }
    }
}

/// (logit, id) of the logits that pass `keep`, in id order.
fn ids_where(logits: &[f32], keep: impl Fn(f32) -> bool) -> impl Iterator<Item = (f32, u32)> {
    logits.iter().enumerate().filter(move |&(_, &x)| keep(x)).map(|(i, &x)| (x, i as u32))
}

/// Appends to `out` the best `k` (by rank) logits that pass `keep`, in no particular order.
/// One pass with a bounded heap: most logits are rejected by a single comparison.
pub(super) fn best_k(logits: &[f32], k: usize, keep: impl Fn(f32) -> bool, storage: &mut Vec<WorstFirst>, out: &mut Vec<(f32, u32)>) {
    storage.clear();
    let mut heap = BinaryHeap::from(std::mem::take(storage));
    for (i, &x) in logits.iter().enumerate() {
        let full = heap.len() == k;
        // Ids only grow, so an equal logit would rank below everything already kept.
        if (full && heap.peek().is_some_and(|w| x <= w.0)) || !keep(x) {
            continue;
        }
        let entry = WorstFirst(x, i as u32);
        if full {
            if let Some(mut worst) = heap.peek_mut() {
                *worst = entry;
            }
        } else {
            heap.push(entry);
        }
    }
    out.extend(heap.iter().map(|w| (w.0, w.1)));
    *storage = heap.into_vec();
}

/// The bin of scaled logit `(x - m) * inv_t`: bins are ordered like the ranks.
#[inline]
fn top_p_bin(x: f32, m: f32, inv_t: f32) -> usize {
    let k = (m - x) * inv_t * TOP_P_BINS_PER_UNIT;
    if k < (TOP_P_BINS - 1) as f32 { k as usize } else { TOP_P_BINS - 1 }
}

/// Top-p's cut: the worst-ranked candidate it keeps, so that it keeps the shortest prefix (in
/// rank order) whose mass reaches `top_p` of the total, at least one token. `None`: keep all.
/// `cands` (in id order) and their `weights` are parallel.
///
/// Avoids sorting the whole vocabulary, which a flat distribution would need: the mass is
/// first gathered into narrow bins of scaled logit (each summed in id order), the bin where the
/// cut falls is found by walking down the bins, and only that bin's candidates are sorted.
pub(super) fn top_p_cut(
    cands: &[(f32, u32)],
    weights: &[f32],
    top_p: f64,
    m: f32,
    inv_t: f32,
    bins: &mut Vec<f64>,
    boundary: &mut Vec<(f32, u32, f32)>,
) -> Option<(f32, u32)> {
    let target = top_p * math::sum(weights);
    let small = cands.len() <= TOP_P_SORT_MAX;
    let (bin, mut cum) = if small {
        (None, 0.0)
    } else {
        bins.clear();
        bins.resize(TOP_P_BINS, 0.0);
        for (c, &w) in cands.iter().zip(weights) {
            bins[top_p_bin(c.0, m, inv_t)] += w as f64;
        }
        let mut cum = 0.0;
        let mut at = None;
        for (b, &mass) in bins.iter().enumerate() {
            if cum + mass >= target {
                at = Some(b);
                break;
            }
            cum += mass;
        }
        (Some(at?), cum)
    };
    boundary.clear();
    boundary.extend(cands.iter().zip(weights).filter(|(c, _)| bin.is_none_or(|b| top_p_bin(c.0, m, inv_t) == b)).map(|(c, &w)| (c.0, c.1, w)));
    boundary.sort_unstable_by(|a, b| by_rank(&(a.0, a.1), &(b.0, b.1)));
    for &(x, id, w) in boundary.iter() {
        cum += w as f64;
        if cum >= target {
            return Some((x, id));
        }
    }
    // Rounding left the target unreached within the bin: keep the whole bin.
    boundary.last().map(|&(x, id, _)| (x, id)).filter(|_| bin.is_some())
}
