//! Vector helpers shared by the CPU kernels, written once over [`Isa`] and inlined into kernels
//! that [`Path::run`](super::isa::Path::run) compiles for each instruction set.
//!
//! Summation orders are fixed by the values and the path, never by how many rows share a call:
//! each row of [`dots`] has its own accumulator running over the elements in order, and each
//! element of [`axpys`] receives the rows in order. bf16 rows widen exactly to f32 as they are
//! loaded, so they give the same bits as f32 rows holding the same values.

use super::isa::{Isa, Kernel};

/// A bfloat16 (stored as its upper 16 bits) as f32: exact.
#[cfg(test)]
pub fn bf16_to_f32(v: u16) -> f32 {
    f32::from_bits((v as u32) << 16)
}

/// An element type rows are stored in, widened exactly to f32 as it is loaded.
pub trait Elem: Copy + Default + 'static {
    /// `F32_LANES` values from `p`.
    ///
    /// # Safety
    /// `p` must be valid for `S::F32_LANES` reads.
    unsafe fn load<S: Isa>(s: S, p: *const Self) -> S::f32s;

    /// The first `src.len() <= S::F32_LANES` lanes from `src`, zeros after.
    fn load_partial<S: Isa>(s: S, src: &[Self]) -> S::f32s;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<S: Isa>(_s: S, p: *const f32) -> S::f32s {
        // SAFETY: `F32_LANES` readable values (the contract); `f32s` is plain old data.
        unsafe { std::ptr::read_unaligned(p as *const S::f32s) }
    }

    #[inline(always)]
    fn load_partial<S: Isa>(s: S, src: &[f32]) -> S::f32s {
        s.partial_load_f32s(src)
    }
}

/// bfloat16, stored as its upper 16 bits: widening shifts them into place, exactly.
impl Elem for u16 {
    #[inline(always)]
    unsafe fn load<S: Isa>(s: S, p: *const u16) -> S::f32s {
        // SAFETY: forwarded from this function's contract.
        let bits = unsafe { s.load_u16(p) };
        s.transmute_f32s_u32s(s.wrapping_dyn_shl_u32s(bits, s.splat_u32s(16)))
    }

    #[inline(always)]
    fn load_partial<S: Isa>(s: S, src: &[u16]) -> S::f32s {
        let buf = padded(src);
        // SAFETY: `buf` holds 64 >= F32_LANES values.
        unsafe { Self::load(s, buf.as_ptr()) }
    }
}

/// IEEE half precision: widened exactly, subnormals, infinities and NaNs included.
impl Elem for half::f16 {
    #[inline(always)]
    unsafe fn load<S: Isa>(s: S, p: *const half::f16) -> S::f32s {
        // SAFETY: forwarded from this function's contract (f16 is 16 bits wide).
        let h = unsafe { s.load_u16(p as *const u16) };
        let magnitude = s.and_u32s(h, s.splat_u32s(0x7fff));
        let sign = s.wrapping_dyn_shl_u32s(s.and_u32s(h, s.splat_u32s(0x8000)), s.splat_u32s(16));
        // Exponent and mantissa moved to an f32's places read as a number 2^112 too small, for
        // normal and subnormal halves alike; the product is exact.
        let shifted = s.wrapping_dyn_shl_u32s(magnitude, s.splat_u32s(13));
        let scaled = s.transmute_u32s_f32s(s.mul_f32s(s.transmute_f32s_u32s(shifted), s.splat_f32s(f32::from_bits(0x7780_0000))));
        // A maximal exponent (infinity, NaN) keeps its mantissa under an f32's maximal exponent.
        let special = s.greater_than_or_equal_u32s(magnitude, s.splat_u32s(0x7c00));
        let value = s.select_u32s(special, s.or_u32s(shifted, s.splat_u32s(0x7f80_0000)), scaled);
        s.transmute_f32s_u32s(s.or_u32s(value, sign))
    }

    #[inline(always)]
    fn load_partial<S: Isa>(s: S, src: &[half::f16]) -> S::f32s {
        let buf = padded(src);
        // SAFETY: `buf` holds 64 >= F32_LANES values.
        unsafe { Self::load(s, buf.as_ptr()) }
    }
}

/// `src` (at most 64 values are kept) followed by zeros, 64 values in all.
#[inline(always)]
fn padded<T: Copy + Default>(src: &[T]) -> [T; 64] {
    let mut buf = [T::default(); 64];
    let n = src.len().min(64);
    buf[..n].copy_from_slice(&src[..n]);
    buf
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

/// Rows summed together in one pass over `x`: eight independent FMA chains.
const DOT_GROUP: usize = 8;

/// `out[r] = dot(x, rows[r])` (over `min(len(x), len(row))` elements) for every row.
#[inline(always)]
pub fn dots<S: Isa>(s: S, x: &[f32], rows: Rows<'_>, out: &mut [f32]) {
    match rows {
        Rows::F32(rows) => dots_rows(s, x, rows, out),
        Rows::Bf16(rows) => dots_rows(s, x, rows, out),
    }
}

#[inline(always)]
pub(super) fn dots_rows<S: Isa, E: Elem>(s: S, x: &[f32], rows: &[&[E]], out: &mut [f32]) {
    let count = rows.len().min(out.len());
    let mut r0 = 0;
    while r0 < count {
        let group = &rows[r0..(r0 + DOT_GROUP).min(count)];
        let out = &mut out[r0..r0 + group.len()];
        let n = group.iter().map(|r| r.len()).min().unwrap_or(0).min(x.len());
        if group.len() == DOT_GROUP && group.iter().all(|r| r.len().min(x.len()) == n) {
            dots_group::<S, E, DOT_GROUP>(s, x, group, n, out);
        } else {
            // A short group or rows of other lengths: one row at a time, each with its own n
            // and the same order of sums.
            for (o, r) in out.iter_mut().zip(group) {
                dots_group::<S, E, 1>(s, x, std::slice::from_ref(r), r.len().min(x.len()), std::slice::from_mut(o));
            }
        }
        r0 += group.len();
    }
}

/// `out[g] = Σ_{i < n} x[i] * rows[g][i]`: lane `j` of row `g`'s accumulator takes elements
/// `j, j + lanes, ..` in order; the lanes are reduced at the end.
#[inline(always)]
fn dots_group<S: Isa, E: Elem, const G: usize>(s: S, x: &[f32], rows: &[&[E]], n: usize, out: &mut [f32]) {
    let lanes = S::F32_LANES;
    let mut acc = [s.splat_f32s(0.0); G];
    let ptrs: [*const E; G] = std::array::from_fn(|g| rows[g].as_ptr());
    let mut i = 0;
    // SAFETY: every full load covers i..i + lanes <= n, inside x and each row (all hold >= n).
    unsafe {
        while i + lanes <= n {
            let xv = f32::load(s, x.as_ptr().add(i));
            for g in 0..G {
                acc[g] = s.mul_add_e_f32s(xv, E::load(s, ptrs[g].add(i)), acc[g]);
            }
            i += lanes;
        }
    }
    if i < n {
        let xv = s.partial_load_f32s(&x[i..n]);
        for g in 0..G {
            acc[g] = s.mul_add_e_f32s(xv, E::load_partial(s, &rows[g][i..n]), acc[g]);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = s.reduce_sum_f32s(a);
    }
}

/// Queries a tile of [`dots_queries`] takes at once.
const DOT_QUERIES: usize = 4;

/// `out[q * stride + j] = dot(xs[q], rows[j])` for the queries `xs` (`n` values each, one after
/// another) and every row: for each query what [`dots_rows`] gives (the same products summed in
/// the same order, so the same bits), computed in tiles of four queries by four rows (two on
/// machines with 16 vector registers), so that each vector loaded serves several multiply-adds
/// instead of one: a query's from L1 serves every row of its tile, a row's every query.
#[inline(always)]
pub(super) fn dots_queries<S: Isa, E: Elem>(s: S, xs: &[f32], n: usize, rows: &[&[E]], out: &mut [f32], stride: usize) {
    let queries = xs.len().checked_div(n).unwrap_or(0);
    assert!(queries == 0 || (out.len() >= (queries - 1) * stride + rows.len() && stride >= rows.len()));
    if rows.iter().any(|r| r.len() < n) {
        // Rows shorter than the queries: each sum over its own length.
        for (x, o) in xs.chunks_exact(n).zip(out.chunks_mut(stride)) {
            dots_rows(s, x, rows, &mut o[..rows.len()]);
        }
        return;
    }
    let mut q0 = 0;
    while q0 < queries {
        let qs = DOT_QUERIES.min(queries - q0);
        let x = &xs[q0 * n..(q0 + qs) * n];
        let o = &mut out[q0 * stride..];
        let mut r0 = 0;
        while r0 < rows.len() {
            let left = rows.len() - r0;
            let (x, o, rs) = (x, &mut o[r0..], &rows[r0..]);
            if qs < DOT_QUERIES {
                // Fewer queries than a tile: one at a time, eight rows' sums in flight.
                dots_rows(s, &x[..n], rs, &mut o[..left]);
                r0 = rows.len();
                continue;
            }
            r0 += match left {
                4.. if S::REGISTER_COUNT >= 32 => dots_tile::<S, E, DOT_QUERIES, 4>(s, x, n, rs, o, stride),
                2.. => dots_tile::<S, E, DOT_QUERIES, 2>(s, x, n, rs, o, stride),
                _ => dots_tile::<S, E, DOT_QUERIES, 1>(s, x, n, rs, o, stride),
            };
        }
        // A short tile of queries went one query at a time; the rest of them follow.
        q0 += if qs == DOT_QUERIES { DOT_QUERIES } else { 1 };
    }
}

/// `Q` queries (`n` values each in `x`) against the first `R` rows, each sum as in
/// [`dots_group`]: lane `l` takes elements `l, l + lanes, ..` in order, the lanes reduced at the
/// end. Returns `R`. The caller has checked that every row holds at least `n` values and that
/// `out` holds `(Q - 1) * stride + R`.
#[inline(always)]
fn dots_tile<S: Isa, E: Elem, const Q: usize, const R: usize>(s: S, x: &[f32], n: usize, rows: &[&[E]], out: &mut [f32], stride: usize) -> usize {
    let lanes = S::F32_LANES;
    assert!(x.len() >= Q * n && rows.len() >= R && rows[..R].iter().all(|r| r.len() >= n));
    assert!(out.len() >= (Q - 1) * stride + R);
    let ptrs: [*const E; R] = std::array::from_fn(|r| rows[r].as_ptr());
    let mut acc = [[s.splat_f32s(0.0); R]; Q];
    let mut i = 0;
    // SAFETY: every full load covers i..i + lanes <= n, inside each query of x and each row
    // (checked above).
    unsafe {
        while i + lanes <= n {
            // Plain loops, no closures: a closure is a function of its own, compiled without
            // the path's target features.
            let mut w = [s.splat_f32s(0.0); R];
            for r in 0..R {
                w[r] = E::load(s, ptrs[r].add(i));
            }
            for (q, a) in acc.iter_mut().enumerate() {
                let xv = f32::load(s, x.as_ptr().add(q * n + i));
                for r in 0..R {
                    a[r] = s.mul_add_e_f32s(xv, w[r], a[r]);
                }
            }
            i += lanes;
        }
    }
    if i < n {
        let mut w = [s.splat_f32s(0.0); R];
        for r in 0..R {
            w[r] = E::load_partial(s, &rows[r][i..n]);
        }
        for (q, a) in acc.iter_mut().enumerate() {
            let xv = s.partial_load_f32s(&x[q * n + i..q * n + n]);
            for r in 0..R {
                a[r] = s.mul_add_e_f32s(xv, w[r], a[r]);
            }
        }
    }
    for (q, a) in acc.iter().enumerate() {
        for (r, &v) in a.iter().enumerate() {
            out[q * stride + r] = s.reduce_sum_f32s(v);
        }
    }
    R
}

/// Output registers kept together while every row passes over them.
const AXPY_CHUNKS: usize = 8;

/// `y += Σ_r coeffs[r] · rows[r]`, each element receiving the rows in order (as successive
/// single-row calls would), loading and storing `y` once per block. A row shorter than `y`
/// updates only its own prefix.
#[inline(always)]
pub fn axpys<S: Isa>(s: S, y: &mut [f32], coeffs: &[f32], rows: Rows<'_>) {
    match rows {
        Rows::F32(rows) => axpys_rows(s, y, coeffs, rows),
        Rows::Bf16(rows) => axpys_rows(s, y, coeffs, rows),
    }
}

#[inline(always)]
pub(super) fn axpys_rows<S: Isa, E: Elem>(s: S, y: &mut [f32], coeffs: &[f32], rows: &[&[E]]) {
    let count = rows.len().min(coeffs.len());
    let (rows, coeffs) = (&rows[..count], &coeffs[..count]);
    if rows.iter().any(|r| r.len() < y.len()) {
        for (r, c) in rows.iter().zip(coeffs) {
            let n = r.len().min(y.len());
            axpys_block(s, &mut y[..n], std::slice::from_ref(c), std::slice::from_ref(r));
        }
        return;
    }
    axpys_block(s, y, coeffs, rows);
}

/// Queries a tile of [`axpys_queries`] takes at once.
const AXPY_QUERIES: usize = 4;

/// `ys[q] += Σ_r coeffs[q * stride + r] · rows[r]` for the queries' outputs `ys` (`n` values
/// each, one after another): for each query what [`axpys_rows`] gives (each element receives the
/// rows in order, one multiply-add each, so the same bits), in tiles of four queries by up to
/// four vectors of columns held in registers, so that each vector of a row loaded serves four
/// queries and sixteen independent sums are in flight instead of one.
#[inline(always)]
pub(super) fn axpys_queries<S: Isa, E: Elem>(s: S, ys: &mut [f32], n: usize, coeffs: &[f32], stride: usize, rows: &[&[E]]) {
    let queries = ys.len().checked_div(n).unwrap_or(0);
    assert!(queries == 0 || (coeffs.len() >= (queries - 1) * stride + rows.len() && stride >= rows.len()));
    if rows.iter().any(|r| r.len() < n) {
        for (q, y) in ys.chunks_exact_mut(n).enumerate() {
            axpys_rows(s, y, &coeffs[q * stride..][..rows.len()], rows);
        }
        return;
    }
    let lanes = S::F32_LANES;
    let mut q0 = 0;
    while q0 < queries {
        let y = &mut ys[q0 * n..];
        let c = &coeffs[q0 * stride..];
        let mut i = 0;
        if queries - q0 >= AXPY_QUERIES {
            let wide = if S::REGISTER_COUNT >= 32 { 4 } else { 2 };
            while i + wide * lanes <= n {
                match wide {
                    4 => axpys_tile::<S, E, AXPY_QUERIES, 4>(s, y, n, i, c, stride, rows),
                    _ => axpys_tile::<S, E, AXPY_QUERIES, 2>(s, y, n, i, c, stride, rows),
                }
                i += wide * lanes;
            }
            while i + lanes <= n {
                axpys_tile::<S, E, AXPY_QUERIES, 1>(s, y, n, i, c, stride, rows);
                i += lanes;
            }
            if i < n {
                axpys_tail::<S, E, AXPY_QUERIES>(s, y, n, i, c, stride, rows);
            }
            q0 += AXPY_QUERIES;
        } else {
            // Fewer queries than a tile: one at a time, up to eight vectors of it in flight.
            axpys_block(s, &mut y[..n], &c[..rows.len()], rows);
            q0 += 1;
        }
    }
}

/// Columns `i .. i + C * lanes` of `Q` queries' outputs (`n` apart in `y`) plus the rows times
/// their coefficients (`stride` apart in `coeffs`). The caller has checked the lengths: every
/// row holds `n`, `i + C * lanes <= n`, `y` holds `Q * n` and `coeffs` `(Q - 1) * stride +
/// rows.len()`.
#[inline(always)]
fn axpys_tile<S: Isa, E: Elem, const Q: usize, const C: usize>(s: S, y: &mut [f32], n: usize, i: usize, coeffs: &[f32], stride: usize, rows: &[&[E]]) {
    let lanes = S::F32_LANES;
    assert!(i + C * lanes <= n && y.len() >= Q * n && coeffs.len() >= (Q - 1) * stride + rows.len());
    let yp = y.as_mut_ptr();
    let mut acc = [[s.splat_f32s(0.0); C]; Q];
    // SAFETY: the accesses cover columns i .. i + C * lanes <= n of Q outputs n apart and of
    // each row (all hold >= n), checked above.
    unsafe {
        for (q, a) in acc.iter_mut().enumerate() {
            for (c, v) in a.iter_mut().enumerate() {
                *v = f32::load(s, yp.add(q * n + i + c * lanes));
            }
        }
        for (r, row) in rows.iter().enumerate() {
            let mut w = [s.splat_f32s(0.0); C];
            for (c, v) in w.iter_mut().enumerate() {
                *v = E::load(s, row.as_ptr().add(i + c * lanes));
            }
            for (q, a) in acc.iter_mut().enumerate() {
                let cv = s.splat_f32s(*coeffs.get_unchecked(q * stride + r));
                for c in 0..C {
                    a[c] = s.mul_add_e_f32s(cv, w[c], a[c]);
                }
            }
        }
        for (q, a) in acc.iter().enumerate() {
            for (c, v) in a.iter().enumerate() {
                std::ptr::write_unaligned(yp.add(q * n + i + c * lanes) as *mut S::f32s, *v);
            }
        }
    }
}

/// Columns `i..n` (fewer than a vector) of `Q` queries' outputs, as [`axpys_tile`].
#[inline(always)]
fn axpys_tail<S: Isa, E: Elem, const Q: usize>(s: S, y: &mut [f32], n: usize, i: usize, coeffs: &[f32], stride: usize, rows: &[&[E]]) {
    let mut acc = [s.splat_f32s(0.0); Q];
    for (q, a) in acc.iter_mut().enumerate() {
        *a = s.partial_load_f32s(&y[q * n + i..q * n + n]);
    }
    for (r, row) in rows.iter().enumerate() {
        let w = E::load_partial(s, &row[i..n]);
        for (q, a) in acc.iter_mut().enumerate() {
            *a = s.mul_add_e_f32s(s.splat_f32s(coeffs[q * stride + r]), w, *a);
        }
    }
    for (q, a) in acc.iter().enumerate() {
        s.partial_store_f32s(&mut y[q * n + i..q * n + n], *a);
    }
}

/// [`axpys`] where every row holds at least `y.len()` elements and `coeffs` one coefficient a
/// row: one output, as a tile of one query ([`axpys_tile`], [`axpys_tail`]), eight vectors of
/// columns in registers at a time, then four where eight do not fit (a head of 64 on AVX-512:
/// four independent chains instead of one), then one, then the tail.
#[inline(always)]
fn axpys_block<S: Isa, E: Elem>(s: S, y: &mut [f32], coeffs: &[f32], rows: &[&[E]]) {
    let lanes = S::F32_LANES;
    let n = y.len();
    let mut i = 0;
    while i + AXPY_CHUNKS * lanes <= n {
        axpys_tile::<S, E, 1, AXPY_CHUNKS>(s, y, n, i, coeffs, 0, rows);
        i += AXPY_CHUNKS * lanes;
    }
    while i + 4 * lanes <= n {
        axpys_tile::<S, E, 1, 4>(s, y, n, i, coeffs, 0, rows);
        i += 4 * lanes;
    }
    while i + lanes <= n {
        axpys_tile::<S, E, 1, 1>(s, y, n, i, coeffs, 0, rows);
        i += lanes;
    }
    if i < n {
        axpys_tail::<S, E, 1>(s, y, n, i, coeffs, 0, rows);
    }
}

/// `Σ x[i]`, read as fast as the CPU can (the memory-bandwidth probe's inner loop): eight
/// accumulators, so loads, not adds, set the pace, and the lines 1 KiB ahead requested early.
#[inline(always)]
pub fn sum<S: Isa>(s: S, x: &[f32]) -> f32 {
    const ACC: usize = 8;
    const AHEAD: usize = 256;
    let lanes = S::F32_LANES;
    let n = x.len();
    let mut acc = [s.splat_f32s(0.0); ACC];
    let mut i = 0;
    // SAFETY: every full load covers i..i + ACC * lanes <= n; prefetches never fault.
    unsafe {
        while i + ACC * lanes <= n {
            let p = x.as_ptr().add(i);
            let mut line = 0;
            while line < ACC * lanes * 4 {
                s.prefetch_l2((p as *const u8).wrapping_add(4 * AHEAD + line));
                line += 64;
            }
            for (j, a) in acc.iter_mut().enumerate() {
                *a = s.add_f32s(*a, f32::load(s, p.add(j * lanes)));
            }
            i += ACC * lanes;
        }
    }
    while i < n {
        let end = (i + lanes).min(n);
        acc[0] = s.add_f32s(acc[0], s.partial_load_f32s(&x[i..end]));
        i = end;
    }
    let mut total = acc[0];
    for a in &acc[1..] {
        total = s.add_f32s(total, *a);
    }
    s.reduce_sum_f32s(total)
}

/// `Σ x[i]²`, lane by lane over the elements in order, then reduced.
#[inline(always)]
pub fn sum_squares<S: Isa>(s: S, x: &[f32]) -> f32 {
    let lanes = S::F32_LANES;
    let mut acc = s.splat_f32s(0.0);
    for chunk in x.chunks(lanes) {
        let v = s.partial_load_f32s(chunk);
        acc = s.mul_add_e_f32s(v, v, acc);
    }
    s.reduce_sum_f32s(acc)
}

/// `out[i] = w[i] * (x[i] * scale)` over the shortest of the three.
#[inline(always)]
pub fn scale_mul<S: Isa>(s: S, out: &mut [f32], x: &[f32], scale: f32, w: &[f32]) {
    let lanes = S::F32_LANES;
    let n = out.len().min(x.len()).min(w.len());
    let sv = s.splat_f32s(scale);
    for ((o, xc), wc) in out[..n].chunks_mut(lanes).zip(x[..n].chunks(lanes)).zip(w[..n].chunks(lanes)) {
        let v = s.mul_f32s(s.partial_load_f32s(wc), s.mul_f32s(s.partial_load_f32s(xc), sv));
        s.partial_store_f32s(o, v);
    }
}

/// `acc[i] += x[i]` over the shorter of the two.
#[inline(always)]
pub fn add_assign<S: Isa>(s: S, acc: &mut [f32], x: &[f32]) {
    let lanes = S::F32_LANES;
    let n = acc.len().min(x.len());
    for (a, xc) in acc[..n].chunks_mut(lanes).zip(x[..n].chunks(lanes)) {
        let v = s.add_f32s(s.partial_load_f32s(a), s.partial_load_f32s(xc));
        s.partial_store_f32s(a, v);
    }
}

/// `e^x` in every lane: `x = k ln 2 + r` with `k` an integer and `|r| <= ln 2 / 2`, then
/// `e^r` from Cephes' `expf` polynomial and `2^k` written straight into the exponent bits.
/// Within 2 ulp of the exact value where the result is a normal number; 0 below
/// -87.336 (where e^x falls under f32's normal range: flushed to zero), +inf above 88.723, NaN
/// for NaN. A few instructions a lane instead of a libm call an
/// element: the softmax of attention and SiLU take one per score and per activation.
#[inline(always)]
pub fn exp<S: Isa>(s: S, x: S::f32s) -> S::f32s {
    // ln of the least normal and of the greatest finite f32.
    const LO: f32 = -87.336_54;
    const HI: f32 = 88.722_84;
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: u32 = 0x4b40_0000;
    // ln 2 as a part with 9 significant bits (so `k * LN2_HI` is exact) and the rest.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
    let c = s.min_f32s(s.max_f32s(x, s.splat_f32s(LO)), s.splat_f32s(HI));
    let t = s.mul_add_e_f32s(c, s.splat_f32s(std::f32::consts::LOG2_E), s.splat_f32s(ROUND));
    let k = s.sub_f32s(t, s.splat_f32s(ROUND));
    let r = s.mul_add_e_f32s(k, s.splat_f32s(-LN2_HI), c);
    let r = s.mul_add_e_f32s(k, s.splat_f32s(-LN2_LO), r);
    let mut p = s.splat_f32s(P[0]);
    for &coef in &P[1..] {
        p = s.mul_add_e_f32s(p, r, s.splat_f32s(coef));
    }
    let er = s.add_f32s(s.mul_add_e_f32s(s.mul_f32s(p, r), r, r), s.splat_f32s(1.0));
    // 2^min(k, 127) from its exponent bits, times 2 more where k is 128 (x near HI).
    let kb = s.transmute_u32s_f32s(s.min_f32s(t, s.splat_f32s(ROUND + 127.0)));
    let pow = s.transmute_f32s_u32s(s.wrapping_dyn_shl_u32s(s.add_u32s(kb, s.splat_u32s(127u32.wrapping_sub(ROUND_BITS))), s.splat_u32s(23)));
    let twice = s.select_f32s(s.greater_than_f32s(t, s.splat_f32s(ROUND + 127.0)), s.splat_f32s(2.0), s.splat_f32s(1.0));
    let y = s.mul_f32s(s.mul_f32s(er, pow), twice);
    let y = s.select_f32s(s.less_than_f32s(x, s.splat_f32s(LO)), s.splat_f32s(0.0), y);
    let y = s.select_f32s(s.greater_than_f32s(x, s.splat_f32s(HI)), s.splat_f32s(f32::INFINITY), y);
    s.select_f32s(s.equal_f32s(x, x), y, x)
}

/// `x[i] = e^(scale x[i] - m) / Σ_j e^(scale x[j] - m)`, `m` the largest `scale x[j]`: the
/// softmax of a row of scores, scaled first. Each value's sum runs over its own row only.
#[inline(always)]
pub fn softmax_scaled<S: Isa>(s: S, x: &mut [f32], scale: f32) {
    let lanes = S::F32_LANES;
    let n = x.len();
    let full = n - n % lanes;
    let sv = s.splat_f32s(scale);
    let mut mx = s.splat_f32s(f32::NEG_INFINITY);
    let p = x.as_mut_ptr();
    // SAFETY: the full loads and stores cover i..i + lanes <= full <= n.
    unsafe {
        let mut i = 0;
        while i < full {
            let v = s.mul_f32s(f32::load(s, p.add(i)), sv);
            std::ptr::write_unaligned(p.add(i) as *mut S::f32s, v);
            mx = s.max_f32s(mx, v);
            i += lanes;
        }
    }
    let mut m = s.reduce_max_f32s(mx);
    for v in &mut x[full..] {
        *v *= scale;
        m = m.max(*v);
    }
    let mv = s.splat_f32s(m);
    let mut acc = s.splat_f32s(0.0);
    // SAFETY: as above.
    unsafe {
        let mut i = 0;
        while i < full {
            let e = exp(s, s.sub_f32s(f32::load(s, p.add(i)), mv));
            std::ptr::write_unaligned(p.add(i) as *mut S::f32s, e);
            acc = s.add_f32s(acc, e);
            i += lanes;
        }
    }
    if full < n {
        let tail = &mut x[full..];
        s.partial_store_f32s(tail, exp(s, s.sub_f32s(s.partial_load_f32s(tail), mv)));
        // Reloaded: the lanes past the row's end read as zeros.
        acc = s.add_f32s(acc, s.partial_load_f32s(tail));
    }
    let inv = s.splat_f32s(1.0 / s.reduce_sum_f32s(acc));
    for chunk in x.chunks_mut(lanes) {
        s.partial_store_f32s(chunk, s.mul_f32s(s.partial_load_f32s(chunk), inv));
    }
}

/// `out[i] = silu(gate[i]) * up[i]` with `silu(g) = g / (1 + e^-g)`, over the shortest of the
/// three.
#[inline(always)]
pub fn silu_mul<S: Isa>(s: S, out: &mut [f32], gate: &[f32], up: &[f32]) {
    let lanes = S::F32_LANES;
    let n = out.len().min(gate.len()).min(up.len());
    let one = s.splat_f32s(1.0);
    for ((o, g), u) in out[..n].chunks_mut(lanes).zip(gate[..n].chunks(lanes)).zip(up[..n].chunks(lanes)) {
        let g = s.partial_load_f32s(g);
        let silu = s.div_f32s(g, s.add_f32s(one, exp(s, s.neg_f32s(g))));
        s.partial_store_f32s(o, s.mul_f32s(silu, s.partial_load_f32s(u)));
    }
}

/// [`sum`] of `x` as one kernel call.
pub struct Sum<'a>(pub &'a [f32]);

impl Kernel for Sum<'_> {
    type Output = f32;
    #[inline(always)]
    fn run<S: Isa>(self, s: S) -> f32 {
        sum(s, self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::isa::Path;
    use super::*;

    /// Rows of `rows` values of length `n`, in f32 and as the same values in bf16 (every value
    /// rounded to bf16 first, so both hold exactly the same numbers).
    fn rows_both(n: usize, rows: usize) -> (Vec<Vec<f32>>, Vec<Vec<u16>>) {
        let h: Vec<Vec<u16>> = (0..rows).map(|r| (0..n).map(|i| (((i + 3 * r) as f32 * 0.13).cos().to_bits() >> 16) as u16).collect()).collect();
        let f = h.iter().map(|row| row.iter().map(|&v| bf16_to_f32(v)).collect()).collect();
        (f, h)
    }

    /// Runs a closure generic over the instruction set on one path.
    struct With<F>(F);
    trait Body {
        fn body<S: Isa>(&mut self, s: S);
    }
    impl<F: Body> Kernel for With<F> {
        type Output = F;
        fn run<S: Isa>(mut self, s: S) -> F {
            self.0.body(s);
            self.0
        }
    }

    struct DotsAxpys<'a> {
        x: &'a [f32],
        rows: Rows<'a>,
        coeffs: &'a [f32],
        dots: Vec<f32>,
        y: Vec<f32>,
    }
    impl Body for DotsAxpys<'_> {
        fn body<S: Isa>(&mut self, s: S) {
            dots(s, self.x, self.rows, &mut self.dots);
            axpys(s, &mut self.y, self.coeffs, self.rows);
        }
    }

    fn dots_axpys(path: Path, x: &[f32], rows: Rows<'_>, coeffs: &[f32], y: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let out = path.run(With(DotsAxpys { x, rows, coeffs, dots: vec![0.0; rows.len()], y: y.to_vec() }));
        (out.dots, out.y)
    }

    #[test]
    fn f16_and_bf16_widen_exactly_on_every_path() {
        struct Widen<'a>(&'a [u16], &'a [half::f16]);
        impl Kernel for Widen<'_> {
            type Output = (Vec<f32>, Vec<f32>);
            fn run<S: Isa>(self, s: S) -> (Vec<f32>, Vec<f32>) {
                let (mut b, mut h) = (vec![0f32; self.0.len()], vec![0f32; self.1.len()]);
                for (o, c) in b.chunks_mut(S::F32_LANES).zip(self.0.chunks(S::F32_LANES)) {
                    s.partial_store_f32s(o, u16::load_partial(s, c));
                }
                for (o, c) in h.chunks_mut(S::F32_LANES).zip(self.1.chunks(S::F32_LANES)) {
                    s.partial_store_f32s(o, half::f16::load_partial(s, c));
                }
                (b, h)
            }
        }
        // Every 16-bit pattern: normals, subnormals, zeros, infinities and NaNs of both signs.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let halves: Vec<half::f16> = all.iter().map(|&b| half::f16::from_bits(b)).collect();
        for path in Path::available() {
            let (b, h) = path.run(Widen(&all, &halves));
            for (i, &bits) in all.iter().enumerate() {
                assert_eq!(b[i].to_bits(), bf16_to_f32(bits).to_bits(), "{path:?} bf16 {bits:#06x}");
                let want = halves[i].to_f32();
                if want.is_nan() {
                    assert!(h[i].is_nan() && h[i].is_sign_negative() == want.is_sign_negative(), "{path:?} f16 {bits:#06x}: {}", h[i]);
                } else {
                    assert_eq!(h[i].to_bits(), want.to_bits(), "{path:?} f16 {bits:#06x}");
                }
            }
        }
    }

    #[test]
    fn bf16_rows_compute_exactly_like_f32_rows_of_the_same_values_on_every_path() {
        for path in Path::available() {
            for (n, rows) in [(1, 1), (5, 3), (16, 4), (31, 2), (37, 7), (100, 9), (130, 17), (1024, 16)] {
                let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.21).sin()).collect();
                let (f, h) = rows_both(n, rows);
                let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
                let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
                let coeffs: Vec<f32> = (0..rows).map(|r| r as f32 * 0.3 - 1.0).collect();
                let (d32, y32) = dots_axpys(path, &x, Rows::F32(&fr), &coeffs, &x);
                let (d16, y16) = dots_axpys(path, &x, Rows::Bf16(&hr), &coeffs, &x);
                assert_eq!(d32, d16, "{path:?} n={n}");
                assert_eq!(y32, y16, "{path:?} n={n}");
                for (r, &got) in d32.iter().enumerate() {
                    let exact: f64 = x.iter().zip(&f[r]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    assert!((got as f64 - exact).abs() < 1e-4, "{path:?} n={n} row {r}: {got} vs {exact}");
                }
                for i in 0..n {
                    let exact: f64 = x[i] as f64 + (0..rows).map(|r| coeffs[r] as f64 * f[r][i] as f64).sum::<f64>();
                    assert!((y32[i] as f64 - exact).abs() < 1e-4, "{path:?} n={n} element {i}");
                }
            }
        }
    }

    #[test]
    fn grouped_dots_and_axpys_equal_one_row_at_a_time_on_every_path() {
        for path in Path::available() {
            for (n, rows) in [(5, 3), (16, 4), (37, 7), (100, 9), (300, 20)] {
                let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.21).sin()).collect();
                let (f, h) = rows_both(n, rows);
                let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
                let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
                let coeffs: Vec<f32> = (0..rows).map(|r| r as f32 * 0.3 - 1.0).collect();
                for rows_of in [Rows::F32(&fr), Rows::Bf16(&hr)] {
                    let (out, grouped) = dots_axpys(path, &x, rows_of, &coeffs, &x);
                    let mut single = x.clone();
                    for r in 0..rows {
                        let (one_f, one_h) = ([fr[r]], [hr[r]]);
                        let one = match rows_of {
                            Rows::F32(_) => Rows::F32(&one_f),
                            Rows::Bf16(_) => Rows::Bf16(&one_h),
                        };
                        let (o, y) = dots_axpys(path, &x, one, &coeffs[r..r + 1], &single);
                        assert_eq!(o[0].to_bits(), out[r].to_bits(), "{path:?} n={n} row {r}");
                        single = y;
                    }
                    assert_eq!(grouped, single, "{path:?} n={n}");
                    // A vector shorter than the rows: each sum runs over its own length.
                    let (o, _) = dots_axpys(path, &x[..n - 1], rows_of, &coeffs, &x);
                    let exact: f64 = x[..n - 1].iter().zip(&f[0]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    assert!((o[0] as f64 - exact).abs() < 1e-4, "{path:?} n={n}");
                }
            }
        }
    }

    /// Each query of `xs` (`n` values each) against `rows` through [`dots_queries`] (scores
    /// `stride` apart) and through [`dots_rows`] one query at a time.
    struct Queries<'a, E> {
        xs: &'a [f32],
        n: usize,
        rows: &'a [&'a [E]],
        stride: usize,
        tiled: Vec<f32>,
        alone: Vec<f32>,
    }
    impl<E: Elem> Body for Queries<'_, E> {
        fn body<S: Isa>(&mut self, s: S) {
            dots_queries(s, self.xs, self.n, self.rows, &mut self.tiled, self.stride);
            for (x, o) in self.xs.chunks_exact(self.n).zip(self.alone.chunks_mut(self.stride)) {
                dots_rows(s, x, self.rows, &mut o[..self.rows.len()]);
            }
        }
    }

    #[test]
    fn query_tiles_give_each_query_the_bits_of_its_dots_alone_on_every_path() {
        for path in Path::available() {
            for (n, rows) in [(5, 3), (16, 4), (37, 7), (64, 16), (100, 9), (128, 5)] {
                let (f, h) = rows_both(n, rows);
                let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
                let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
                for queries in [1, 2, 3, 4, 5, 8, 9] {
                    let xs: Vec<f32> = (0..queries * n).map(|i| (i as f32 * 0.37).sin()).collect();
                    let stride = rows + 2;
                    let len = (queries - 1) * stride + rows;
                    let f32s = path.run(With(Queries { xs: &xs, n, rows: &fr, stride, tiled: vec![f32::NAN; len], alone: vec![f32::NAN; len] }));
                    let bf16s = path.run(With(Queries { xs: &xs, n, rows: &hr, stride, tiled: vec![f32::NAN; len], alone: vec![f32::NAN; len] }));
                    for (q, r) in (0..queries).flat_map(|q| (0..rows).map(move |r| (q, r))) {
                        let at = q * stride + r;
                        assert_eq!(f32s.tiled[at].to_bits(), f32s.alone[at].to_bits(), "{path:?} n={n} f32 query {q} row {r}");
                        assert_eq!(bf16s.tiled[at].to_bits(), f32s.alone[at].to_bits(), "{path:?} n={n} bf16 query {q} row {r}");
                    }
                    // The gaps between the queries' scores are left alone.
                    assert!((0..queries - 1).all(|q| f32s.tiled[q * stride + rows..(q + 1) * stride].iter().all(|v| v.is_nan())));
                }
            }
        }
    }

    /// Each query's output (`n` values each) plus `rows` weighted by its coefficients (`stride`
    /// apart) through [`axpys_queries`], and through [`axpys_rows`] one query at a time.
    struct Weighted<'a, E> {
        n: usize,
        coeffs: &'a [f32],
        stride: usize,
        rows: &'a [&'a [E]],
        tiled: Vec<f32>,
        alone: Vec<f32>,
    }
    impl<E: Elem> Body for Weighted<'_, E> {
        fn body<S: Isa>(&mut self, s: S) {
            axpys_queries(s, &mut self.tiled, self.n, self.coeffs, self.stride, self.rows);
            for (q, y) in self.alone.chunks_exact_mut(self.n).enumerate() {
                axpys_rows(s, y, &self.coeffs[q * self.stride..][..self.rows.len()], self.rows);
            }
        }
    }

    #[test]
    fn weighted_sums_in_query_tiles_give_each_query_the_bits_of_its_sums_alone_on_every_path() {
        for path in Path::available() {
            for (n, rows) in [(5, 3), (16, 4), (37, 7), (64, 16), (100, 9), (128, 5), (200, 2)] {
                let (f, h) = rows_both(n, rows);
                let fr: Vec<&[f32]> = f.iter().map(Vec::as_slice).collect();
                let hr: Vec<&[u16]> = h.iter().map(Vec::as_slice).collect();
                for queries in [1, 2, 3, 4, 5, 8, 9] {
                    let stride = rows + 3;
                    let coeffs: Vec<f32> = (0..(queries - 1) * stride + rows).map(|i| (i as f32 * 0.61).cos()).collect();
                    let y: Vec<f32> = (0..queries * n).map(|i| (i as f32 * 0.17).sin()).collect();
                    let f32s = path.run(With(Weighted { n, coeffs: &coeffs, stride, rows: &fr, tiled: y.clone(), alone: y.clone() }));
                    let bf16s = path.run(With(Weighted { n, coeffs: &coeffs, stride, rows: &hr, tiled: y.clone(), alone: y.clone() }));
                    for (i, (a, b)) in f32s.tiled.iter().zip(&f32s.alone).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{path:?} n={n} queries={queries} f32 element {i}");
                        assert_eq!(bf16s.tiled[i].to_bits(), b.to_bits(), "{path:?} n={n} queries={queries} bf16 element {i}");
                    }
                }
            }
        }
    }

    struct Small<'a> {
        a: &'a [f32],
        b: &'a [f32],
        out: [f32; 3],
        y: Vec<f32>,
        scaled: Vec<f32>,
    }
    impl Body for Small<'_> {
        fn body<S: Isa>(&mut self, s: S) {
            let mut dot = [0.0];
            dots_rows(s, self.a, &[self.b], &mut dot);
            self.out = [dot[0], sum(s, self.a), sum_squares(s, self.a)];
            axpys_rows(s, &mut self.y, &[0.5], &[self.a]);
            add_assign(s, &mut self.y, self.b);
            scale_mul(s, &mut self.scaled, self.a, 2.0, self.b);
        }
    }

    #[test]
    fn small_helpers_match_their_formulas_on_every_path() {
        for path in Path::available() {
            for n in [1, 7, 16, 17, 64, 100, 333] {
                let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
                let r = path.run(With(Small { a: &a, b: &b, out: [0.0; 3], y: b.clone(), scaled: vec![0.0; n] }));
                let f64sum = |f: &dyn Fn(usize) -> f64| (0..n).map(f).sum::<f64>();
                let want = [f64sum(&|i| a[i] as f64 * b[i] as f64), f64sum(&|i| a[i] as f64), f64sum(&|i| (a[i] as f64).powi(2))];
                for (got, want) in r.out.iter().zip(want) {
                    assert!((*got as f64 - want).abs() < 1e-4, "{path:?} n={n}: {got} vs {want}");
                }
                for i in 0..n {
                    assert!((r.y[i] - (b[i] + 0.5 * a[i] + b[i])).abs() < 1e-6, "{path:?} n={n}");
                    assert!((r.scaled[i] - b[i] * (a[i] * 2.0)).abs() < 1e-6, "{path:?} n={n}");
                }
            }
        }
    }

    struct Exps<'a> {
        x: &'a [f32],
        exp: Vec<f32>,
        softmax: Vec<f32>,
        silu: Vec<f32>,
    }
    impl Body for Exps<'_> {
        fn body<S: Isa>(&mut self, s: S) {
            for (o, x) in self.exp.chunks_mut(S::F32_LANES).zip(self.x.chunks(S::F32_LANES)) {
                s.partial_store_f32s(o, exp(s, s.partial_load_f32s(x)));
            }
            softmax_scaled(s, &mut self.softmax, 0.125);
            silu_mul(s, &mut self.silu, self.x, self.x);
        }
    }

    /// The vector `e^x` within 2 ulp of the exact value over f32's normal results (the range
    /// reduction's edges and `k = 128` included), 0 below, +inf above, NaN for NaN; the
    /// softmax and SiLU built on it against their f64 formulas, rows of every tail length.
    #[test]
    fn exp_softmax_and_silu_match_f64_on_every_path() {
        let mut x: Vec<f32> = (0..40_000).map(|i| -90.0 + i as f32 * 0.0045).collect();
        let ln2 = std::f32::consts::LN_2;
        for k in -126..=128 {
            for d in [-0.5f32, -0.4999, 0.0, 0.4999, 0.5] {
                x.push((k as f32 + d) * ln2);
            }
        }
        x.extend([0.0, -0.0, 1e-30, -1e-30, 88.72, 88.7228, 88.72284, 88.7229, 89.0, -87.33, -87.3365, -87.3366, -88.0, -1e4, 1e4]);
        x.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN]);
        for path in Path::available() {
            let n = x.len();
            let r = path.run(With(Exps { x: &x, exp: vec![0.0; n], softmax: vec![], silu: vec![0.0; n] }));
            for (i, (&v, &got)) in x.iter().zip(&r.exp).enumerate() {
                let want = (v as f64).exp();
                if v.is_nan() {
                    assert!(got.is_nan(), "{path:?}: e^NaN = {got}");
                } else if v < -87.336_54 {
                    assert_eq!(got, 0.0, "{path:?}: e^{v}");
                } else if v > 88.722_84 {
                    assert_eq!(got, f32::INFINITY, "{path:?}: e^{v}");
                } else {
                    let ulp = (want as f32).abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64;
                    assert!((got as f64 - want).abs() <= 2.0 * ulp, "{path:?}: e^{v} = {got}, exactly {want}");
                }
                if v.is_finite() && v.abs() < 80.0 {
                    let silu = v as f64 / (1.0 + (-(v as f64)).exp()) * v as f64;
                    assert!((r.silu[i] as f64 - silu).abs() <= 1e-6 * silu.abs().max(1e-30), "{path:?}: silu({v}) * {v} = {}", r.silu[i]);
                }
            }
            for len in [1, 5, 16, 17, 31, 100, 333] {
                let row: Vec<f32> = (0..len).map(|i| ((i * 7919 % 113) as f32 - 56.0) * 0.9).collect();
                let r = path.run(With(Exps { x: &[], exp: vec![], softmax: row.clone(), silu: vec![] }));
                let m = row.iter().map(|&v| v as f64 * 0.125).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row.iter().map(|&v| (v as f64 * 0.125 - m).exp()).sum();
                for (&v, &got) in row.iter().zip(&r.softmax) {
                    let want = (v as f64 * 0.125 - m).exp() / z;
                    assert!((got as f64 - want).abs() <= 1e-6 * want + 1e-12, "{path:?} len {len}: softmax {got} vs {want}");
                }
            }
        }
    }
}
