//! Turning the sequences chosen for a step into one flat forward batch.

use loraplex_kernels::{Backend, BatchMeta, KernelError};

use crate::model::ForwardBatch;

/// One sequence's share of a step: `tokens` new tokens starting at position `start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    /// Cache slots of `tokens`, one each.
    pub slots: Vec<u32>,
    /// The sequence's pages, in order.
    pub pages: &'a [u32],
    /// Whether the last token of the chunk needs next-token logits.
    pub wants_logits: bool,
}

/// The host side of a forward batch, before upload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct HostBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq_starts: Vec<u32>,
    pub context_lens: Vec<u32>,
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    pub logit_rows: Vec<u32>,
}

impl HostBatch {
    pub fn build(chunks: &[Chunk<'_>]) -> Self {
        let max_blocks = chunks.iter().map(|c| c.pages.len()).max().unwrap_or(0).max(1);
        let mut b = HostBatch { seq_starts: vec![0], max_blocks, ..Default::default() };
        for c in chunks {
            b.token_ids.extend_from_slice(c.tokens);
            b.positions.extend((c.start..c.start + c.tokens.len()).map(|p| p as u32));
            b.slots.extend_from_slice(&c.slots);
            b.seq_starts.push(b.token_ids.len() as u32);
            b.context_lens.push((c.start + c.tokens.len()) as u32);
            b.block_tables.extend_from_slice(c.pages);
            b.block_tables.resize(b.block_tables.len() + max_blocks - c.pages.len(), 0);
            if c.wants_logits {
                b.logit_rows.push(b.token_ids.len() as u32 - 1);
            }
        }
        b
    }

    pub fn upload<B: Backend>(&self, backend: &B) -> Result<ForwardBatch<B>, KernelError> {
        Ok(ForwardBatch {
            token_ids: backend.upload_u32(&self.token_ids)?,
            meta: BatchMeta {
                num_seqs: self.context_lens.len(),
                num_tokens: self.token_ids.len(),
                max_blocks_per_seq: self.max_blocks,
                positions: backend.upload_u32(&self.positions)?,
                slots: backend.upload_u32(&self.slots)?,
                seq_starts: backend.upload_u32(&self.seq_starts)?,
                context_lens: backend.upload_u32(&self.context_lens)?,
                block_tables: backend.upload_u32(&self.block_tables)?,
            },
            logit_rows: backend.upload_u32(&self.logit_rows)?,
            num_logit_rows: self.logit_rows.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattens_prefill_and_decode_without_padding() {
        let prompt = [5, 6, 7];
        let next = [9];
        let chunks = [
            Chunk { tokens: &prompt, start: 0, slots: vec![8, 9, 10], pages: &[2], wants_logits: true },
            Chunk { tokens: &next, start: 17, slots: vec![5], pages: &[0, 3, 1], wants_logits: true },
            Chunk { tokens: &prompt[..2], start: 0, slots: vec![16, 17], pages: &[4], wants_logits: false },
        ];
        let b = HostBatch::build(&chunks);
        assert_eq!(b.token_ids, vec![5, 6, 7, 9, 5, 6]);
        assert_eq!(b.positions, vec![0, 1, 2, 17, 0, 1]);
        assert_eq!(b.seq_starts, vec![0, 3, 4, 6]);
        assert_eq!(b.context_lens, vec![3, 18, 2]);
        assert_eq!(b.max_blocks, 3);
        assert_eq!(b.block_tables, vec![2, 0, 0, 0, 3, 1, 4, 0, 0]);
        assert_eq!(b.logit_rows, vec![2, 3]);
    }
}
