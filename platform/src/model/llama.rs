//! The Llama-family forward pass.

use std::sync::Mutex;

use loraplex_adapters::{BaseShape, TargetModule};
use loraplex_kernels::{AttentionParams, Backend, BatchMeta, KernelError, KvLayout, RowDType};

use super::weights::Checkpoint;
use super::{FusedLinear, Linear, LoraBatch, LoraContext, ModelConfig, ModelError, SharedBackend, rope};

struct Layer<B: Backend> {
    input_norm: B::Buffer,
    /// q, k and v in one weight.
    qkv: FusedLinear<B>,
    o: Linear<B>,
    post_norm: B::Buffer,
    /// gate and up in one weight.
    gate_up: FusedLinear<B>,
    down: Linear<B>,
    sliding_window: Option<usize>,
}

/// A loaded model on one device.
pub struct Model<B: Backend> {
    backend: SharedBackend<B>,
    config: ModelConfig,
    embed: B::Buffer,
    layers: Vec<Layer<B>>,
    norm: B::Buffer,
    lm_head: Linear<B>,
    /// `[max_position_embeddings, head_dim]` cos/sin table for rotary embeddings.
    rope: B::Buffer,
    /// The activations of recent forwards, each taken by the next forward of its token count
    /// (decode steps repeat theirs): no allocating and zeroing ten buffers a step.
    kept: Mutex<Vec<Activations<B>>>,
}

/// Activation sets kept between forwards: two token counts (a decode batch and the chunked
/// prefill's) stay without a fresh allocation.
const KEPT_ACTIVATIONS: usize = 2;

/// One forward batch, already uploaded: the tokens of every sequence flattened without padding.
pub struct ForwardBatch<B: Backend> {
    /// `[num_tokens]` u32 token ids.
    pub token_ids: B::Buffer,
    pub meta: BatchMeta<B::Buffer>,
    /// Indices of the tokens whose next-token logits are wanted (usually each sequence's last).
    pub logit_rows: B::Buffer,
    pub num_logit_rows: usize,
}

/// Scratch activations of one forward, sized for its token count. Every op writes its output
/// whole before anything reads it, so a set is reused as it is, never cleared.
struct Activations<B: Backend> {
    /// Tokens and logit rows.
    shape: (usize, usize),
    x: B::Buffer,
    normed: B::Buffer,
    /// The fused q/k/v projection, `[tokens, q + k + v]`, split into `q`, `k` and `v`.
    qkv: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    /// The fused gate/up projection, `[tokens, 2 · intermediate]`.
    gate_up: B::Buffer,
    /// Gate and up apart, made the first time an adapter adds deltas to them (the SiLU·mul
    /// reads `gate_up` directly otherwise).
    split: Option<(B::Buffer, B::Buffer)>,
    act: B::Buffer,
    /// The logit rows' hidden states, before and after the final norm.
    last: B::Buffer,
    last_normed: B::Buffer,
    /// `[logit rows, vocab]` f32.
    logits: B::Buffer,
}

/// A forward's logits (`[rows, vocab]` f32), read through `Deref`; dropping them gives their
/// activation set back to the model.
pub struct Logits<'m, B: Backend> {
    model: &'m Model<B>,
    set: Option<Activations<B>>,
}

impl<B: Backend> std::ops::Deref for Logits<'_, B> {
    type Target = B::Buffer;

    fn deref(&self) -> &B::Buffer {
        match &self.set {
            Some(a) => &a.logits,
            None => unreachable!("the set leaves only in drop"),
        }
    }
}

impl<B: Backend> Drop for Logits<'_, B> {
    fn drop(&mut self) {
        if let Some(a) = self.set.take() {
            self.model.keep(a);
        }
    }
}

impl<B: Backend> Model<B> {
    pub fn load(backend: SharedBackend<B>, config: ModelConfig, ck: &Checkpoint) -> Result<Self, ModelError> {
        let c = &config;
        let b = backend.as_ref();
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let norm = |name: &str| -> Result<B::Buffer, ModelError> { Ok(b.upload_f32(&ck.tensor_f32(name, &[h])?)?) };
        let embed_data = ck.tensor_f32("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let lin = |name: &str, inf: usize, outf: usize, bias: bool, m: TargetModule| Linear::load(b, ck, &format!("{p}.{name}"), inf, outf, bias, Some(m));
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"))?,
                qkv: FusedLinear::load(
                    b,
                    ck,
                    &[
                        (&format!("{p}.self_attn.q_proj"), qd, TargetModule::Q),
                        (&format!("{p}.self_attn.k_proj"), kvd, TargetModule::K),
                        (&format!("{p}.self_attn.v_proj"), kvd, TargetModule::V),
                    ],
                    h,
                    c.biases.qkv,
                )?,
                o: lin("self_attn.o_proj", qd, h, c.biases.o, TargetModule::O)?,
                post_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                gate_up: FusedLinear::load(
                    b,
                    ck,
                    &[(&format!("{p}.mlp.gate_proj"), i, TargetModule::Gate), (&format!("{p}.mlp.up_proj"), i, TargetModule::Up)],
                    h,
                    c.biases.mlp,
                )?,
                down: lin("mlp.down_proj", i, h, c.biases.mlp, TargetModule::Down)?,
                sliding_window: c.sliding_windows[l],
            });
        }
        let lm_head = if c.tie_word_embeddings {
            Linear::from_host(b, &embed_data, c.vocab_size, h, None)?
        } else {
            Linear::load(b, ck, "lm_head", h, c.vocab_size, false, None)?
        };
        // The rotary table stays f32 whatever the compute type: rope reads it in f32.
        let table = rope::cos_sin_table(c);
        let mut rope = b.zeros_f32(table.len())?;
        b.write_f32(&mut rope, 0, &table)?;
        Ok(Self { embed: b.upload_f32(&embed_data)?, norm: norm("model.norm.weight")?, rope, layers, lm_head, config, backend, kept: Mutex::new(Vec::new()) })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn backend(&self) -> &SharedBackend<B> {
        &self.backend
    }

    /// The layout of one KV page for this model, its values stored as `dtype`.
    pub fn kv_layout(&self, block_size: usize, dtype: RowDType) -> KvLayout {
        KvLayout { num_layers: self.config.num_layers, num_kv_heads: self.config.num_kv_heads, head_dim: self.config.head_dim, block_size, dtype }
    }

    /// The projection shapes adapters are validated against.
    pub fn base_shape(&self) -> BaseShape {
        let c = &self.config;
        BaseShape::llama(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers)
    }

    /// Runs the batch through the model, writing its K/V into `cache`, and returns the logits
    /// of the requested rows, `[num_logit_rows, vocab_size]` f32. `cache` is the whole page
    /// pool: KV blocks and, for `lora`, the adapters' rows. The logits live in the forward's
    /// activation set, which goes back to the model for the next forward when they are dropped.
    pub fn forward(
        &self,
        batch: &ForwardBatch<B>,
        lora: Option<&LoraBatch<B>>,
        cache: &mut B::Buffer,
        layout: &KvLayout,
    ) -> Result<Logits<'_, B>, KernelError> {
        let mut a = self.activations((batch.meta.num_tokens, batch.num_logit_rows))?;
        match self.forward_with(batch, lora, cache, layout, &mut a) {
            Ok(()) => Ok(Logits { model: self, set: Some(a) }),
            Err(e) => {
                self.keep(a);
                Err(e)
            }
        }
    }

    /// Keeps an activation set for a later forward of its shape.
    fn keep(&self, a: Activations<B>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= KEPT_ACTIVATIONS {
            kept.remove(0);
        }
        kept.push(a);
    }

    /// A kept activation set for `t` tokens and `r` logit rows, or a new one.
    fn activations(&self, (t, r): (usize, usize)) -> Result<Activations<B>, KernelError> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = kept.iter().position(|a| a.shape == (t, r)) {
            return Ok(kept.remove(i));
        }
        drop(kept);
        let b = self.backend.as_ref();
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        Ok(Activations {
            shape: (t, r),
            x: b.zeros(t * h)?,
            normed: b.zeros(t * h)?,
            qkv: b.zeros(t * (c.num_heads + 2 * c.num_kv_heads) * hd)?,
            q: b.zeros(t * c.num_heads * hd)?,
            k: b.zeros(t * c.num_kv_heads * hd)?,
            v: b.zeros(t * c.num_kv_heads * hd)?,
            attn: b.zeros(t * c.num_heads * hd)?,
            proj: b.zeros(t * h)?,
            gate_up: b.zeros(t * 2 * c.intermediate_size)?,
            split: None,
            act: b.zeros(t * c.intermediate_size)?,
            last: b.zeros(r * h)?,
            last_normed: b.zeros(r * h)?,
            logits: b.zeros_f32(r * c.vocab_size)?,
        })
    }

    fn forward_with(
        &self,
        batch: &ForwardBatch<B>,
        lora: Option<&LoraBatch<B>>,
        cache: &mut B::Buffer,
        layout: &KvLayout,
        a: &mut Activations<B>,
    ) -> Result<(), KernelError> {
        let b = self.backend.as_ref();
        let c = &self.config;
        let h = c.hidden_size;
        b.embedding(&self.embed, &batch.token_ids, &mut a.x, h)?;
        // Each layer starts from its input norm already in `normed`: a layer's last residual
        // add and the next layer's input norm are one op.
        if let Some(first) = self.layers.first() {
            b.rms_norm(&a.x, &first.input_norm, &mut a.normed, c.rms_norm_eps)?;
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.layer_forward((l, layer), self.layers.get(l + 1), batch, lora, cache, layout, a)?;
        }
        let r = batch.num_logit_rows;
        b.gather_rows(&a.x, &batch.logit_rows, &mut a.last, h)?;
        b.rms_norm(&a.last, &self.norm, &mut a.last_normed, c.rms_norm_eps)?;
        self.lm_head.forward(b, &a.last_normed, &mut a.logits, r, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        (l, layer): (usize, &Layer<B>),
        next: Option<&Layer<B>>,
        batch: &ForwardBatch<B>,
        lora: Option<&LoraBatch<B>>,
        cache: &mut B::Buffer,
        layout: &KvLayout,
        a: &mut Activations<B>,
    ) -> Result<(), KernelError> {
        let b = self.backend.as_ref();
        let c = &self.config;
        let t = batch.meta.num_tokens;
        {
            let lc = lora.map(|batch| LoraContext { batch, pool: &*cache, layer: l });
            layer.qkv.forward_split(b, &a.normed, &mut a.qkv, &mut [&mut a.q, &mut a.k, &mut a.v], t, lc.as_ref())?;
        }
        b.rope_write_kv(&mut a.q, &mut a.k, &a.v, &self.rope, c.num_heads, cache, &batch.meta, layout, l)?;
        let params = AttentionParams {
            layer: l,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: layer.sliding_window,
        };
        b.attention(&a.q, cache, &mut a.attn, &batch.meta, layout, &params)?;
        let lc = lora.map(|batch| LoraContext { batch, pool: &*cache, layer: l });
        let lc = lc.as_ref();
        layer.o.forward(b, &a.attn, &mut a.proj, t, lc)?;
        b.add_rms_norm(&mut a.x, &a.proj, &layer.post_norm, &mut a.normed, c.rms_norm_eps)?;
        let i = c.intermediate_size;
        if layer.gate_up.has_lora(lc) {
            let (gate, up) = match &mut a.split {
                Some(split) => split,
                empty => empty.insert((b.zeros(t * i)?, b.zeros(t * i)?)),
            };
            layer.gate_up.forward_split(b, &a.normed, &mut a.gate_up, &mut [gate, up], t, lc)?;
            b.silu_mul(gate, up, &mut a.act)?;
        } else {
            layer.gate_up.matmul(b, &a.normed, &mut a.gate_up, t)?;
            b.silu_mul_fused(&a.gate_up, &mut a.act, i)?;
        }
        layer.down.forward(b, &a.act, &mut a.proj, t, lc)?;
        match next {
            Some(next) => b.add_rms_norm(&mut a.x, &a.proj, &next.input_norm, &mut a.normed, c.rms_norm_eps),
            None => b.add_assign(&mut a.x, &a.proj),
        }
    }
}
