//! Rotary embeddings, KV writes into pages, and paged attention on the CPU.

use rayon::prelude::*;

use super::isa::{Isa, Kernel};
use super::simd::Elem;
use super::{CpuBackend, CpuBuffer, ensure_len, min_items, rows_of, simd};
use crate::check::Batch;
use crate::{AttentionOps, AttentionParams, BatchMeta, KernelError, KvLayout, Result, RowDType};

impl AttentionOps for CpuBackend {
    fn rope(&self, x: &mut CpuBuffer, positions: &CpuBuffer, cos_sin: &CpuBuffer, heads: usize, head_dim: usize) -> Result<()> {
        const OP: &str = "rope";
        if !head_dim.is_multiple_of(2) {
            return Err(KernelError::Shape { op: OP, detail: format!("head_dim {head_dim} is odd") });
        }
        let positions = positions.u32(OP)?;
        let table = cos_sin.f32(OP)?;
        let max_pos = rows_of(OP, "cos_sin", table.len(), head_dim)?;
        let x = x.f32_mut(OP)?;
        let row = heads * head_dim;
        ensure_len(OP, "x", x.len(), positions.len() * row)?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= max_pos) {
            return Err(KernelError::Index { op: OP, index: p as usize, limit: max_pos });
        }
        let half = head_dim / 2;
        x[..positions.len() * row].par_chunks_mut(row).zip(positions.par_iter()).with_min_len(min_items(row)).for_each(|(xt, &pos)| {
            let base = pos as usize * head_dim;
            let (cos, sin) = table[base..base + head_dim].split_at(half);
            for h in xt.chunks_exact_mut(head_dim) {
                let (x1, x2) = h.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * cos[i] - b * sin[i];
                    x2[i] = b * cos[i] + a * sin[i];
                }
            }
        });
        Ok(())
    }

    fn write_kv(&self, k: &CpuBuffer, v: &CpuBuffer, cache: &mut CpuBuffer, meta: &BatchMeta<CpuBuffer>, layout: &KvLayout, layer: usize) -> Result<()> {
        const OP: &str = "write_kv";
        let m = Batch::read(OP, meta)?;
        let (k, v) = (k.f32(OP)?, v.f32(OP)?);
        let row = layout.num_kv_heads * layout.head_dim;
        let tokens = meta.num_tokens;
        ensure_len(OP, "k", k.len(), tokens * row)?;
        ensure_len(OP, "v", v.len(), tokens * row)?;
        if layer >= layout.num_layers {
            return Err(KernelError::Index { op: OP, index: layer, limit: layout.num_layers });
        }
        let cache = cache.f32_mut(OP)?;
        let pages = cache.len() / layout.page_elems();
        m.check_slots(OP, layout, pages)?;
        let hd = layout.head_dim;
        // The destination of each head's row of K and V, as an offset in values of the layout's
        // type.
        let rows = (0..tokens).flat_map(|t| {
            let slot = m.slots[t] as usize;
            let (page, off) = (slot / layout.block_size, slot % layout.block_size);
            (0..layout.num_kv_heads).map(move |h| (t * row + h * hd, layout.offset(page, layer, 0, h, off), layout.offset(page, layer, 1, h, off)))
        });
        match layout.dtype {
            RowDType::F32 => {
                for (src, kd, vd) in rows {
                    cache[kd..kd + hd].copy_from_slice(&k[src..src + hd]);
                    cache[vd..vd + hd].copy_from_slice(&v[src..src + hd]);
                }
            }
            RowDType::Bf16 => {
                let cache: &mut [u16] = bytemuck::cast_slice_mut(cache);
                let round = |dst: &mut [u16], src: &[f32]| dst.iter_mut().zip(src).for_each(|(d, &x)| *d = half::bf16::from_f32(x).to_bits());
                for (src, kd, vd) in rows {
                    round(&mut cache[kd..kd + hd], &k[src..src + hd]);
                    round(&mut cache[vd..vd + hd], &v[src..src + hd]);
                }
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        cache: &CpuBuffer,
        out: &mut CpuBuffer,
        meta: &BatchMeta<CpuBuffer>,
        layout: &KvLayout,
        p: &AttentionParams,
    ) -> Result<()> {
        const OP: &str = "attention";
        let m = Batch::read(OP, meta)?;
        let (hd, heads) = (p.head_dim, p.num_heads);
        let q = q.f32(OP)?;
        ensure_len(OP, "q", q.len(), meta.num_tokens * heads * hd)?;
        let cache = cache.f32(OP)?;
        let token_seq = m.check_attention(OP, layout, p, cache.len() / layout.page_elems())?;
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), meta.num_tokens * heads * hd)?;
        let group = heads / p.num_kv_heads;
        let cache = match layout.dtype {
            RowDType::F32 => Cache::F32(cache),
            RowDType::Bf16 => Cache::Bf16(bytemuck::cast_slice(cache)),
        };
        let ctx = Attend { m: &m, q, cache, token_seq: &token_seq, layout, p, group };
        let path = self.path;
        // One task per (token, kv head): the group of query heads sharing that kv head reuses
        // each key and value row while it is in cache.
        // A token reads at most the keys up to its position, each twice (scores, then values).
        let work = m.positions.iter().fold(0usize, |w, &pos| w.saturating_add((pos as usize + 1).saturating_mul(2 * heads * hd)));
        let tasks = (meta.num_tokens * p.num_kv_heads).max(1);
        out[..meta.num_tokens * heads * hd].par_chunks_mut(group * hd).with_min_len(min_items(work / tasks)).enumerate().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, (task, o)| {
                path.run(AttendTask { ctx: &ctx, scores, task, out: o });
            },
        );
        Ok(())
    }
}

/// The pool's K and V values, read as the layout's type.
#[derive(Clone, Copy)]
enum Cache<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// What every attention task reads.
struct Attend<'a> {
    m: &'a Batch<'a>,
    q: &'a [f32],
    cache: Cache<'a>,
    token_seq: &'a [u32],
    layout: &'a KvLayout,
    p: &'a AttentionParams,
    group: usize,
}

/// The query heads of one (token, kv head) pair against that sequence's keys and values.
struct AttendTask<'a> {
    ctx: &'a Attend<'a>,
    scores: &'a mut Vec<f32>,
    task: usize,
    out: &'a mut [f32],
}

impl Kernel for AttendTask<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Isa>(self, s: S) {
        match self.ctx.cache {
            Cache::F32(cache) => attend(s, self, cache),
            Cache::Bf16(cache) => attend(s, self, cache),
        }
    }
}

/// The query heads of one (token, kv head) pair against its sequence's keys, then values. The
/// keys and values are walked once, page by page: each row is read from memory once and serves
/// every query head of the group from L1, and the same row of the next page is asked for
/// meanwhile (a sequence's pages lie anywhere in the pool, where the CPU's own prefetcher loses
/// the stream). A page's rows go through the batched kernels together: eight scores' sums in
/// flight at once, and each output row loaded and stored once a page instead of once a value.
/// Each score depends on its query and key alone, and each output element sums its values in
/// position order, whatever the batch.
#[inline(always)]
fn attend<S: Isa, E: Elem>(s: S, task: AttendTask<'_>, cache: &[E]) {
    let AttendTask { ctx, scores, task, out: o } = task;
    let Attend { m, q, token_seq, layout, p, group, .. } = *ctx;
    let (hd, heads) = (p.head_dim, p.num_heads);
    let (t, kvh) = (task / p.num_kv_heads, task % p.num_kv_heads);
    let seq = token_seq[t] as usize;
    let last = m.positions[t] as usize;
    let first = p.sliding_window.map_or(0, |w| (last + 1).saturating_sub(w));
    let table = &m.block_tables[seq * m.max_blocks..];
    let n = last + 1 - first;
    let qs = &q[(t * heads + kvh * group) * hd..][..group * hd];
    scores.resize(group * n, 0.0);
    page_rows(s, cache, layout, table, p.layer, 0, kvh, first, last, |j, keys| {
        for (g, qh) in qs.chunks_exact(hd).enumerate() {
            let sc = &mut scores[g * n + j..][..keys.len()];
            simd::dots_rows(s, qh, keys, sc);
        }
    });
    for sc in scores.chunks_exact_mut(n) {
        simd::softmax_scaled(s, sc, p.scale);
    }
    o[..group * hd].fill(0.0);
    page_rows(s, cache, layout, table, p.layer, 1, kvh, first, last, |j, values| {
        for (g, oh) in o[..group * hd].chunks_exact_mut(hd).enumerate() {
            simd::axpys_rows(s, oh, &scores[g * n + j..][..values.len()], values);
        }
    });
}

/// Most rows handed over at once by [`page_rows`].
const PAGE_ROWS: usize = 16;

/// Calls `f(j, rows)` with the K (`which` 0) or V (1) rows of positions `first..=last` of one
/// kv head, up to [`PAGE_ROWS`] of one page at a time, `j` the first one's index counting from
/// `first`: the sequence's pages (`table`) in order, the same rows of the next page prefetched.
#[allow(clippy::too_many_arguments)] // a row's address: page table, layer, K or V, head, range
#[inline(always)]
fn page_rows<'c, S: Isa, E: Elem>(
    s: S,
    cache: &'c [E],
    layout: &KvLayout,
    table: &[u32],
    layer: usize,
    which: usize,
    kvh: usize,
    first: usize,
    last: usize,
    mut f: impl FnMut(usize, &[&'c [E]]),
) {
    let (bs, hd) = (layout.block_size, layout.head_dim);
    let row_bytes = hd * std::mem::size_of::<E>();
    let (b0, b1) = (first / bs, last / bs);
    let mut rows: [&[E]; PAGE_ROWS] = [&[]; PAGE_ROWS];
    let mut j = 0;
    for b in b0..=b1 {
        let base = layout.offset(table[b] as usize, layer, which, kvh, 0);
        let next = (b < b1).then(|| cache[layout.offset(table[b + 1] as usize, layer, which, kvh, 0)..].as_ptr() as *const u8);
        let mut slot = if b == b0 { first % bs } else { 0 };
        let end = if b == b1 { last % bs + 1 } else { bs };
        while slot < end {
            let count = PAGE_ROWS.min(end - slot);
            for (r, row) in rows[..count].iter_mut().enumerate() {
                let at = slot + r;
                if let Some(next) = next {
                    for line in (0..row_bytes).step_by(64) {
                        s.prefetch_l2(next.wrapping_add(at * row_bytes + line));
                    }
                }
                *row = &cache[base + at * hd..base + (at + 1) * hd];
            }
            f(j, &rows[..count]);
            j += count;
            slot += count;
        }
    }
}

#[cfg(test)]
mod tests;
