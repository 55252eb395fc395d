//! Descriptors that travel with op calls: where K/V live in a page, what a batch looks like.

/// How one KV block (a page of the pool) is laid out.
///
/// A page holds `block_size` consecutive tokens of one sequence, for every layer:
/// `[layer][k|v][kv_head][token_in_block][head_dim]`. One block table per sequence therefore
/// serves all layers, and a head's keys within a block are contiguous.
///
/// The pool is a buffer of f32 slots. K and V values are stored as `dtype`: one per slot (f32),
/// or two per slot (bf16, the lower-addressed half first), so a bf16 page takes half the bytes
/// of an f32 page of the same block size. Arithmetic is f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: RowDType,
}

impl KvLayout {
    /// K and V values in one page.
    pub fn page_values(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
    }

    /// f32 slots of the pool one page takes (every page of the pool, KV or adapter rows, is
    /// this size). The value count is even (K and V), so a bf16 page fills its slots exactly.
    pub fn page_elems(&self) -> usize {
        self.dtype.slots(self.page_values())
    }

    /// Bytes in one page.
    pub fn page_bytes(&self) -> usize {
        self.page_elems() * std::mem::size_of::<f32>()
    }

    /// Offset, in values of `dtype` from the start of the pool, of token `slot_in_block` of
    /// `kv_head`, layer `layer`, K (`which = 0`) or V (`which = 1`), within page `page`. For
    /// f32 this indexes the pool's f32 slots; for bf16, the pool read as 16-bit values.
    #[inline]
    pub fn offset(&self, page: usize, layer: usize, which: usize, kv_head: usize, slot_in_block: usize) -> usize {
        let per_head = self.block_size * self.head_dim;
        let per_kv = self.num_kv_heads * per_head;
        page * self.page_values() + (layer * 2 + which) * per_kv + kv_head * per_head + slot_in_block * self.head_dim
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

/// Unit of row offsets into the pool: rows start on 16-element (64-byte) boundaries.
pub const LORA_ROW_ALIGN: usize = 16;

/// Projections of a decoder layer an adapter may target: q, k, v, o, gate, up, down, in that order.
/// The caller names a module by its index in this list.
pub const NUM_MODULES: usize = 7;

/// The slot of a segment or row that uses no adapter: those tokens cost nothing.
pub const NO_ADAPTER: u32 = u32::MAX;

/// How values are stored in the (f32) pool: an adapter's rows, or the KV pages (see
/// [`KvLayout::dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RowDType {
    /// One f32 per element.
    F32 = 0,
    /// One bfloat16 per element, two per f32 slot (the lower-addressed half first).
    Bf16 = 1,
}

impl RowDType {
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(RowDType::F32),
            1 => Some(RowDType::Bf16),
            _ => None,
        }
    }

    /// f32 slots a row of `elems` elements occupies (before alignment).
    pub fn slots(self, elems: usize) -> usize {
        match self {
            RowDType::F32 => elems,
            RowDType::Bf16 => elems.div_ceil(2),
        }
    }

    /// The element type this stores values as.
    pub fn dtype(self) -> crate::DType {
        match self {
            RowDType::F32 => crate::DType::F32,
            RowDType::Bf16 => crate::DType::Bf16,
        }
    }
}

/// Where the rank rows of the adapters used by one batch live in the pool. All u32 buffers.
///
/// For every (layer, module) it targets, an adapter owns `rank` A rows of `in_features` elements
/// and `rank` B rows of `out_features` elements. B is stored transposed (row `r` holds column `r`
/// of B) with the LoRA scaling already multiplied in. Rows sit anywhere in the pool, each whole
/// and starting on a [`LORA_ROW_ALIGN`] boundary; ranks are not padded in storage. Each adapter's
/// rows are f32 or bf16 ([`RowDType`]); arithmetic is f32 either way.
#[derive(Debug)]
pub struct LoraRows<Buf> {
    /// Adapters in this batch; segments and rows name them by slot `0..num_slots`.
    pub num_slots: usize,
    pub num_layers: usize,
    /// `[num_slots * num_layers * NUM_MODULES * 2]`: for (slot, layer, module), at
    /// [`LoraRows::entry`], the first index into `a_rows`/`b_rows` and the rank; rank 0 means the
    /// adapter does not target that module (its first index is then ignored).
    pub directory: Buf,
    /// `[total rows]`: the pool offset of each A row, in units of [`LORA_ROW_ALIGN`] elements.
    pub a_rows: Buf,
    /// `[total rows]`: the same for the B rows (Bᵀ rows, scaling folded in).
    pub b_rows: Buf,
    /// `[num_slots]`: the [`RowDType`] of each slot's rows, as u32.
    pub slot_dtypes: Buf,
}

impl<Buf> LoraRows<Buf> {
    /// Index in `directory` of the (first row, rank) pair of `slot` for `layer`, `module`.
    #[inline]
    pub fn entry(&self, slot: usize, layer: usize, module: usize) -> usize {
        ((slot * self.num_layers + layer) * NUM_MODULES + module) * 2
    }

    /// Elements `directory` must hold.
    pub fn directory_len(&self) -> usize {
        self.num_slots * self.num_layers * NUM_MODULES * 2
    }
}

/// Which adapter each part of the batch uses: consecutive runs of tokens (segments) sharing one
/// adapter, as in prefill. All u32 buffers.
#[derive(Debug)]
pub struct LoraSegments<Buf> {
    pub num_segments: usize,
    /// `[num_segments + 1]`: prefix sums of tokens per segment, from 0 to the batch's token count
    /// (like [`BatchMeta::seq_starts`]); empty segments are allowed.
    pub seg_starts: Buf,
    /// `[num_segments]`: the adapter slot of each segment, or [`NO_ADAPTER`].
    pub seg_slots: Buf,
}

/// The projection a LoRA op applies to: which (layer, module) and its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraTarget {
    pub layer: usize,
    /// Index into q, k, v, o, gate, up, down (see [`NUM_MODULES`]).
    pub module: usize,
    /// Length of an input row and of an A row.
    pub in_features: usize,
    /// Length of an output row and of a B row.
    pub out_features: usize,
    /// Row length of the intermediate `v`: no adapter of the batch may exceed it for this target.
    pub max_rank: usize,
}
