//! Vector helpers for the attention loops: AVX-512 when the CPU has it, portable code otherwise.
//! The choice is made at run time, so one binary runs on any x86-64 CPU.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `Σ a[i] * b[i]` over the shorter of the two.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above); both slices hold at least n elements.
        return unsafe { dot_avx512(&a[..n], &b[..n]) };
    }
    dot_portable(&a[..n], &b[..n])
}

/// `y[i] += alpha * x[i]` over the shorter of the two.
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above); both slices hold at least n elements.
        unsafe { axpy_avx512(&mut y[..n], alpha, &x[..n]) };
        return;
    }
    for (a, &b) in y[..n].iter_mut().zip(&x[..n]) {
        *a += alpha * b;
    }
}

/// A bfloat16 (stored as its upper 16 bits) as f32: exact.
#[inline]
pub fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

/// Rows of one element type: the A or B rows of one adapter for one projection.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    F32(&'a [&'a [f32]]),
    Bf16(&'a [&'a [u16]]),
}

impl Rows<'_> {
    pub fn len(&self) -> usize {
        match self {
            Rows::F32(r) => r.len(),
            Rows::Bf16(r) => r.len(),
        }
    }

    fn row_len(&self, r: usize) -> usize {
        match self {
            Rows::F32(rows) => rows[r].len(),
            Rows::Bf16(rows) => rows[r].len(),
        }
    }

    /// Element `i` of row `r` as f32.
    fn get(&self, r: usize, i: usize) -> f32 {
        match self {
            Rows::F32(rows) => rows[r][i],
            Rows::Bf16(rows) => bf16_to_f32(rows[r][i]),
        }
    }
}

/// `out[r] = dot(x, rows[r])` for every row, each summed exactly as [`dot`] / [`dot_bf16`] sum
/// it; four rows share each load of `x`.
pub fn dots(x: &[f32], rows: Rows<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above).
        unsafe { dots_avx512(x, rows, out) };
        return;
    }
    for (r, o) in out.iter_mut().enumerate().take(rows.len()) {
        let n = x.len().min(rows.row_len(r));
        *o = (0..n).map(|i| x[i] * rows.get(r, i)).sum();
    }
}

/// `y += Σ_r coeffs[r] · rows[r]`, rows in order, each element updated exactly as successive
/// [`axpy`] / [`axpy_bf16`] calls would, but loading and storing `y` once.
pub fn axpys(y: &mut [f32], coeffs: &[f32], rows: Rows<'_>) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above).
        unsafe { axpys_avx512(y, coeffs, rows) };
        return;
    }
    for (r, &c) in coeffs.iter().enumerate().take(rows.len()) {
        let n = y.len().min(rows.row_len(r));
        for (i, yi) in y[..n].iter_mut().enumerate() {
            *yi += c * rows.get(r, i);
        }
    }
}

/// An element type adapter rows are stored in, widened exactly to f32 as it is loaded.
#[cfg(target_arch = "x86_64")]
trait Elem: Copy {
    /// Loads 32 values from `p` (only the first `left` when `left < 32`, zeros after) split into
    /// the even-indexed and the odd-indexed ones: `(p[0], p[2], .., p[30])`, `(p[1], .., p[31])`.
    ///
    /// # Safety
    /// AVX-512F must be available; `p` must be valid for `min(left, 32)` reads.
    unsafe fn load_pair(p: *const Self, left: usize) -> (__m512, __m512);

    /// `y[i] += Σ_r coeffs[r] * rows[r][i]`, rows in order for every element.
    ///
    /// # Safety
    /// AVX-512F must be available; every row holds at least `y.len()` elements.
    unsafe fn axpys(y: &mut [f32], coeffs: &[f32], rows: &[&[Self]]);
}

#[cfg(target_arch = "x86_64")]
impl Elem for f32 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_pair(p: *const f32, left: usize) -> (__m512, __m512) {
        // SAFETY: the masks cover the `min(left, 32)` readable values.
        unsafe {
            let lo = _mm512_maskz_loadu_ps(lanes(left), p);
            let hi = _mm512_maskz_loadu_ps(lanes(left.saturating_sub(16)), p.add(16.min(left)));
            deinterleave(lo, hi)
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn axpys(y: &mut [f32], coeffs: &[f32], rows: &[&[f32]]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { axpys_f32(y, coeffs, rows) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Elem for u16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_pair(p: *const u16, left: usize) -> (__m512, __m512) {
        // Each 32-bit lane holds two bf16 values, the even-indexed one in its low half: shifting
        // it up, or masking the high half, gives either as an f32 exactly.
        let words = if left >= 32 {
            // SAFETY: 32 values (64 bytes) are readable at `p`.
            unsafe { _mm512_loadu_si512(p as *const _) }
        } else {
            let mut buf = [0u16; 32];
            // SAFETY: the caller guarantees `left` readable values at `p`.
            buf[..left].copy_from_slice(unsafe { std::slice::from_raw_parts(p, left) });
            // SAFETY: `buf` holds 32 values.
            unsafe { _mm512_loadu_si512(buf.as_ptr() as *const _) }
        };
        let even = _mm512_slli_epi32::<16>(words);
        let odd = _mm512_and_si512(words, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
        (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn axpys(y: &mut [f32], coeffs: &[f32], rows: &[&[u16]]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { axpys_bf16(y, coeffs, rows) }
    }
}

/// Splits 32 consecutive values (`lo`: 0..16, `hi`: 16..32) into the even- and odd-indexed ones.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn deinterleave(lo: __m512, hi: __m512) -> (__m512, __m512) {
    let even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    let odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    (_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi))
}

/// The inverse of [`deinterleave`]: 32 consecutive values from their even and odd halves.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn interleave(even: __m512, odd: __m512) -> (__m512, __m512) {
    let lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    (_mm512_permutex2var_ps(even, lo, odd), _mm512_permutex2var_ps(even, hi, odd))
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_avx512(x: &[f32], rows: Rows<'_>, out: &mut [f32]) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match rows {
            Rows::F32(rows) => dots_rows(x, rows, out),
            Rows::Bf16(rows) => dots_rows(x, rows, out),
        }
    }
}

/// Rows summed together in one pass over `x`: with two accumulators each, sixteen independent
/// FMA chains keep both FMA ports busy.
#[cfg(target_arch = "x86_64")]
const DOT_GROUP: usize = 8;

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_rows<E: Elem>(x: &[f32], rows: &[&[E]], out: &mut [f32]) {
    let count = rows.len().min(out.len());
    let mut r0 = 0;
    while r0 < count {
        let group = &rows[r0..(r0 + DOT_GROUP).min(count)];
        let out = &mut out[r0..r0 + group.len()];
        // Each row's sum runs over min(len(x), len(row)) elements.
        let n = group.iter().map(|r| r.len()).min().unwrap_or(0).min(x.len());
        // SAFETY: `n` is within x and every row of `group` (those of other lengths go one at a
        // time, each with its own `n`).
        unsafe {
            if group.iter().all(|r| r.len().min(x.len()) == n) {
                match group.len() {
                    8 => dots_group::<E, 8>(x, group, n, out),
                    7 => dots_group::<E, 7>(x, group, n, out),
                    6 => dots_group::<E, 6>(x, group, n, out),
                    5 => dots_group::<E, 5>(x, group, n, out),
                    4 => dots_group::<E, 4>(x, group, n, out),
                    3 => dots_group::<E, 3>(x, group, n, out),
                    2 => dots_group::<E, 2>(x, group, n, out),
                    _ => dots_group::<E, 1>(x, group, n, out),
                }
            } else {
                for (o, r) in out.iter_mut().zip(group) {
                    dots_group::<E, 1>(x, std::slice::from_ref(r), r.len().min(x.len()), std::slice::from_mut(o));
                }
            }
        }
        r0 += group.len();
    }
}

/// `out[g] = Σ_{i < n} x[i] * rows[g][i]`. Per 32-element chunk, in order, lane `j` of one
/// accumulator takes element `2j` and lane `j` of another element `2j + 1`; the two are added
/// and reduced at the end. The sums depend only on `n` and the values, not on the row type or
/// the group size.
///
/// # Safety
/// AVX-512F must be available; `x` and every row hold at least `n` elements; `rows` holds `G`
/// rows (`G` fixed at compile time keeps the accumulators in registers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_group<E: Elem, const G: usize>(x: &[f32], rows: &[&[E]], n: usize, out: &mut [f32]) {
    let mut even = [_mm512_setzero_ps(); G];
    let mut odd = [_mm512_setzero_ps(); G];
    let ptrs: [*const E; G] = std::array::from_fn(|g| rows[g].as_ptr());
    let mut i = 0;
    // SAFETY: every load covers elements i..min(i + 32, n), inside x and each row.
    unsafe {
        while i + 32 <= n {
            let (xe, xo) = f32::load_pair(x.as_ptr().add(i), 32);
            for g in 0..G {
                let (re, ro) = E::load_pair(ptrs[g].add(i), 32);
                even[g] = _mm512_fmadd_ps(xe, re, even[g]);
                odd[g] = _mm512_fmadd_ps(xo, ro, odd[g]);
            }
            i += 32;
        }
        if i < n {
            let (xe, xo) = f32::load_pair(x.as_ptr().add(i), n - i);
            for g in 0..G {
                let (re, ro) = E::load_pair(ptrs[g].add(i), n - i);
                even[g] = _mm512_fmadd_ps(xe, re, even[g]);
                odd[g] = _mm512_fmadd_ps(xo, ro, odd[g]);
            }
        }
    }
    for ((out, e), o) in out.iter_mut().zip(&even).zip(&odd) {
        *out = _mm512_reduce_add_ps(_mm512_add_ps(*e, *o));
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpys_avx512(y: &mut [f32], coeffs: &[f32], rows: Rows<'_>) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match rows {
            Rows::F32(rows) => axpys_rows(y, coeffs, rows),
            Rows::Bf16(rows) => axpys_rows(y, coeffs, rows),
        }
    }
}

/// 16-lane chunks of the output kept in registers together while every row passes over them:
/// independent FMA chains, one per chunk.
#[cfg(target_arch = "x86_64")]
const AXPY_CHUNKS: usize = 8;

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpys_rows<E: Elem>(y: &mut [f32], coeffs: &[f32], rows: &[&[E]]) {
    let count = rows.len().min(coeffs.len());
    let (rows, coeffs) = (&rows[..count], &coeffs[..count]);
    if rows.iter().any(|r| r.len() < y.len()) {
        // Rows shorter than y update only their own prefix: one row at a time, each element
        // still receiving the rows in order.
        for (r, c) in rows.iter().zip(coeffs) {
            let n = r.len().min(y.len());
            // SAFETY: `n` is within y and the row.
            unsafe { E::axpys(&mut y[..n], std::slice::from_ref(c), std::slice::from_ref(r)) };
        }
        return;
    }
    // SAFETY: every row holds at least y.len() elements (checked above).
    unsafe { E::axpys(y, coeffs, rows) };
}

/// `y[i] += Σ_r coeffs[r] * f32 rows[r][i]`, rows in order for every element.
///
/// # Safety
/// AVX-512F must be available; every row holds at least `y.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpys_f32(y: &mut [f32], coeffs: &[f32], rows: &[&[f32]]) {
    const W: usize = 16 * AXPY_CHUNKS;
    let n = y.len();
    let mut i = 0;
    // SAFETY: every access covers elements below n, inside y and each row.
    unsafe {
        while i + W <= n {
            let yp = y.as_mut_ptr().add(i);
            let mut acc = [_mm512_setzero_ps(); AXPY_CHUNKS];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(yp.add(16 * c));
            }
            for (r, &coef) in rows.iter().zip(coeffs) {
                let cv = _mm512_set1_ps(coef);
                let rp = r.as_ptr().add(i);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(cv, _mm512_loadu_ps(rp.add(16 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(yp.add(16 * c), *a);
            }
            i += W;
        }
        while i < n {
            let m = lanes(n - i);
            let mut yv = _mm512_maskz_loadu_ps(m, y.as_ptr().add(i));
            for (r, &coef) in rows.iter().zip(coeffs) {
                yv = _mm512_fmadd_ps(_mm512_set1_ps(coef), _mm512_maskz_loadu_ps(m, r.as_ptr().add(i)), yv);
            }
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(i), m, yv);
            i += 16;
        }
    }
}

/// [`axpys_f32`] over bf16 rows: `y` is held split into even and odd elements, matching how bf16
/// pairs widen, and every element still receives the rows in order: the same results as f32
/// rows of the same values.
///
/// # Safety
/// AVX-512F must be available; every row holds at least `y.len()` elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpys_bf16(y: &mut [f32], coeffs: &[f32], rows: &[&[u16]]) {
    const PAIRS: usize = AXPY_CHUNKS / 2;
    const W: usize = 32 * PAIRS;
    let n = y.len();
    let mut i = 0;
    // SAFETY: every access covers elements below n, inside y and each row.
    unsafe {
        while i + W <= n {
            axpys_bf16_pairs::<PAIRS>(y.as_mut_ptr().add(i), W, coeffs, rows, i);
            i += W;
        }
        while i < n {
            axpys_bf16_pairs::<1>(y.as_mut_ptr().add(i), n - i, coeffs, rows, i);
            i += 32;
        }
    }
}

/// `P` pairs of output chunks (32 elements each, the last cut to `left`) of [`axpys_bf16`], at
/// element `at` of the rows.
///
/// # Safety
/// AVX-512F must be available; `y` holds `min(left, 32 * P)` elements and every row
/// `at + min(left, 32 * P)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn axpys_bf16_pairs<const P: usize>(y: *mut f32, left: usize, coeffs: &[f32], rows: &[&[u16]], at: usize) {
    // SAFETY: every access covers elements below `left` of this block (see the contract).
    unsafe {
        let left_in = |c: usize| left.saturating_sub(32 * c);
        let mut acc: [(__m512, __m512); P] = std::array::from_fn(|c| f32::load_pair(y.add(32 * c), left_in(c)));
        for (r, &coef) in rows.iter().zip(coeffs) {
            let cv = _mm512_set1_ps(coef);
            let rp = r.as_ptr().add(at);
            for (c, (e, o)) in acc.iter_mut().enumerate() {
                let (re, ro) = u16::load_pair(rp.add(32 * c), left_in(c));
                *e = _mm512_fmadd_ps(cv, re, *e);
                *o = _mm512_fmadd_ps(cv, ro, *o);
            }
        }
        for (c, &(e, o)) in acc.iter().enumerate() {
            let (lo, hi) = interleave(e, o);
            let left = left_in(c);
            _mm512_mask_storeu_ps(y.add(32 * c), lanes(left), lo);
            _mm512_mask_storeu_ps(y.add(32 * c + 16.min(left)), lanes(left.saturating_sub(16)), hi);
        }
    }
}

/// `Σ x[i]`, read as fast as the CPU can (the memory-bandwidth probe's inner loop).
pub fn sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above).
        return unsafe { sum_avx512(x) };
    }
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    let n = x.len();
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: full loads cover i..i+64 <= n; the masked tail loads stay below n.
    unsafe {
        while i + 64 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(x.as_ptr().add(i + 16 * j)));
            }
            i += 64;
        }
        while i < n {
            acc[0] = _mm512_add_ps(acc[0], _mm512_maskz_loadu_ps(lanes(n - i), x.as_ptr().add(i)));
            i += 16;
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums let the compiler vectorize without reassociating.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Lanes `0..n` of a 16-lane mask.
#[cfg(target_arch = "x86_64")]
#[inline]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 { 0xFFFF } else { ((1u32 << n) - 1) as __mmask16 }
}

/// # Safety
/// AVX-512F must be available; `a` and `b` have equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    // SAFETY: every load covers lanes i..i+16 masked to i..n, inside both slices.
    unsafe {
        while i < n {
            let m = lanes(n - i);
            let x = _mm512_maskz_loadu_ps(m, a.as_ptr().add(i));
            let y = _mm512_maskz_loadu_ps(m, b.as_ptr().add(i));
            acc = _mm512_fmadd_ps(x, y, acc);
            i += 16;
        }
    }
    _mm512_reduce_add_ps(acc)
}

/// # Safety
/// AVX-512F must be available; `y` and `x` have equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len();
    let a = _mm512_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: every access covers lanes i..i+16 masked to i..n, inside both slices.
    unsafe {
        while i < n {
            let m = lanes(n - i);
            let xv = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
            let yv = _mm512_maskz_loadu_ps(m, y.as_ptr().add(i));
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(i), m, _mm512_fmadd_ps(a, xv, yv));
            i += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of `rows` values of length `n`, in f32 and as the same values in bf16 (every value
    /// rounded to bf16 first, so both hold exactly the same numbers).
    fn rows_both(n: usize, rows: usize) -> (Vec<Vec<f32>>, Vec<Vec<u16>>) {
        let h: Vec<Vec<u16>> = (0..rows).map(|r| (0..n).map(|i| (((i + 3 * r) as f32 * 0.13).cos().to_bits() >> 16) as u16).collect()).collect();
        let f = h.iter().map(|row| row.iter().map(|&v| bf16_to_f32(v)).collect()).collect();
        (f, h)
    }

    #[test]
    fn bf16_rows_compute_exactly_like_f32_rows_of_the_same_values() {
        for (n, rows) in [(1, 1), (5, 3), (16, 4), (31, 2), (37, 7), (100, 9), (130, 17), (1024, 16)] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.21).sin()).collect();
            let (f, h) = rows_both(n, rows);
            let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
            let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
            let (mut from_f32, mut from_bf16) = (vec![0f32; rows], vec![0f32; rows]);
            dots(&x, Rows::F32(&fr), &mut from_f32);
            dots(&x, Rows::Bf16(&hr), &mut from_bf16);
            assert_eq!(from_f32, from_bf16, "n={n}");
            for (r, &got) in from_f32.iter().enumerate() {
                let exact: f64 = x.iter().zip(&f[r]).map(|(a, b)| *a as f64 * *b as f64).sum();
                assert!((got as f64 - exact).abs() < 1e-4, "n={n} row {r}: {got} vs {exact}");
            }
            let coeffs: Vec<f32> = (0..rows).map(|r| r as f32 * 0.3 - 1.0).collect();
            let (mut y32, mut y16) = (x.clone(), x.clone());
            axpys(&mut y32, &coeffs, Rows::F32(&fr));
            axpys(&mut y16, &coeffs, Rows::Bf16(&hr));
            assert_eq!(y32, y16, "n={n}");
        }
    }

    #[test]
    fn grouped_dots_and_axpys_equal_one_row_at_a_time() {
        for (n, rows) in [(5, 3), (16, 4), (37, 7), (100, 9), (300, 20)] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.21).sin()).collect();
            let (f, h) = rows_both(n, rows);
            let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
            let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
            for rows_of in [Rows::F32(&fr), Rows::Bf16(&hr)] {
                let mut out = vec![0f32; rows];
                dots(&x, rows_of, &mut out);
                let coeffs: Vec<f32> = (0..rows).map(|r| r as f32 * 0.3 - 1.0).collect();
                let mut grouped = x.clone();
                axpys(&mut grouped, &coeffs, rows_of);
                let mut single = x.clone();
                for r in 0..rows {
                    let (one_f, one_h) = ([fr[r]], [hr[r]]);
                    let one = match rows_of {
                        Rows::F32(_) => Rows::F32(&one_f),
                        Rows::Bf16(_) => Rows::Bf16(&one_h),
                    };
                    let mut o = [0f32];
                    dots(&x, one, &mut o);
                    assert_eq!(o[0].to_bits(), out[r].to_bits(), "n={n} row {r}");
                    axpys(&mut single, &coeffs[r..r + 1], one);
                }
                assert_eq!(grouped, single, "n={n}");
                // A row and a vector shorter than the others: each sums only over its own length.
                let short = &x[..n - 1];
                let mut o = vec![0f32; rows];
                dots(short, rows_of, &mut o);
                let exact: f64 = short.iter().zip(&f[0]).map(|(a, b)| *a as f64 * *b as f64).sum();
                assert!((o[0] as f64 - exact).abs() < 1e-4, "n={n}");
            }
        }
    }

    #[test]
    fn vector_and_portable_paths_agree() {
        for n in [1, 7, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - exact).abs() < 1e-5, "n={n}");
            assert!((dot_portable(&a, &b) as f64 - exact).abs() < 1e-5, "n={n}");
            assert!((sum(&a) as f64 - a.iter().map(|v| *v as f64).sum::<f64>()).abs() < 1e-5, "n={n}");
            let mut y = b.clone();
            axpy(&mut y, 0.5, &a);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}
