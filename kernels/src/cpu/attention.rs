//! Rotary embeddings, KV writes into pages, and paged attention on the CPU.

use rayon::prelude::*;

use super::isa::{Isa, Kernel};
use super::simd::Elem;
use super::{CpuBackend, CpuBuffer, OutPtr, ensure_len, min_items, rows_of, simd};
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
        // Each sequence's tokens in blocks of at most QUERY_BLOCK, and one task per (kv head,
        // block): every key and value row a task reads serves the query heads sharing that kv
        // head for every token of its block. Tasks of one kv head come in turn, so one thread
        // walks a sequence's rows of one head block after block while they are still in cache.
        let blocks: Vec<(usize, usize)> = (0..meta.num_seqs)
            .flat_map(|s| {
                let (start, end) = (m.seq_starts[s] as usize, m.seq_starts[s + 1] as usize);
                (start..end).step_by(QUERY_BLOCK).map(move |b| (b, QUERY_BLOCK.min(end - b)))
            })
            .collect();
        let tasks = (blocks.len() * p.num_kv_heads).max(1);
        // A token reads at most the keys up to its position, each twice (scores, then values).
        let work = m.positions.iter().fold(0usize, |w, &pos| w.saturating_add((pos as usize + 1).saturating_mul(2 * heads * hd)));
        let dst = OutPtr(out.as_mut_ptr());
        (0..blocks.len() * p.num_kv_heads).into_par_iter().with_min_len(min_items(work / tasks)).for_each_init(Vec::new, |scores: &mut Vec<f32>, i| {
            let (first, len) = blocks[i % blocks.len()];
            path.run(AttendTask { ctx: &ctx, scores, tokens: first..first + len, kvh: i / blocks.len(), out: dst });
        });
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

/// Query tokens of one sequence attended together: each key and value row read serves all of
/// them (prefill; a decode step has one token a sequence).
const QUERY_BLOCK: usize = 8;

/// The query heads of one kv head for a block of one sequence's tokens, against that
/// sequence's keys and values.
struct AttendTask<'a> {
    ctx: &'a Attend<'a>,
    scores: &'a mut Vec<f32>,
    tokens: std::ops::Range<usize>,
    kvh: usize,
    out: OutPtr,
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

/// The query heads of one kv head, for each token of a block of one sequence, against the
/// sequence's keys, then values. The keys and values are walked once for the whole block, page by
/// page, from the block's earliest visible position to its latest: each row is read from memory
/// once and serves every query head of the group for every token that sees it, from L1, and the
/// same row of the next page is asked for meanwhile (a sequence's pages lie anywhere in the pool,
/// where the CPU's own prefetcher loses the stream). A page's rows go through the tiled kernels
/// together: the scores four query heads by four keys at a time, and the values each loaded once
/// for four query heads, their outputs held in registers over the page. Each score depends on its
/// query and key alone, and each output element sums its values in position order, so a token's
/// result is the same bits whatever its block and batch.
#[inline(always)]
fn attend<S: Isa, E: Elem>(s: S, task: AttendTask<'_>, cache: &[E]) {
    // No closures here: a closure is a function of its own, compiled without the path's target
    // features, and the vector code inlined into it would become calls.
    let AttendTask { ctx, scores, tokens, kvh, out } = task;
    let Attend { m, q, token_seq, layout, p, group, .. } = *ctx;
    let (hd, heads) = (p.head_dim, p.num_heads);
    let seq = token_seq[tokens.start] as usize;
    let table = &m.block_tables[seq * m.max_blocks..];
    let (mut lo, mut hi) = (usize::MAX, 0);
    for t in tokens.clone() {
        let (first, last) = span(m, p, t);
        (lo, hi) = (lo.min(first), hi.max(last));
    }
    // The scores of token i (counting from the block's first), query head g, at
    // (i * group + g) * width + position - its first.
    let width = hi + 1 - lo;
    scores.resize(tokens.len() * group * width, 0.0);
    let mut rows: [&[E]; PAGE_ROWS] = [&[]; PAGE_ROWS];
    let mut keys = PageRows::new(cache, layout, table, p.layer, 0, kvh, lo, hi);
    while let Some((j, count)) = keys.next(s, &mut rows) {
        for (i, t) in tokens.clone().enumerate() {
            let Some((seen, at)) = visible(m, p, t, lo + j, count) else { continue };
            let qs = &q[(t * heads + kvh * group) * hd..][..group * hd];
            simd::dots_queries(s, qs, hd, &rows[seen], &mut scores[i * group * width + at..], width);
        }
    }
    for (i, t) in tokens.clone().enumerate() {
        let (first, last) = span(m, p, t);
        for g in 0..group {
            simd::softmax_scaled(s, &mut scores[(i * group + g) * width..][..last + 1 - first], p.scale);
        }
        // SAFETY: token t's query heads of this kv head, (t * heads + kvh * group) * hd and
        // the group * hd values after it, lie inside the output (`attention` checked its length
        // for every token of the batch), and no other task writes them; no other reference to
        // them is live.
        unsafe { std::slice::from_raw_parts_mut(out.at((t * heads + kvh * group) * hd).0, group * hd) }.fill(0.0);
    }
    let mut values = PageRows::new(cache, layout, table, p.layer, 1, kvh, lo, hi);
    while let Some((j, count)) = values.next(s, &mut rows) {
        for (i, t) in tokens.clone().enumerate() {
            let Some((seen, at)) = visible(m, p, t, lo + j, count) else { continue };
            // SAFETY: as above.
            let o = unsafe { std::slice::from_raw_parts_mut(out.at((t * heads + kvh * group) * hd).0, group * hd) };
            simd::axpys_queries(s, o, hd, &scores[i * group * width + at..], width, &rows[seen]);
        }
    }
}

/// The positions token `t` attends to, `first..=last`.
#[inline(always)]
fn span(m: &Batch<'_>, p: &AttentionParams, t: usize) -> (usize, usize) {
    let last = m.positions[t] as usize;
    (p.sliding_window.map_or(0, |w| (last + 1).saturating_sub(w)), last)
}

/// Which of `count` rows at positions `from..` token `t` sees, as a range of them, and where the
/// first of those falls among the token's own scores; `None` for none.
#[inline(always)]
fn visible(m: &Batch<'_>, p: &AttentionParams, t: usize, from: usize, count: usize) -> Option<(std::ops::Range<usize>, usize)> {
    let (first, last) = span(m, p, t);
    let (a, b) = (from.max(first), (from + count).min(last + 1));
    (a < b).then(|| (a - from..b - from, a - first))
}

/// Most rows handed over at once by [`PageRows`].
const PAGE_ROWS: usize = 16;

/// The K (`which` 0) or V (1) rows of positions `first..=last` of one kv head, up to
/// [`PAGE_ROWS`] of one page at a time: the sequence's pages (`table`) in order, the same rows of
/// the next page prefetched.
struct PageRows<'c, 'a, E> {
    cache: &'c [E],
    layout: &'a KvLayout,
    table: &'a [u32],
    layer: usize,
    which: usize,
    kvh: usize,
    last: usize,
    /// The page (index into the table) and slot of the next row, and its index from `first`.
    block: usize,
    slot: usize,
    j: usize,
}

impl<'c, 'a, E: Elem> PageRows<'c, 'a, E> {
    #[allow(clippy::too_many_arguments)] // a row's address: page table, layer, K or V, head, range
    #[inline(always)]
    fn new(cache: &'c [E], layout: &'a KvLayout, table: &'a [u32], layer: usize, which: usize, kvh: usize, first: usize, last: usize) -> Self {
        let bs = layout.block_size;
        PageRows { cache, layout, table, layer, which, kvh, last, block: first / bs, slot: first % bs, j: 0 }
    }

    /// Fills the front of `rows` with the next rows and returns the index of the first (counting
    /// from `first`) and how many; `None` past `last`.
    #[inline(always)]
    fn next<S: Isa>(&mut self, s: S, rows: &mut [&'c [E]; PAGE_ROWS]) -> Option<(usize, usize)> {
        let (bs, hd, b) = (self.layout.block_size, self.layout.head_dim, self.block);
        let b1 = self.last / bs;
        if b > b1 {
            return None;
        }
        let row_bytes = hd * std::mem::size_of::<E>();
        let base = self.layout.offset(self.table[b] as usize, self.layer, self.which, self.kvh, 0);
        let next = (b < b1).then(|| self.cache[self.layout.offset(self.table[b + 1] as usize, self.layer, self.which, self.kvh, 0)..].as_ptr() as *const u8);
        let end = if b == b1 { self.last % bs + 1 } else { bs };
        let count = PAGE_ROWS.min(end - self.slot);
        for (r, row) in rows[..count].iter_mut().enumerate() {
            let at = self.slot + r;
            if let Some(next) = next {
                for line in (0..row_bytes).step_by(64) {
                    s.prefetch_l2(next.wrapping_add(at * row_bytes + line));
                }
            }
            *row = &self.cache[base + at * hd..base + (at + 1) * hd];
        }
        let j = self.j;
        self.j += count;
        self.slot += count;
        if self.slot == end {
            (self.block, self.slot) = (b + 1, 0);
        }
        Some((j, count))
    }
}

#[cfg(test)]
mod tests;
