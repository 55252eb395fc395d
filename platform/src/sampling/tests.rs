use super::sampler::{best_k, by_rank, top_p_cut};
use super::*;

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams { seed: Some(seed), ..SamplingParams::default() }
}

/// Logits whose softmax is exactly proportional to `probs`.
fn logits_for(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - m) / temperature).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Token frequencies over `n` draws from fresh copies of `logits`.
fn histogram(params: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = Sampler::new(params, &[]);
    let mut counts = vec![0; logits.len()];
    for _ in 0..n {
        counts[s.sample(&mut logits.to_vec()).token as usize] += 1;
    }
    counts
}

/// Pearson's chi-square statistic of `counts` against `probs` (cells with p = 0 must be empty).
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "a token with probability 0 was drawn");
                0.0
            } else {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}

/// Deterministic pseudo-random logits, roughly N(0, 2^2)-shaped.
fn random_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Xoshiro256::seed_from_u64(seed);
    (0..n).map(|_| ((0..4).map(|_| r.next_f64()).sum::<f64>() - 2.0) as f32 * 3.5).collect()
}

#[test]
fn greedy_picks_argmax_and_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingParams::greedy(), &[]);
    assert_eq!(s.sample(&mut [0.1, 2.0, -1.0, 1.9]).token, 1);
    assert_eq!(s.sample(&mut [0.5, 3.0, 3.0, 3.0, -2.0]).token, 1);
    assert_eq!(s.sample(&mut [7.0, 7.0]).token, 0);
    // A tiny temperature is greedy too, and consumes no randomness.
    let mut t = Sampler::new(SamplingParams { temperature: 1e-6, ..seeded(1) }, &[]);
    assert_eq!(t.sample(&mut [1.0, 4.0, 4.0]).token, 1);
}

#[test]
fn same_seed_same_samples_and_different_seeds_differ() {
    let logits = random_logits(1000, 3);
    let run = |params: SamplingParams| -> Vec<u32> {
        let mut s = Sampler::new(params, &[5, 6]);
        (0..64).map(|_| s.sample(&mut logits.clone()).token).collect()
    };
    let filtered = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.01,
        repetition_penalty: 1.1,
        presence_penalty: 0.2,
        frequency_penalty: 0.1,
        ..seeded(seed)
    };
    for params in [seeded(11), filtered(11)] {
        let a = run(params.clone());
        assert_eq!(a, run(params.clone()));
        let other = SamplingParams { seed: Some(12), ..params };
        assert_ne!(a, run(other));
    }
    // Unseeded samplers draw their seeds from the OS.
    assert_ne!(run(SamplingParams::default()), run(SamplingParams::default()));
}

#[test]
fn seeded_stream_is_pinned() {
    // Guards the documented promise: a seed gives these tokens on any machine and build.
    let logits = logits_for(&[0.1, 0.2, 0.3, 0.4]);
    let mut s = Sampler::new(seeded(2024), &[]);
    let got: Vec<u32> = (0..12).map(|_| s.sample(&mut logits.clone()).token).collect();
    assert_eq!(got, PINNED_2024);
}

// Also reproduced by an independent implementation of xoshiro256** and inverse-CDF sampling.
const PINNED_2024: [u32; 12] = [0, 3, 0, 1, 3, 1, 2, 1, 2, 0, 3, 3];

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let logits = random_logits(5000, 9);
    let best = Sampler::new(SamplingParams::greedy(), &[]).sample(&mut logits.clone()).token;
    for seed in 0..20 {
        let k1 = SamplingParams { top_k: 1, ..seeded(seed) };
        assert_eq!(Sampler::new(k1, &[]).sample(&mut logits.clone()).token, best);
        let p0 = SamplingParams { top_p: 1e-6, ..seeded(seed) };
        assert_eq!(Sampler::new(p0, &[]).sample(&mut logits.clone()).token, best);
        let m1 = SamplingParams { min_p: 1.0, ..seeded(seed) };
        assert_eq!(Sampler::new(m1, &[]).sample(&mut logits.clone()).token, best);
    }
    // Exact ties: top-k keeps the lower id, as greedy does.
    let k1 = SamplingParams { top_k: 1, ..seeded(0) };
    assert_eq!(Sampler::new(k1.clone(), &[]).sample(&mut [1.0, 3.0, 3.0]).token, 1);
    assert_eq!(Sampler::new(k1, &[]).sample(&mut [-1.0, -0.0, 0.0]).token, 1);
    let mut g = Sampler::new(SamplingParams::greedy(), &[]);
    assert_eq!(g.sample(&mut [-1.0, -0.0, 0.0]).token, 1);
}

#[test]
fn temperature_frequencies_match_softmax() {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 3.0];
    for t in [1.0, 0.7, 1.8] {
        let params = SamplingParams { temperature: t as f32, ..seeded(7) };
        let counts = histogram(params, &logits, 20_000);
        let chi = chi_square(&counts, &softmax(&logits, t));
        // 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
        assert!(chi < 18.47, "t={t}: chi-square {chi:.2}, counts {counts:?}");
    }
}

#[test]
fn top_k_and_top_p_keep_the_right_tokens() {
    let probs = [0.15, 0.5, 0.05, 0.3];
    let logits = logits_for(&probs);
    // top-k 2 keeps tokens 1 and 3, renormalized 5:3.
    let counts = histogram(SamplingParams { top_k: 2, ..seeded(1) }, &logits, 8000);
    let chi = chi_square(&counts, &[0.0, 0.625, 0.0, 0.375]);
    assert!(chi < 10.83, "chi-square {chi:.2}, counts {counts:?}"); // 1 dof, p = 0.001
    // top-p 0.75: 0.5 is not enough, 0.5 + 0.3 is.
    let counts = histogram(SamplingParams { top_p: 0.75, ..seeded(2) }, &logits, 8000);
    let chi = chi_square(&counts, &[0.0, 0.625, 0.0, 0.375]);
    assert!(chi < 10.83, "chi-square {chi:.2}, counts {counts:?}");
    // top-p 0.9 adds the 0.15 token; top-k 2 applied first removes it again.
    let counts = histogram(SamplingParams { top_p: 0.9, ..seeded(3) }, &logits, 4000);
    assert!(counts[0] > 0 && counts[2] == 0, "{counts:?}");
    let both = SamplingParams { top_p: 0.9, top_k: 2, ..seeded(3) };
    let counts = histogram(both, &logits, 4000);
    assert!(counts[0] == 0 && counts[2] == 0, "{counts:?}");
}

#[test]
fn min_p_filters_relative_to_the_top_token() {
    let probs = [0.5, 0.3, 0.15, 0.05];
    let logits = logits_for(&probs);
    // Threshold 0.2 * 0.5 = 0.1: token 3 goes.
    let counts = histogram(SamplingParams { min_p: 0.2, ..seeded(4) }, &logits, 10_000);
    let chi = chi_square(&counts, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]);
    assert!(chi < 13.82, "chi-square {chi:.2}, counts {counts:?}"); // 2 dof, p = 0.001
    // Threshold 0.5 * 0.5 = 0.25: only tokens 0 and 1 remain.
    let counts = histogram(SamplingParams { min_p: 0.5, ..seeded(5) }, &logits, 4000);
    assert!(counts[0] > 0 && counts[1] > 0 && counts[2] + counts[3] == 0);
    // min-p acts on the tempered distribution: at t = 2 the ratios are square roots, so
    // token 3 (sqrt(0.1) = 0.32 of the top) passes a 0.3 threshold it fails at t = 1.
    let hot = SamplingParams { min_p: 0.3, temperature: 2.0, ..seeded(6) };
    assert!(histogram(hot, &logits, 4000)[3] > 0);
    let cold = SamplingParams { min_p: 0.3, ..seeded(6) };
    assert_eq!(histogram(cold, &logits, 4000)[3], 0);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let params = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() };
    let mut s = Sampler::new(params, &[1, 3, 3, 99]); // 99 is out of range: ignored
    let mut logits = [2.0, 4.0, -1.0, -3.0, 0.0];
    // Token 1 drops from 4 to 2 and ties with token 0, which wins as the lower id.
    let out = s.sample(&mut logits);
    assert_eq!(logits, [2.0, 2.0, -1.0, -6.0, 0.0]);
    assert_eq!(out.token, 0);
    // The generated token 0 is penalized from now on as well; zero stays zero.
    let mut logits = [3.0, 1.0, 0.5, -0.5, 0.0];
    let out = s.sample(&mut logits);
    assert_eq!(logits, [1.5, 0.5, 0.5, -1.0, 0.0]);
    assert_eq!(out.token, 0);
    // The reported logprob is the raw one.
    let expected = (3.0f64 - softmax_denominator(&[3.0, 1.0, 0.5, -0.5, 0.0]).ln()) as f32;
    assert!((out.logprob - expected).abs() < 1e-6);
}

fn softmax_denominator(logits: &[f32]) -> f64 {
    logits.iter().map(|&x| (x as f64).exp()).sum()
}

#[test]
fn presence_and_frequency_penalties_follow_openai() {
    let params = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..SamplingParams::greedy() };
    let mut s = Sampler::new(params, &[2]); // prompt tokens are not penalized
    let mut l = [0.0, 5.0, 0.0, 0.0];
    assert_eq!(s.sample(&mut l).token, 1);
    assert_eq!(l, [0.0, 5.0, 0.0, 0.0]);
    let mut l = [0.0, 5.0, 0.0, 0.0];
    assert_eq!(s.sample(&mut l).token, 1);
    assert_eq!(l, [0.0, 4.25, 0.0, 0.0]); // 5 - 0.25 * 1 - 0.5
    let mut l = [0.0, 5.0, 0.0, 0.0];
    s.sample(&mut l);
    assert_eq!(l, [0.0, 4.0, 0.0, 0.0]); // 5 - 0.25 * 2 - 0.5
    let mut l = [4.2, 5.0, 0.0, 0.0];
    assert_eq!(s.sample(&mut l).token, 0); // 5 - 0.75 - 0.5 = 3.75 < 4.2
    let mut l = [1.0, 5.0, 0.0, -1.0];
    s.sample(&mut l);
    assert_eq!(l, [0.25, 3.75, 0.0, -1.0]); // token 0 was generated once: 1 - 0.25 - 0.5
}

#[test]
fn negative_penalties_encourage_repeats() {
    let params = SamplingParams { presence_penalty: -1.0, frequency_penalty: -0.5, repetition_penalty: 0.5, ..SamplingParams::greedy() };
    let mut s = Sampler::new(params, &[]);
    assert_eq!(s.sample(&mut [1.0, 1.5]).token, 1);
    let mut l = [1.0, 1.5];
    s.sample(&mut l);
    // Repetition 0.5 doubles 1.5 to 3, then 3 + 0.5 + 1.
    assert_eq!(l, [1.0, 4.5]);
}

#[test]
fn logprobs_are_raw_normalized_and_sorted() {
    let logits = random_logits(20, 5);
    let params = SamplingParams { logprobs: Some(20), temperature: 0.5, repetition_penalty: 1.3, top_k: 3, ..seeded(8) };
    let mut s = Sampler::new(params, &[0, 1, 2, 3]);
    let out = s.sample(&mut logits.clone());
    assert_eq!(out.top_logprobs.len(), 20);
    let total: f64 = out.top_logprobs.iter().map(|&(_, lp)| (lp as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "sum of probabilities {total}");
    assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
    let raw = softmax(&logits, 1.0);
    for &(id, lp) in &out.top_logprobs {
        assert!((lp as f64 - raw[id as usize].ln()).abs() < 1e-5);
    }
    let sampled = out.top_logprobs.iter().find(|e| e.0 == out.token).unwrap();
    assert_eq!(sampled.1, out.logprob);

    // n = 0: only the sampled token's logprob; a larger vocabulary; ties ordered by id.
    let mut s = Sampler::new(SamplingParams { logprobs: Some(0), ..seeded(1) }, &[]);
    let out = s.sample(&mut random_logits(50_000, 6));
    assert!(out.top_logprobs.is_empty() && out.logprob < 0.0);
    let mut s = Sampler::new(SamplingParams { logprobs: Some(3), ..seeded(1) }, &[]);
    let out = s.sample(&mut [0.0, 2.0, 1.0, 2.0, 2.0, -1.0]);
    let ids: Vec<u32> = out.top_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(ids, [1, 3, 4]);
}

#[test]
fn nan_and_infinite_logits_do_not_panic() {
    let nan = f32::NAN;
    let mut g = Sampler::new(SamplingParams { logprobs: Some(2), ..SamplingParams::greedy() }, &[]);
    let out = g.sample(&mut [nan, 1.0, nan, 0.5]);
    assert_eq!(out.token, 1);
    assert!(out.logprob.is_finite());
    for seed in 0..50 {
        let p = SamplingParams { top_p: 0.99, top_k: 3, min_p: 0.01, ..seeded(seed) };
        let t = Sampler::new(p, &[]).sample(&mut [nan, 1.0, nan, 0.5]).token;
        assert!(t == 1 || t == 3);
        let t = Sampler::new(seeded(seed), &[]).sample(&mut [nan, 1.0, nan, 0.5]).token;
        assert!(t == 1 || t == 3);
    }
    for params in [seeded(0), SamplingParams::greedy()] {
        let mut s = Sampler::new(params.clone(), &[]);
        let out = s.sample(&mut [nan, nan]);
        assert_eq!((out.token, out.logprob), (0, f32::NEG_INFINITY));
        let out = s.sample(&mut [0.0, f32::INFINITY, 1.0]);
        assert_eq!(out.token, 1);
        assert_eq!(s.sample(&mut []).token, 0);
    }
    // Parameters that validation would reject do not panic either.
    let wild = SamplingParams { temperature: f32::NAN, repetition_penalty: f32::NAN, ..seeded(0) };
    Sampler::new(wild, &[0]).sample(&mut [1.0, 2.0]);
    let hot = SamplingParams { temperature: f32::INFINITY, ..seeded(0) };
    Sampler::new(hot, &[]).sample(&mut [1.0, f32::NEG_INFINITY]);
}

#[test]
fn top_p_cut_matches_a_full_sort() {
    let (mut bins, mut boundary, mut weights) = (Vec::new(), Vec::new(), Vec::new());
    for (vocab, seed, temperature) in [(1000, 1u64, 1.0f32), (100_000, 2, 1.0), (100_000, 3, 0.3), (100_000, 4, 3.0)] {
        let logits = random_logits(vocab, seed);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / temperature;
        let cands: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
        math::fill_weights(&mut weights, &logits, m, inv_t);
        let z: f64 = weights.iter().map(|&w| w as f64).sum();
        let mut sorted: Vec<(f32, u32, f32)> = cands.iter().zip(&weights).map(|(c, &w)| (c.0, c.1, w)).collect();
        sorted.sort_by(|a, b| by_rank(&(a.0, a.1), &(b.0, b.1)));
        for top_p in [1e-9, 0.3, 0.9, 0.999] {
            let mut cum = 0.0;
            let expected = sorted
                .iter()
                .position(|c| {
                    cum += c.2 as f64;
                    cum >= top_p * z
                })
                .map_or(vocab, |j| j + 1);
            let cut = top_p_cut(&cands, &weights, top_p, m, inv_t, &mut bins, &mut boundary);
            let kept = cut.map_or(vocab, |cut| cands.iter().filter(|c| by_rank(c, &cut) != std::cmp::Ordering::Greater).count());
            // Sums in another order may round differently right at the boundary.
            let msg = format!("vocab {vocab} t={temperature} p={top_p}: {kept} vs {expected}");
            assert!(kept.abs_diff(expected) <= 1, "{msg}");
        }
    }
}

#[test]
fn best_k_matches_a_full_sort() {
    // Coarse values, so there are many ties to break by id.
    let logits: Vec<f32> = random_logits(20_000, 9).iter().map(|x| (x * 4.0).round()).collect();
    let mut sorted: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
    sorted.sort_by(by_rank);
    let (mut storage, mut out) = (Vec::new(), Vec::new());
    for k in [1, 2, 7, 50, 4096, 20_000, 30_000] {
        out.clear();
        best_k(&logits, k, |_| true, &mut storage, &mut out);
        out.sort_by(by_rank);
        assert_eq!(out, sorted[..k.min(sorted.len())], "k={k}");
    }
    // With a filter: only logits above 0 may be kept.
    out.clear();
    best_k(&logits, 100_000, |x| x > 0.0, &mut storage, &mut out);
    out.sort_by(by_rank);
    let positive: Vec<(f32, u32)> = sorted.iter().copied().filter(|c| c.0 > 0.0).collect();
    assert_eq!(out, positive);
}

#[test]
fn validate_reports_the_first_bad_parameter() {
    assert_eq!(SamplingParams::default().validate(), Ok(()));
    assert_eq!(SamplingParams::greedy().validate(), Ok(()));
    let msg = |p: SamplingParams| p.validate().unwrap_err().to_string();
    let d = SamplingParams::default;
    assert_eq!(msg(SamplingParams { top_p: 1.5, ..d() }), "`top_p` must be in (0, 1]; given: 1.5");
    assert_eq!(msg(SamplingParams { top_p: 0.0, ..d() }), "`top_p` must be in (0, 1]; given: 0");
    assert_eq!(msg(SamplingParams { temperature: -0.5, ..d() }), "`temperature` must be a finite number >= 0; given: -0.5");
    assert_eq!(msg(SamplingParams { temperature: f32::NAN, ..d() }), "`temperature` must be a finite number >= 0; given: NaN");
    assert_eq!(msg(SamplingParams { min_p: 1.1, ..d() }), "`min_p` must be in [0, 1]; given: 1.1");
    assert_eq!(msg(SamplingParams { repetition_penalty: 0.0, ..d() }), "`repetition_penalty` must be a finite number > 0; given: 0");
    assert_eq!(msg(SamplingParams { presence_penalty: 2.5, ..d() }), "`presence_penalty` must be in [-2, 2]; given: 2.5");
    assert_eq!(msg(SamplingParams { frequency_penalty: -3.0, ..d() }), "`frequency_penalty` must be in [-2, 2]; given: -3");
    assert_eq!(msg(SamplingParams { logprobs: Some(21), ..d() }), "`logprobs` must be at most 20; given: 21");
    let edge = SamplingParams { temperature: 0.0, top_p: 1.0, min_p: 1.0, presence_penalty: -2.0, frequency_penalty: 2.0, logprobs: Some(20), ..d() };
    assert_eq!(edge.validate(), Ok(()));
    let err = SamplingParams { top_p: 2.0, min_p: 5.0, ..d() }.validate().unwrap_err();
    assert_eq!((err.field, err.expected, err.given.as_str()), ("top_p", "in (0, 1]", "2"));
}

#[test]
fn params_deserialize_with_defaults() {
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.5, "seed": 3}"#).unwrap();
    assert_eq!(p, SamplingParams { temperature: 0.5, seed: Some(3), ..SamplingParams::default() });
    let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
}
