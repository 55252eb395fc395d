//! Raw logits of one sequence, step by step: what parity checks against a reference compare.

use loraplex_adapters::{LoraAdapter, PackedAdapter};
use loraplex_kernels::{Backend, LORA_ROW_ALIGN, RowDType};

use super::EngineError;
use super::batch::{Chunk, HostBatch};
use crate::memory::{BlockTable, DevicePool, EntryKind, ResidentRows};
use crate::model::{LoraBatch, Model};

/// Prefills `prompt` in one forward, then decodes greedily one token per forward, returning the
/// logits of each step: row 0 is the last prompt position, row `k` the logits that chose
/// generated token `k`. `n` rows in all. With `adapter`, every token gets its LoRA delta, the
/// adapter's rows sitting in pool pages as in serving.
pub fn greedy_logits<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
    block_size: usize,
    kv_dtype: RowDType,
    adapter: Option<&LoraAdapter>,
) -> Result<Vec<Vec<f32>>, EngineError> {
    forced_logits(model, prompt, &[], n, block_size, kv_dtype, adapter)
}

/// [`greedy_logits`] fed a given continuation: after row `k`, `follow[k]` is the next token
/// where it exists (the argmax past its end), so two implementations compare logits along the
/// same tokens even where their argmaxes part (teacher forcing, one decode forward per token).
pub fn forced_logits<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    follow: &[u32],
    n: usize,
    block_size: usize,
    kv_dtype: RowDType,
    adapter: Option<&LoraAdapter>,
) -> Result<Vec<Vec<f32>>, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Config("an empty prompt has no logits".into()));
    }
    let vocab = model.config().vocab_size;
    if let Some(&bad) = prompt.iter().chain(follow).find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Config(format!("token {bad} is outside the vocabulary of {vocab}")));
    }
    let layout = model.kv_layout(block_size, kv_dtype);
    let backend = model.backend().as_ref();
    let total = prompt.len() + n;
    let packed =
        adapter.map(|a| PackedAdapter::pack(a, layout.page_elems(), LORA_ROW_ALIGN)).transpose().map_err(|e| EngineError::Adapter(e.to_string().into()))?;
    let pages = total.div_ceil(block_size) + packed.as_ref().map_or(0, PackedAdapter::num_pages);
    let mut kv = DevicePool::with_bytes(backend, layout, pages * layout.page_bytes())?;
    let mut table = BlockTable::new(&kv.pages, block_size);
    if !table.reserve(total) {
        return Err(EngineError::Config(format!("a pool of {} pages cannot hold {total} tokens", kv.pages.stats().total)));
    }
    let mut rows_table = None;
    let mut _entry = None;
    if let Some(packed) = &packed {
        let (entry, pin) = kv
            .pages
            .insert(EntryKind::Adapter, packed.num_pages())
            .ok_or_else(|| EngineError::Config(format!("a pool of {pages} pages cannot hold the adapter")))?;
        let placed = entry.pages();
        for (i, &p) in placed.iter().enumerate() {
            backend.write_f32(&mut kv.buffer, p as usize * layout.page_elems(), packed.page(i))?;
        }
        rows_table = Some(ResidentRows::place(packed, &placed, model.config().num_layers).map_err(|e| EngineError::Adapter(e.into()))?);
        _entry = Some((entry, pin));
    }
    let mut tokens = prompt.to_vec();
    let mut computed = 0;
    let mut rows = Vec::with_capacity(n);
    while rows.len() < n {
        let chunk = Chunk {
            tokens: &tokens[computed..],
            start: computed,
            slots: (computed..tokens.len()).map(|p| table.slot(p)).collect(),
            pages: table.pages(),
            wants_logits: true,
        };
        let tokens_now = chunk.tokens.len();
        let batch = HostBatch::build(&[chunk]).upload(backend)?;
        let lora = match &rows_table {
            Some(r) => LoraBatch::build(backend, &[r], &vec![0; tokens_now], tokens_now == 1, model.config().num_layers)?,
            None => None,
        };
        let logits = model.forward(&batch, lora.as_ref(), &mut kv.buffer, &kv.layout)?;
        let next = match follow.get(rows.len()) {
            Some(&t) => vec![t],
            None => model.backend().argmax_rows(&logits, vocab)?,
        };
        computed = tokens.len();
        tokens.extend_from_slice(&next);
        rows.push(model.backend().download_f32(&logits)?);
    }
    Ok(rows)
}
