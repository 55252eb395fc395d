//! Descriptors that travel with op calls: where K/V live in a page, what a batch looks like.

/// How one KV block (a page of the pool) is laid out.
///
/// A page holds `block_size` consecutive tokens of one sequence, for every layer:
/// `[layer][k|v][kv_head][token_in_block][head_dim]`. One block table per sequence therefore
/// serves all layers, and a head's keys within a block are contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvLayout {
    /// f32 elements in one page.
    pub fn page_elems(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Element offset of token `slot_in_block` of `kv_head`, layer `layer`, K (`which = 0`) or
    /// V (`which = 1`), within page `page`.
    #[inline]
    pub fn offset(&self, page: usize, layer: usize, which: usize, kv_head: usize, slot_in_block: usize) -> usize {
        let per_head = self.block_size * self.head_dim;
        let per_kv = self.num_kv_heads * per_head;
        page * self.page_elems() + (layer * 2 + which) * per_kv + kv_head * per_head + slot_in_block * self.head_dim
    }
}

/// Shape and options of one layer's attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    pub layer: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier of q·k, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// When set, a query at position `p` sees only keys at positions `> p - window`.
    pub sliding_window: Option<usize>,
}

/// The layout of one forward batch: sequences of different lengths, flattened without padding.
///
/// Sequence `s` contributes query tokens `seq_starts[s] .. seq_starts[s + 1]` of the batch. They
/// are the last tokens of its context: after this step the sequence holds `context_lens[s]`
/// tokens in the cache, so its first new token sits at position
/// `context_lens[s] - (seq_starts[s + 1] - seq_starts[s])`. All index buffers hold u32.
#[derive(Debug)]
pub struct BatchMeta<Buf> {
    pub num_seqs: usize,
    pub num_tokens: usize,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: usize,
    /// `[num_tokens]`: each token's position in its sequence.
    pub positions: Buf,
    /// `[num_tokens]`: each token's cache slot, `page * block_size + offset_in_block`.
    pub slots: Buf,
    /// `[num_seqs + 1]`: prefix sums of query tokens per sequence.
    pub seq_starts: Buf,
    /// `[num_seqs]`: tokens in the cache per sequence once this step's tokens are written.
    pub context_lens: Buf,
    /// `[num_seqs, max_blocks_per_seq]`: the pages of each sequence, in order (padding unused).
    pub block_tables: Buf,
}
