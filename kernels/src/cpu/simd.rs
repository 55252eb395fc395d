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

/// [`dot`] with `b` in bfloat16: the same products, summed in the same order, so a vector of
/// bf16-representable values gives the same result bit for bit in either storage.
#[inline]
pub fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // One row of the grouped kernel is exactly this dot product.
        let mut out = [0f32];
        // SAFETY: AVX-512F is present (checked above).
        unsafe { dots_avx512(&a[..n], Rows::Bf16(&[&b[..n]]), &mut out) };
        return out[0];
    }
    let mut acc = [0f32; 8];
    let (ca, cb) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, &y)| x * bf16_to_f32(y)).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * bf16_to_f32(y[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`axpy`] with `x` in bfloat16.
#[inline]
pub fn axpy_bf16(y: &mut [f32], alpha: f32, x: &[u16]) {
    let n = y.len().min(x.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // One row of the grouped kernel is exactly this update.
        // SAFETY: AVX-512F is present (checked above).
        unsafe { axpys_avx512(&mut y[..n], &[alpha], Rows::Bf16(&[&x[..n]])) };
        return;
    }
    for (a, &b) in y[..n].iter_mut().zip(&x[..n]) {
        *a += alpha * bf16_to_f32(b);
    }
}

/// Loads 16 bfloat16 values from `p` (only the first `n` when `n < 16`, zeros after) as f32.
///
/// # Safety
/// AVX-512F must be available; `p` must be valid for `min(n, 16)` reads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_bf16(p: *const u16, n: usize) -> __m512 {
    let mut buf = [0u16; 16];
    // SAFETY: the caller guarantees `min(n, 16)` readable values at `p`.
    let src: &[u16] = unsafe { std::slice::from_raw_parts(p, n.min(16)) };
    let half = if n >= 16 {
        // SAFETY: 16 values (32 bytes) are readable at `p`.
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    } else {
        buf[..src.len()].copy_from_slice(src);
        // SAFETY: `buf` holds 16 values.
        unsafe { _mm256_loadu_si256(buf.as_ptr() as *const __m256i) }
    };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
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
    match rows {
        Rows::F32(rows) => out.iter_mut().zip(rows).for_each(|(o, r)| *o = dot(x, r)),
        Rows::Bf16(rows) => out.iter_mut().zip(rows).for_each(|(o, r)| *o = dot_bf16(x, r)),
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
    match rows {
        Rows::F32(rows) => coeffs.iter().zip(rows).for_each(|(&c, r)| axpy(y, c, r)),
        Rows::Bf16(rows) => coeffs.iter().zip(rows).for_each(|(&c, r)| axpy_bf16(y, c, r)),
    }
}

/// Loads 16 values of row `r` starting at `i` (masked to `n`) as f32.
///
/// # Safety
/// AVX-512F must be available; every row holds at least `n` elements and `i < n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_row(rows: Rows<'_>, r: usize, i: usize, n: usize) -> __m512 {
    // SAFETY: the caller guarantees rows hold n elements and i < n.
    unsafe {
        match rows {
            Rows::F32(rows) => _mm512_maskz_loadu_ps(lanes(n - i), rows[r].as_ptr().add(i)),
            Rows::Bf16(rows) => load_bf16(rows[r].as_ptr().add(i), n - i),
        }
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_avx512(x: &[f32], rows: Rows<'_>, out: &mut [f32]) {
    let count = rows.len().min(out.len());
    let row_len = |r: usize| match rows {
        Rows::F32(rows) => rows[r].len(),
        Rows::Bf16(rows) => rows[r].len(),
    };
    let mut r0 = 0;
    while r0 < count {
        let group = (count - r0).min(4);
        // Each row's sum runs over min(len(x), len(row)) elements, as `dot` does.
        let n = (r0..r0 + group).map(row_len).min().unwrap_or(0).min(x.len());
        let same = (r0..r0 + group).all(|r| row_len(r).min(x.len()) == n);
        if !same {
            for r in r0..r0 + group {
                out[r] = match rows {
                    Rows::F32(rows) => dot(x, rows[r]),
                    Rows::Bf16(rows) => dot_bf16(x, rows[r]),
                };
            }
            r0 += group;
            continue;
        }
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load covers elements i..min(i + 16, n), inside x and each row.
        unsafe {
            while i < n {
                let xv = _mm512_maskz_loadu_ps(lanes(n - i), x.as_ptr().add(i));
                for (g, a) in acc.iter_mut().enumerate().take(group) {
                    *a = _mm512_fmadd_ps(xv, load_row(rows, r0 + g, i, n), *a);
                }
                i += 16;
            }
        }
        for (g, a) in acc.iter().enumerate().take(group) {
            out[r0 + g] = _mm512_reduce_add_ps(*a);
        }
        r0 += group;
    }
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpys_avx512(y: &mut [f32], coeffs: &[f32], rows: Rows<'_>) {
    let count = rows.len().min(coeffs.len());
    let shortest = (0..count)
        .map(|r| match rows {
            Rows::F32(rows) => rows[r].len(),
            Rows::Bf16(rows) => rows[r].len(),
        })
        .min()
        .unwrap_or(0);
    if shortest < y.len() {
        // Rows shorter than y update only their own prefix: keep the one-at-a-time order.
        match rows {
            Rows::F32(rows) => coeffs.iter().zip(rows).for_each(|(&c, r)| axpy(y, c, r)),
            Rows::Bf16(rows) => coeffs.iter().zip(rows).for_each(|(&c, r)| axpy_bf16(y, c, r)),
        }
        return;
    }
    let n = y.len();
    let mut i = 0;
    // SAFETY: every access covers elements i..min(i + 16, n), inside y and each row.
    unsafe {
        while i < n {
            let m = lanes(n - i);
            let mut yv = _mm512_maskz_loadu_ps(m, y.as_ptr().add(i));
            for (r, &c) in coeffs.iter().enumerate().take(count) {
                yv = _mm512_fmadd_ps(_mm512_set1_ps(c), load_row(rows, r, i, n), yv);
            }
            _mm512_mask_storeu_ps(y.as_mut_ptr().add(i), m, yv);
            i += 16;
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

    #[test]
    fn bf16_rows_compute_exactly_like_f32_rows_of_the_same_values() {
        for n in [1, 7, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b16: Vec<u16> = (0..n).map(|i| ((i as f32 * 0.11).cos().to_bits() >> 16) as u16).collect();
            let b32: Vec<f32> = b16.iter().map(|&v| bf16_to_f32(v)).collect();
            assert_eq!(dot_bf16(&a, &b16).to_bits(), dot(&a, &b32).to_bits(), "n={n}");
            let (mut y16, mut y32) = (a.clone(), a.clone());
            axpy_bf16(&mut y16, 0.75, &b16);
            axpy(&mut y32, 0.75, &b32);
            assert_eq!(y16, y32, "n={n}");
        }
    }

    #[test]
    fn grouped_dots_and_axpys_equal_one_row_at_a_time() {
        for (n, rows) in [(5, 3), (16, 4), (37, 7), (100, 9)] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.21).sin()).collect();
            let f: Vec<Vec<f32>> = (0..rows).map(|r| (0..n).map(|i| ((i + 3 * r) as f32 * 0.13).cos()).collect()).collect();
            let h: Vec<Vec<u16>> = f.iter().map(|row| row.iter().map(|v| (v.to_bits() >> 16) as u16).collect()).collect();
            let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
            let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
            let mut out = vec![0f32; rows];
            dots(&x, Rows::F32(&fr), &mut out);
            for r in 0..rows {
                assert_eq!(out[r].to_bits(), dot(&x, &f[r]).to_bits(), "n={n} row {r}");
            }
            dots(&x, Rows::Bf16(&hr), &mut out);
            for r in 0..rows {
                assert_eq!(out[r].to_bits(), dot_bf16(&x, &h[r]).to_bits(), "n={n} row {r}");
            }
            let coeffs: Vec<f32> = (0..rows).map(|r| r as f32 * 0.3 - 1.0).collect();
            for bf16 in [false, true] {
                let (mut grouped, mut single) = (x.clone(), x.clone());
                if bf16 {
                    axpys(&mut grouped, &coeffs, Rows::Bf16(&hr));
                    coeffs.iter().zip(&h).for_each(|(&c, r)| axpy_bf16(&mut single, c, r));
                } else {
                    axpys(&mut grouped, &coeffs, Rows::F32(&fr));
                    coeffs.iter().zip(&f).for_each(|(&c, r)| axpy(&mut single, c, r));
                }
                assert_eq!(grouped, single, "n={n} bf16={bf16}");
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
