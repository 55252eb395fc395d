//! bf16 weights times activations rounded to bf16, on AVX-512 BF16's dot product
//! (`vdpbf16ps`): each instruction multiplies 16 pairs of bf16 values and adds both products
//! to 16 f32 accumulators, twice the multiply-adds of an f32 FMA for the same issue slot.
//!
//! The panels hold the weight's pairs of inputs side by side: `panel[p][kp][2 j + h] =
//! W[p * 32 + j][2 kp + h]` (zero beyond `n` and `k`), so one 64-byte load gives 16 columns'
//! pairs. The activations are rounded to bf16 (to nearest, ties to even) and paired the same
//! way, one 32-bit pair broadcast per row. As in the f32 kernels, every output element starts
//! from its bias and takes the pairs `kp = 0, 1, ..` in order, in the tile and in the
//! single-row loop alike, so a row's result does not depend on its batch.
//!
//! The instruction exists only on x86-64 (NEON's `BFDOT` is not yet reachable from stable
//! Rust), so this is the one kernel written for one instruction set; every other path reaches
//! the same rounding of the inputs through the generic kernels (see `super::matmul`).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::{Aligned, OutPtr, ROW_CHUNK};
use crate::cpu::min_items;

/// Output columns per panel: two registers of 16 f32 accumulators.
pub(super) const NR: usize = 32;
/// Rows per tile: 24 accumulators, two weight registers and a broadcast fit in 32 registers.
const MR: usize = 12;
/// Most panels the single-row loop walks side by side.
const GROUP: usize = 8;

/// Whether this CPU has the instructions.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// Inputs `2 kp` and `2 kp + 1` of `row` as one bf16 pair, the first in the low half.
#[inline]
fn pair(row: &[f32], kp: usize) -> u32 {
    let lo = bf16_select(row[2 * kp]);
    let hi = row.get(2 * kp + 1).map_or(0, |&v| bf16_select(v));
    lo | (hi << 16)
}

/// Packs `w` (`[n, k]`, bf16 bits, row-major) into pair panels.
pub(super) fn pack(w: &[u16], n: usize, k: usize) -> Aligned<u16> {
    let k2 = k.div_ceil(2);
    let mut out = Aligned::zeroed(n.div_ceil(NR) * k2 * 2 * NR);
    out.as_mut_slice().par_chunks_mut(k2 * 2 * NR).enumerate().for_each(|(p, panel)| {
        for j in 0..NR.min(n - p * NR) {
            let row = &w[(p * NR + j) * k..(p * NR + j + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                panel[(kk / 2) * 2 * NR + 2 * j + kk % 2] = v;
            }
        }
    });
    out
}

/// `out[rows, n] = round(x)[rows, k] · Wᵀ (+ bias)` with pair panels from [`pack`]. The caller
/// has checked every length and that [`available`] holds.
#[allow(clippy::too_many_arguments)] // a matmul's operands
pub(super) fn matmul(x: &[f32], packed: &[u16], bias: Option<&[f32]>, out: &mut [f32], rows: usize, k: usize, n: usize) {
    let k2 = k.div_ceil(2);
    let count = n.div_ceil(NR);
    assert!(available() && x.len() >= rows * k && out.len() >= rows * n && packed.len() == count * k2 * 2 * NR);
    assert!(bias.is_none_or(|b| b.len() >= n));
    let dst = OutPtr(out.as_mut_ptr());
    if rows == 1 {
        let xp: Vec<u32> = (0..k2).map(|kp| pair(&x[..k], kp)).collect();
        let per = count.div_ceil(rayon::current_num_threads()).clamp(1, GROUP);
        (0..count.div_ceil(per)).into_par_iter().with_min_len(min_items(per * k2 * 2 * NR)).for_each(|g| {
            let p0 = g * per;
            let group = per.min(count - p0);
            let task = RowGroup {
                x: &xp,
                panels: &packed[p0 * k2 * 2 * NR..(p0 + group) * k2 * 2 * NR],
                bias: bias.map(|b| &b[p0 * NR..n]),
                // SAFETY: column p0 * NR lies inside out (n elements).
                out: unsafe { dst.at(p0 * NR) },
                cols: n - p0 * NR,
                k2,
            };
            // SAFETY: `available` was checked above; the task's slices hold its group's panels.
            unsafe { task.run(group) };
        });
        return;
    }
    let mut xp = Vec::new();
    for r0 in (0..rows).step_by(ROW_CHUNK) {
        let chunk_rows = ROW_CHUNK.min(rows - r0);
        pack_rows(&x[r0 * k..(r0 + chunk_rows) * k], k, &mut xp);
        let xp = &xp[..];
        (0..count).into_par_iter().with_min_len(min_items(chunk_rows * k2 * 2 * NR)).for_each(|p| {
            let cols = NR.min(n - p * NR);
            let task = PanelTask {
                xp,
                panel: &packed[p * k2 * 2 * NR..(p + 1) * k2 * 2 * NR],
                next: &packed[((p + 1) % count) * k2 * 2 * NR..][..k2 * 2 * NR],
                bias: bias.map(|b| &b[p * NR..p * NR + cols]),
                // SAFETY: column p * NR of row r0 lies inside out (rows * n elements).
                out: unsafe { dst.at(r0 * n + p * NR) },
                out_rs: n,
                rows: chunk_rows,
                cols,
                k2,
            };
            // SAFETY: `available` was checked above; the task's slices are this panel's.
            unsafe { task.run() };
        });
    }
}

/// `v` rounded to bf16, to nearest with ties to even (NaN stays NaN, quieted), the bits of
/// `half::bf16::from_f32`, with no branch: a loop of it over a row compiles to vector code.
#[inline(always)]
fn bf16_select(v: f32) -> u32 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    if b & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded }
}

/// Rows of `x` (`[rows, k]`) rounded to bf16 and paired, in blocks of `MR`, interleaved:
/// `out[block][kp][i]` is row `block * MR + i`'s pair `kp` (zero beyond the last row). Each row
/// is rounded in one vectorizable pass, then its pairs are spread over the block.
fn pack_rows(x: &[f32], k: usize, out: &mut Vec<u32>) {
    let rows = x.len() / k;
    let k2 = k.div_ceil(2);
    out.clear();
    out.resize(rows.div_ceil(MR) * k2 * MR, 0);
    out.par_chunks_mut(k2 * MR).with_min_len(min_items(k2 * 2 * MR)).enumerate().for_each_init(
        || vec![0u32; k2 * 2],
        |halves, (b, block)| {
            for i in 0..MR.min(rows - b * MR) {
                let row = &x[(b * MR + i) * k..(b * MR + i + 1) * k];
                for (h, &v) in halves.iter_mut().zip(row) {
                    *h = bf16_select(v);
                }
                // An odd row's last pair has a zero high half.
                halves[k..].fill(0);
                for (kp, two) in halves.chunks_exact(2).enumerate() {
                    block[kp * MR + i] = two[0] | (two[1] << 16);
                }
            }
        },
    );
}

/// The masks of a panel's real columns in its two registers.
#[inline(always)]
fn masks(cols: usize) -> [__mmask16; 2] {
    let lo = cols.min(16);
    let hi = cols.saturating_sub(16).min(16);
    [((1u32 << lo) - 1) as __mmask16, ((1u32 << hi) - 1) as __mmask16]
}

/// The accumulators' starting values: the bias of the real columns, zero elsewhere.
///
/// # Safety
/// Needs AVX-512F; `bias`, when given, holds the real columns `masks` covers.
#[inline(always)]
unsafe fn start(bias: Option<&[f32]>, m: [__mmask16; 2]) -> [__m512; 2] {
    // SAFETY: the masked loads touch only the real columns, inside `bias` (the contract).
    unsafe {
        match bias {
            Some(b) => [_mm512_maskz_loadu_ps(m[0], b.as_ptr()), _mm512_maskz_loadu_ps(m[1], b.as_ptr().wrapping_add(16))],
            None => [_mm512_setzero_ps(); 2],
        }
    }
}

/// 16 columns' pairs at `p`.
///
/// # Safety
/// Needs AVX-512F; 32 values are readable at `p`.
#[inline(always)]
unsafe fn load_pairs(p: *const u16) -> __m512bh {
    // SAFETY: the contract; `__m512bh` and `__m512i` are both 64 plain bytes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) }
}

/// A row's pair broadcast to every lane.
///
/// # Safety
/// Needs AVX-512F.
#[inline(always)]
unsafe fn broadcast(pair: u32) -> __m512bh {
    // SAFETY: as above.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32)) }
}

/// Every tile of one panel against one chunk of packed rows.
struct PanelTask<'a> {
    xp: &'a [u32],
    panel: &'a [u16],
    /// The panel to fetch into L2 meanwhile.
    next: &'a [u16],
    bias: Option<&'a [f32]>,
    /// The chunk's first row, at this panel's first column.
    out: OutPtr,
    out_rs: usize,
    rows: usize,
    cols: usize,
    k2: usize,
}

impl PanelTask<'_> {
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16; `out` holds the chunk's rows at stride `out_rs`
    /// with at least `cols` columns each, written by this task alone.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn run(self) {
        let k2 = self.k2;
        let tiles = self.xp.len() / (k2 * MR);
        assert!(self.panel.len() >= k2 * 2 * NR && self.next.len() >= k2 * 2 * NR && self.cols <= NR);
        let m = masks(self.cols);
        // SAFETY: the bias holds `cols` values (see `matmul`).
        let start = unsafe { start(self.bias, m) };
        for (b, block) in self.xp.chunks_exact(k2 * MR).enumerate() {
            let rows = MR.min(self.rows - b * MR);
            // Tile t of T fetches rows t*k2/T .. (t+1)*k2/T of the next panel, one every T
            // iterations.
            let prefetch = (self.next[b * k2 / tiles * 2 * NR..].as_ptr(), tiles);
            // SAFETY: rows b*MR .. + rows of the chunk lie inside the output.
            let out = unsafe { self.out.at(b * MR * self.out_rs) }.0;
            let tile = Tile { x: block.as_ptr(), w: self.panel.as_ptr(), k2, start, masks: m, prefetch };
            // SAFETY: `block` holds k2 x MR pairs, the panel k2 x 2 NR values (checked above),
            // and `out` the tile's rows.
            unsafe {
                match rows {
                    1 => tile.run::<1>(out, self.out_rs),
                    2 => tile.run::<2>(out, self.out_rs),
                    3 => tile.run::<3>(out, self.out_rs),
                    4 => tile.run::<4>(out, self.out_rs),
                    5 => tile.run::<5>(out, self.out_rs),
                    6 => tile.run::<6>(out, self.out_rs),
                    7 => tile.run::<7>(out, self.out_rs),
                    8 => tile.run::<8>(out, self.out_rs),
                    9 => tile.run::<9>(out, self.out_rs),
                    10 => tile.run::<10>(out, self.out_rs),
                    11 => tile.run::<11>(out, self.out_rs),
                    _ => tile.run::<MR>(out, self.out_rs),
                }
            }
        }
    }
}

/// One `M x NR` tile.
struct Tile {
    /// `k2 x MR` packed pairs.
    x: *const u32,
    /// `k2 x 2 NR` panel values.
    w: *const u16,
    k2: usize,
    start: [__m512; 2],
    masks: [__mmask16; 2],
    /// Where to prefetch from, and every how many iterations.
    prefetch: (*const u16, usize),
}

impl Tile {
    /// # Safety
    /// Needs AVX-512F and AVX-512 BF16 (inlined only into [`PanelTask::run`]); the pointers
    /// hold what the fields say; `out` points at `M` rows, `out_rs` apart, with the real
    /// columns writable.
    #[inline(always)]
    unsafe fn run<const M: usize>(&self, out: *mut f32, out_rs: usize) {
        let mut acc = [self.start; M];
        let (mut pf, every) = (self.prefetch.0 as *const i8, self.prefetch.1);
        let mut count = 0usize;
        // SAFETY: reads are x[kp * MR + i] for i < M <= MR, kp < k2, and w[kp * 2 NR .. + 2 NR]
        // (the contract); prefetches never fault; the stores are masked to the real columns.
        unsafe {
            for kp in 0..self.k2 {
                count += 1;
                if count == every {
                    count = 0;
                    _mm_prefetch::<_MM_HINT_T1>(pf);
                    _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(64));
                    pf = pf.wrapping_add(4 * NR);
                }
                let w0 = load_pairs(self.w.add(kp * 2 * NR));
                let w1 = load_pairs(self.w.add(kp * 2 * NR + NR));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = broadcast(*self.x.add(kp * MR + i));
                    a[0] = _mm512_dpbf16_ps(a[0], xv, w0);
                    a[1] = _mm512_dpbf16_ps(a[1], xv, w1);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let row = out.add(i * out_rs);
                _mm512_mask_storeu_ps(row, self.masks[0], a[0]);
                _mm512_mask_storeu_ps(row.wrapping_add(16), self.masks[1], a[1]);
            }
        }
    }
}

/// One row against up to [`GROUP`] neighbouring panels, side by side (a decode step at batch
/// 1): the same instructions per output element as a tile, in the same order.
struct RowGroup<'a> {
    /// The row's `k2` pairs.
    x: &'a [u32],
    panels: &'a [u16],
    /// The bias from the group's first column on.
    bias: Option<&'a [f32]>,
    out: OutPtr,
    /// Output columns from the group's first one to the end of the row.
    cols: usize,
    k2: usize,
}

impl RowGroup<'_> {
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16; the output row from `out` on holds `cols`
    /// values, the group's columns written by this task alone.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn run(self, group: usize) {
        // SAFETY: forwarded.
        unsafe {
            match group {
                8 => self.side_by_side::<8>(),
                7 => self.side_by_side::<7>(),
                6 => self.side_by_side::<6>(),
                5 => self.side_by_side::<5>(),
                4 => self.side_by_side::<4>(),
                3 => self.side_by_side::<3>(),
                2 => self.side_by_side::<2>(),
                _ => self.side_by_side::<1>(),
            }
        }
    }

    /// # Safety
    /// As [`RowGroup::run`], into which it is inlined.
    #[inline(always)]
    unsafe fn side_by_side<const G: usize>(&self) {
        let k2 = self.k2;
        assert!(self.panels.len() >= G * k2 * 2 * NR && self.x.len() >= k2 && self.cols > (G - 1) * NR);
        let m: [[__mmask16; 2]; G] = std::array::from_fn(|g| masks(self.cols - g * NR));
        // SAFETY: each panel's bias holds its real columns (the bias runs to the row's end).
        let mut acc: [[__m512; 2]; G] = std::array::from_fn(|g| unsafe { start(self.bias.map(|b| &b[g * NR..]), m[g]) });
        let w = self.panels.as_ptr();
        // SAFETY: reads are x[kp] for kp < k2 and panel g's pairs kp, w[g * k2 * 2 NR + kp * 2
        // NR .. + 2 NR] for g < G (checked above); the stores are masked to the real columns.
        unsafe {
            for kp in 0..k2 {
                let xv = broadcast(*self.x.as_ptr().add(kp));
                for (g, a) in acc.iter_mut().enumerate() {
                    let p = w.add(g * k2 * 2 * NR + kp * 2 * NR);
                    a[0] = _mm512_dpbf16_ps(a[0], xv, load_pairs(p));
                    a[1] = _mm512_dpbf16_ps(a[1], xv, load_pairs(p.add(NR)));
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let row = self.out.0.add(g * NR);
                _mm512_mask_storeu_ps(row, m[g][0], a[0]);
                _mm512_mask_storeu_ps(row.wrapping_add(16), m[g][1], a[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(v: f32) -> u32 {
        half::bf16::from_f32(v).to_bits() as u32
    }

    /// The branch-free rounding gives the bits of `half`'s, on ties (both ways), the edges of
    /// the range (overflow to infinity), infinities, NaNs of both signs and payloads, subnormals
    /// and a sweep of ordinary values.
    #[test]
    fn branch_free_rounding_equals_halfs() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x3F80_8001,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F7F_8000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0xFFC0_0000,
            0x7FFF_FFFF,
            0xFF80_0001,
            0x0000_0001,
            0x0000_8000,
            0x8001_8000,
            0x007F_FFFF,
        ];
        let mut s = 0x9E37_79B9u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bits.push(s);
        }
        for b in bits {
            let v = f32::from_bits(b);
            assert_eq!(bf16_select(v), bf16(v), "{b:#010x}");
        }
    }
}
