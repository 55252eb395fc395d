//! Row-wise CPU ops: embedding, RMS norm, SiLU·mul, add, row gather, argmax.

use rayon::prelude::*;

use super::isa::{Isa, Kernel};
use super::{CpuBackend, CpuBuffer, CpuWeight, ensure_len, min_items, rows_of, simd};
use crate::check::ensure_rows;
use crate::{DenseOps, KernelError, Result, RowLogprobs, SampleParams, SamplingOps};

/// The work one element of an elementwise op counts for against [`super::PAR_MIN_WORK`]
/// (loads, a store, and for SiLU an exponential): such an op runs on the calling thread below
/// 2^14 elements.
const ELEM_WORK: usize = 4;

/// Elements of the tasks of `add_assign` and `silu_mul`.
const ADD_CHUNK: usize = 1 << 13;

impl DenseOps for CpuBackend {
    fn embedding(&self, table: &CpuBuffer, ids: &CpuBuffer, out: &mut CpuBuffer, hidden: usize) -> Result<()> {
        const OP: &str = "embedding";
        let table = table.f32(OP)?;
        let vocab = rows_of(OP, "table", table.len(), hidden)?;
        let ids = ids.u32(OP)?;
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), ids.len() * hidden)?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(KernelError::Index { op: OP, index: bad as usize, limit: vocab });
        }
        out[..ids.len() * hidden].par_chunks_mut(hidden).zip(ids.par_iter()).with_min_len(min_items(hidden)).for_each(|(row, &id)| {
            let start = id as usize * hidden;
            row.copy_from_slice(&table[start..start + hidden]);
        });
        Ok(())
    }

    fn rms_norm(&self, x: &CpuBuffer, weight: &CpuBuffer, out: &mut CpuBuffer, eps: f32) -> Result<()> {
        const OP: &str = "rms_norm";
        let weight = weight.f32(OP)?;
        let dim = weight.len();
        let x = x.f32(OP)?;
        let rows = rows_of(OP, "x", x.len(), dim)?;
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), rows * dim)?;
        let path = self.path;
        out[..rows * dim].par_chunks_mut(dim).zip(x.par_chunks(dim)).with_min_len(min_items(dim)).for_each(|(out, x)| path.run(RmsRow { out, x, weight, eps }));
        Ok(())
    }

    fn matmul(&self, x: &CpuBuffer, w: &CpuWeight, bias: Option<&CpuBuffer>, out: &mut CpuBuffer, rows: usize) -> Result<()> {
        self.matmul_impl(x, w, bias, out, rows)
    }

    fn silu_mul(&self, gate: &CpuBuffer, up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        const OP: &str = "silu_mul";
        let gate = gate.f32(OP)?;
        let up = up.f32(OP)?;
        ensure_len(OP, "up", up.len(), gate.len())?;
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), gate.len())?;
        let n = gate.len();
        let path = self.path;
        out[..n]
            .par_chunks_mut(ADD_CHUNK)
            .zip(gate.par_chunks(ADD_CHUNK).zip(up.par_chunks(ADD_CHUNK)))
            .with_min_len(min_items(ELEM_WORK * ADD_CHUNK))
            .for_each(|(out, (gate, up))| path.run(SiluMul { out, gate, up }));
        Ok(())
    }

    fn silu_mul_fused(&self, x: &CpuBuffer, out: &mut CpuBuffer, width: usize) -> Result<()> {
        const OP: &str = "silu_mul_fused";
        let x = x.f32(OP)?;
        let row = width.checked_mul(2).ok_or_else(|| KernelError::Shape { op: OP, detail: format!("width {width} overflows") })?;
        let rows = rows_of(OP, "x", x.len(), row)?;
        let out = out.f32_mut(OP)?;
        ensure_rows(OP, "out", out.len(), rows, width)?;
        let path = self.path;
        let f = |(out, x): (&mut [f32], &[f32])| {
            let (gate, up) = x.split_at(width);
            path.run(SiluMul { out, gate, up });
        };
        out[..rows * width].par_chunks_mut(width).zip(x.par_chunks(row)).with_min_len(min_items(ELEM_WORK * width)).for_each(f);
        Ok(())
    }

    fn split_columns(&self, src: &CpuBuffer, rows: usize, parts: &mut [(&mut CpuBuffer, usize)]) -> Result<()> {
        const OP: &str = "split_columns";
        let src = src.f32(OP)?;
        let mut outs = Vec::with_capacity(parts.len());
        let mut shape = Vec::with_capacity(parts.len());
        for (buf, width) in parts.iter_mut() {
            let out = buf.f32_mut(OP)?;
            shape.push((out.len(), *width));
            outs.push((out, *width));
        }
        let total = crate::check::split_columns(OP, src.len(), rows, &shape)?;
        let src = &src[..rows * total];
        // Rows of the whole source per task, so that the parts split alike.
        let per = min_items(ELEM_WORK * total);
        let mut offset = 0;
        for (out, width) in outs {
            let copy = |(o, s): (&mut [f32], &[f32])| o.copy_from_slice(&s[offset..offset + width]);
            out[..rows * width].par_chunks_exact_mut(width).zip(src.par_chunks_exact(total)).with_min_len(per).for_each(copy);
            offset += width;
        }
        Ok(())
    }

    fn add_assign(&self, acc: &mut CpuBuffer, x: &CpuBuffer) -> Result<()> {
        const OP: &str = "add_assign";
        let x = x.f32(OP)?;
        let acc = acc.f32_mut(OP)?;
        ensure_len(OP, "x", x.len(), acc.len())?;
        let n = acc.len();
        let path = self.path;
        acc.par_chunks_mut(ADD_CHUNK)
            .zip(x[..n].par_chunks(ADD_CHUNK))
            .with_min_len(min_items(ELEM_WORK * ADD_CHUNK))
            .for_each(|(acc, x)| path.run(AddAssign { acc, x }));
        Ok(())
    }

    fn gather_rows(&self, x: &CpuBuffer, rows: &CpuBuffer, out: &mut CpuBuffer, dim: usize) -> Result<()> {
        const OP: &str = "gather_rows";
        let x = x.f32(OP)?;
        let total = rows_of(OP, "x", x.len(), dim)?;
        let rows = rows.u32(OP)?;
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), rows.len() * dim)?;
        for (o, &r) in out.chunks_exact_mut(dim).zip(rows) {
            let r = r as usize;
            if r >= total {
                return Err(KernelError::Index { op: OP, index: r, limit: total });
            }
            o.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
        Ok(())
    }
}

/// One row of RMS norm: `out = weight * (x / rms(x))`.
struct RmsRow<'a> {
    out: &'a mut [f32],
    x: &'a [f32],
    weight: &'a [f32],
    eps: f32,
}

impl Kernel for RmsRow<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        let inv = 1.0 / (simd::sum_squares(s, self.x) / self.x.len() as f32 + self.eps).sqrt();
        simd::scale_mul(s, self.out, self.x, inv, self.weight);
    }
}

/// `out = silu(gate) * up`.
struct SiluMul<'a> {
    out: &'a mut [f32],
    gate: &'a [f32],
    up: &'a [f32],
}

impl Kernel for SiluMul<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        simd::silu_mul(s, self.out, self.gate, self.up);
    }
}

/// `acc += x`.
struct AddAssign<'a> {
    acc: &'a mut [f32],
    x: &'a [f32],
}

impl Kernel for AddAssign<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        simd::add_assign(s, self.acc, self.x);
    }
}

impl SamplingOps for CpuBackend {
    fn argmax_rows(&self, logits: &CpuBuffer, vocab: usize) -> Result<Vec<u32>> {
        const OP: &str = "argmax_rows";
        let logits = logits.f32(OP)?;
        rows_of(OP, "logits", logits.len(), vocab)?;
        Ok(logits.par_chunks(vocab).with_min_len(min_items(vocab)).map(argmax).collect())
    }

    fn sample_rows(&self, logits: &CpuBuffer, vocab: usize, params: &[SampleParams]) -> Result<Vec<u32>> {
        const OP: &str = "sample_rows";
        let logits = logits.f32(OP)?;
        let rows = rows_of(OP, "logits", logits.len(), vocab)?;
        crate::check_sample_params(OP, params, rows)?;
        Ok(logits.par_chunks(vocab).zip(params.par_iter()).with_min_len(min_items(vocab)).map(|(row, p)| sample_row(row, p)).collect())
    }

    fn row_logprobs(&self, logits: &CpuBuffer, vocab: usize, tokens: &[u32], n: usize) -> Result<Vec<RowLogprobs>> {
        const OP: &str = "row_logprobs";
        let logits = logits.f32(OP)?;
        let rows = rows_of(OP, "logits", logits.len(), vocab)?;
        crate::check_logprob_args(OP, tokens, rows, vocab, n)?;
        Ok(logits.par_chunks(vocab).zip(tokens.par_iter()).with_min_len(min_items(vocab)).map(|(row, &t)| row_logprobs(row, t, n)).collect())
    }
}

/// [`SamplingOps::row_logprobs`] for one row, with an f64 sum.
pub(crate) fn row_logprobs(row: &[f32], token: u32, n: usize) -> RowLogprobs {
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) };
    let max = row.iter().map(|&x| clean(x)).fold(f32::NEG_INFINITY, f32::max);
    let n = n.min(row.len());
    if max == f32::NEG_INFINITY {
        return RowLogprobs { logprob: f32::NEG_INFINITY, top: (0..n as u32).map(|id| (id, f32::NEG_INFINITY)).collect() };
    }
    let ln_z = row.iter().map(|&x| ((clean(x) - max) as f64).exp()).sum::<f64>().ln();
    let logprob = |x: f32| ((clean(x) - max) as f64 - ln_z) as f32;
    let mut order: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &x)| (clean(x), i as u32)).collect();
    // Clean values hold no NaN; -0 and +0 rank as equals, as on the device.
    let by_rank = |a: &(f32, u32), b: &(f32, u32)| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1));
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, by_rank);
    }
    order.truncate(n);
    order.sort_by(by_rank);
    RowLogprobs { logprob: logprob(row[token as usize]), top: order.into_iter().map(|(x, id)| (id, logprob(x))).collect() }
}

/// [`SamplingOps::sample_rows`] for one row, with f64 sums.
pub(crate) fn sample_row(row: &[f32], p: &SampleParams) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let z: Vec<f32> = row.iter().map(|&l| l * inv_t).map(|z| if z.is_nan() { f32::NEG_INFINITY } else { z }).collect();
    let mut sorted: Vec<f32> = z.iter().copied().filter(|&v| v != f32::NEG_INFINITY).collect();
    if sorted.is_empty() {
        return 0;
    }
    sorted.sort_by(|a, b| b.total_cmp(a));
    let max = sorted[0];
    let w = |v: f32| ((v - max) as f64).exp();
    let mut threshold = *sorted.last().unwrap_or(&max);
    let k = p.top_k as usize;
    if k > 0 && k < row.len() && k <= sorted.len() {
        threshold = sorted[k - 1];
    }
    if p.top_p < 1.0 {
        let kept: f64 = sorted.iter().filter(|&&v| v >= threshold).map(|&v| w(v)).sum();
        let need = p.top_p as f64 * kept;
        let mut cum = 0f64;
        let mut i = 0;
        while i < sorted.len() {
            // All tokens equal to sorted[i] enter together.
            let v = sorted[i];
            while i < sorted.len() && sorted[i] == v {
                cum += w(v);
                i += 1;
            }
            if cum >= need {
                threshold = threshold.max(v);
                break;
            }
        }
    }
    let kept = |v: f32| v >= threshold && v != f32::NEG_INFINITY;
    let total: f64 = z.iter().filter(|&&v| kept(v)).map(|&v| w(v)).sum();
    let target = p.uniform as f64 * total;
    let mut cum = 0f64;
    let mut last = 0;
    for (i, &v) in z.iter().enumerate() {
        if kept(v) {
            cum += w(v);
            last = i;
            if cum > target {
                return i as u32;
            }
        }
    }
    last as u32
}

/// Index of the first largest value; NaNs never win.
pub(crate) fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_val = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best_val {
            best = i;
            best_val = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Memory;

    #[test]
    fn rms_norm_matches_formula() {
        let cpu = CpuBackend::new();
        let x = cpu.upload_f32(&[1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 0.5, 2.0]).unwrap();
        let w = cpu.upload_f32(&[0.5, 1.0, 1.5, 2.0]).unwrap();
        let mut out = cpu.zeros(8).unwrap();
        cpu.rms_norm(&x, &w, &mut out, 1e-5).unwrap();
        let got = cpu.download_f32(&out).unwrap();
        let rms0 = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f32 + 1e-5).sqrt();
        assert!((got[3] - 4.0 / rms0 * 2.0).abs() < 1e-6);
        let rms1 = ((1.0 + 0.0 + 0.25 + 4.0) / 4.0f32 + 1e-5).sqrt();
        assert!((got[4] - (-1.0 / rms1 * 0.5)).abs() < 1e-6);
    }

    #[test]
    fn embedding_rejects_out_of_vocab_ids() {
        let cpu = CpuBackend::new();
        let table = cpu.upload_f32(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        let mut out = cpu.zeros(4).unwrap();
        cpu.embedding(&table, &cpu.upload_u32(&[2, 0]).unwrap(), &mut out, 2).unwrap();
        assert_eq!(cpu.download_f32(&out).unwrap(), vec![4.0, 5.0, 0.0, 1.0]);
        let err = cpu.embedding(&table, &cpu.upload_u32(&[3]).unwrap(), &mut out, 2).unwrap_err();
        assert!(matches!(err, KernelError::Index { index: 3, limit: 3, .. }), "{err}");
    }

    #[test]
    fn silu_mul_add_gather_argmax() {
        let cpu = CpuBackend::new();
        let gate = cpu.upload_f32(&[0.0, 1.0, -2.0]).unwrap();
        let up = cpu.upload_f32(&[3.0, 2.0, 1.0]).unwrap();
        let mut out = cpu.zeros(3).unwrap();
        cpu.silu_mul(&gate, &up, &mut out).unwrap();
        let got = cpu.download_f32(&out).unwrap();
        let silu = |g: f32| g / (1.0 + (-g).exp());
        for (got, want) in got.iter().zip([0.0, silu(1.0) * 2.0, silu(-2.0)]) {
            assert!((got - want).abs() <= 1e-6 * want.abs(), "{got} vs {want}");
        }

        let mut acc = cpu.upload_f32(&[1.0, 1.0, 1.0]).unwrap();
        cpu.add_assign(&mut acc, &up).unwrap();
        assert_eq!(cpu.download_f32(&acc).unwrap(), vec![4.0, 3.0, 2.0]);

        let x = cpu.upload_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let mut g = cpu.zeros(4).unwrap();
        cpu.gather_rows(&x, &cpu.upload_u32(&[2, 0]).unwrap(), &mut g, 2).unwrap();
        assert_eq!(cpu.download_f32(&g).unwrap(), vec![5.0, 6.0, 1.0, 2.0]);
        assert!(cpu.gather_rows(&x, &cpu.upload_u32(&[3]).unwrap(), &mut g, 2).is_err());

        let logits = cpu.upload_f32(&[0.5, 2.0, 2.0, f32::NAN, -1.0, f32::NAN]).unwrap();
        assert_eq!(cpu.argmax_rows(&logits, 3).unwrap(), vec![1, 1]);
    }

    /// A fused projection's output, split: each part gets its columns of every row; the fused
    /// SiLU·mul equals `silu_mul` on the halves. Small shapes run on the calling thread, large
    /// ones in the pool; both are checked.
    #[test]
    fn split_columns_and_fused_silu_mul() {
        let cpu = CpuBackend::new();
        for (rows, widths) in [(3, vec![2, 1, 3]), (2, vec![4, 4]), (1, vec![5]), (700, vec![40, 8, 8])] {
            let total: usize = widths.iter().sum();
            let src: Vec<f32> = (0..rows * total).map(|i| i as f32).collect();
            let mut parts: Vec<(CpuBuffer, usize)> = widths.iter().map(|&w| (cpu.upload_f32(&vec![f32::NAN; rows * w]).unwrap(), w)).collect();
            let mut refs: Vec<(&mut CpuBuffer, usize)> = parts.iter_mut().map(|(b, w)| (b, *w)).collect();
            cpu.split_columns(&cpu.upload_f32(&src).unwrap(), rows, &mut refs).unwrap();
            let mut offset = 0;
            for (b, w) in &parts {
                let want: Vec<f32> = (0..rows).flat_map(|r| src[r * total + offset..r * total + offset + w].to_vec()).collect();
                assert_eq!(cpu.download_f32(b).unwrap(), want, "rows {rows} widths {widths:?}, part at {offset}");
                offset += w;
            }
        }
        let src = cpu.upload_f32(&[0.0; 12]).unwrap();
        let (mut a, mut b) = (cpu.zeros(8).unwrap(), cpu.zeros(4).unwrap());
        let err = cpu.split_columns(&src, 2, &mut [(&mut a, 4), (&mut b, 4)]).unwrap_err();
        assert!(err.to_string().contains("needed"), "a short part: {err}");
        let err = cpu.split_columns(&src, 3, &mut [(&mut a, 2), (&mut b, 0)]).unwrap_err();
        assert!(err.to_string().contains("no columns"), "{err}");
        let (mut c, mut d) = (cpu.zeros(3).unwrap(), cpu.zeros(3).unwrap());
        let err = cpu.split_columns(&src, 3, &mut [(&mut a, 1), (&mut b, 1), (&mut c, 1), (&mut d, 1)]).unwrap_err();
        assert!(err.to_string().contains("4 parts"), "{err}");

        for (rows, width) in [(3, 5), (20, 1000)] {
            let x: Vec<f32> = (0..rows * 2 * width).map(|i| ((i * 37 % 101) as f32 - 50.0) / 10.0).collect();
            let (gate, up): (Vec<f32>, Vec<f32>) =
                (x.chunks(2 * width).flat_map(|r| r[..width].to_vec()).collect(), x.chunks(2 * width).flat_map(|r| r[width..].to_vec()).collect());
            let mut want = cpu.zeros(rows * width).unwrap();
            cpu.silu_mul(&cpu.upload_f32(&gate).unwrap(), &cpu.upload_f32(&up).unwrap(), &mut want).unwrap();
            let mut got = cpu.zeros(rows * width).unwrap();
            cpu.silu_mul_fused(&cpu.upload_f32(&x).unwrap(), &mut got, width).unwrap();
            assert_eq!(cpu.download_f32(&got).unwrap(), cpu.download_f32(&want).unwrap(), "rows {rows} width {width}");
        }
        let mut out = cpu.zeros(2).unwrap();
        assert!(cpu.silu_mul_fused(&cpu.upload_f32(&[0.0; 5]).unwrap(), &mut out, 1).is_err(), "5 is not rows of 2");
    }

    #[test]
    fn sample_rows_follows_temperature_top_k_and_top_p() {
        let cpu = CpuBackend::new();
        let p = |temperature, top_k, top_p, uniform| SampleParams { temperature, top_k, top_p, uniform };
        let ln3 = 3f32.ln();
        // Weights 1 and 3: the first token takes the first quarter of the draws.
        let logits = cpu.upload_f32(&[0.0, ln3, 0.0, ln3]).unwrap();
        assert_eq!(cpu.sample_rows(&logits, 2, &[p(1.0, 0, 1.0, 0.2), p(1.0, 0, 1.0, 0.3)]).unwrap(), vec![0, 1]);
        // top_k 1 and top_p 0.5 both keep only the larger one.
        assert_eq!(cpu.sample_rows(&logits, 2, &[p(1.0, 1, 1.0, 0.0), p(1.0, 0, 0.5, 0.0)]).unwrap(), vec![1, 1]);
        // top_p 0.8 needs both (3/4 < 0.8).
        assert_eq!(cpu.sample_rows(&logits, 2, &[p(1.0, 0, 0.8, 0.1), p(1.0, 0, 0.74, 0.1)]).unwrap(), vec![0, 1]);
        // A low temperature sharpens: weights 1 and 3^10.
        assert_eq!(cpu.sample_rows(&logits, 2, &[p(0.1, 0, 1.0, 0.0001), p(10.0, 0, 1.0, 0.45)]).unwrap(), vec![1, 0]);
        // NaN never drawn; a row of nothing gives 0; ties at the top-k threshold are kept.
        let logits = cpu.upload_f32(&[f32::NAN, 1.0, f32::NAN, f32::NAN, 2.0, 2.0, 0.0, 0.0]).unwrap();
        assert_eq!(cpu.sample_rows(&logits, 4, &[p(1.0, 0, 1.0, 0.0), p(1.0, 1, 1.0, 0.9)]).unwrap(), vec![1, 1]);
        assert!(cpu.sample_rows(&logits, 4, &[p(0.0, 0, 1.0, 0.0), p(1.0, 0, 1.0, 0.0)]).is_err());
        assert!(cpu.sample_rows(&logits, 4, &[p(1.0, 0, 1.0, 1.0), p(1.0, 0, 1.0, 0.0)]).is_err());
        assert!(cpu.sample_rows(&logits, 4, &[p(1.0, 0, 1.0, 0.0)]).is_err());
    }
}
