//! bf16 weights times activations rounded to bf16, on the CPU's bf16 dot product: AVX-512
//! BF16's `vdpbf16ps` on x86-64 (16 lanes; 8 in the single-row loop) and the BF16 extension's
//! `BFDOT` on aarch64 (4 lanes; Graviton 3 and 4, Ampere One, Apple M2 and later). Each
//! instruction multiplies a pair of bf16 values in every lane and adds both products to that
//! lane's f32 accumulator, twice the multiply-adds of an f32 FMA for the same issue slot.
//!
//! The panels hold the weight's pairs of inputs side by side: `panel[p][kp][2 j + h] =
//! W[p * NR + j][2 kp + h]` (zero beyond `n` and `k`), so one vector load gives a register's
//! columns' pairs. The activations are rounded to bf16 (to nearest, ties to even) and paired the
//! same way, one 32-bit pair broadcast per row. As in the f32 kernels, every output element
//! starts from its bias and takes the pairs `kp = 0, 1, ..` in order, in the tile and in the
//! single-row loop alike, so a row's result does not depend on its batch.
//!
//! The kernel is written once over [`Dot`], the few operations it needs; pulp exposes neither
//! instruction, so each architecture implements them with its own intrinsics (`BFDOT` through
//! inline assembly: its intrinsics are not in stable Rust). The two instructions round
//! differently (x86 adds each product to the accumulator to nearest; Arm adds the two products,
//! then the accumulator, rounding to odd), so the two architectures' results may differ in the
//! last bits; on each, a row's result is the same in every batch.

use rayon::prelude::*;

use super::{Aligned, OutPtr, ROW_CHUNK};
use crate::cpu::min_items;

/// Output columns per panel: two registers of f32 accumulators (32 on x86-64, 8 on aarch64).
pub(super) const NR: usize = 2 * Native::LANES;
/// Rows per tile: 24 accumulators, two weight registers and a broadcast fit in the 32 vector
/// registers both architectures have.
const MR: usize = 12;
/// Most panels the single-row loop walks side by side: 12 accumulators on x86-64 (four 256-bit
/// registers a panel), 16 on aarch64.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 3;
#[cfg(target_arch = "aarch64")]
const GROUP: usize = 8;

/// Whether this CPU has the instructions.
pub(super) fn available() -> bool {
    Native::available() && Row::available()
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

/// What the kernel needs of an instruction set: `LANES` f32 accumulators a register, and a dot
/// product of bf16 pairs into them.
///
/// # Safety
/// Every function may be called only inside a function built with the set's target features
/// (`PanelTask::run` and `RowGroup::run`), on a CPU for which `available` holds.
trait Dot {
    const LANES: usize;
    type Acc: Copy;
    type Pairs: Copy;
    /// Which of a register's lanes are real columns.
    type Mask: Copy;

    fn available() -> bool;

    /// The first `cols` lanes (all of them from `LANES` on).
    fn mask(cols: usize) -> Self::Mask;

    /// # Safety
    /// See the trait.
    unsafe fn zero() -> Self::Acc;

    /// The real lanes of `m` from `p`, zero elsewhere.
    ///
    /// # Safety
    /// See the trait; `p` is readable for the real lanes.
    unsafe fn load_masked(p: *const f32, m: Self::Mask) -> Self::Acc;

    /// `LANES` columns' pairs (`2 LANES` bf16 values) at `p`.
    ///
    /// # Safety
    /// See the trait; `2 LANES` values are readable at `p`.
    unsafe fn load_pairs(p: *const u16) -> Self::Pairs;

    /// A row's pair in every lane.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn broadcast(pair: u32) -> Self::Pairs;

    /// `acc` plus, in each lane, the products of its two pairs.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn dot(acc: Self::Acc, x: Self::Pairs, w: Self::Pairs) -> Self::Acc;

    /// Stores the real lanes of `m` at `p`.
    ///
    /// # Safety
    /// See the trait; `p` is writable for the real lanes.
    unsafe fn store_masked(p: *mut f32, m: Self::Mask, v: Self::Acc);

    /// Asks for the cache line at `p` to be brought into L2; never faults, may do nothing.
    fn prefetch_l2(p: *const u8);
}

/// AVX-512 BF16 (Intel from Cooper Lake, AMD from Zen 4).
#[cfg(target_arch = "x86_64")]
struct Avx512Bf16;

#[cfg(target_arch = "x86_64")]
impl Dot for Avx512Bf16 {
    const LANES: usize = 16;
    type Acc = std::arch::x86_64::__m512;
    type Pairs = std::arch::x86_64::__m512bh;
    type Mask = std::arch::x86_64::__mmask16;

    fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    #[inline(always)]
    fn mask(cols: usize) -> Self::Mask {
        ((1u32 << cols.min(16)) - 1) as Self::Mask
    }

    #[inline(always)]
    unsafe fn zero() -> Self::Acc {
        // SAFETY: AVX-512F (the trait's contract).
        unsafe { std::arch::x86_64::_mm512_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const f32, m: Self::Mask) -> Self::Acc {
        // SAFETY: the masked load touches only the real lanes (the contract).
        unsafe { std::arch::x86_64::_mm512_maskz_loadu_ps(m, p) }
    }

    #[inline(always)]
    unsafe fn load_pairs(p: *const u16) -> Self::Pairs {
        use std::arch::x86_64::*;
        // SAFETY: 64 bytes are readable (the contract); `__m512bh` and `__m512i` are both 64
        // plain bytes.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) }
    }

    #[inline(always)]
    unsafe fn broadcast(pair: u32) -> Self::Pairs {
        use std::arch::x86_64::*;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32)) }
    }

    #[inline(always)]
    unsafe fn dot(acc: Self::Acc, x: Self::Pairs, w: Self::Pairs) -> Self::Acc {
        // SAFETY: AVX-512 BF16 (the contract).
        unsafe { std::arch::x86_64::_mm512_dpbf16_ps(acc, x, w) }
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: Self::Mask, v: Self::Acc) {
        // SAFETY: the masked store touches only the real lanes (the contract).
        unsafe { std::arch::x86_64::_mm512_mask_storeu_ps(p, m, v) }
    }

    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        use std::arch::x86_64::*;
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
    }
}

/// AVX-512 BF16 on 256-bit vectors (with AVX-512VL), for the single-row loop: on Zen 4 a
/// stream of 512-bit loads from memory runs slower than one of 256-bit loads. The same
/// instruction on 8 lanes, so each output element gets the same products in the same order.
#[cfg(target_arch = "x86_64")]
struct Avx512Bf16Ymm;

#[cfg(target_arch = "x86_64")]
impl Dot for Avx512Bf16Ymm {
    const LANES: usize = 8;
    type Acc = std::arch::x86_64::__m256;
    type Pairs = std::arch::x86_64::__m256bh;
    type Mask = std::arch::x86_64::__mmask8;

    fn available() -> bool {
        Avx512Bf16::available() && std::arch::is_x86_feature_detected!("avx512vl")
    }

    #[inline(always)]
    fn mask(cols: usize) -> Self::Mask {
        ((1u32 << cols.min(8)) - 1) as Self::Mask
    }

    #[inline(always)]
    unsafe fn zero() -> Self::Acc {
        // SAFETY: AVX (implied by AVX-512F, the trait's contract).
        unsafe { std::arch::x86_64::_mm256_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const f32, m: Self::Mask) -> Self::Acc {
        // SAFETY: the masked load touches only the real lanes (the contract).
        unsafe { std::arch::x86_64::_mm256_maskz_loadu_ps(m, p) }
    }

    #[inline(always)]
    unsafe fn load_pairs(p: *const u16) -> Self::Pairs {
        use std::arch::x86_64::*;
        // SAFETY: 32 bytes are readable (the contract); `__m256bh` and `__m256i` are both 32
        // plain bytes.
        unsafe { std::mem::transmute::<__m256i, __m256bh>(_mm256_loadu_si256(p as *const __m256i)) }
    }

    #[inline(always)]
    unsafe fn broadcast(pair: u32) -> Self::Pairs {
        use std::arch::x86_64::*;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<__m256i, __m256bh>(_mm256_set1_epi32(pair as i32)) }
    }

    #[inline(always)]
    unsafe fn dot(acc: Self::Acc, x: Self::Pairs, w: Self::Pairs) -> Self::Acc {
        // SAFETY: AVX-512 BF16 and VL (the contract).
        unsafe { std::arch::x86_64::_mm256_dpbf16_ps(acc, x, w) }
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: Self::Mask, v: Self::Acc) {
        // SAFETY: the masked store touches only the real lanes (the contract).
        unsafe { std::arch::x86_64::_mm256_mask_storeu_ps(p, m, v) }
    }

    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        Avx512Bf16::prefetch_l2(p)
    }
}

/// The BF16 extension of Armv8.6 (optional from Armv8.2): Neoverse V1, V2 and N2, Ampere One,
/// Apple M2 and later.
#[cfg(target_arch = "aarch64")]
struct NeonBf16;

#[cfg(target_arch = "aarch64")]
impl Dot for NeonBf16 {
    const LANES: usize = 4;
    type Acc = std::arch::aarch64::float32x4_t;
    type Pairs = std::arch::aarch64::uint32x4_t;
    /// The number of real lanes.
    type Mask = usize;

    fn available() -> bool {
        std::arch::is_aarch64_feature_detected!("neon") && std::arch::is_aarch64_feature_detected!("bf16")
    }

    #[inline(always)]
    fn mask(cols: usize) -> usize {
        cols.min(4)
    }

    #[inline(always)]
    unsafe fn zero() -> Self::Acc {
        // SAFETY: NEON (the trait's contract).
        unsafe { std::arch::aarch64::vdupq_n_f32(0.0) }
    }

    #[inline(always)]
    unsafe fn load_masked(p: *const f32, m: usize) -> Self::Acc {
        use std::arch::aarch64::*;
        // SAFETY: a whole register is read only when all four lanes are real; otherwise the
        // real ones are copied (the contract).
        unsafe {
            if m == 4 {
                return vld1q_f32(p);
            }
            let mut v = [0.0f32; 4];
            std::ptr::copy_nonoverlapping(p, v.as_mut_ptr(), m);
            vld1q_f32(v.as_ptr())
        }
    }

    #[inline(always)]
    unsafe fn load_pairs(p: *const u16) -> Self::Pairs {
        use std::arch::aarch64::*;
        // SAFETY: 16 bytes are readable (the contract).
        unsafe { vreinterpretq_u32_u16(vld1q_u16(p)) }
    }

    #[inline(always)]
    unsafe fn broadcast(pair: u32) -> Self::Pairs {
        // SAFETY: NEON (the contract).
        unsafe { std::arch::aarch64::vdupq_n_u32(pair) }
    }

    #[inline(always)]
    unsafe fn dot(mut acc: Self::Acc, x: Self::Pairs, w: Self::Pairs) -> Self::Acc {
        // SAFETY: `BFDOT` only reads and writes these registers; the CPU has the BF16
        // extension, and the function this is inlined into enables it (the contract).
        unsafe {
            std::arch::asm!(
                "bfdot {acc:v}.4s, {x:v}.8h, {w:v}.8h",
                acc = inout(vreg) acc,
                x = in(vreg) x,
                w = in(vreg) w,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        acc
    }

    #[inline(always)]
    unsafe fn store_masked(p: *mut f32, m: usize, v: Self::Acc) {
        use std::arch::aarch64::*;
        // SAFETY: as in `load_masked`.
        unsafe {
            if m == 4 {
                return vst1q_f32(p, v);
            }
            let mut out = [0.0f32; 4];
            vst1q_f32(out.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(out.as_ptr(), p, m);
        }
    }

    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address, and touches no register but
        // its address operand.
        unsafe { std::arch::asm!("prfm pldl2keep, [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly)) }
    }
}

/// The instruction set of this architecture.
#[cfg(target_arch = "x86_64")]
type Native = Avx512Bf16;
#[cfg(target_arch = "aarch64")]
type Native = NeonBf16;
/// The single-row loop's: 256-bit vectors on x86-64 (four a panel row), NEON's (two).
#[cfg(target_arch = "x86_64")]
type Row = Avx512Bf16Ymm;
#[cfg(target_arch = "aarch64")]
type Row = NeonBf16;
/// Registers a panel row takes in the single-row loop.
const ROW_REGS: usize = NR / Row::LANES;

type Acc = <Native as Dot>::Acc;
type Mask = <Native as Dot>::Mask;

/// The masks of a panel's real columns in its two registers.
#[inline(always)]
fn masks(cols: usize) -> [Mask; 2] {
    let lanes = Native::LANES;
    [Native::mask(cols.min(lanes)), Native::mask(cols.saturating_sub(lanes).min(lanes))]
}

/// The accumulators' starting values: the bias of the real columns, zero elsewhere.
///
/// # Safety
/// As [`Dot`]'s; `bias`, when given, holds the real columns `masks` covers.
#[inline(always)]
unsafe fn start(bias: Option<&[f32]>, m: [Mask; 2]) -> [Acc; 2] {
    // SAFETY: the masked loads touch only the real columns, inside `bias` (the contract).
    unsafe {
        match bias {
            Some(b) => [Native::load_masked(b.as_ptr(), m[0]), Native::load_masked(b.as_ptr().wrapping_add(Native::LANES), m[1])],
            None => [Native::zero(); 2],
        }
    }
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
    /// [`available`] holds; `out` holds the chunk's rows at stride `out_rs`
    /// with at least `cols` columns each, written by this task alone.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16"))]
    #[cfg_attr(target_arch = "aarch64", target_feature(enable = "neon,bf16"))]
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
    start: [Acc; 2],
    masks: [Mask; 2],
    /// Where to prefetch from, and every how many iterations.
    prefetch: (*const u16, usize),
}

impl Tile {
    /// # Safety
    /// As [`Dot`]'s (inlined only into [`PanelTask::run`]); the pointers
    /// hold what the fields say; `out` points at `M` rows, `out_rs` apart, with the real
    /// columns writable.
    #[inline(always)]
    unsafe fn run<const M: usize>(&self, out: *mut f32, out_rs: usize) {
        let mut acc = [self.start; M];
        let (mut pf, every) = (self.prefetch.0 as *const u8, self.prefetch.1);
        let mut count = 0usize;
        // SAFETY: reads are x[kp * MR + i] for i < M <= MR, kp < k2, and w[kp * 2 NR .. + 2 NR]
        // (the contract); prefetches never fault; the stores are masked to the real columns.
        unsafe {
            for kp in 0..self.k2 {
                count += 1;
                if count == every {
                    count = 0;
                    // One pair row of the panel: 4 NR bytes.
                    for line in (0..4 * NR).step_by(64) {
                        Native::prefetch_l2(pf.wrapping_add(line));
                    }
                    pf = pf.wrapping_add(4 * NR);
                }
                let w0 = Native::load_pairs(self.w.add(kp * 2 * NR));
                let w1 = Native::load_pairs(self.w.add(kp * 2 * NR + NR));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = Native::broadcast(*self.x.add(kp * MR + i));
                    a[0] = Native::dot(a[0], xv, w0);
                    a[1] = Native::dot(a[1], xv, w1);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let row = out.add(i * out_rs);
                Native::store_masked(row, self.masks[0], a[0]);
                Native::store_masked(row.wrapping_add(Native::LANES), self.masks[1], a[1]);
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
    /// [`available`] holds; the output row from `out` on holds `cols`
    /// values, the group's columns written by this task alone.
    #[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx512f,avx512bf16,avx512vl"))]
    #[cfg_attr(target_arch = "aarch64", target_feature(enable = "neon,bf16"))]
    unsafe fn run(self, group: usize) {
        assert!((1..=GROUP).contains(&group), "a group of {group} panels");
        // SAFETY: forwarded.
        unsafe {
            match group {
                #[cfg(target_arch = "aarch64")]
                8 => self.side_by_side::<8>(),
                #[cfg(target_arch = "aarch64")]
                7 => self.side_by_side::<7>(),
                #[cfg(target_arch = "aarch64")]
                6 => self.side_by_side::<6>(),
                #[cfg(target_arch = "aarch64")]
                5 => self.side_by_side::<5>(),
                #[cfg(target_arch = "aarch64")]
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
        let (k2, lanes) = (self.k2, Row::LANES);
        assert!(self.panels.len() >= G * k2 * 2 * NR && self.x.len() >= k2 && self.cols > (G - 1) * NR);
        // The real columns of panel g's register j.
        let m: [[<Row as Dot>::Mask; ROW_REGS]; G] =
            std::array::from_fn(|g| std::array::from_fn(|j| Row::mask(NR.min(self.cols - g * NR).saturating_sub(j * lanes))));
        let mut acc: [[<Row as Dot>::Acc; ROW_REGS]; G] = std::array::from_fn(|g| {
            // SAFETY: the masked loads read only real columns, inside the bias (which runs to
            // the row's end); the target features are this function's caller's (the contract).
            std::array::from_fn(|j| unsafe {
                match self.bias {
                    Some(b) => Row::load_masked(b.as_ptr().wrapping_add(g * NR + j * lanes), m[g][j]),
                    None => Row::zero(),
                }
            })
        });
        let w = self.panels.as_ptr();
        // SAFETY: reads are x[kp] for kp < k2 and panel g's pairs kp, w[g * k2 * 2 NR + kp * 2
        // NR .. + 2 NR] for g < G (checked above); the stores are masked to the real columns.
        unsafe {
            for kp in 0..k2 {
                let xv = Row::broadcast(*self.x.as_ptr().add(kp));
                for (g, a) in acc.iter_mut().enumerate() {
                    let p = w.add(g * k2 * 2 * NR + kp * 2 * NR);
                    for (j, a) in a.iter_mut().enumerate() {
                        *a = Row::dot(*a, xv, Row::load_pairs(p.add(2 * j * lanes)));
                    }
                }
            }
            for (g, a) in acc.iter().enumerate() {
                for (j, &v) in a.iter().enumerate() {
                    Row::store_masked(self.out.0.add(g * NR + j * lanes), m[g][j], v);
                }
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
