//! A matmul for decode-shaped products (few activation rows, a large weight), on AVX-512.
//!
//! The weight `[n, k]` is packed once, at load, into panels of [`NR`] output features:
//! `panel[p][kk][j] = W[p * NR + j][kk]` (zero beyond `n`). A panel is read front to back, which
//! streams memory at full bandwidth when one row is multiplied, and stays in L2 while blocks of
//! [`MR`] activation rows reuse it when many are. Each microkernel call computes an `MR x NR`
//! tile in 24 zmm accumulators: per `kk`, two loads of the panel, one broadcast per row, and two
//! FMAs per row.
//!
//! Every output element is accumulated in the same order (bias, then `kk = 0, 1, ..`) whatever
//! the tile height, so a row's result does not depend on which other rows share its batch.

use std::arch::x86_64::*;

use rayon::prelude::*;

/// Output features per panel: two zmm registers.
pub const NR: usize = 32;
/// Activation rows per microkernel tile.
pub const MR: usize = 12;
/// Activation rows kept hot in L2 while every panel passes over them.
const ROW_CHUNK: usize = 96;

/// Whether this CPU can run the packed kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// Packed weight panels, starting on a 64-byte boundary so that every zmm load of a panel row
/// stays within one cache line.
#[derive(Debug, Clone)]
pub struct Panels {
    storage: Vec<f32>,
    offset: usize,
    len: usize,
}

impl Panels {
    pub fn as_slice(&self) -> &[f32] {
        &self.storage[self.offset..self.offset + self.len]
    }
}

/// Packs `w` (`[n, k]`, row-major) into `NR`-wide panels.
pub fn pack(w: &[f32], n: usize, k: usize) -> Panels {
    let panels = n.div_ceil(NR);
    let len = panels * k * NR;
    let mut storage: Vec<f32> = Vec::with_capacity(len + 16);
    super::advise_huge_pages(storage.spare_capacity_mut());
    storage.resize(len + 16, 0.0);
    let offset = storage.as_ptr().align_offset(64).min(16);
    let out = &mut storage[offset..offset + len];
    out.par_chunks_mut(k * NR).enumerate().for_each(|(p, panel)| {
        for j in 0..NR.min(n - p * NR) {
            let row = &w[(p * NR + j) * k..(p * NR + j + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * NR + j] = v;
            }
        }
    });
    Panels { storage, offset, len }
}

/// Destination pointer shared by the tasks of one matmul; each task writes only the columns of
/// its own panels.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
impl OutPtr {
    /// The element `offset` past the start. Taking `self` whole keeps closures capturing the
    /// `Send` wrapper rather than the bare pointer.
    ///
    /// # Safety
    /// `offset` must lie within the output buffer.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: tasks write disjoint column ranges of the output (one panel each), never the same
// element, and the pointer outlives the parallel loop that uses it (see `matmul`).
unsafe impl Send for OutPtr {}
// SAFETY: as above; the pointer itself is only copied, never written through concurrently at
// the same address.
unsafe impl Sync for OutPtr {}

/// `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` with `packed` from [`pack`]. The caller has checked
/// every length: `x.len() >= rows * k`, `out.len() >= rows * n`, `packed.len() == panels * k * NR`,
/// `bias.len() >= n`; and [`available`] returned true.
pub fn matmul(x: &[f32], packed: &[f32], bias: Option<&[f32]>, out: &mut [f32], rows: usize, k: usize, n: usize) {
    assert!(x.len() >= rows * k && out.len() >= rows * n && packed.len() == n.div_ceil(NR) * k * NR);
    assert!(bias.is_none_or(|b| b.len() >= n) && available());
    let dst = OutPtr(out.as_mut_ptr());
    let panels = n.div_ceil(NR);
    let mut xp = Vec::new();
    for r0 in (0..rows).step_by(ROW_CHUNK) {
        let chunk_rows = ROW_CHUNK.min(rows - r0);
        pack_rows(&x[r0 * k..(r0 + chunk_rows) * k], k, &mut xp);
        (0..panels).into_par_iter().for_each(|p| {
            let panel = &packed[p * k * NR..(p + 1) * k * NR];
            let cols = NR.min(n - p * NR);
            let bias = bias.map(|b| &b[p * NR..p * NR + cols]);
            // While this panel's tiles run, the next panel is fetched into L2: tile t of T
            // prefetches rows t*k/T .. (t+1)*k/T of it, one row every T iterations.
            let next = &packed[((p + 1) % panels) * k * NR..][..k * NR];
            let tiles = xp.len() / (k * MR);
            for (b, block) in xp.chunks_exact(k * MR).enumerate() {
                let r = r0 + b * MR;
                let mr = MR.min(r0 + chunk_rows - r);
                let prefetch = Prefetch { from: next[b * k / tiles * NR..].as_ptr(), every: tiles };
                // SAFETY: `block` holds k * MR packed activations; the tile r..r+mr x
                // p*NR..p*NR+cols lies inside out (rows * n, checked above) and belongs to this
                // panel's task only; the prefetched range lies within `next`; AVX-512
                // availability was checked above.
                unsafe {
                    let op = dst.at(r * n + p * NR);
                    tile(mr, k, block.as_ptr(), panel.as_ptr(), op, n, cols, bias, prefetch);
                }
            }
        });
    }
}

/// Packs rows of `x` (`[rows, k]`) in blocks of [`MR`], interleaved: `out[block][kk][i] =
/// x[block * MR + i][kk]`, zero beyond the last row. The kernel then reads one sequential stream
/// instead of `MR` rows `k` floats apart (which, for power-of-two `k`, collide in L1 sets).
fn pack_rows(x: &[f32], k: usize, out: &mut Vec<f32>) {
    let rows = x.len() / k;
    let blocks = rows.div_ceil(MR);
    out.clear();
    out.resize(blocks * k * MR, 0.0);
    out.par_chunks_mut(k * MR).enumerate().for_each(|(b, block)| {
        for i in 0..MR.min(rows - b * MR) {
            let row = &x[(b * MR + i) * k..(b * MR + i + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                block[kk * MR + i] = v;
            }
        }
    });
}

/// Panel rows to pull into L2 during a tile: one row of `NR` floats every `every` iterations,
/// starting at `from`.
#[derive(Clone, Copy)]
struct Prefetch {
    from: *const f32,
    every: usize,
}

/// Dispatches a tile of `mr` rows to the kernel compiled for that row count.
///
/// # Safety
/// `x` points at a packed block of `k x MR` floats (see [`pack_rows`]); `w` at a `k x NR` panel;
/// `out` at `mr` rows of at least `cols` floats with stride `out_rs`; `pf.from` at least
/// `k / pf.every` panel rows; AVX-512F is available.
#[inline]
#[allow(clippy::too_many_arguments)] // the microkernel's operands, each a raw pointer or a bound
unsafe fn tile(mr: usize, k: usize, x: *const f32, w: *const f32, out: *mut f32, out_rs: usize, cols: usize, bias: Option<&[f32]>, pf: Prefetch) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match mr {
            1 => kernel::<1>(k, x, w, out, out_rs, cols, bias, pf),
            2 => kernel::<2>(k, x, w, out, out_rs, cols, bias, pf),
            3 => kernel::<3>(k, x, w, out, out_rs, cols, bias, pf),
            4 => kernel::<4>(k, x, w, out, out_rs, cols, bias, pf),
            5 => kernel::<5>(k, x, w, out, out_rs, cols, bias, pf),
            6 => kernel::<6>(k, x, w, out, out_rs, cols, bias, pf),
            7 => kernel::<7>(k, x, w, out, out_rs, cols, bias, pf),
            8 => kernel::<8>(k, x, w, out, out_rs, cols, bias, pf),
            9 => kernel::<9>(k, x, w, out, out_rs, cols, bias, pf),
            10 => kernel::<10>(k, x, w, out, out_rs, cols, bias, pf),
            11 => kernel::<11>(k, x, w, out, out_rs, cols, bias, pf),
            _ => kernel::<12>(k, x, w, out, out_rs, cols, bias, pf),
        }
    }
}

/// Initial accumulators of one tile row: the bias, or zero.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn init(bias: Option<&[f32]>, mask_lo: __mmask16, mask_hi: __mmask16) -> [__m512; 2] {
    match bias {
        // SAFETY: the masks cover only the first `cols <= bias.len()` elements.
        Some(b) => unsafe { [_mm512_maskz_loadu_ps(mask_lo, b.as_ptr()), _mm512_maskz_loadu_ps(mask_hi, b.as_ptr().add(16))] },
        None => [_mm512_setzero_ps(); 2],
    }
}

/// Lane masks for the first `cols` of the two halves of a panel.
#[inline]
fn masks(cols: usize) -> (__mmask16, __mmask16) {
    let lo = if cols >= 16 { 0xFFFF } else { (1u32 << cols) as u16 - 1 };
    let hi = if cols >= 32 {
        0xFFFF
    } else if cols > 16 {
        (1u32 << (cols - 16)) as u16 - 1
    } else {
        0
    };
    (lo, hi)
}

/// `MR`-row tile.
///
/// # Safety
/// See [`tile`].
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)] // see `tile`
unsafe fn kernel<const M: usize>(k: usize, x: *const f32, w: *const f32, out: *mut f32, out_rs: usize, cols: usize, bias: Option<&[f32]>, pf: Prefetch) {
    let (mlo, mhi) = masks(cols);
    // SAFETY: all reads are x[kk * MR + i] for i < M, kk < k and w[kk * NR .. kk * NR + 32];
    // prefetches touch at most k / pf.every rows from pf.from (and never fault);
    // all writes are masked to the first `cols` columns of the M output rows (see `tile`).
    unsafe {
        let start = init(bias, mlo, mhi);
        let mut acc = [start; M];
        let (mut pf_ptr, mut pf_count) = (pf.from, 0usize);
        for kk in 0..k {
            pf_count += 1;
            if pf_count == pf.every {
                pf_count = 0;
                _mm_prefetch::<_MM_HINT_T1>(pf_ptr as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(pf_ptr.add(16) as *const i8);
                pf_ptr = pf_ptr.add(NR);
            }
            let w0 = _mm512_loadu_ps(w.add(kk * NR));
            let w1 = _mm512_loadu_ps(w.add(kk * NR + 16));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(kk * MR + i));
                a[0] = _mm512_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm512_fmadd_ps(xv, w1, a[1]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(i * out_rs), mlo, a[0]);
            _mm512_mask_storeu_ps(out.add(i * out_rs + 16), mhi, a[1]);
        }
    }
}
