//! Packing an adapter into the page pool's row layout.
//!
//! For every adapted (layer, module) of rank `r`, the adapter is stored as `r` A rows
//! (`in_features` values each: the rows of A) and `r` B rows (`out_features` values each: the
//! columns of B, with the LoRA scaling multiplied in). Rows start on `align`-element boundaries
//! and never cross a page boundary; no rank is padded. The result is a host image of whole pages
//! plus a row table, so that placing the adapter in the pool is one copy per page and the LoRA
//! kernels find each row through the table.
//!
//! Rows are placed first-fit in decreasing order of length: the long rows fill pages first and
//! the short ones fill the gaps, which keeps the unused space well under one page per adapter
//! for the shapes of real models.
//!
//! Rows are stored as bfloat16 (two per f32 slot) when every value, scaling included, is exactly
//! a bfloat16 (an adapter saved in bf16, with a power-of-two scaling), halving the bytes the
//! LoRA kernels stream; otherwise as f32. The stored values are always exactly the adapter's.

use crate::{LoraAdapter, TargetModule};

/// Why an adapter cannot be packed with the pool's page geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    #[error("the page size ({page_elems} values) must be a positive multiple of the row alignment ({align})")]
    PageGeometry { page_elems: usize, align: usize },
    #[error(
        "layer {layer} {module}: a row of {len} values does not fit in a page of {page_elems} values; \
         use a larger KV block size"
    )]
    RowTooLong { layer: usize, module: &'static str, len: usize, page_elems: usize },
}

/// How rows are stored: f32, or bfloat16 packed two per f32 slot (lower-addressed half first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowStorage {
    F32,
    Bf16,
}

impl RowStorage {
    /// f32 slots a row of `elems` values occupies, before alignment.
    pub fn slots(self, elems: usize) -> usize {
        match self {
            RowStorage::F32 => elems,
            RowStorage::Bf16 => elems.div_ceil(2),
        }
    }

    /// The narrowest storage that holds every value of `adapter` (B with its scaling) exactly.
    pub fn exact_for(adapter: &LoraAdapter) -> Self {
        let is_bf16 = |v: f32| v.to_bits() & 0xFFFF == 0;
        let exact = adapter.modules().all(|m| m.a.iter().all(|&v| is_bf16(v)) && m.b.iter().all(|&v| is_bf16(v * m.scaling)));
        if exact { RowStorage::Bf16 } else { RowStorage::F32 }
    }
}

/// The rows of one adapted (layer, module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedEntry {
    pub layer: usize,
    pub module: TargetModule,
    pub rank: usize,
    pub in_features: usize,
    pub out_features: usize,
    /// Index of this entry's first row in [`PackedAdapter::a_rows`] and `b_rows`.
    pub first_row: usize,
}

/// An adapter laid out as pool pages, ready to be copied in.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedAdapter {
    page_elems: usize,
    storage: RowStorage,
    /// `pages * page_elems` values: the page images in order.
    data: Vec<f32>,
    entries: Vec<PackedEntry>,
    /// Offset (in f32 slots) in `data` of each A row, entries in order, rank order within an
    /// entry.
    a_rows: Vec<usize>,
    /// The same for B rows.
    b_rows: Vec<usize>,
    /// f32 slots occupied by rows, alignment padding included.
    used: usize,
}

fn round_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

impl PackedAdapter {
    /// Packs `adapter` into pages of `page_elems` f32 slots with rows aligned to `align` slots,
    /// in the narrowest exact storage ([`RowStorage::exact_for`]).
    pub fn pack(adapter: &LoraAdapter, page_elems: usize, align: usize) -> Result<Self, PackError> {
        Self::pack_as(adapter, page_elems, align, RowStorage::exact_for(adapter))
    }

    /// Packs with the given storage. Values that bf16 cannot hold are rounded to nearest even.
    pub fn pack_as(adapter: &LoraAdapter, page_elems: usize, align: usize, storage: RowStorage) -> Result<Self, PackError> {
        if align == 0 || page_elems == 0 || !page_elems.is_multiple_of(align) {
            return Err(PackError::PageGeometry { page_elems, align });
        }
        // (aligned length, entry index, rank index, is_b) for every row.
        let mut entries = Vec::with_capacity(adapter.len());
        let mut rows = Vec::with_capacity(2 * adapter.total_rank_rows());
        for (e, m) in adapter.modules().enumerate() {
            for (len, is_b) in [(m.in_features, false), (m.out_features, true)] {
                let slots = round_up(storage.slots(len), align);
                if slots > page_elems {
                    return Err(PackError::RowTooLong { layer: m.layer, module: m.module.hf_name(), len, page_elems });
                }
                rows.extend((0..m.rank).map(|r| (slots, e, r, is_b)));
            }
            let first_row = entries.last().map_or(0, |p: &PackedEntry| p.first_row + p.rank);
            entries.push(PackedEntry { layer: m.layer, module: m.module, rank: m.rank, in_features: m.in_features, out_features: m.out_features, first_row });
        }
        // Longest first; ties keep table order so the layout is deterministic.
        rows.sort_by_key(|&(len, e, r, is_b)| (std::cmp::Reverse(len), e, is_b, r));
        let total_rows: usize = entries.iter().map(|e| e.rank).sum();
        let (mut a_rows, mut b_rows) = (vec![0; total_rows], vec![0; total_rows]);
        // Space used in each page so far.
        let mut fill: Vec<usize> = Vec::new();
        // First page that may still have room for the current length (lengths only decrease).
        let mut first_open = 0;
        let mut used = 0;
        for &(len, e, r, is_b) in &rows {
            while first_open < fill.len() && page_elems - fill[first_open] < align {
                first_open += 1;
            }
            let page = match (first_open..fill.len()).find(|&p| page_elems - fill[p] >= len) {
                Some(p) => p,
                None => {
                    fill.push(0);
                    fill.len() - 1
                }
            };
            let offset = page * page_elems + fill[page];
            fill[page] += len;
            used += len;
            let slot = entries[e].first_row + r;
            if is_b {
                b_rows[slot] = offset;
            } else {
                a_rows[slot] = offset;
            }
        }
        let mut data = vec![0f32; fill.len() * page_elems];
        let mut row = Vec::new();
        for (m, entry) in adapter.modules().zip(&entries) {
            for r in 0..m.rank {
                row.clear();
                row.extend_from_slice(&m.a[r * m.in_features..(r + 1) * m.in_features]);
                write_row(&mut data, a_rows[entry.first_row + r], &row, storage);
                row.clear();
                row.extend((0..m.out_features).map(|o| m.b[o * m.rank + r] * m.scaling));
                write_row(&mut data, b_rows[entry.first_row + r], &row, storage);
            }
        }
        Ok(PackedAdapter { page_elems, storage, data, entries, a_rows, b_rows, used })
    }

    pub fn storage(&self) -> RowStorage {
        self.storage
    }

    pub fn page_elems(&self) -> usize {
        self.page_elems
    }

    pub fn num_pages(&self) -> usize {
        self.data.len() / self.page_elems
    }

    /// The page images, `num_pages() * page_elems()` values.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Page `i`'s image.
    pub fn page(&self, i: usize) -> &[f32] {
        &self.data[i * self.page_elems..(i + 1) * self.page_elems]
    }

    /// The adapted (layer, module) pairs, sorted by layer then module.
    pub fn entries(&self) -> &[PackedEntry] {
        &self.entries
    }

    /// Offsets (in values, within [`Self::data`]) of every A row.
    pub fn a_rows(&self) -> &[usize] {
        &self.a_rows
    }

    /// Offsets (in values, within [`Self::data`]) of every B row.
    pub fn b_rows(&self) -> &[usize] {
        &self.b_rows
    }

    /// Values of the pages not occupied by any row (alignment padding counts as occupied).
    pub fn unused(&self) -> usize {
        self.data.len() - self.used
    }

    /// Bytes of the page images in host memory.
    pub fn bytes(&self) -> usize {
        self.data.len() * size_of::<f32>()
    }

    /// Reads one entry back as `(A [rank, in], B·scaling [out, rank])`, for checks.
    pub fn unpack(&self, entry: &PackedEntry) -> (Vec<f32>, Vec<f32>) {
        let (rank, inf, outf) = (entry.rank, entry.in_features, entry.out_features);
        let mut a = Vec::with_capacity(rank * inf);
        let mut b = vec![0f32; outf * rank];
        for r in 0..rank {
            a.extend(read_row(&self.data, self.a_rows[entry.first_row + r], inf, self.storage));
            for (o, v) in read_row(&self.data, self.b_rows[entry.first_row + r], outf, self.storage).enumerate() {
                b[o * rank + r] = v;
            }
        }
        (a, b)
    }
}

/// Writes `values` as a row starting at f32 slot `at`.
fn write_row(data: &mut [f32], at: usize, values: &[f32], storage: RowStorage) {
    match storage {
        RowStorage::F32 => data[at..at + values.len()].copy_from_slice(values),
        RowStorage::Bf16 => {
            let halves: &mut [u16] = bytemuck::cast_slice_mut(data);
            for (dst, v) in halves[2 * at..2 * at + values.len()].iter_mut().zip(values) {
                *dst = half::bf16::from_f32(*v).to_bits();
            }
        }
    }
}

/// Reads `len` values of the row at f32 slot `at`.
fn read_row(data: &[f32], at: usize, len: usize, storage: RowStorage) -> Box<dyn Iterator<Item = f32> + '_> {
    match storage {
        RowStorage::F32 => Box::new(data[at..at + len].iter().copied()),
        RowStorage::Bf16 => {
            let halves: &[u16] = bytemuck::cast_slice(data);
            Box::new(halves[2 * at..2 * at + len].iter().map(|&h| half::bf16::from_bits(h).to_f32()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BaseShape, LoraModule};

    fn adapter(shape: &BaseShape, ranks: &[(TargetModule, usize)], layers: usize, seed: u32) -> LoraAdapter {
        let mut modules = Vec::new();
        for layer in 0..layers {
            for &(module, rank) in ranks {
                let (inf, outf) = shape.dims(module);
                let val = |i: usize, k: u32| ((i as u32).wrapping_mul(2654435761) ^ (seed + k + layer as u32)) as f32 / u32::MAX as f32 - 0.5;
                modules.push(LoraModule {
                    layer,
                    module,
                    rank,
                    alpha: 2.0 * rank as f32,
                    scaling: 2.0,
                    in_features: inf,
                    out_features: outf,
                    a: (0..rank * inf).map(|i| val(i, 1)).collect(),
                    b: (0..outf * rank).map(|i| val(i, 2)).collect(),
                });
            }
        }
        LoraAdapter::from_modules(modules, false)
    }

    #[test]
    fn rows_round_trip_with_scaling_folded_into_b() {
        let shape = BaseShape::llama(128, 344, 8, 2, 16, 3);
        let ad = adapter(&shape, &[(TargetModule::Q, 8), (TargetModule::V, 4), (TargetModule::Down, 16)], 3, 1);
        let packed = PackedAdapter::pack(&ad, 2048, 16).unwrap();
        assert_eq!(packed.entries().len(), 9);
        for (m, e) in ad.modules().zip(packed.entries()) {
            assert_eq!((e.layer, e.module, e.rank), (m.layer, m.module, m.rank));
            let (a, b) = packed.unpack(e);
            assert_eq!(a, m.a);
            let scaled: Vec<f32> = m.b.iter().map(|v| v * m.scaling).collect();
            assert_eq!(b, scaled);
        }
    }

    #[test]
    fn bf16_exact_adapters_are_stored_as_bf16_and_round_trip() {
        let shape = BaseShape::llama(128, 344, 8, 2, 16, 2);
        let mut ad = adapter(&shape, &[(TargetModule::Q, 8), (TargetModule::Down, 4)], 2, 5);
        assert_eq!(RowStorage::exact_for(&ad), RowStorage::F32);
        let f32_pages = PackedAdapter::pack(&ad, 2048, 16).unwrap().num_pages();
        let truncated: Vec<LoraModule> = ad
            .modules()
            .map(|m| {
                let mut m = m.clone();
                for v in m.a.iter_mut().chain(m.b.iter_mut()) {
                    *v = f32::from_bits(v.to_bits() & 0xFFFF_0000);
                }
                m
            })
            .collect();
        ad = LoraAdapter::from_modules(truncated, false);
        let packed = PackedAdapter::pack(&ad, 2048, 16).unwrap();
        assert_eq!(packed.storage(), RowStorage::Bf16);
        assert!(packed.num_pages() < f32_pages, "{} bf16 pages vs {f32_pages} f32", packed.num_pages());
        for (m, e) in ad.modules().zip(packed.entries()) {
            let (a, b) = packed.unpack(e);
            assert_eq!(a, m.a);
            assert_eq!(b, m.b.iter().map(|v| v * m.scaling).collect::<Vec<_>>());
        }
        // A scaling that is not a power of two would round: those stay f32.
        let odd: Vec<LoraModule> = ad.modules().map(|m| LoraModule { scaling: 1.3, ..m.clone() }).collect();
        assert_eq!(RowStorage::exact_for(&LoraAdapter::from_modules(odd, false)), RowStorage::F32);
    }

    #[test]
    fn rows_are_aligned_whole_and_disjoint() {
        let shape = BaseShape::llama(128, 344, 8, 2, 16, 4);
        let all: Vec<_> = TargetModule::ALL.iter().map(|&m| (m, 8)).collect();
        let ad = adapter(&shape, &all, 4, 2);
        let page = 1024;
        let packed = PackedAdapter::pack(&ad, page, 16).unwrap();
        let mut spans = Vec::new();
        for e in packed.entries() {
            for r in 0..e.rank {
                spans.push((packed.a_rows()[e.first_row + r], e.in_features));
                spans.push((packed.b_rows()[e.first_row + r], e.out_features));
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "rows overlap: {w:?}");
        }
        for &(off, len) in &spans {
            assert_eq!(off % 16, 0, "row at {off} is not aligned");
            assert_eq!(off / page, (off + len - 1) / page, "row at {off} crosses a page");
            assert!(off + len <= packed.data().len());
        }
    }

    /// Fragmentation: less than one page per adapter is left unused, across model shapes,
    /// ranks, target sets and page sizes.
    #[test]
    fn unused_space_is_below_one_page() {
        let shapes = [
            (BaseShape::llama(128, 344, 8, 2, 16, 4), [2048, 4096, 8192]),
            (BaseShape::llama(1024, 2816, 16, 4, 64, 8), [65536, 131072, 262144]),
            (BaseShape::llama(4096, 14336, 32, 8, 128, 2), [1 << 20, 1 << 21, 1 << 22]),
        ];
        let qv = [(TargetModule::Q, 0), (TargetModule::V, 0)];
        let all = TargetModule::ALL.map(|m| (m, 0));
        for (shape, pages) in &shapes {
            for rank in [1, 4, 8, 16, 64] {
                for targets in [&qv[..], &all[..]] {
                    let ranks: Vec<_> = targets.iter().map(|&(m, _)| (m, rank)).collect();
                    let ad = adapter(shape, &ranks, shape.num_layers, 3);
                    for (&page, storage) in pages.iter().flat_map(|p| [(p, RowStorage::F32), (p, RowStorage::Bf16)]) {
                        let p = PackedAdapter::pack_as(&ad, page, 16, storage).unwrap();
                        assert!(
                            p.unused() < page,
                            "rank {rank}, {} targets, page {page}, {storage:?}: {} pages, {} slots unused",
                            targets.len(),
                            p.num_pages(),
                            p.unused()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn geometry_errors_are_reported() {
        let shape = BaseShape::llama(128, 344, 8, 2, 16, 1);
        let ad = adapter(&shape, &[(TargetModule::Down, 4)], 1, 0);
        assert_eq!(PackedAdapter::pack(&ad, 100, 16), Err(PackError::PageGeometry { page_elems: 100, align: 16 }));
        let err = PackedAdapter::pack(&ad, 256, 16).unwrap_err();
        assert!(err.to_string().contains("layer 0 down_proj: a row of 344 values"), "{err}");
    }
}
