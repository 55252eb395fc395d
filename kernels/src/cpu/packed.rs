//! The CPU matmul: `out[rows, n] = x[rows, k] · Wᵀ (+ bias)`, one source for every instruction
//! set.
//!
//! The weight `[n, k]` is packed once, at load, into panels of `NR` output features (two vector
//! registers of the path it is packed for): `panel[p][kk][j] = W[p * NR + j][kk]` (zero beyond
//! `n`). A panel is read front to back, which streams memory at full bandwidth when one row is
//! multiplied, and stays in L2 while blocks of `MR` activation rows reuse it when many are. Each
//! microkernel call computes an `MR x NR` tile in `2 * MR` accumulator registers: per `kk`, two
//! loads of the panel, one broadcast per row, and two FMAs per row. `MR` is 12 on paths with 32
//! vector registers (AVX-512, NEON) and 6 on those with 16 (AVX2).
//!
//! One to three rows (decode at batch 1 to 3) take another loop over the same panels, several
//! side by side, to keep more loads in flight, on 256-bit vectors on AVX-512 (see
//! [`few_rows`]).
//!
//! Every output element is accumulated in the same order (bias, then `kk = 0, 1, ..`) whatever
//! the tile height, and in the few-rows loop, so a row's result does not depend on which other
//! rows share its batch, on every path.

use rayon::prelude::*;

use super::isa::{Isa, Kernel, Path};
use super::simd::Elem;
use super::{MatmulInputs, OutPtr, min_items};
use crate::WeightData;

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod pairs;

/// Activation rows kept hot in L2 while every panel passes over them.
const ROW_CHUNK: usize = 96;
/// The largest tile height of any path.
const MAX_MR: usize = 12;

/// Batches of at most this many rows take [`few_rows`] instead of tiles: on a 2-core AVX2
/// machine two rows there took 0.25x to 0.6x the time of a two-row tile on weights in cache and
/// 0.4x to 0.85x on weights in memory; three rows, once in two passes, were no faster than a
/// tile, and now take one pass.
const FEW_ROWS: usize = 3;

/// Tile height on `path`.
fn mr(path: Path) -> usize {
    if path.registers() >= 32 { MAX_MR } else { 6 }
}

/// Panel storage of one element type, starting on a 64-byte boundary so that every vector load
/// of a panel row stays within as few cache lines as it can.
#[derive(Debug, Clone)]
struct Aligned<T> {
    storage: Vec<T>,
    offset: usize,
    len: usize,
}

impl<T: Copy + Default + Send + Sync> Aligned<T> {
    /// `len` zeros (`T::default()`), on huge pages where the OS gives them.
    fn zeroed(len: usize) -> Self {
        let pad = 64 / std::mem::size_of::<T>();
        let mut storage: Vec<T> = Vec::with_capacity(len + pad);
        super::advise_huge_pages(storage.spare_capacity_mut());
        storage.resize(len + pad, T::default());
        let offset = storage.as_ptr().align_offset(64).min(pad);
        Aligned { storage, offset, len }
    }

    /// Packs `w` (`[n, k]`, row-major) into `nr`-wide panels.
    fn pack(w: &[T], n: usize, k: usize, nr: usize) -> Self {
        let mut out = Self::zeroed(n.div_ceil(nr) * k * nr);
        out.as_mut_slice().par_chunks_mut(k * nr).enumerate().for_each(|(p, panel)| {
            for j in 0..nr.min(n - p * nr) {
                let row = &w[(p * nr + j) * k..(p * nr + j + 1) * k];
                for (kk, &v) in row.iter().enumerate() {
                    panel[kk * nr + j] = v;
                }
            }
        });
        out
    }

    fn as_slice(&self) -> &[T] {
        &self.storage[self.offset..self.offset + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.storage[self.offset..self.offset + self.len]
    }
}

/// The panels in the element type the weight was loaded in: half-precision weights stay
/// half-size and are widened in registers as they are read.
#[derive(Debug, Clone)]
enum Data {
    F32(Aligned<f32>),
    Bf16(Aligned<u16>),
    F16(Aligned<half::f16>),
    /// bf16 weights in pairs of inputs, for the bf16 dot-product kernel (`pairs`).
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    Bf16Pairs(Aligned<u16>),
}

/// A weight packed into panels for one instruction set.
#[derive(Debug, Clone)]
pub struct Panels {
    data: Data,
    /// The path the panels were packed for (their width is two of its registers).
    path: Path,
    nr: usize,
    /// Round the activations to bf16 before the generic kernels multiply them (bf16 inputs
    /// asked for where the CPU has no bf16 dot product).
    round_inputs: bool,
}

impl Panels {
    /// Bytes the panels take.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Data::F32(d) => 4 * d.len,
            Data::Bf16(d) => 2 * d.len,
            Data::F16(d) => 2 * d.len,
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            Data::Bf16Pairs(d) => 2 * d.len,
        }
    }
}

/// The bf16 dot-product instruction of this architecture, as benchmarks print it.
#[cfg(target_arch = "x86_64")]
pub const BF16_DOT: &str = "AVX-512 BF16";
#[cfg(target_arch = "aarch64")]
pub const BF16_DOT: &str = "BF16 (BFDOT)";
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub const BF16_DOT: &str = "no bf16";

/// Whether `path` multiplies bf16 weights with a bf16 dot-product instruction when asked for
/// bf16 inputs (AVX-512 BF16, or NEON with Arm's BF16 extension); elsewhere the inputs are
/// rounded and widened again.
pub fn bf16_dot(path: Path) -> bool {
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512(_) => pairs::available(),
        #[cfg(target_arch = "aarch64")]
        Path::Neon(_) => pairs::available(),
        _ => false,
    }
}

/// Packs `w` (`[n, k]`, row-major) into panels for `path`, in `w`'s own element type. With
/// bf16 `inputs`, a bf16 weight is packed for the bf16 dot product where `path` has one.
pub fn pack(path: Path, w: WeightData<'_>, n: usize, k: usize, inputs: MatmulInputs) -> Panels {
    let nr = 2 * path.lanes();
    let bf16_inputs = inputs == MatmulInputs::Bf16 && matches!(w, WeightData::Bf16(_));
    let data = match w {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        WeightData::Bf16(w) if bf16_inputs && bf16_dot(path) => {
            return Panels { data: Data::Bf16Pairs(pairs::pack(w, n, k)), path, nr: pairs::NR, round_inputs: false };
        }
        WeightData::F32(w) => Data::F32(Aligned::pack(w, n, k, nr)),
        WeightData::Bf16(w) => Data::Bf16(Aligned::pack(w, n, k, nr)),
        WeightData::F16(w) => Data::F16(Aligned::pack(w, n, k, nr)),
    };
    Panels { data, path, nr, round_inputs: bf16_inputs }
}

/// `out[rows, n] = x[rows, k] · Wᵀ (+ bias)` with `panels` from [`pack`]. The caller has checked
/// every length: `x.len() >= rows * k`, `out.len() >= rows * n`, `bias.len() >= n`, and that
/// the panels were packed for `[n, k]`.
pub fn matmul(x: &[f32], panels: &Panels, bias: Option<&[f32]>, out: &mut [f32], rows: usize, k: usize, n: usize) {
    let rounded: Vec<f32>;
    let x = if panels.round_inputs {
        rounded = x[..rows * k].par_iter().with_min_len(min_items(1)).map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        &rounded[..]
    } else {
        x
    };
    match &panels.data {
        Data::F32(d) => matmul_typed(x, d.as_slice(), panels, bias, out, rows, k, n),
        Data::Bf16(d) => matmul_typed(x, d.as_slice(), panels, bias, out, rows, k, n),
        Data::F16(d) => matmul_typed(x, d.as_slice(), panels, bias, out, rows, k, n),
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        Data::Bf16Pairs(d) => pairs::matmul(x, d.as_slice(), bias, out, rows, k, n),
    }
}

#[allow(clippy::too_many_arguments)] // `matmul`'s operands with the panels' typed data
fn matmul_typed<E: Elem + Send + Sync>(x: &[f32], packed: &[E], panels: &Panels, bias: Option<&[f32]>, out: &mut [f32], rows: usize, k: usize, n: usize) {
    let (nr, path) = (panels.nr, panels.path);
    assert!(x.len() >= rows * k && out.len() >= rows * n && packed.len() == n.div_ceil(nr) * k * nr);
    assert!(bias.is_none_or(|b| b.len() >= n));
    let mr = mr(path);
    let dst = OutPtr(out.as_mut_ptr());
    let count = n.div_ceil(nr);
    if rows <= FEW_ROWS {
        few_rows(x, packed, panels, bias, out, rows, k, n);
        return;
    }
    let mut xp = Vec::new();
    for r0 in (0..rows).step_by(ROW_CHUNK) {
        let chunk_rows = ROW_CHUNK.min(rows - r0);
        pack_rows(&x[r0 * k..(r0 + chunk_rows) * k], k, mr, &mut xp);
        let xp = &xp[..];
        (0..count).into_par_iter().with_min_len(min_items(chunk_rows * k * nr)).for_each(|p| {
            let cols = nr.min(n - p * nr);
            path.run(PanelTask {
                xp,
                panel: &packed[p * k * nr..(p + 1) * k * nr],
                next: &packed[((p + 1) % count) * k * nr..][..k * nr],
                bias: bias.map(|b| &b[p * nr..p * nr + cols]),
                // SAFETY: column p * nr of row r0 lies inside out (rows * n elements).
                out: unsafe { dst.at(r0 * n + p * nr) },
                out_rs: n,
                rows: chunk_rows,
                cols,
                k,
                mr,
            });
        });
    }
}

/// Packs rows of `x` (`[rows, k]`) in blocks of `mr`, interleaved: `out[block][kk][i] =
/// x[block * mr + i][kk]`, zero beyond the last row. The kernel then reads one sequential stream
/// instead of `mr` rows `k` floats apart (which, for power-of-two `k`, collide in L1 sets).
fn pack_rows(x: &[f32], k: usize, mr: usize, out: &mut Vec<f32>) {
    let rows = x.len() / k;
    let blocks = rows.div_ceil(mr);
    out.clear();
    out.resize(blocks * k * mr, 0.0);
    out.par_chunks_mut(k * mr).with_min_len(min_items(k * mr)).enumerate().for_each(|(b, block)| {
        for i in 0..mr.min(rows - b * mr) {
            let row = &x[(b * mr + i) * k..(b * mr + i + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                block[kk * mr + i] = v;
            }
        }
    });
}

/// Every tile of one panel against one chunk of packed rows.
struct PanelTask<'a, E> {
    xp: &'a [f32],
    panel: &'a [E],
    /// The panel to fetch into L2 meanwhile.
    next: &'a [E],
    bias: Option<&'a [f32]>,
    /// The chunk's first row, at this panel's first column.
    out: OutPtr,
    out_rs: usize,
    rows: usize,
    cols: usize,
    k: usize,
    mr: usize,
}

impl<E: Elem> Kernel for PanelTask<'_, E> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        let PanelTask { xp, panel, next, bias, out, out_rs, rows, cols, k, mr } = self;
        let nr = 2 * S::F32_LANES;
        let tiles = xp.len() / (k * mr);
        for (b, block) in xp.chunks_exact(k * mr).enumerate() {
            let m = mr.min(rows - b * mr);
            // Tile t of T prefetches rows t*k/T .. (t+1)*k/T of the next panel, one row every
            // T iterations.
            let prefetch = Prefetch { from: next[b * k / tiles * nr..].as_ptr() as *const u8, every: tiles, row_bytes: nr * std::mem::size_of::<E>() };
            let tile = Tile { x: block, w: panel, mr, k, bias, cols, prefetch };
            // SAFETY: rows b*mr .. b*mr + m of this chunk lie inside the output, and this
            // panel's task alone writes its columns.
            let out = unsafe { out.at(b * mr * out_rs) }.0;
            // SAFETY: the tile's contract holds: `block` is k x mr packed rows, `panel` k x nr,
            // and the output rows hold `cols` columns at stride out_rs.
            unsafe {
                match m {
                    1 => tile.run::<S, 1>(s, out, out_rs),
                    2 => tile.run::<S, 2>(s, out, out_rs),
                    3 => tile.run::<S, 3>(s, out, out_rs),
                    4 => tile.run::<S, 4>(s, out, out_rs),
                    5 => tile.run::<S, 5>(s, out, out_rs),
                    6 => tile.run::<S, 6>(s, out, out_rs),
                    7 => tile.run::<S, 7>(s, out, out_rs),
                    8 => tile.run::<S, 8>(s, out, out_rs),
                    9 => tile.run::<S, 9>(s, out, out_rs),
                    10 => tile.run::<S, 10>(s, out, out_rs),
                    11 => tile.run::<S, 11>(s, out, out_rs),
                    _ => tile.run::<S, MAX_MR>(s, out, out_rs),
                }
            }
        }
    }
}

/// One to three rows times the weight (decode at a small batch, bound by how fast the panels
/// stream from memory). A tile keeps one panel streaming at a time, which leaves most of the
/// memory bandwidth unused; here each task walks `G` neighbouring panels side by side for every
/// row (`W R G` accumulators for panels `W` registers wide, `G` streams), so that the weight is
/// read once at a rate near the machine's. Every output element still starts from its bias and adds `kk = 0, 1, ..` in
/// order, exactly as in a tile, so a row's result is the same bits as when it shares a batch of
/// any size.
#[allow(clippy::too_many_arguments)] // `matmul`'s operands with the panels' typed data
fn few_rows<E: Elem + Send + Sync>(x: &[f32], packed: &[E], panels: &Panels, bias: Option<&[f32]>, out: &mut [f32], rows: usize, k: usize, n: usize) {
    debug_assert!((1..=FEW_ROWS).contains(&rows), "few_rows takes one to three rows, not {rows}");
    let (nr, path) = (panels.nr, panels.path);
    let count = n.div_ceil(nr);
    // Panels side by side for one, two and three rows: the accumulators and the rows'
    // broadcasts fit in the registers. AVX-512 panels are walked with 256-bit vectors, four to a panel row
    // (see `Path::run_256`): on Zen 4 that streams the weight 10-15% faster than 512-bit loads,
    // at any number of panels side by side, and as fast as the AVX2 kernel does.
    let narrow = nr > 2 * path.lanes_256();
    let most = match (narrow, path.registers() >= 32) {
        (true, _) => [3, 3, 2],
        (false, true) => [8, 6, 4],
        (false, false) => [6, 3, 2],
    };
    // Every thread gets at least one group: a small weight is not left to one thread.
    let per = count.div_ceil(rayon::current_num_threads()).clamp(1, most[rows - 1]);
    let groups = count.div_ceil(per);
    let dst = OutPtr(out.as_mut_ptr());
    (0..groups).into_par_iter().with_min_len(min_items(rows * per * k * nr)).for_each(|g| {
        let p0 = g * per;
        let group = per.min(count - p0);
        let rg = RowsGroup {
            x,
            rows,
            nr,
            panels: &packed[p0 * k * nr..(p0 + group) * k * nr],
            bias: bias.map(|b| &b[p0 * nr..n]),
            // SAFETY: column p0 * nr of the first row lies inside out (rows * n elements).
            out: unsafe { dst.at(p0 * nr) },
            out_rs: n,
            cols: n - p0 * nr,
            k,
            group,
        };
        path.run_256(rg)
    });
}

/// One to three rows against `group` neighbouring panels (at most 8, 6 and 4 for one, two and
/// three rows with 32 registers, 6, 3 and 2 with 16; 3, 3 and 2 when the panels are four of
/// the kernel's registers wide).
struct RowsGroup<'a, E> {
    /// The rows, `k` values each, one after the other.
    x: &'a [f32],
    rows: usize,
    /// Panel width: two of the kernel's registers, or four (AVX-512 panels on 256-bit vectors).
    nr: usize,
    panels: &'a [E],
    /// The bias from the group's first column on.
    bias: Option<&'a [f32]>,
    /// The first row's output at the group's first column.
    out: OutPtr,
    /// Distance between output rows.
    out_rs: usize,
    /// Output columns from the group's first one to the end of the row.
    cols: usize,
    k: usize,
    group: usize,
}

impl<E: Elem> Kernel for RowsGroup<'_, E> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        // 32-wide AVX-512 panels walked with 256-bit vectors: four registers a panel row.
        if self.nr == 4 * S::F32_LANES {
            match (self.rows, self.group) {
                (1, 3) => self.side_by_side::<S, 1, 3, 4>(s),
                (1, 2) => self.side_by_side::<S, 1, 2, 4>(s),
                (1, _) => self.side_by_side::<S, 1, 1, 4>(s),
                (2, 3) => self.side_by_side::<S, 2, 3, 4>(s),
                (2, 2) => self.side_by_side::<S, 2, 2, 4>(s),
                (2, _) => self.side_by_side::<S, 2, 1, 4>(s),
                (_, 2) => self.side_by_side::<S, 3, 2, 4>(s),
                (_, _) => self.side_by_side::<S, 3, 1, 4>(s),
            }
            return;
        }
        match (self.rows, self.group) {
            (1, 8) => self.side_by_side::<S, 1, 8, 2>(s),
            (1, 7) => self.side_by_side::<S, 1, 7, 2>(s),
            (1, 6) => self.side_by_side::<S, 1, 6, 2>(s),
            (1, 5) => self.side_by_side::<S, 1, 5, 2>(s),
            (1, 4) => self.side_by_side::<S, 1, 4, 2>(s),
            (1, 3) => self.side_by_side::<S, 1, 3, 2>(s),
            (1, 2) => self.side_by_side::<S, 1, 2, 2>(s),
            (1, _) => self.side_by_side::<S, 1, 1, 2>(s),
            (2, 6) => self.side_by_side::<S, 2, 6, 2>(s),
            (2, 5) => self.side_by_side::<S, 2, 5, 2>(s),
            (2, 4) => self.side_by_side::<S, 2, 4, 2>(s),
            (2, 3) => self.side_by_side::<S, 2, 3, 2>(s),
            (2, 2) => self.side_by_side::<S, 2, 2, 2>(s),
            (2, _) => self.side_by_side::<S, 2, 1, 2>(s),
            (_, 4) => self.side_by_side::<S, 3, 4, 2>(s),
            (_, 3) => self.side_by_side::<S, 3, 3, 2>(s),
            (_, 2) => self.side_by_side::<S, 3, 2, 2>(s),
            (_, _) => self.side_by_side::<S, 3, 1, 2>(s),
        }
    }
}

impl<E: Elem> RowsGroup<'_, E> {
    #[inline(always)]
    fn side_by_side<S: Isa, const R: usize, const G: usize, const W: usize>(&self, s: S) {
        let lanes = S::F32_LANES;
        let nr = W * lanes;
        let k = self.k;
        // Real columns of panel g in each of its W registers.
        let part = |g: usize, j: usize| nr.min(self.cols - g * nr).saturating_sub(j * lanes).min(lanes);
        let start: [[S::f32s; W]; G] = std::array::from_fn(|g| match self.bias {
            Some(b) => std::array::from_fn(|j| {
                let from = g * nr + j * lanes;
                s.partial_load_f32s(&b[from.min(b.len())..from.min(b.len()) + part(g, j)])
            }),
            None => [s.splat_f32s(0.0); W],
        });
        let mut acc = [start; R];
        assert!(self.nr == nr && self.rows == R && self.group == G && self.panels.len() >= G * k * nr && self.x.len() >= R * k && self.cols > (G - 1) * nr);
        let (x, w) = (self.x.as_ptr(), self.panels.as_ptr());
        // SAFETY: reads are x[r * k + kk] for r < R, kk < k, and panel g's row kk, w[g * k * nr
        // + kk * nr .. + nr] for g < G (checked above); the writes are panel g's real columns
        // of the R output rows, which only this task writes.
        unsafe {
            for kk in 0..k {
                let xv: [S::f32s; R] = std::array::from_fn(|r| s.splat_f32s(*x.add(r * k + kk)));
                for g in 0..G {
                    let p = w.add(g * k * nr + kk * nr);
                    let wv: [S::f32s; W] = std::array::from_fn(|j| E::load(s, p.add(j * lanes)));
                    // Each panel row is loaded once and used for every row.
                    for (row_acc, &xr) in acc.iter_mut().zip(&xv) {
                        let a = &mut row_acc[g];
                        for j in 0..W {
                            a[j] = s.mul_add_e_f32s(xr, wv[j], a[j]);
                        }
                    }
                }
            }
            for (r, row_acc) in acc.iter().enumerate() {
                for (g, a) in row_acc.iter().enumerate() {
                    for (j, &v) in a.iter().enumerate() {
                        let c = part(g, j);
                        if c > 0 {
                            let row = std::slice::from_raw_parts_mut(self.out.0.add(r * self.out_rs + g * nr + j * lanes), c);
                            s.partial_store_f32s(row, v);
                        }
                    }
                }
            }
        }
    }
}

/// Panel rows to pull into L2 during a tile: one row (`row_bytes`) every `every` iterations,
/// from `from`.
#[derive(Clone, Copy)]
struct Prefetch {
    from: *const u8,
    every: usize,
    row_bytes: usize,
}

/// One `M x NR` tile: packed rows `x` (`k x mr`), a panel `w` (`k x NR`), the bias of its
/// columns, and how many of the panel's columns are real.
struct Tile<'a, E> {
    x: &'a [f32],
    w: &'a [E],
    mr: usize,
    k: usize,
    bias: Option<&'a [f32]>,
    cols: usize,
    prefetch: Prefetch,
}

impl<E: Elem> Tile<'_, E> {
    /// # Safety
    /// `out` points at `M` rows of at least `cols` writable floats, `out_rs` apart; `x` holds
    /// `k * mr` values with `M <= mr`; `w` holds `k * 2 * S::F32_LANES`.
    #[inline(always)]
    unsafe fn run<S: Isa, const M: usize>(&self, s: S, out: *mut f32, out_rs: usize) {
        let lanes = S::F32_LANES;
        let nr = 2 * lanes;
        let (lo_cols, hi_cols) = (self.cols.min(lanes), self.cols.saturating_sub(lanes));
        let start = match self.bias {
            Some(b) => [s.partial_load_f32s(&b[..lo_cols]), s.partial_load_f32s(&b[lo_cols..lo_cols + hi_cols])],
            None => [s.splat_f32s(0.0); 2],
        };
        let mut acc = [start; M];
        let (x, w, mr) = (self.x.as_ptr(), self.w.as_ptr(), self.mr);
        assert!(self.x.len() >= self.k * mr && self.w.len() >= self.k * nr && M <= mr);
        let (mut pf, mut pf_count) = (self.prefetch.from, 0usize);
        // SAFETY: reads are x[kk * mr + i] for i < M <= mr, kk < k, and w[kk * nr .. + nr]
        // (checked above); prefetches never fault; the writes stay in the contract's rows.
        unsafe {
            for kk in 0..self.k {
                pf_count += 1;
                if pf_count == self.prefetch.every {
                    pf_count = 0;
                    s.prefetch_l2(pf);
                    if self.prefetch.row_bytes > 64 {
                        s.prefetch_l2(pf.wrapping_add(64));
                    }
                    pf = pf.wrapping_add(self.prefetch.row_bytes);
                }
                let w0 = E::load(s, w.add(kk * nr));
                let w1 = E::load(s, w.add(kk * nr + lanes));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = s.splat_f32s(*x.add(kk * mr + i));
                    a[0] = s.mul_add_e_f32s(xv, w0, a[0]);
                    a[1] = s.mul_add_e_f32s(xv, w1, a[1]);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let row = std::slice::from_raw_parts_mut(out.add(i * out_rs), self.cols);
                let (lo, hi) = row.split_at_mut(lo_cols);
                s.partial_store_f32s(lo, a[0]);
                s.partial_store_f32s(hi, a[1]);
            }
        }
    }
}
