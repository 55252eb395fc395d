//! Argument checks every backend runs on the host before an op touches memory: the batch layout,
//! the block tables, the LoRA directory and segments. Index buffers are always readable on the
//! host (the CPU's are host memory; the CUDA backend keeps a host copy of each u32 buffer it
//! uploads), so a bad index is an error before any launch, never an out-of-bounds read.

use crate::{AttentionParams, BatchMeta, KernelError, KvLayout, LORA_ROW_ALIGN, LoraRows, LoraTarget, NO_ADAPTER, NUM_MODULES, Result, RowDType};

/// A buffer whose u32 contents the host can read.
pub(crate) trait HostU32 {
    fn host_u32(&self, op: &'static str) -> Result<&[u32]>;
}

/// Fails with a shape error unless `len` is at least `need`.
pub(crate) fn ensure_len(op: &'static str, what: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(KernelError::Shape { op, detail: format!("{what} holds {len} elements, {need} needed") });
    }
    Ok(())
}

/// Fails with a shape error unless `len` is a whole number of `dim`-long rows; returns the rows.
pub(crate) fn rows_of(op: &'static str, what: &str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(KernelError::Shape { op, detail: format!("{what} holds {len} elements, not a multiple of the row length {dim}") });
    }
    Ok(len / dim)
}

/// Fails unless a buffer of `len` elements holds `rows` rows of `dim` (overflow included).
pub(crate) fn ensure_rows(op: &'static str, what: &str, len: usize, rows: usize, dim: usize) -> Result<()> {
    let need = rows.checked_mul(dim).ok_or_else(|| KernelError::Shape { op, detail: format!("{what}: {rows} rows of {dim} overflow") })?;
    ensure_len(op, what, len, need)
}

/// The most parts [`crate::DenseOps::split_columns`] takes (a fused q/k/v projection's).
pub(crate) const MAX_SPLIT_PARTS: usize = 3;

/// Checks a column split of `[rows, Σ widths]` from a buffer of `src_len` elements into parts of
/// `part_lens` elements: one to three parts, no empty width, every buffer long enough. Returns
/// the source's row length.
pub(crate) fn split_columns(op: &'static str, src_len: usize, rows: usize, parts: &[(usize, usize)]) -> Result<usize> {
    if parts.is_empty() || parts.len() > MAX_SPLIT_PARTS {
        return Err(KernelError::Shape { op, detail: format!("{} parts; one to {MAX_SPLIT_PARTS} are taken", parts.len()) });
    }
    let mut total = 0usize;
    for (i, &(len, width)) in parts.iter().enumerate() {
        if width == 0 {
            return Err(KernelError::Shape { op, detail: format!("part {i} has no columns") });
        }
        ensure_rows(op, "a part", len, rows, width)?;
        total = total.checked_add(width).ok_or_else(|| KernelError::Shape { op, detail: "the widths overflow".into() })?;
    }
    ensure_rows(op, "the source", src_len, rows, total)?;
    Ok(total)
}

/// The batch layout read back as host slices, checked once for consistency.
pub(crate) struct Batch<'a> {
    pub positions: &'a [u32],
    pub slots: &'a [u32],
    pub seq_starts: &'a [u32],
    pub context_lens: &'a [u32],
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
}

impl<'a> Batch<'a> {
    pub fn read<B: HostU32>(op: &'static str, meta: &'a BatchMeta<B>) -> Result<Self> {
        let m = Batch {
            positions: meta.positions.host_u32(op)?,
            slots: meta.slots.host_u32(op)?,
            seq_starts: meta.seq_starts.host_u32(op)?,
            context_lens: meta.context_lens.host_u32(op)?,
            block_tables: meta.block_tables.host_u32(op)?,
            max_blocks: meta.max_blocks_per_seq,
        };
        let (s, t) = (meta.num_seqs, meta.num_tokens);
        ensure_len(op, "positions", m.positions.len(), t)?;
        ensure_len(op, "slots", m.slots.len(), t)?;
        ensure_len(op, "seq_starts", m.seq_starts.len(), s + 1)?;
        ensure_len(op, "context_lens", m.context_lens.len(), s)?;
        ensure_rows(op, "block_tables", m.block_tables.len(), s, m.max_blocks)?;
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
        Ok(Batch { positions: &m.positions[..t], slots: &m.slots[..t], seq_starts: &m.seq_starts[..s + 1], context_lens: &m.context_lens[..s], ..m })
    }

    pub fn num_seqs(&self) -> usize {
        self.context_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }

    /// Fails unless every token's slot lies in one of `pages` pages.
    pub fn check_slots(&self, op: &'static str, layout: &KvLayout, pages: usize) -> Result<()> {
        for &slot in self.slots {
            let page = slot as usize / layout.block_size;
            if page >= pages {
                return Err(KernelError::Index { op, index: page, limit: pages });
            }
        }
        Ok(())
    }

    /// The checks attention needs: the params fit the layout, each sequence's table covers its
    /// context with pages that exist, each token's position lies inside its context. Returns the
    /// sequence of each token.
    pub fn check_attention(&self, op: &'static str, layout: &KvLayout, p: &AttentionParams, pages: usize) -> Result<Vec<u32>> {
        if p.num_kv_heads == 0
            || !p.num_heads.is_multiple_of(p.num_kv_heads)
            || p.num_kv_heads != layout.num_kv_heads
            || p.head_dim != layout.head_dim
            || p.layer >= layout.num_layers
        {
            return Err(KernelError::Shape { op, detail: format!("attention params {p:?} do not fit the KV layout {layout:?}") });
        }
        for (s, &len) in self.context_lens.iter().enumerate() {
            let blocks = (len as usize).div_ceil(layout.block_size);
            if blocks > self.max_blocks {
                return Err(KernelError::Shape { op, detail: format!("sequence {s} needs {blocks} blocks, its table has {}", self.max_blocks) });
            }
            let table = &self.block_tables[s * self.max_blocks..s * self.max_blocks + blocks];
            if let Some(&bad) = table.iter().find(|&&b| b as usize >= pages) {
                return Err(KernelError::Index { op, index: bad as usize, limit: pages });
            }
        }
        let mut token_seq = vec![0u32; self.num_tokens()];
        for s in 0..self.num_seqs() {
            token_seq[self.seq_starts[s] as usize..self.seq_starts[s + 1] as usize].fill(s as u32);
        }
        for (t, &s) in token_seq.iter().enumerate() {
            let (pos, ctx) = (self.positions[t] as usize, self.context_lens[s as usize] as usize);
            if pos >= ctx {
                return Err(KernelError::Index { op, index: pos, limit: ctx });
            }
        }
        Ok(token_seq)
    }
}

/// One slot's rows for a LoRA target, checked against the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotEntry {
    pub dtype: RowDType,
    /// First index into `a_rows` / `b_rows`.
    pub first: usize,
    /// 0 when the slot does not target the module.
    pub rank: usize,
}

/// The LoRA directory read back and checked: every slot's entry for the target, its row offsets
/// inside the pool (of `pool_len` f32 elements).
pub(crate) struct Directory<'a> {
    pub slots: Vec<SlotEntry>,
    pub a_rows: &'a [u32],
    pub b_rows: &'a [u32],
}

impl<'a> Directory<'a> {
    pub fn read<B: HostU32>(op: &'static str, rows: &'a LoraRows<B>, target: &LoraTarget, pool_len: usize) -> Result<Self> {
        let directory = rows.directory.host_u32(op)?;
        let a_rows = rows.a_rows.host_u32(op)?;
        let b_rows = rows.b_rows.host_u32(op)?;
        let slot_dtypes = rows.slot_dtypes.host_u32(op)?;
        ensure_len(op, "slot_dtypes", slot_dtypes.len(), rows.num_slots)?;
        let LoraTarget { layer, module, in_features, out_features, max_rank } = *target;
        if in_features == 0 || out_features == 0 || max_rank == 0 {
            return Err(KernelError::Shape { op, detail: format!("LoRA target {target:?} has a zero dimension") });
        }
        if layer >= rows.num_layers {
            return Err(KernelError::Index { op, index: layer, limit: rows.num_layers });
        }
        if module >= NUM_MODULES {
            return Err(KernelError::Index { op, index: module, limit: NUM_MODULES });
        }
        let entries = rows
            .num_slots
            .checked_mul(rows.num_layers)
            .and_then(|n| n.checked_mul(NUM_MODULES * 2))
            .ok_or_else(|| KernelError::Shape { op, detail: format!("{} slots × {} layers overflow", rows.num_slots, rows.num_layers) })?;
        ensure_len(op, "directory", directory.len(), entries)?;
        let mut slots = Vec::with_capacity(rows.num_slots);
        for (slot, &d) in slot_dtypes[..rows.num_slots].iter().enumerate() {
            let dtype = RowDType::from_u32(d).ok_or_else(|| KernelError::Shape { op, detail: format!("slot {slot} has an unknown row dtype {d}") })?;
            let e = rows.entry(slot, layer, module);
            let (first, rank) = (directory[e] as usize, directory[e + 1] as usize);
            if rank > max_rank {
                return Err(KernelError::Shape {
                    op,
                    detail: format!("slot {slot} has rank {rank} at layer {layer} module {module}, more than max_rank {max_rank}"),
                });
            }
            let end = first.saturating_add(rank);
            if rank > 0 && (end > a_rows.len() || end > b_rows.len()) {
                return Err(KernelError::Shape {
                    op,
                    detail: format!(
                        "slot {slot} names rows {first}..{end} at layer {layer} module {module}; a_rows holds {}, b_rows {}",
                        a_rows.len(),
                        b_rows.len()
                    ),
                });
            }
            if rank > 0 {
                check_offsets(op, &a_rows[first..end], dtype.slots(in_features), pool_len)?;
                check_offsets(op, &b_rows[first..end], dtype.slots(out_features), pool_len)?;
            }
            slots.push(SlotEntry { dtype, first: if rank == 0 { 0 } else { first }, rank });
        }
        Ok(Directory { slots, a_rows, b_rows })
    }

    /// Whether `slot` changes anything for this target.
    pub fn active(&self, slot: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.rank > 0)
    }
}

/// Fails unless every row at `offsets` (in `LORA_ROW_ALIGN` units) lies wholly inside the pool.
fn check_offsets(op: &'static str, offsets: &[u32], len: usize, pool_len: usize) -> Result<()> {
    // Offsets 0..limit are the ones whose `len` elements fit.
    let limit = if pool_len >= len { (pool_len - len) / LORA_ROW_ALIGN + 1 } else { 0 };
    match offsets.iter().find(|&&off| off as usize >= limit) {
        Some(&off) => Err(KernelError::Index { op, index: off as usize, limit }),
        None => Ok(()),
    }
}

/// The segment table read back as host slices and checked.
pub(crate) struct Segments<'a> {
    pub starts: &'a [u32],
    pub slots: &'a [u32],
    pub tokens: usize,
}

impl<'a> Segments<'a> {
    pub fn read<B: HostU32>(op: &'static str, segs: &'a crate::LoraSegments<B>, num_slots: usize) -> Result<Self> {
        let n = segs.num_segments;
        let starts = segs.seg_starts.host_u32(op)?;
        let slots = segs.seg_slots.host_u32(op)?;
        ensure_len(op, "seg_starts", starts.len(), n.saturating_add(1))?;
        ensure_len(op, "seg_slots", slots.len(), n)?;
        if starts[0] != 0 {
            return Err(KernelError::Shape { op, detail: format!("seg_starts begins at {}, not 0", starts[0]) });
        }
        for s in 0..n {
            if starts[s + 1] < starts[s] {
                return Err(KernelError::Shape { op, detail: format!("segment {s} runs from token {} back to {}", starts[s], starts[s + 1]) });
            }
        }
        check_slots(op, &slots[..n], num_slots)?;
        Ok(Segments { starts: &starts[..n + 1], slots: &slots[..n], tokens: starts[n] as usize })
    }
}

/// Fails unless every slot names one of `num_slots` adapters or is [`NO_ADAPTER`].
pub(crate) fn check_slots(op: &'static str, slots: &[u32], num_slots: usize) -> Result<()> {
    match slots.iter().find(|&&s| s != NO_ADAPTER && s as usize >= num_slots) {
        Some(&bad) => Err(KernelError::Index { op, index: bad as usize, limit: num_slots }),
        None => Ok(()),
    }
}
