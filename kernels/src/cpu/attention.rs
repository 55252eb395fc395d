//! Rotary embeddings, KV writes into pages, and paged attention on the CPU.

use rayon::prelude::*;

use super::{CpuBackend, CpuBuffer, ensure_len, rows_of, simd};
use crate::{AttentionOps, AttentionParams, BatchMeta, KernelError, KvLayout, Result};

/// The batch layout read back as host slices, checked once for consistency.
struct Meta<'a> {
    positions: &'a [u32],
    slots: &'a [u32],
    seq_starts: &'a [u32],
    context_lens: &'a [u32],
    block_tables: &'a [u32],
    max_blocks: usize,
}

impl<'a> Meta<'a> {
    fn read(op: &'static str, meta: &'a BatchMeta<CpuBuffer>) -> Result<Self> {
        let m = Meta {
            positions: meta.positions.u32(op)?,
            slots: meta.slots.u32(op)?,
            seq_starts: meta.seq_starts.u32(op)?,
            context_lens: meta.context_lens.u32(op)?,
            block_tables: meta.block_tables.u32(op)?,
            max_blocks: meta.max_blocks_per_seq,
        };
        let (s, t) = (meta.num_seqs, meta.num_tokens);
        ensure_len(op, "positions", m.positions.len(), t)?;
        ensure_len(op, "slots", m.slots.len(), t)?;
        ensure_len(op, "seq_starts", m.seq_starts.len(), s + 1)?;
        ensure_len(op, "context_lens", m.context_lens.len(), s)?;
        ensure_len(op, "block_tables", m.block_tables.len(), s * m.max_blocks)?;
        if m.seq_starts[0] != 0 || m.seq_starts[s] as usize != t {
            return Err(KernelError::Shape { op, detail: format!("seq_starts must run from 0 to {t}") });
        }
        for i in 0..s {
            let (a, b) = (m.seq_starts[i] as usize, m.seq_starts[i + 1] as usize);
            if b < a || b - a > m.context_lens[i] as usize {
                return Err(KernelError::Shape {
                    op,
                    detail: format!("sequence {i} has {} new tokens but a context of {}", b.wrapping_sub(a), m.context_lens[i]),
                });
            }
        }
        Ok(m)
    }
}

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
        x[..positions.len() * row].par_chunks_mut(row).zip(positions.par_iter()).for_each(|(xt, &pos)| {
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

    fn write_kv(
        &self,
        k: &CpuBuffer,
        v: &CpuBuffer,
        cache: &mut CpuBuffer,
        meta: &BatchMeta<CpuBuffer>,
        layout: &KvLayout,
        layer: usize,
    ) -> Result<()> {
        const OP: &str = "write_kv";
        let m = Meta::read(OP, meta)?;
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
        let hd = layout.head_dim;
        for t in 0..tokens {
            let slot = m.slots[t] as usize;
            let (page, off) = (slot / layout.block_size, slot % layout.block_size);
            if page >= pages {
                return Err(KernelError::Index { op: OP, index: page, limit: pages });
            }
            for h in 0..layout.num_kv_heads {
                let src = t * row + h * hd;
                let kd = layout.offset(page, layer, 0, h, off);
                cache[kd..kd + hd].copy_from_slice(&k[src..src + hd]);
                let vd = layout.offset(page, layer, 1, h, off);
                cache[vd..vd + hd].copy_from_slice(&v[src..src + hd]);
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
        let m = Meta::read(OP, meta)?;
        if p.num_kv_heads == 0 || !p.num_heads.is_multiple_of(p.num_kv_heads) || p.num_kv_heads != layout.num_kv_heads
            || p.head_dim != layout.head_dim || p.layer >= layout.num_layers
        {
            return Err(KernelError::Shape { op: OP, detail: format!("attention params {p:?} do not fit the KV layout {layout:?}") });
        }
        let (hd, heads) = (p.head_dim, p.num_heads);
        let q = q.f32(OP)?;
        ensure_len(OP, "q", q.len(), meta.num_tokens * heads * hd)?;
        let cache = cache.f32(OP)?;
        let pages = cache.len() / layout.page_elems();
        for (s, &len) in m.context_lens.iter().enumerate() {
            let blocks = (len as usize).div_ceil(layout.block_size);
            if blocks > m.max_blocks {
                return Err(KernelError::Shape { op: OP, detail: format!("sequence {s} needs {blocks} blocks, its table has {}", m.max_blocks) });
            }
            let table = &m.block_tables[s * m.max_blocks..s * m.max_blocks + blocks];
            if let Some(&bad) = table.iter().find(|&&b| b as usize >= pages) {
                return Err(KernelError::Index { op: OP, index: bad as usize, limit: pages });
            }
        }
        // The sequence each token belongs to.
        let mut token_seq = vec![0u32; meta.num_tokens];
        for s in 0..meta.num_seqs {
            token_seq[m.seq_starts[s] as usize..m.seq_starts[s + 1] as usize].fill(s as u32);
        }
        for (t, &s) in token_seq.iter().enumerate() {
            let (pos, ctx) = (m.positions[t] as usize, m.context_lens[s as usize] as usize);
            if pos >= ctx {
                return Err(KernelError::Index { op: OP, index: pos, limit: ctx });
            }
        }
        let out = out.f32_mut(OP)?;
        ensure_len(OP, "out", out.len(), meta.num_tokens * heads * hd)?;
        let group = heads / p.num_kv_heads;
        let bs = layout.block_size;
        // One task per (token, kv head): the group of query heads sharing that kv head reuses
        // each key and value row while it is in cache.
        out[..meta.num_tokens * heads * hd]
            .par_chunks_mut(group * hd)
            .enumerate()
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, (task, o)| {
                let (t, kvh) = (task / p.num_kv_heads, task % p.num_kv_heads);
                let s = token_seq[t] as usize;
                let pos = m.positions[t] as usize;
                let last = pos;
                let first = p.sliding_window.map_or(0, |w| (last + 1).saturating_sub(w));
                let table = &m.block_tables[s * m.max_blocks..];
                let n = last + 1 - first;
                scores.resize(group * n, 0.0);
                for g in 0..group {
                    let h = kvh * group + g;
                    let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
                    let sc = &mut scores[g * n..(g + 1) * n];
                    for (j, key_pos) in (first..=last).enumerate() {
                        let off = layout.offset(table[key_pos / bs] as usize, p.layer, 0, kvh, key_pos % bs);
                        sc[j] = simd::dot(qh, &cache[off..off + hd]) * p.scale;
                    }
                    softmax_in_place(sc);
                    let oh = &mut o[g * hd..(g + 1) * hd];
                    oh.fill(0.0);
                    for (j, key_pos) in (first..=last).enumerate() {
                        let off = layout.offset(table[key_pos / bs] as usize, p.layer, 1, kvh, key_pos % bs);
                        simd::axpy(oh, sc[j], &cache[off..off + hd]);
                    }
                }
            });
        Ok(())
    }
}

fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests;
