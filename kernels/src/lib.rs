//! The compute backends of loraplex.
//!
//! A backend owns device memory and runs the ops of a Llama-family forward pass over it. The
//! contract is split into a few small traits ([`Memory`], [`DenseOps`], [`AttentionOps`],
//! [`SamplingOps`], [`LoraOps`]) that together form [`Backend`]. Buffers are opaque: the engine
//! allocates them, fills them by upload, passes them between ops and reads results back by
//! download. Shapes travel with each call as small descriptor structs, so every op checks its
//! arguments and reports a [`KernelError`] instead of reading out of bounds.
//!
//! The CPU backend ([`cpu::CpuBackend`]) is the reference implementation: f32 arithmetic, matmuls
//! on packed weights, rayon for parallelism. Every other backend is tested against it.

mod check;
pub mod cpu;
pub mod cuda;
mod layout;
pub mod mmap;
pub mod quant;

pub use layout::{AttentionParams, BatchMeta, KvLayout, LORA_ROW_ALIGN, LoraRows, LoraSegments, LoraTarget, NO_ADAPTER, NUM_MODULES, RowDType};

/// Errors from a backend. Each names the op and what was wrong with its arguments.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// An argument's size disagrees with the shape the op was given.
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// An index (token id, slot, block, position) points outside the buffer it indexes.
    #[error("{op}: index {index} out of range (limit {limit})")]
    Index { op: &'static str, index: usize, limit: usize },
    /// A buffer holds a different element type than the op needs.
    #[error("{op}: expected a {expected} buffer, got {actual}")]
    DType { op: &'static str, expected: DType, actual: DType },
    /// The device could not provide the memory asked for.
    #[error("out of memory allocating {bytes} bytes on {device}")]
    OutOfMemory { device: String, bytes: usize },
    /// The device, its driver or one of its libraries failed (a CUDA call, a kernel compile).
    #[error("{op}: {detail}")]
    Device { op: &'static str, detail: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// Element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// IEEE half precision (storage only: arithmetic is f32).
    F16,
    /// bfloat16 (storage only: arithmetic is f32).
    Bf16,
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::U32 => "u32",
        })
    }
}

/// Device memory: allocation and host transfers.
pub trait Memory {
    /// An opaque device buffer of float (f32, or the compute type) or u32 elements.
    type Buffer: Send + Sync;
    /// A linear layer's weight (`[out_features, in_features]`, as in HF checkpoints), stored in
    /// whatever layout this backend's matmul wants.
    type Weight: Send + Sync;

    /// A human-readable name of the device ("cpu", "cuda:0 (NVIDIA H200)").
    fn device_name(&self) -> String;
    /// How fast this backend's attention runs compared with its matmuls, in FLOP/s (1: as
    /// fast). Schedulers that bound a step's cost weigh a token's attention by it.
    fn attention_efficiency(&self) -> f64 {
        1.0
    }
    /// Whether this backend's attention reads KV pages stored as `dtype` in an f32 pool (see
    /// [`KvLayout::dtype`]). By default only f32.
    fn supports_kv_dtype(&self, dtype: RowDType) -> bool {
        dtype == RowDType::F32
    }
    /// Runs `step` (one engine iteration) where this backend's kernels run best: by default on
    /// the calling thread. The CPU backend makes the calling thread the first of a rayon pool
    /// of its own, so each parallel kernel runs there and splits among the pool's threads
    /// directly, instead of the calling thread handing every kernel (or every step) to the pool
    /// and sleeping until it is done.
    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        step()
    }
    /// Whether [`Memory::join`] runs its two halves side by side, so that a caller gains by
    /// giving it independent work (the CPU backend: a LoRA delta, which streams adapter rows
    /// from memory, beside the base matmul, which is bound by the FMA units).
    fn overlaps(&self) -> bool {
        false
    }
    /// Runs `a` and `b` and returns both results: by default one after the other. The CPU
    /// backend lets another thread of the step's pool take `b` while the calling thread starts
    /// `a`; whichever finishes first helps with the other's parallel kernels.
    fn join<RA: Send, RB: Send>(&self, a: impl FnOnce() -> RA + Send, b: impl FnOnce() -> RB + Send) -> (RA, RB) {
        let ra = a();
        (ra, b())
    }
    /// Sets the first `len` elements of a float buffer to zero.
    fn fill_zero(&self, buf: &mut Self::Buffer, len: usize) -> Result<()> {
        self.write_f32(buf, 0, &vec![0.0; len])
    }
    /// The element type of the activations, weights and logits this backend computes on:
    /// what [`Memory::zeros`], [`Memory::upload_f32`] and [`Memory::load_weight`] make (f32
    /// storage on the CPU backend; f32 or bf16 on CUDA). Arithmetic accumulates in f32 either way.
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    /// The element type a weight decoded from a quantized format (a GGUF's blocks) is best
    /// handed to [`Memory::load_weight_data`] in: what this backend's matmuls multiply
    /// (bf16 where they round their inputs to bf16 anyway), so decoding loses nothing the
    /// matmul keeps.
    fn weight_dtype(&self) -> DType {
        self.compute_dtype()
    }
    /// A zero-filled buffer of `len` elements of [`Memory::compute_dtype`].
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    /// A zero-filled buffer of `len` f32 elements, whatever the compute type: the page pool (KV
    /// pages and adapter rows, each stored as [`RowDType`] in f32 slots), LoRA's rank buffers,
    /// and logits.
    fn zeros_f32(&self, len: usize) -> Result<Self::Buffer> {
        self.zeros(len)
    }
    /// Host f32 values stored as [`Memory::compute_dtype`] (rounded to nearest even).
    fn upload_f32(&self, data: &[f32]) -> Result<Self::Buffer>;
    fn upload_u32(&self, data: &[u32]) -> Result<Self::Buffer>;
    /// Copies a float buffer back to the host, widened to f32.
    fn download_f32(&self, buf: &Self::Buffer) -> Result<Vec<f32>>;
    /// Overwrites `buf[offset .. offset + data.len()]` with host data (filling pool pages).
    fn write_f32(&self, buf: &mut Self::Buffer, offset: usize, data: &[f32]) -> Result<()>;
    /// Starts writing host values into `buf`, each `(offset, values)`, beside the compute: on a
    /// backend with a copy queue (CUDA: a second stream, from page-locked staging memory) the
    /// call returns once the values are staged, and the copy runs while later steps compute.
    /// The copy is ordered after every op queued before the call. Until the returned
    /// [`Upload`] has landed, no op may read the written regions, nor may another write touch
    /// them. By default the values are written at once ([`Memory::write_f32`]) and the upload
    /// has landed when this returns.
    fn start_upload(&self, buf: &mut Self::Buffer, writes: &[(usize, &[f32])]) -> Result<Upload> {
        for &(offset, data) in writes {
            self.write_f32(buf, offset, data)?;
        }
        Ok(Upload::landed())
    }
    /// Copies `buf[src .. src + len]` to `buf[dst .. dst + len]`; the ranges must not overlap
    /// (a shared KV page copied before one of its sharers writes to it).
    fn copy_within(&self, buf: &mut Self::Buffer, src: usize, dst: usize, len: usize) -> Result<()>;
    /// Prepares a weight from host data laid out `[out_features, in_features]`, row-major.
    fn load_weight(&self, data: &[f32], out_features: usize, in_features: usize) -> Result<Self::Weight>;
    /// [`Memory::load_weight`] from data in the element type a checkpoint stores it in. A backend
    /// that can compute on half-precision weights keeps them half-size (the CPU backend does);
    /// by default they are widened to f32 here, exactly.
    fn load_weight_data(&self, data: WeightData<'_>, out_features: usize, in_features: usize) -> Result<Self::Weight> {
        self.load_weight(&data.to_f32(), out_features, in_features)
    }
}

/// A write into device memory started by [`Memory::start_upload`]: landed, or still in flight
/// on the device's copy queue. Dropping one in flight waits for its copy first (its staging
/// memory is freed only after the device has read it).
pub struct Upload(Option<Box<dyn InFlight>>);

/// A copy still in flight, as a backend tracks it.
pub trait InFlight: Send + Sync {
    /// Whether the copy has landed; never waits.
    fn landed(&self) -> Result<bool>;
}

impl Upload {
    /// A write already done.
    pub fn landed() -> Self {
        Upload(None)
    }

    pub fn in_flight(copy: impl InFlight + 'static) -> Self {
        Upload(Some(Box::new(copy)))
    }

    /// Whether the copy has landed, so that ops queued from now on read its values. Never waits.
    pub fn is_landed(&mut self) -> Result<bool> {
        if let Some(copy) = &self.0 {
            if !copy.landed()? {
                return Ok(false);
            }
            self.0 = None;
        }
        Ok(true)
    }
}

impl std::fmt::Debug for Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Upload(in flight)" } else { "Upload(landed)" })
    }
}

/// A weight's values as a checkpoint stores them.
#[derive(Debug, Clone, Copy)]
pub enum WeightData<'a> {
    F32(&'a [f32]),
    /// bfloat16, each value the upper half of an f32.
    Bf16(&'a [u16]),
    F16(&'a [half::f16]),
}

impl WeightData<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightData::F32(d) => d.len(),
            WeightData::Bf16(d) => d.len(),
            WeightData::F16(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values widened to f32 (exact for every type).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            WeightData::F32(d) => d.to_vec(),
            WeightData::Bf16(d) => d.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect(),
            WeightData::F16(d) => d.iter().map(|h| h.to_f32()).collect(),
        }
    }

    /// Bytes per value.
    pub fn elem_bytes(&self) -> usize {
        match self {
            WeightData::F32(_) => 4,
            WeightData::Bf16(_) | WeightData::F16(_) => 2,
        }
    }
}

/// Row-wise dense ops over `[rows, dim]` activations.
pub trait DenseOps: Memory {
    /// `out[i] = table[ids[i]]` for each row; `table` is `[vocab, hidden]`.
    fn embedding(&self, table: &Self::Buffer, ids: &Self::Buffer, out: &mut Self::Buffer, hidden: usize) -> Result<()>;
    /// `out = x / rms(x) * weight` per row; the row length is `weight`'s length.
    fn rms_norm(&self, x: &Self::Buffer, weight: &Self::Buffer, out: &mut Self::Buffer, eps: f32) -> Result<()>;
    /// `out[rows, n] = x[rows, k] · Wᵀ (+ bias)`. `out` holds `x`'s element type, or f32 when
    /// there is no bias (logits kept at full precision from compute-type activations).
    fn matmul(&self, x: &Self::Buffer, w: &Self::Weight, bias: Option<&Self::Buffer>, out: &mut Self::Buffer, rows: usize) -> Result<()>;
    /// `out = silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Self::Buffer, up: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;
    /// `out[r, c] = silu(x[r, c]) * x[r, width + c]` over rows of `2 * width`: [`DenseOps::silu_mul`]
    /// on the output of a fused gate/up projection, with no copy of its halves.
    fn silu_mul_fused(&self, x: &Self::Buffer, out: &mut Self::Buffer, width: usize) -> Result<()>;
    /// Copies the column ranges of `src` (`[rows, Σ widths]`) into `parts` (each `[rows, width]`),
    /// in order: a fused projection's output handed to the ops that read each part. One, two or
    /// three parts.
    fn split_columns(&self, src: &Self::Buffer, rows: usize, parts: &mut [(&mut Self::Buffer, usize)]) -> Result<()>;
    /// `acc += x`, elementwise.
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()>;
    /// The residual add and the next norm: `residual += x`, then `out = rms_norm(residual)`
    /// (the sum stored as the buffers' type first, and normalized as stored: the same values as
    /// the two ops one after the other). A backend may fuse them into one pass (CUDA: one launch
    /// instead of two).
    fn add_rms_norm(&self, residual: &mut Self::Buffer, x: &Self::Buffer, weight: &Self::Buffer, out: &mut Self::Buffer, eps: f32) -> Result<()> {
        self.add_assign(residual, x)?;
        self.rms_norm(residual, weight, out, eps)
    }
    /// `out[i] = x[rows[i]]` over rows of `dim` elements.
    fn gather_rows(&self, x: &Self::Buffer, rows: &Self::Buffer, out: &mut Self::Buffer, dim: usize) -> Result<()>;
}

/// Rotary embeddings, the paged KV cache and attention over it.
pub trait AttentionOps: Memory {
    /// Rotates `x` (`[tokens, heads, head_dim]`) in place, half-split ("rotate_half") convention.
    /// `cos_sin` is `[max_positions, head_dim]`: per position, `head_dim / 2` cosines then as many
    /// sines; `positions` has one u32 per token.
    fn rope(&self, x: &mut Self::Buffer, positions: &Self::Buffer, cos_sin: &Self::Buffer, heads: usize, head_dim: usize) -> Result<()>;
    /// Writes each token's K and V (`[tokens, kv_heads, head_dim]`) into its slot of the cache.
    fn write_kv(
        &self,
        k: &Self::Buffer,
        v: &Self::Buffer,
        cache: &mut Self::Buffer,
        meta: &BatchMeta<Self::Buffer>,
        layout: &KvLayout,
        layer: usize,
    ) -> Result<()>;
    /// A layer's attention inputs made ready in one op: [`AttentionOps::rope`] over `q`
    /// (`num_heads` heads) and `k` (the layout's KV heads) at the batch's positions, then
    /// [`AttentionOps::write_kv`] of `k` and `v`. The same values as those three calls, which is
    /// what this default does; a device backend does it in one pass over the tokens.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: &Self::Buffer,
        cos_sin: &Self::Buffer,
        num_heads: usize,
        cache: &mut Self::Buffer,
        meta: &BatchMeta<Self::Buffer>,
        layout: &KvLayout,
        layer: usize,
    ) -> Result<()> {
        self.rope(q, &meta.positions, cos_sin, num_heads, layout.head_dim)?;
        self.rope(k, &meta.positions, cos_sin, layout.num_kv_heads, layout.head_dim)?;
        self.write_kv(k, v, cache, meta, layout, layer)
    }
    /// Causal attention of each query token over its sequence's cached keys and values (which must
    /// already include the batch's own tokens). `q` and `out` are `[tokens, heads, head_dim]`.
    fn attention(
        &self,
        q: &Self::Buffer,
        cache: &Self::Buffer,
        out: &mut Self::Buffer,
        meta: &BatchMeta<Self::Buffer>,
        layout: &KvLayout,
        params: &AttentionParams,
    ) -> Result<()>;
}

/// One row's settings for [`SamplingOps::sample_rows`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// Divides the logits; must be positive (greedy rows use [`SamplingOps::argmax_rows`]).
    pub temperature: f32,
    /// Keep the `top_k` largest (ties at the threshold kept); 0 keeps all.
    pub top_k: u32,
    /// Then keep the smallest set of largest tokens whose probability reaches `top_p`, in (0, 1].
    pub top_p: f32,
    /// The row's uniform draw in [0, 1): the caller owns the random stream.
    pub uniform: f32,
}

/// One row's log-softmax figures from [`SamplingOps::row_logprobs`].
#[derive(Debug, Clone, PartialEq)]
pub struct RowLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The row's `n` most likely tokens with theirs, most likely first (the lower id first among
    /// equals); `min(n, vocab)` of them.
    pub top: Vec<(u32, f32)>,
}

/// The most alternatives [`SamplingOps::row_logprobs`] gives per row.
pub const MAX_TOP_LOGPROBS: usize = 64;

/// Fails unless there is one token in the vocabulary per row and `n` is within the limit.
pub(crate) fn check_logprob_args(op: &'static str, tokens: &[u32], rows: usize, vocab: usize, n: usize) -> Result<()> {
    if tokens.len() != rows {
        return Err(KernelError::Shape { op, detail: format!("{} tokens for {rows} rows", tokens.len()) });
    }
    if n > MAX_TOP_LOGPROBS {
        return Err(KernelError::Shape { op, detail: format!("{n} alternatives asked; at most {MAX_TOP_LOGPROBS}") });
    }
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&t) => Err(KernelError::Index { op, index: t as usize, limit: vocab }),
        None => Ok(()),
    }
}

/// Fails unless there is one valid [`SampleParams`] per row.
pub(crate) fn check_sample_params(op: &'static str, params: &[SampleParams], rows: usize) -> Result<()> {
    if params.len() != rows {
        return Err(KernelError::Shape { op, detail: format!("{} sampling settings for {rows} rows", params.len()) });
    }
    for (i, p) in params.iter().enumerate() {
        let ok = p.temperature.is_finite() && p.temperature > 0.0 && p.top_p > 0.0 && p.top_p <= 1.0 && (0.0..1.0).contains(&p.uniform);
        if !ok {
            return Err(KernelError::Shape { op, detail: format!("row {i}: invalid sampling settings {p:?}") });
        }
    }
    Ok(())
}

/// Helpers that let decoding avoid copying whole logit rows back to the host.
pub trait SamplingOps: Memory {
    /// The index of the largest value of each `vocab`-long row (the first one on ties, NaN ignored).
    fn argmax_rows(&self, logits: &Self::Buffer, vocab: usize) -> Result<Vec<u32>>;
    /// One token per `vocab`-long row, drawn with that row's [`SampleParams`]: the logits are
    /// divided by the temperature (NaN counts as -inf) and turned into weights
    /// `w = exp(z - max z)`; top-k keeps `z >=` the k-th largest `z`; top-p then keeps `z >=` the
    /// largest threshold whose kept weight reaches `top_p` times the weight top-k kept; the token
    /// is the first index whose running sum of kept weights exceeds `uniform` times their total.
    fn sample_rows(&self, logits: &Self::Buffer, vocab: usize, params: &[SampleParams]) -> Result<Vec<u32>>;
    /// Per `vocab`-long row, with `tokens` the token chosen for each: that token's
    /// log-probability under the row's softmax and the row's `n` most likely tokens with theirs
    /// (see [`RowLogprobs`]). Logits are cleaned first: NaN counts as -inf, +inf as `f32::MAX`.
    /// So a device gives the logprobs a request asks for without the row crossing to the host.
    fn row_logprobs(&self, logits: &Self::Buffer, vocab: usize, tokens: &[u32], n: usize) -> Result<Vec<RowLogprobs>>;
    /// Whether drawing tokens with [`SamplingOps::sample_rows`] spares copying logit rows to the
    /// host (a device backend). The CPU backend's logits are on the host already.
    fn draws_on_device(&self) -> bool {
        false
    }
}

/// Batched LoRA over adapters whose rank rows live in the pool (see [`LoraRows`]), many adapters
/// per batch, each token paying only for its own adapter's rank.
///
/// The low-rank update of a projection `y = x · Wᵀ` is `y += (x · Aᵀ) · Bᵀ`, applied after the
/// base matmul. `x` is `[tokens, target.in_features]`, `y` is `[tokens, target.out_features]`;
/// buffers may be longer than needed. Every index (slots, directory ranges, row offsets, segment
/// bounds) is checked before any output is written, so an error leaves the outputs as they were.
/// The directory entries of every slot for the target are checked, used in this call or not.
/// A token's result does not depend on which op computes it or how tokens are grouped.
pub trait LoraOps: Memory {
    /// SGMV shrink (prefill segments): `v[t, r] = x[t, :] · A_slot(t)[r, :]` for
    /// `r < rank(slot(t), target)`, `v[t, r] = 0` beyond it; `v` is `[tokens, target.max_rank]`.
    /// Segments without an adapter write zeros.
    fn sgmv_shrink(
        &self,
        x: &Self::Buffer,
        pool: &Self::Buffer,
        rows: &LoraRows<Self::Buffer>,
        segs: &LoraSegments<Self::Buffer>,
        target: &LoraTarget,
        v: &mut Self::Buffer,
    ) -> Result<()>;
    /// SGMV expand: `y[t, :] += Σ_r v[t, r] · Bᵀ_slot(t)[r, :]` over `r < rank(slot(t), target)`;
    /// tokens of [`NO_ADAPTER`] segments are left untouched.
    fn sgmv_expand(
        &self,
        v: &Self::Buffer,
        pool: &Self::Buffer,
        rows: &LoraRows<Self::Buffer>,
        segs: &LoraSegments<Self::Buffer>,
        target: &LoraTarget,
        y: &mut Self::Buffer,
    ) -> Result<()>;
    /// BGMV (decode): one adapter slot per row (`slots`: `[rows]` u32, [`NO_ADAPTER`] allowed);
    /// `y[t] += (x[t] · A_slot(t)ᵀ) · Bᵀ_slot(t)`, shrink and expand fused per row.
    fn bgmv(
        &self,
        x: &Self::Buffer,
        pool: &Self::Buffer,
        rows: &LoraRows<Self::Buffer>,
        slots: &Self::Buffer,
        target: &LoraTarget,
        y: &mut Self::Buffer,
    ) -> Result<()>;
}

/// Everything the model needs from a device.
pub trait Backend: Memory + DenseOps + AttentionOps + SamplingOps + LoraOps + Send + Sync + 'static {}

impl<T> Backend for T where T: Memory + DenseOps + AttentionOps + SamplingOps + LoraOps + Send + Sync + 'static {}
