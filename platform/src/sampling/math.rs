//! Vocabulary-wide arithmetic for the sampler, written so the compiler can vectorize it and so
//! every result is fixed by IEEE-754 single/double arithmetic alone (no platform `expf`), which
//! keeps seeded sampling bit-identical across machines.

use loraplex_kernels::cpu::isa::{Isa, Kernel, Path};

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer (ties to even).
const ROUND_MAGIC: f32 = 12_582_912.0;
/// ln 2 split in two (Cody and Waite), so that `d - n ln 2` is computed almost exactly.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this `exp` would leave the normal range; such weights count as 0.
const EXP_FLOOR: f32 = -87.0;

/// `exp(d)` for `d <= 0` (including -inf, which gives exactly 0), relative error about 2e-7.
/// `exp_neg(0.0)` is exactly 1. Results below `exp(-87)` are flushed to 0.
#[inline(always)]
pub(super) fn exp_neg(d: f32) -> f32 {
    let dc = d.max(EXP_FLOOR);
    let t = dc * LOG2E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = (dc - n * LN2_HI) - n * LN2_LO;
    // Minimax polynomial for exp on [-ln2/2, ln2/2] (Cephes expf).
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n is in [-126, 0]: the integer sits in the low mantissa bits of t.
    let n_int = t.to_bits() as i32 - ROUND_MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if d < EXP_FLOOR { 0.0 } else { e * scale }
}

/// Runs `f` compiled for the widest instruction set this CPU has ([`Path::detect`]): the
/// loops below are plain scalar code, which the compiler vectorizes to that width. Their
/// results do not depend on the width: Rust neither reassociates nor contracts floating-point
/// arithmetic, and every reduction spells out its order (a test compares every path's bits).
#[inline]
fn wide<R>(f: impl FnOnce() -> R) -> R {
    wide_on(Path::detect(), f)
}

#[inline]
fn wide_on<R>(path: Path, f: impl FnOnce() -> R) -> R {
    struct Wide<F>(F);
    impl<R, F: FnOnce() -> R> Kernel for Wide<F> {
        type Output = R;
        #[inline(always)]
        fn run<S: Isa>(self, _: S) -> R {
            (self.0)()
        }
    }
    path.run(Wide(f))
}

/// Overwrites `out` with `exp_neg((x - max) * inv_t)` for each logit `x`.
pub(super) fn fill_weights(out: &mut Vec<f32>, logits: &[f32], max: f32, inv_t: f32) {
    wide(
        #[inline(always)]
        || fill_into(out, logits, max, inv_t),
    );
}

#[inline(always)]
fn fill_into(out: &mut Vec<f32>, logits: &[f32], max: f32, inv_t: f32) {
    out.resize(logits.len(), 0.0);
    for (w, &x) in out.iter_mut().zip(logits) {
        *w = exp_neg((x - max) * inv_t);
    }
}

/// [`fill_weights`] for (logit, id) candidates.
pub(super) fn fill_weights_of(out: &mut Vec<f32>, cands: &[(f32, u32)], max: f32, inv_t: f32) {
    out.clear();
    out.resize(cands.len(), 0.0);
    for (w, c) in out.iter_mut().zip(cands) {
        *w = exp_neg((c.0 - max) * inv_t);
    }
}

/// Weights are summed in blocks of this many, each block with eight interleaved accumulators.
const BLOCK: usize = 64;

#[inline(always)]
fn block_sum(ws: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = ws.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a += w as f64;
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for &w in rest {
        s += w as f64;
    }
    s
}

/// Sum in f64: block sums added in order. Fast, and the same order on every machine.
pub(super) fn sum(ws: &[f32]) -> f64 {
    wide(
        #[inline(always)]
        || sum_of(ws),
    )
}

#[inline(always)]
fn sum_of(ws: &[f32]) -> f64 {
    ws.chunks(BLOCK).fold(0.0, |acc, block| acc + block_sum(block))
}

/// Maximum of NaN-free values (-inf for an empty slice).
pub(super) fn max(xs: &[f32]) -> f32 {
    wide(
        #[inline(always)]
        || max_of(xs),
    )
}

#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    acc.into_iter().chain(rest.iter().copied()).fold(f32::NEG_INFINITY, f32::max)
}

/// NaN becomes -inf and +inf (or an overflow) becomes `f32::MAX`, in place.
pub(super) fn sanitize(logits: &mut [f32]) {
    wide(
        #[inline(always)]
        || sanitize_in(logits),
    );
}

#[inline(always)]
fn sanitize_in(logits: &mut [f32]) {
    for x in logits.iter_mut() {
        *x = clean(*x);
    }
}

/// NaN becomes -inf and +inf (or an overflow) becomes `f32::MAX`.
#[inline(always)]
pub(super) fn clean(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) }
}

/// Lanes [`argmax`] compares at a time.
const ARGMAX_CHUNK: usize = 64;

/// Index of the first largest of NaN-free values (0 for an empty slice or all -inf): the
/// maximum first, then the first chunk that holds it, then the place in that chunk.
pub(super) fn argmax(xs: &[f32]) -> u32 {
    wide(
        #[inline(always)]
        || argmax_of(xs),
    )
}

#[inline(always)]
fn argmax_of(xs: &[f32]) -> u32 {
    let m = max_of(xs);
    if m == f32::NEG_INFINITY {
        return 0;
    }
    for (c, chunk) in xs.chunks(ARGMAX_CHUNK).enumerate() {
        if chunk.iter().fold(false, |hit, &x| hit | (x == m)) {
            let at = chunk.iter().position(|&x| x == m).unwrap_or(0);
            return (c * ARGMAX_CHUNK + at) as u32;
        }
    }
    0
}

/// The index at which the running sum of `ws` first exceeds `target`; if rounding leaves the
/// target unreached, the last index with positive weight. `None` when every weight is 0.
///
/// The running sum is [`sum`]'s: whole blocks are skipped by their block sums, and only the
/// block where `target` falls is walked element by element. So `pick(ws, u * sum(ws))` with
/// `u` in [0, 1) never runs past the end for lack of mass.
pub(super) fn pick(ws: &[f32], target: f64) -> Option<usize> {
    let mut cum = 0.0f64;
    let mut last_block = None;
    for (b, block) in ws.chunks(BLOCK).enumerate() {
        let s = block_sum(block);
        if s > 0.0 && cum + s > target {
            let mut c = cum;
            let mut last = None;
            for (j, &w) in block.iter().enumerate() {
                if w > 0.0 {
                    c += w as f64;
                    last = Some(b * BLOCK + j);
                    if c > target {
                        break;
                    }
                }
            }
            return last;
        }
        if s > 0.0 {
            last_block = Some(b);
        }
        cum += s;
    }
    let b = last_block?;
    let block = &ws[b * BLOCK..ws.len().min((b + 1) * BLOCK)];
    block.iter().rposition(|&w| w > 0.0).map(|j| b * BLOCK + j)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_neg_is_accurate_and_exact_at_the_ends() {
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-88.0), 0.0);
        let mut worst = 0.0f64;
        let mut d = 0.0f32;
        while d > -87.0 {
            let want = (d as f64).exp();
            worst = worst.max(((exp_neg(d) as f64) - want).abs() / want);
            d -= 0.000_731;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        // Monotone, as the filters rely on ranking by logit and weighting by exp agreeing.
        let mut prev = 1.0;
        for i in 0..200_000 {
            let v = exp_neg(-(i as f32) * 1e-4);
            assert!(v <= prev);
            prev = v;
        }
    }

    #[test]
    fn sums_maxima_and_picks() {
        let ws: Vec<f32> = (0..37).map(|i| i as f32 * 0.25).collect();
        assert_eq!(sum(&ws), (0..37).map(|i| i as f64 * 0.25).sum::<f64>());
        assert_eq!(max(&ws), 9.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NEG_INFINITY, -3.0]), -3.0);
        let ws = [0.0, 1.0, 0.0, 2.0, 0.0];
        assert_eq!(pick(&ws, 0.0), Some(1));
        assert_eq!(pick(&ws, 0.999), Some(1));
        assert_eq!(pick(&ws, 1.0), Some(3));
        assert_eq!(pick(&ws, 3.0), Some(3)); // unreachable target: last positive weight
        assert_eq!(pick(&[0.0, 0.0], 0.0), None);
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for len in [0usize, 1, 7, 8, 63, 64, 65, 1000, 32_000] {
            let mut logits: Vec<f32> = (0..len).map(|_| rng.random_range(-30.0f32..30.0)).collect();
            for (i, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 29.9, 29.9].into_iter().enumerate() {
                if len > 3 * i + 2 {
                    logits[3 * i + 2] = special;
                }
            }
            let run = |path: Path| {
                wide_on(path, || {
                    let mut x = logits.clone();
                    sanitize_in(&mut x);
                    let m = max_of(&x);
                    let mut w = Vec::new();
                    fill_into(&mut w, &x, m, 0.7);
                    let bits: Vec<u32> = x.iter().chain(&w).map(|v| v.to_bits()).collect();
                    (bits, m.to_bits(), sum_of(&w).to_bits(), argmax_of(&x))
                })
            };
            let scalar = run(Path::Scalar);
            assert_eq!(argmax_of(&[1.0, 3.0, 3.0]), 1, "the first of equal maxima");
            for path in Path::available() {
                assert!(run(path) == scalar, "{path:?}, {len} logits");
            }
        }
    }
}
