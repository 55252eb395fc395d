//! `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` on the CPU.

use super::isa::Path;
use super::{CpuBackend, CpuBuffer, MatmulInputs, ensure_len, packed};
use crate::{KernelError, Result, WeightData};

/// A linear layer's weight, packed into panels for the instruction set of the backend that
/// loaded it (see the `packed` module).
#[derive(Debug, Clone)]
pub struct CpuWeight {
    panels: packed::Panels,
    out_features: usize,
    in_features: usize,
}

impl CpuWeight {
    pub(crate) fn pack(path: Path, data: WeightData<'_>, out_features: usize, in_features: usize, inputs: MatmulInputs) -> Result<Self> {
        if out_features.checked_mul(in_features) != Some(data.len()) || out_features == 0 || in_features == 0 {
            return Err(KernelError::Shape { op: "load_weight", detail: format!("{} elements for a [{out_features}, {in_features}] weight", data.len()) });
        }
        Ok(Self { panels: packed::pack(path, data, out_features, in_features, inputs), out_features, in_features })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Bytes the weight takes in memory (what one row's matmul reads).
    pub fn bytes(&self) -> usize {
        self.panels.bytes()
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
        packed::matmul(x, &w.panels, bias, &mut out[..rows * n], rows, k, n);
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
        for &(rows, k, n) in &[
            (1, 7, 5),
            (3, 33, 17),
            (17, 64, 48),
            (64, 130, 97),
            (5, 1, 1),
            (200, 40, 33),
            (1, 70, 16 * 43 + 5),
            (2, 70, 16 * 43 + 5),
            (2, 33, 17),
            (3, 70, 16 * 43 + 5),
        ] {
            let x = pseudo_random(rows * k, 1);
            let w = pseudo_random(n * k, 2);
            let b = pseudo_random(n, 3);
            for (cpu, with_bias) in Path::available().into_iter().flat_map(|p| [false, true].map(|b| (CpuBackend::with_path(p), b))) {
                let weight = cpu.load_weight(&w, n, k).unwrap();
                let mut out = cpu.upload_f32(&vec![f32::NAN; rows * n]).unwrap();
                let bias_buf = cpu.upload_f32(&b).unwrap();
                cpu.matmul(&cpu.upload_f32(&x).unwrap(), &weight, with_bias.then_some(&bias_buf), &mut out, rows).unwrap();
                let got = cpu.download_f32(&out).unwrap();
                let want = reference(&x, &w, with_bias.then_some(&b[..]), rows, k, n);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{:?} rows={rows} k={k} n={n}: {g} vs {w}", cpu.path());
                }
            }
        }
    }

    /// Half-precision weights stay half-size and give the same bits as f32 weights holding the
    /// same values (widening is exact, the order of the sums the same), on every path.
    #[test]
    fn half_weights_compute_exactly_like_f32_weights_of_the_same_values() {
        for rows in [13, 1] {
            half_weights_like_f32(rows);
        }
    }

    fn half_weights_like_f32(rows: usize) {
        let (k, n) = (67, 16 * 21 + 6);
        let x = pseudo_random(rows * k, 4);
        let w = pseudo_random(n * k, 5);
        let bf16: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let f16: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
        for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
            let x = cpu.upload_f32(&x).unwrap();
            for (name, half) in [("bf16", WeightData::Bf16(&bf16)), ("f16", WeightData::F16(&f16))] {
                let widened = cpu.load_weight(&half.to_f32(), n, k).unwrap();
                let kept = cpu.load_weight_data(half, n, k).unwrap();
                assert_eq!(2 * kept.bytes(), widened.bytes(), "{:?} {name}: half-size", cpu.path());
                let (mut a, mut b) = (cpu.zeros(rows * n).unwrap(), cpu.zeros(rows * n).unwrap());
                cpu.matmul(&x, &widened, None, &mut a, rows).unwrap();
                cpu.matmul(&x, &kept, None, &mut b, rows).unwrap();
                assert_eq!(cpu.download_f32(&a).unwrap(), cpu.download_f32(&b).unwrap(), "{:?} {name}", cpu.path());
            }
        }
    }

    /// With bf16 matmul inputs, bf16 weights multiply the activations rounded to bf16 (to
    /// nearest, ties to even), with products summed in f32: on the dot-product kernel where the
    /// CPU has one, and by rounding then widening on every other path. Other weight types stay
    /// exact.
    #[test]
    fn bf16_inputs_multiply_the_rounded_activations() {
        for &(rows, k, n) in &[(1, 67, 16 * 43 + 5), (13, 67, 45), (30, 128, 100), (2, 1, 3)] {
            let x: Vec<f32> = pseudo_random(rows * k, 6).iter().map(|v| v * 3.0).collect();
            let b = pseudo_random(n, 8);
            let bits: Vec<u16> = pseudo_random(n * k, 7).iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let w: Vec<f32> = bits.iter().map(|&v| half::bf16::from_bits(v).to_f32()).collect();
            let rounded: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            let want = reference(&rounded, &w, Some(&b), rows, k, n);
            let exact = reference(&x, &w, Some(&b), rows, k, n);
            // The rounding moves some output by far more than the tolerance below.
            assert!(want.iter().zip(&exact).any(|(a, e)| (a - e).abs() > 1e-3 * (1.0 + e.abs())));
            for path in Path::available() {
                let cpu = CpuBackend::with_path(path).with_matmul_inputs(MatmulInputs::Bf16);
                let weight = cpu.load_weight_data(WeightData::Bf16(&bits), n, k).unwrap();
                if k % 2 == 0 {
                    assert_eq!(2 * weight.bytes(), cpu.load_weight(&w, n, k).unwrap().bytes(), "{path:?}: half-size, and f32 weights keep f32 panels");
                }
                let bias = cpu.upload_f32(&b).unwrap();
                let mut out = cpu.upload_f32(&vec![f32::NAN; rows * n]).unwrap();
                cpu.matmul(&cpu.upload_f32(&x).unwrap(), &weight, Some(&bias), &mut out, rows).unwrap();
                for (i, (g, w)) in cpu.download_f32(&out).unwrap().iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 2e-6 * (1.0 + k as f32) * (1.0 + w.abs()), "{}: rows={rows} k={k} n={n} [{i}]: {g} vs {w}", cpu.describe());
                }
                // f32 weights ignore the setting.
                let f32_weight = cpu.load_weight(&w, n, k).unwrap();
                cpu.matmul(&cpu.upload_f32(&x).unwrap(), &f32_weight, Some(&bias), &mut out, rows).unwrap();
                for (g, e) in cpu.download_f32(&out).unwrap().iter().zip(&exact) {
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{path:?} f32 weights: {g} vs {e}");
                }
            }
        }
    }

    /// With `LORAPLEX_REQUIRE_BF16_DOT=1` (CI's aarch64 run, whose emulated CPU has Arm's BF16
    /// extension) the bf16 dot-product kernel must be reachable, so that the test above runs it
    /// rather than the rounding every other path shares.
    #[test]
    fn the_bf16_dot_product_is_there_when_required() {
        let required = std::env::var("LORAPLEX_REQUIRE_BF16_DOT").is_ok_and(|v| v == "1");
        let paths: Vec<String> = Path::available().iter().filter(|&&p| packed::bf16_dot(p)).map(|p| p.name().to_string()).collect();
        assert!(!required || !paths.is_empty(), "LORAPLEX_REQUIRE_BF16_DOT=1 but no path of this CPU has a bf16 dot product");
        let cpu = CpuBackend::with_path(Path::available()[0]).with_matmul_inputs(MatmulInputs::Bf16);
        assert_eq!(cpu.describe().contains(packed::BF16_DOT), !paths.is_empty(), "{}", cpu.describe());
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

    /// A row's output is bit-identical whether it is multiplied alone or inside a larger batch,
    /// on every instruction set this CPU runs.
    #[test]
    fn rows_do_not_depend_on_their_batch() {
        for path in super::Path::available() {
            rows_do_not_depend_on_their_batch_on(CpuBackend::with_path(path), false);
        }
    }

    /// The same with bf16 weights and bf16 matmul inputs (the bf16 dot-product kernel where the
    /// CPU has one, which pairs the inputs: odd `k` included).
    #[test]
    fn rows_do_not_depend_on_their_batch_with_bf16_inputs() {
        for path in super::Path::available() {
            rows_do_not_depend_on_their_batch_on(CpuBackend::with_path(path).with_matmul_inputs(MatmulInputs::Bf16), true);
        }
    }

    /// Shapes of one panel and of many (one to three rows walk several panels side by side, in
    /// groups of up to 8, the last panel partly filled), with and without a bias.
    fn rows_do_not_depend_on_their_batch_on(cpu: CpuBackend, bf16: bool) {
        for (k, n) in [(70, 45), (70, 16 * 43 + 5), (67, 16 * 43 + 5)] {
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            let x: Vec<f32> = (0..30 * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 29 % 31) as f32 - 15.0) / 15.0).collect();
            let bits: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let weight = if bf16 { cpu.load_weight_data(WeightData::Bf16(&bits), n, k).unwrap() } else { cpu.load_weight(&w, n, k).unwrap() };
            let bias = cpu.upload_f32(&b).unwrap();
            for bias in [None, Some(&bias)] {
                let mut all = cpu.zeros(30 * n).unwrap();
                cpu.matmul(&cpu.upload_f32(&x).unwrap(), &weight, bias, &mut all, 30).unwrap();
                let all = cpu.download_f32(&all).unwrap();
                // Alone, in a pair and three at once (the few-rows loop), and four to seventeen
                // at once (tiles, some with a short last one).
                for (r, rows) in [(0, 1), (13, 1), (29, 1), (0, 2), (17, 2), (28, 2), (5, 3), (27, 3), (5, 4), (3, 7), (10, 13), (0, 16), (7, 17)] {
                    let mut few = cpu.upload_f32(&vec![f32::NAN; rows * n]).unwrap();
                    cpu.matmul(&cpu.upload_f32(&x[r * k..(r + rows) * k]).unwrap(), &weight, bias, &mut few, rows).unwrap();
                    let few = cpu.download_f32(&few).unwrap();
                    let same = few.iter().zip(&all[r * n..(r + rows) * n]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} k {k} n {n}, bias {}: rows {r}..{} alone differ from the batch", cpu.describe(), bias.is_some(), r + rows);
                }
            }
        }
    }
}
