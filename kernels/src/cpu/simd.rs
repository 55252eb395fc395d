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
