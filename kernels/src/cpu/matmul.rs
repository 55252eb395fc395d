//! `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` on the CPU.

use super::{CpuBackend, CpuBuffer, ensure_len, packed};
use crate::{KernelError, Result};

#[derive(Debug, Clone)]
enum Layout {
    /// AVX-512 panels.
    Packed(packed::Panels),
    /// Row-major `[out, in]` for the `gemm` crate.
    Plain(Vec<f32>),
}

/// A linear layer's weight. On CPUs with AVX-512 it is packed into panels for the kernels of
/// the `packed` module; elsewhere it stays `[out_features, in_features]` row-major, as in HF
/// checkpoints, for the `gemm` crate.
#[derive(Debug, Clone)]
pub struct CpuWeight {
    layout: Layout,
    out_features: usize,
    in_features: usize,
}

impl CpuWeight {
    pub(crate) fn pack(data: &[f32], out_features: usize, in_features: usize) -> Result<Self> {
        Self::with_layout(data, out_features, in_features, packed::available())
    }

    /// Builds the weight in the packed or the plain layout.
    fn with_layout(data: &[f32], out_features: usize, in_features: usize, packed: bool) -> Result<Self> {
        if data.len() != out_features * in_features || out_features == 0 || in_features == 0 {
            return Err(KernelError::Shape { op: "load_weight", detail: format!("{} elements for a [{out_features}, {in_features}] weight", data.len()) });
        }
        let layout = if packed { Layout::Packed(packed::pack(data, out_features, in_features)) } else { Layout::Plain(data.to_vec()) };
        Ok(Self { layout, out_features, in_features })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }
}

impl CpuBackend {
    pub(crate) fn matmul_impl(&self, x: &CpuBuffer, w: &CpuWeight, bias: Option<&CpuBuffer>, out: &mut CpuBuffer, rows: usize) -> Result<()> {
        const OP: &str = "matmul";
        let (k, n) = (w.in_features, w.out_features);
        let x = x.f32(OP)?;
        ensure_len(OP, "x", x.len(), rows * k)?;
        let bias = bias.map(|b| b.f32(OP)).transpose()?;
        if let Some(b) = bias {
            ensure_len(OP, "bias", b.len(), n)?;
        }
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), rows * n)?;
        if rows == 0 {
            return Ok(());
        }
        let out = &mut out[..rows * n];
        let plain = match &w.layout {
            Layout::Packed(panels) => {
                packed::matmul(x, panels.as_slice(), bias, out, rows, k, n);
                return Ok(());
            }
            Layout::Plain(data) => data,
        };
        if let Some(b) = bias {
            for row in out.chunks_exact_mut(n) {
                row.copy_from_slice(&b[..n]);
            }
        }
        let threads = rayon::current_num_threads();
        let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
        // SAFETY: `out` holds rows*n elements (row stride n, column stride 1), `x` at least
        // rows*k (row stride k), and `plain` exactly n*k laid out [n, k], which read as the
        // [k, n] right-hand side has row stride 1 and column stride k. All three are distinct
        // allocations, so the written range does not alias the read ones.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                bias.is_some(),
                x.as_ptr(),
                1,
                k as isize,
                plain.as_ptr(),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DenseOps, Memory};

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, rows: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut acc = 0f64;
                for i in 0..k {
                    acc += x[r * k + i] as f64 * w[j * k + i] as f64;
                }
                out[r * n + j] = acc as f32 + bias.map_or(0.0, |b| b[j]);
            }
        }
        out
    }

    fn pseudo_random(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_naive_product_on_odd_shapes() {
        let cpu = CpuBackend::new();
        for &(rows, k, n) in &[(1, 7, 5), (3, 33, 17), (17, 64, 48), (64, 130, 97), (5, 1, 1), (200, 40, 33)] {
            let x = pseudo_random(rows * k, 1);
            let w = pseudo_random(n * k, 2);
            let b = pseudo_random(n, 3);
            let layouts = if packed::available() { vec![false, true] } else { vec![false] };
            for (weight, with_bias) in layouts.into_iter().flat_map(|p| [false, true].map(|b| (CpuWeight::with_layout(&w, n, k, p).unwrap(), b))) {
                let mut out = cpu.upload_f32(&vec![f32::NAN; rows * n]).unwrap();
                let bias_buf = cpu.upload_f32(&b).unwrap();
                cpu.matmul(&cpu.upload_f32(&x).unwrap(), &weight, with_bias.then_some(&bias_buf), &mut out, rows).unwrap();
                let got = cpu.download_f32(&out).unwrap();
                let want = reference(&x, &w, with_bias.then_some(&b[..]), rows, k, n);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "rows={rows} k={k} n={n} {:?}: {g} vs {w}", std::mem::discriminant(&weight.layout));
                }
            }
        }
    }

    #[test]
    fn rejects_short_buffers() {
        let cpu = CpuBackend::new();
        let weight = cpu.load_weight(&[1.0; 6], 2, 3).unwrap();
        let x = cpu.upload_f32(&[1.0; 5]).unwrap();
        let mut out = cpu.zeros(4).unwrap();
        let err = cpu.matmul(&x, &weight, None, &mut out, 2).unwrap_err();
        assert!(err.to_string().contains("x holds 5 elements, 6 needed"), "{err}");
        assert!(cpu.load_weight(&[1.0; 5], 2, 3).is_err());
    }
}

#[cfg(test)]
mod batch_invariance {
    use super::*;
    use crate::{DenseOps, Memory};

    /// A row's output is bit-identical whether it is multiplied alone or inside a larger batch.
    #[test]
    fn rows_do_not_depend_on_their_batch() {
        let cpu = CpuBackend::new();
        let (k, n) = (70, 45);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let x: Vec<f32> = (0..30 * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
        let weight = cpu.load_weight(&w, n, k).unwrap();
        let mut all = cpu.zeros(30 * n).unwrap();
        cpu.matmul(&cpu.upload_f32(&x).unwrap(), &weight, None, &mut all, 30).unwrap();
        let all = cpu.download_f32(&all).unwrap();
        if !packed::available() {
            return;
        }
        for r in [0, 13, 29] {
            let mut one = cpu.zeros(n).unwrap();
            cpu.matmul(&cpu.upload_f32(&x[r * k..(r + 1) * k]).unwrap(), &weight, None, &mut one, 1).unwrap();
            assert_eq!(cpu.download_f32(&one).unwrap(), all[r * n..(r + 1) * n].to_vec(), "row {r}");
        }
    }
}
