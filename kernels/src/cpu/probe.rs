//! Measurements of this machine's limits, taken by the benchmarks in the same run as the
//! figures they are compared against.

use std::time::Instant;

use rayon::prelude::*;

use super::{CpuBackend, MatmulInputs, simd};
use crate::{DenseOps, Memory, Result, WeightData};

/// Read bandwidth of main memory in bytes/s: the best of `reps` parallel passes summing a buffer
/// of `bytes` (make it several times the last-level cache). The buffer is backed by huge pages
/// where the OS allows, as the weights are, and each thread reads its own contiguous part with
/// the widest loads this CPU has, so the figure is what the matmuls could stream at best.
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let path = super::Path::detect();
    let len = bytes / 4;
    let mut data: Vec<f32> = Vec::with_capacity(len);
    super::advise_huge_pages(data.spare_capacity_mut());
    data.resize(len, 0.0);
    data.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| chunk.iter_mut().enumerate().for_each(|(i, v)| *v = ((c + i) % 7) as f32));
    let chunk = len.div_ceil(rayon::current_num_threads().max(1)).max(1 << 16);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let s: f32 = data.par_chunks(chunk).map(|c| path.run(simd::Sum(c))).sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.min(dt);
    }
    (len * 4) as f64 / best
}

/// The matmul peak of this machine in FLOP/s: the better of the backend's own matmul and the
/// `gemm` crate on plain row-major operands, each on a large square product (`n`×`n`×`n`), best
/// of `reps` runs.
pub fn matmul_peak(cpu: &CpuBackend, n: usize, reps: usize) -> Result<f64> {
    Ok(backend_matmul_peak(cpu, n, reps)?.max(gemm_crate_peak(n, reps)))
}

/// The `gemm` crate's throughput on `n`×`n`×`n` row-major f32 operands, best of `reps` runs.
pub fn gemm_crate_peak(n: usize, reps: usize) -> f64 {
    let a = vec![0.5f32; n * n];
    let b = vec![0.25f32; n * n];
    let mut c = vec![0f32; n * n];
    let threads = rayon::current_num_threads();
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) + 1 {
        let t = Instant::now();
        // SAFETY: a, b and c are distinct n*n buffers, each addressed row-major (row stride n,
        // column stride 1) within its bounds.
        unsafe {
            gemm::gemm(n, n, n, c.as_mut_ptr(), 1, n as isize, false, a.as_ptr(), 1, n as isize, b.as_ptr(), 1, n as isize, 0.0, 1.0, false, false, false, par);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / best
}

/// The backend's matmul throughput in FLOP/s on an `n`×`n`×`n` product, best of `reps` runs:
/// with f32 weights, or bf16 ones when the backend multiplies those with bf16 inputs (the
/// bf16 dot product's peak, where the CPU has one).
pub fn backend_matmul_peak(cpu: &CpuBackend, n: usize, reps: usize) -> Result<f64> {
    let x = cpu.upload_f32(&vec![0.5; n * n])?;
    let w = match cpu.matmul_inputs() {
        MatmulInputs::F32 => cpu.load_weight(&vec![0.25; n * n], n, n)?,
        MatmulInputs::Bf16 => cpu.load_weight_data(WeightData::Bf16(&vec![half::bf16::from_f32(0.25).to_bits(); n * n]), n, n)?,
    };
    let mut out = cpu.zeros(n * n)?;
    cpu.matmul(&x, &w, None, &mut out, n)?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        cpu.matmul(&x, &w, None, &mut out, n)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * n * n) as f64 / best)
}
