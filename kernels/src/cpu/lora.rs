//! Batched LoRA on the CPU: SGMV over segments of tokens sharing an adapter, BGMV with one adapter
//! per row.
//!
//! Every token gets the same arithmetic whichever op serves it: `v[t, r]` is the dot product of
//! the token's input with A row `r` (`simd::dots`, whose sums depend only on the values, not on
//! how many rows share a pass), stored as f32, and each output element receives the B rows'
//! contributions fused one after another in rank order (`simd::axpys`, keeping blocks of the
//! output in registers across all rows). Segments only decide which tokens share a task, never
//! the order of any element's sums, so SGMV under any grouping and BGMV agree bit for bit. Rows
//! stored as bf16 are widened exactly to f32 as they are read, and give the same results as f32
//! rows holding the same values.

use rayon::prelude::*;

use super::isa::{Isa, Kernel, Path};
use super::{CpuBackend, CpuBuffer, min_items, simd};
use crate::check::{Directory, Segments, check_slots, ensure_rows};
use crate::{LORA_ROW_ALIGN, LoraOps, LoraRows, LoraSegments, LoraTarget, Result, RowDType};

/// Tokens of one segment handled by one rayon task in SGMV.
const TOKEN_BLOCK: usize = 16;

/// One slot's rows for the target, as slices of the pool in the slot's storage.
enum SlotRows<'a> {
    F32 { a: Vec<&'a [f32]>, b: Vec<&'a [f32]> },
    Bf16 { a: Vec<&'a [u16]>, b: Vec<&'a [u16]> },
}

impl SlotRows<'_> {
    fn a(&self) -> simd::Rows<'_> {
        match self {
            SlotRows::F32 { a, .. } => simd::Rows::F32(a),
            SlotRows::Bf16 { a, .. } => simd::Rows::Bf16(a),
        }
    }

    fn b(&self) -> simd::Rows<'_> {
        match self {
            SlotRows::F32 { b, .. } => simd::Rows::F32(b),
            SlotRows::Bf16 { b, .. } => simd::Rows::Bf16(b),
        }
    }

    fn rank(&self) -> usize {
        self.a().len()
    }
}

/// The rows of every slot for one target, checked against the pool.
struct Adapters<'a> {
    /// Per slot (none when the slot does not target the module: rank 0).
    slots: Vec<SlotRows<'a>>,
    in_features: usize,
    out_features: usize,
    max_rank: usize,
    path: Path,
}

impl<'a> Adapters<'a> {
    fn read(op: &'static str, path: Path, pool: &'a CpuBuffer, rows: &'a LoraRows<CpuBuffer>, target: &LoraTarget) -> Result<Self> {
        let pool = pool.f32(op)?;
        let dir = Directory::read(op, rows, target, pool.len())?;
        let LoraTarget { in_features, out_features, max_rank, .. } = *target;
        let pool16: &[u16] = bytemuck::cast_slice(pool);
        let start = |off: u32| off as usize * LORA_ROW_ALIGN;
        let slots = dir
            .slots
            .iter()
            .map(|e| {
                let (a, b) = (&dir.a_rows[e.first..e.first + e.rank], &dir.b_rows[e.first..e.first + e.rank]);
                match e.dtype {
                    RowDType::F32 => SlotRows::F32 {
                        a: a.iter().map(|&o| &pool[start(o)..start(o) + in_features]).collect(),
                        b: b.iter().map(|&o| &pool[start(o)..start(o) + out_features]).collect(),
                    },
                    RowDType::Bf16 => SlotRows::Bf16 {
                        a: a.iter().map(|&o| &pool16[2 * start(o)..2 * start(o) + in_features]).collect(),
                        b: b.iter().map(|&o| &pool16[2 * start(o)..2 * start(o) + out_features]).collect(),
                    },
                }
            })
            .collect();
        Ok(Adapters { slots, in_features, out_features, max_rank, path })
    }

    /// `v[t, r] = x[t] · A[r]` for each token of a block and `r < rank`, zeros up to `max_rank`.
    /// `x` holds the block's input rows, `v` its `max_rank`-long rows.
    fn shrink(&self, slot: u32, x: &[f32], v: &mut [f32]) {
        self.path.run(Shrink { ad: self, slot, x, v });
    }

    /// `y[t] += Σ_r v[t, r] · Bᵀ[r]` for each token of a block, `r` ascending.
    fn expand(&self, slot: u32, v: &[f32], y: &mut [f32]) {
        self.path.run(Expand { ad: self, slot, v, y });
    }

    /// Whether `slot` changes anything for this target.
    fn active(&self, slot: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.rank() > 0)
    }
}

/// [`Adapters::shrink`] as one kernel call.
struct Shrink<'s, 'a> {
    ad: &'s Adapters<'a>,
    slot: u32,
    x: &'s [f32],
    v: &'s mut [f32],
}

impl Kernel for Shrink<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        let Shrink { ad, slot, x, v } = self;
        let rows = ad.slots.get(slot as usize);
        let rank = rows.map_or(0, SlotRows::rank);
        for (vt, xt) in v.chunks_exact_mut(ad.max_rank).zip(x.chunks_exact(ad.in_features)) {
            if let Some(rows) = rows {
                simd::dots(s, xt, rows.a(), &mut vt[..rank]);
            }
            vt[rank..].fill(0.0);
        }
    }
}

/// [`Adapters::expand`] as one kernel call.
struct Expand<'s, 'a> {
    ad: &'s Adapters<'a>,
    slot: u32,
    v: &'s [f32],
    y: &'s mut [f32],
}

impl Kernel for Expand<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        let Expand { ad, slot, v, y } = self;
        let Some(rows) = ad.slots.get(slot as usize) else { return };
        let rank = rows.rank();
        for (yt, vt) in y.chunks_exact_mut(ad.out_features).zip(v.chunks_exact(ad.max_rank)) {
            simd::axpys(s, yt, &vt[..rank], rows.b());
        }
    }
}

/// Splits `out` (`row`-long rows, one per token) into blocks of at most `TOKEN_BLOCK` tokens
/// of one segment each, keeping those whose slot passes `keep`: (slot, first token, rows).
fn blocks<'o>(segs: &Segments<'_>, out: &'o mut [f32], row: usize, keep: impl Fn(u32) -> bool) -> Vec<(u32, usize, &'o mut [f32])> {
    let mut blocks = Vec::new();
    let mut rest = &mut out[..segs.tokens * row];
    for (s, &slot) in segs.slots.iter().enumerate() {
        let (first, len) = (segs.starts[s] as usize, (segs.starts[s + 1] - segs.starts[s]) as usize);
        let (seg, tail) = std::mem::take(&mut rest).split_at_mut(len * row);
        rest = tail;
        if keep(slot) {
            for (i, rows) in seg.chunks_mut(TOKEN_BLOCK * row).enumerate() {
                blocks.push((slot, first + i * TOKEN_BLOCK, rows));
            }
        }
    }
    blocks
}

impl LoraOps for CpuBackend {
    fn sgmv_shrink(
        &self,
        x: &CpuBuffer,
        pool: &CpuBuffer,
        rows: &LoraRows<CpuBuffer>,
        segs: &LoraSegments<CpuBuffer>,
        target: &LoraTarget,
        v: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "sgmv_shrink";
        let ad = Adapters::read(OP, self.path, pool, rows, target)?;
        let segs = Segments::read(OP, segs, rows.num_slots)?;
        let x = x.f32(OP)?;
        ensure_rows(OP, "x", x.len(), segs.tokens, ad.in_features)?;
        let v = v.f32_mut(OP)?;
        ensure_rows(OP, "v", v.len(), segs.tokens, ad.max_rank)?;
        // Every token's row of v is written, zeros where there is no adapter.
        let blocks = blocks(&segs, v, ad.max_rank, |_| true);
        let per = segs.tokens * ad.max_rank * ad.in_features / blocks.len().max(1);
        blocks.into_par_iter().with_min_len(min_items(per)).for_each(|(slot, t0, vb)| {
            let n = vb.len() / ad.max_rank;
            ad.shrink(slot, &x[t0 * ad.in_features..(t0 + n) * ad.in_features], vb);
        });
        Ok(())
    }

    fn sgmv_expand(
        &self,
        v: &CpuBuffer,
        pool: &CpuBuffer,
        rows: &LoraRows<CpuBuffer>,
        segs: &LoraSegments<CpuBuffer>,
        target: &LoraTarget,
        y: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "sgmv_expand";
        let ad = Adapters::read(OP, self.path, pool, rows, target)?;
        let segs = Segments::read(OP, segs, rows.num_slots)?;
        let v = v.f32(OP)?;
        ensure_rows(OP, "v", v.len(), segs.tokens, ad.max_rank)?;
        let y = y.f32_mut(OP)?;
        ensure_rows(OP, "y", y.len(), segs.tokens, ad.out_features)?;
        let blocks = blocks(&segs, y, ad.out_features, |slot| ad.active(slot));
        let per = segs.tokens * ad.max_rank * ad.out_features / blocks.len().max(1);
        blocks.into_par_iter().with_min_len(min_items(per)).for_each(|(slot, t0, yb)| {
            let n = yb.len() / ad.out_features;
            ad.expand(slot, &v[t0 * ad.max_rank..(t0 + n) * ad.max_rank], yb);
        });
        Ok(())
    }

    fn bgmv(&self, x: &CpuBuffer, pool: &CpuBuffer, rows: &LoraRows<CpuBuffer>, slots: &CpuBuffer, target: &LoraTarget, y: &mut CpuBuffer) -> Result<()> {
        const OP: &str = "bgmv";
        let ad = Adapters::read(OP, self.path, pool, rows, target)?;
        let slots = slots.u32(OP)?;
        check_slots(OP, slots, rows.num_slots)?;
        let n = slots.len();
        let x = x.f32(OP)?;
        ensure_rows(OP, "x", x.len(), n, ad.in_features)?;
        let y = y.f32_mut(OP)?;
        ensure_rows(OP, "y", y.len(), n, ad.out_features)?;
        y[..n * ad.out_features]
            .par_chunks_mut(ad.out_features)
            .zip(x[..n * ad.in_features].par_chunks(ad.in_features))
            .zip(slots.par_iter())
            .with_min_len(min_items(ad.max_rank * (ad.in_features + ad.out_features)))
            .for_each_init(
                || vec![0f32; ad.max_rank],
                |v, ((yt, xt), &slot)| {
                    if ad.active(slot) {
                        // The same shrink and expand as SGMV, on a block of one token.
                        ad.shrink(slot, xt, v);
                        ad.expand(slot, v, yt);
                    }
                },
            );
        Ok(())
    }
}

#[cfg(test)]
mod tests;
