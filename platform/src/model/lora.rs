//! The LoRA side of one forward batch: which adapters it uses, where their rows are, and which
//! tokens use which adapter.

use std::sync::Mutex;

use loraplex_adapters::TargetModule;
use loraplex_kernels::{Backend, KernelError, LoraRows, LoraSegments, LoraTarget, NO_ADAPTER, NUM_MODULES};

use crate::memory::ResidentRows;

/// How the batch's tokens map to adapter slots.
pub enum LoraLayout<Buf> {
    /// Runs of consecutive tokens sharing an adapter (SGMV); used when prompts are in the batch.
    Segments(LoraSegments<Buf>),
    /// One slot per token (BGMV); used when every sequence contributes one token.
    PerRow(Buf),
}

/// The adapters of one batch, uploaded for the LoRA kernels, and the batch's layout over them.
pub struct LoraBatch<B: Backend> {
    rows: LoraRows<B::Buffer>,
    layout: LoraLayout<B::Buffer>,
    /// Highest rank of any adapter in the batch: the row length of the shrink output.
    max_rank: usize,
    /// Per layer and module: whether some adapter of the batch targets it.
    targeted: Vec<[bool; NUM_MODULES]>,
    /// SGMV's rank buffer (`[tokens, max_rank]` f32), made at the first site and reused by
    /// every other site of the batch: the shrink writes it whole before the expand reads it.
    /// Kept with its length in values.
    scratch: Mutex<Option<(usize, B::Buffer)>>,
    /// Deltas computed beside a base projection ([`LoraBatch::beside`]), each kept with its
    /// length in values (a site's `tokens * out_features`: a site takes one of its exact
    /// length) and zeroed before every use.
    deltas: Mutex<Vec<(usize, B::Buffer)>>,
}

/// The host form of a batch's segment layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSegments {
    pub starts: Vec<u32>,
    pub slots: Vec<u32>,
}

/// Collapses per-token slots into runs of equal slots.
pub fn segments_of(token_slots: &[u32]) -> HostSegments {
    let mut seg = HostSegments { starts: vec![0], slots: Vec::new() };
    for (t, &slot) in token_slots.iter().enumerate() {
        if seg.slots.last() != Some(&slot) {
            if t > 0 {
                seg.starts.push(t as u32);
            }
            seg.slots.push(slot);
        }
    }
    if !token_slots.is_empty() {
        seg.starts.push(token_slots.len() as u32);
    }
    seg
}

impl<B: Backend> LoraBatch<B> {
    /// Builds the batch's LoRA tables: `adapters[s]` is the adapter in slot `s`, `token_slots`
    /// gives each token's slot (or [`NO_ADAPTER`]). `per_row` picks BGMV over SGMV.
    /// `None` when no token uses an adapter.
    pub fn build(backend: &B, adapters: &[&ResidentRows], token_slots: &[u32], per_row: bool, num_layers: usize) -> Result<Option<Self>, KernelError> {
        if adapters.is_empty() || token_slots.iter().all(|&s| s == NO_ADAPTER) {
            return Ok(None);
        }
        let dir_len = num_layers * NUM_MODULES * 2;
        let mut directory = Vec::with_capacity(adapters.len() * dir_len);
        let (mut a_rows, mut b_rows) = (Vec::new(), Vec::new());
        let mut targeted = vec![[false; NUM_MODULES]; num_layers];
        for rows in adapters {
            if rows.directory.len() != dir_len {
                return Err(KernelError::Shape {
                    op: "lora_batch",
                    detail: format!("an adapter's row directory has {} entries, the model needs {dir_len}", rows.directory.len()),
                });
            }
            let base = a_rows.len() as u32;
            for (i, pair) in rows.directory.chunks_exact(2).enumerate() {
                directory.extend_from_slice(&[pair[0] + base, pair[1]]);
                if pair[1] > 0 {
                    targeted[i / NUM_MODULES][i % NUM_MODULES] = true;
                }
            }
            a_rows.extend_from_slice(&rows.a_rows);
            b_rows.extend_from_slice(&rows.b_rows);
        }
        let max_rank = adapters.iter().map(|r| r.max_rank).max().unwrap_or(0);
        let rows = LoraRows {
            num_slots: adapters.len(),
            num_layers,
            directory: backend.upload_u32(&directory)?,
            a_rows: backend.upload_u32(&a_rows)?,
            b_rows: backend.upload_u32(&b_rows)?,
            slot_dtypes: backend.upload_u32(&adapters.iter().map(|r| r.dtype as u32).collect::<Vec<_>>())?,
        };
        let layout = if per_row {
            LoraLayout::PerRow(backend.upload_u32(token_slots)?)
        } else {
            let seg = segments_of(token_slots);
            LoraLayout::Segments(LoraSegments {
                num_segments: seg.slots.len(),
                seg_starts: backend.upload_u32(&seg.starts)?,
                seg_slots: backend.upload_u32(&seg.slots)?,
            })
        };
        Ok(Some(Self { rows, layout, max_rank, targeted, scratch: Mutex::new(None), deltas: Mutex::new(Vec::new()) }))
    }

    /// Whether some adapter of the batch adds a delta to `module` of `layer`.
    pub fn targets(&self, layer: usize, module: TargetModule) -> bool {
        self.max_rank > 0 && self.targeted.get(layer).is_some_and(|t| t[module.index()])
    }

    /// Adds the batch's LoRA deltas at `site` to `y`, the base projection of `x`.
    pub fn apply(&self, backend: &B, pool: &B::Buffer, site: &LoraSite, x: &B::Buffer, y: &mut B::Buffer) -> Result<(), KernelError> {
        let LoraSite { layer, module, in_features, out_features, tokens } = *site;
        if !self.targets(layer, module) {
            return Ok(());
        }
        let target = LoraTarget { layer, module: module.index(), in_features, out_features, max_rank: self.max_rank };
        match &self.layout {
            LoraLayout::PerRow(slots) => backend.bgmv(x, pool, &self.rows, slots, &target, y),
            LoraLayout::Segments(segs) => {
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                let need = tokens * self.max_rank;
                let v = match &mut *scratch {
                    Some((len, v)) if *len >= need => v,
                    other => &mut other.insert((need, backend.zeros_f32(need)?)).1,
                };
                backend.sgmv_shrink(x, pool, &self.rows, segs, &target, v)?;
                backend.sgmv_expand(v, pool, &self.rows, segs, &target, y)
            }
        }
    }
}

impl<B: Backend> LoraBatch<B> {
    /// Runs `base` (the projection, writing `out`) and, beside it where the backend overlaps
    /// work ([`loraplex_kernels::Memory::overlaps`]), the deltas of `sites` (all of one input
    /// `x`) into zeroed buffers of their own; then `finish` gets `out` and the deltas, one per
    /// site, each `tokens * out_features` values long, to add them in.
    ///
    /// On the CPU the base matmul is bound by the FMA units and the LoRA kernels by memory (no
    /// adapter row serves two tokens of a decode batch), so one thread streaming the rows while
    /// the others multiply hides much of the rows' time. Each delta is summed on its own, then
    /// added to the base output: `base + delta` elementwise, the same for a row whatever its
    /// batch.
    #[allow(clippy::too_many_arguments)] // the projection's halves and the buffers they share
    pub fn beside<T: Send>(
        &self,
        backend: &B,
        pool: &B::Buffer,
        x: &B::Buffer,
        sites: &[LoraSite],
        out: &mut T,
        base: impl FnOnce(&mut T) -> Result<(), KernelError> + Send,
        finish: impl FnOnce(&mut T, &[&B::Buffer]) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        let mut mine = Vec::with_capacity(sites.len());
        {
            let mut kept = self.deltas.lock().unwrap_or_else(|p| p.into_inner());
            for site in sites {
                let need = site.tokens.checked_mul(site.out_features).ok_or_else(|| KernelError::Shape {
                    op: "lora_delta",
                    detail: format!("{} tokens of {} values overflow", site.tokens, site.out_features),
                })?;
                let buf = match kept.iter().position(|(len, _)| *len == need) {
                    Some(i) => kept.swap_remove(i).1,
                    None => backend.zeros(need)?,
                };
                mine.push((need, buf));
            }
        }
        let (done, added) = backend.join(
            || base(out),
            || {
                for ((need, delta), site) in mine.iter_mut().zip(sites) {
                    backend.fill_zero(delta, *need)?;
                    self.apply(backend, pool, site, x, delta)?;
                }
                Ok::<_, KernelError>(())
            },
        );
        let result = done.and(added).and_then(|()| finish(out, &mine.iter().map(|(_, d)| d).collect::<Vec<_>>()));
        self.deltas.lock().unwrap_or_else(|p| p.into_inner()).extend(mine);
        result
    }
}

/// One projection a LoRA delta may be added to, and the batch's token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraSite {
    pub layer: usize,
    pub module: TargetModule,
    pub in_features: usize,
    pub out_features: usize,
    pub tokens: usize,
}

/// What a decorated linear layer needs to add the batch's LoRA deltas: the batch's adapter
/// tables and layout, the pool buffer holding the rows, and the layer index.
pub struct LoraContext<'a, B: Backend> {
    pub batch: &'a LoraBatch<B>,
    pub pool: &'a B::Buffer,
    pub layer: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_collapse_runs() {
        let s = segments_of(&[0, 0, 1, NO_ADAPTER, NO_ADAPTER, 0]);
        assert_eq!(s.starts, vec![0, 2, 3, 5, 6]);
        assert_eq!(s.slots, vec![0, 1, NO_ADAPTER, 0]);
        let empty = segments_of(&[]);
        assert_eq!((empty.starts, empty.slots), (vec![0], vec![]));
    }
}
