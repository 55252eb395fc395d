//! Raw logits of one sequence, step by step: what parity checks against a reference compare.

use loraplex_kernels::Backend;

use super::EngineError;
use super::batch::{Chunk, HostBatch};
use crate::memory::{BlockTable, KvCache};
use crate::model::Model;

/// Prefills `prompt` in one forward, then decodes greedily one token per forward, returning the
/// logits of each step: row 0 is the last prompt position, row `k` the logits that chose
/// generated token `k`. `n` rows in all.
pub fn greedy_logits<B: Backend>(model: &Model<B>, prompt: &[u32], n: usize, block_size: usize) -> Result<Vec<Vec<f32>>, EngineError> {
    let layout = model.kv_layout(block_size);
    let total = prompt.len() + n;
    let pages = total.div_ceil(block_size);
    let mut kv = KvCache::with_bytes(model.backend().as_ref(), layout, pages * layout.page_bytes())?;
    let mut table = BlockTable::new(&kv.pool, block_size);
    if !table.reserve(total) {
        return Err(EngineError::TooLargeForPool { needed: pages, total: kv.pool.stats().total });
    }
    let mut tokens = prompt.to_vec();
    let mut computed = 0;
    let mut rows = Vec::with_capacity(n);
    let vocab = model.config().vocab_size;
    while rows.len() < n {
        let chunk = Chunk {
            tokens: &tokens[computed..],
            start: computed,
            slots: (computed..tokens.len()).map(|p| table.slot(p)).collect(),
            pages: table.pages(),
            wants_logits: true,
        };
        let batch = HostBatch::build(&[chunk]).upload(model.backend().as_ref())?;
        let logits = model.forward(&batch, &mut kv.buffer, &kv.layout)?;
        let next = model.backend().argmax_rows(&logits, vocab)?;
        computed = tokens.len();
        tokens.extend_from_slice(&next);
        rows.push(model.backend().download_f32(&logits)?);
    }
    Ok(rows)
}
