//! Helpers the CUDA tests share (the simulator's and the GPU's): random inputs, the error bound
//! per storage type, and batches over a paged cache.

#![allow(dead_code)]

use loraplex_kernels::{BatchMeta, DType, LORA_ROW_ALIGN, Memory, NUM_MODULES, RowDType};
use rand::{Rng, SeedableRng, rngs::StdRng};

pub const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

/// A generator seeded afresh on every run: each run draws new inputs.
pub fn rng() -> StdRng {
    StdRng::seed_from_u64(rand::random())
}

pub fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// The bound on the relative error norm for outputs stored as `dtype`.
pub fn bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

/// Prints ‖got − want‖ / ‖want‖ and fails over the bound, or on any non-finite output (outputs
/// start as NaN, so an unwritten element shows).
pub fn check(what: &str, dtype: DType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what} {dtype}: element {i} is {g} (unwritten or overflowed)");
        num += ((g - w) as f64).powi(2);
        den += (w as f64).powi(2);
    }
    let e = (num / den.max(1e-30)).sqrt();
    println!("{what:<44} {dtype:<5} rel err {e:.2e} (bound {:.0e})", bound(dtype));
    assert!(e <= bound(dtype), "{what} {dtype}: relative error {e:.3e} over {:.0e}", bound(dtype));
}

/// A batch over a paged cache: sequences of (cached, new) tokens, pages in shuffled order.
pub struct Paged {
    pub pages: usize,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq_starts: Vec<u32>,
    pub context_lens: Vec<u32>,
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
}

pub fn paged(r: &mut StdRng, block: usize, seqs: &[(usize, usize)]) -> Paged {
    let max_blocks = seqs.iter().map(|&(c, n)| (c + n).div_ceil(block)).max().unwrap();
    let pages = seqs.iter().map(|&(c, n)| (c + n).div_ceil(block)).sum::<usize>() + 2;
    let mut order: Vec<u32> = (0..pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, r.random_range(0..=i));
    }
    let mut next = order.into_iter();
    let mut p = Paged {
        pages,
        positions: vec![],
        slots: vec![],
        seq_starts: vec![0],
        context_lens: vec![],
        block_tables: vec![0; seqs.len() * max_blocks],
        max_blocks,
    };
    for (s, &(cached, new)) in seqs.iter().enumerate() {
        for b in 0..(cached + new).div_ceil(block) {
            p.block_tables[s * max_blocks + b] = next.next().unwrap();
        }
        for pos in cached..cached + new {
            p.positions.push(pos as u32);
            p.slots.push(p.block_tables[s * max_blocks + pos / block] * block as u32 + (pos % block) as u32);
        }
        p.seq_starts.push(p.positions.len() as u32);
        p.context_lens.push((cached + new) as u32);
    }
    p
}

/// One attention check: heads, kv heads, head_dim, sequences as (cached, new), sliding window.
#[derive(Clone, Copy)]
pub struct Case<'a> {
    pub what: &'a str,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub seqs: &'a [(usize, usize)],
    pub window: Option<usize>,
}

/// Adapters for one target (layer 0 of 1, module `module`): per slot a rank and a row type;
/// rows placed in a shuffled pool.
pub struct Adapters {
    pub pool: Vec<f32>,
    pub directory: Vec<u32>,
    pub a_rows: Vec<u32>,
    pub b_rows: Vec<u32>,
    pub dtypes: Vec<u32>,
}

pub fn adapters(r: &mut StdRng, module: usize, slots: &[(usize, RowDType)], in_f: usize, out_f: usize) -> Adapters {
    let unit = |n: usize, d: RowDType| d.slots(n).div_ceil(LORA_ROW_ALIGN);
    let total: usize = slots.iter().map(|&(rank, d)| rank * (unit(in_f, d) + unit(out_f, d))).sum();
    let rows_total: usize = slots.iter().map(|&(rank, _)| 2 * rank).sum();
    let mut pool = vec![f32::NAN; (total + rows_total + 1) * LORA_ROW_ALIGN];
    let mut ad = Adapters { pool: vec![], directory: vec![0; slots.len() * NUM_MODULES * 2], a_rows: vec![], b_rows: vec![], dtypes: vec![] };
    // Rows take whole, disjoint unit ranges, a gap after each; the rest of the pool is NaN, so a
    // read outside a row shows.
    let mut next_unit = 0usize;
    let mut place = |pool: &mut Vec<f32>, data: &[f32], d: RowDType| -> u32 {
        let off = next_unit;
        next_unit += unit(data.len(), d) + 1;
        match d {
            RowDType::F32 => pool[off * LORA_ROW_ALIGN..off * LORA_ROW_ALIGN + data.len()].copy_from_slice(data),
            RowDType::Bf16 => {
                let bits: Vec<u16> = data.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut pool[..]);
                p16[2 * off * LORA_ROW_ALIGN..2 * off * LORA_ROW_ALIGN + bits.len()].copy_from_slice(&bits);
            }
        }
        off as u32
    };
    for (slot, &(rank, d)) in slots.iter().enumerate() {
        let e = (slot * NUM_MODULES + module) * 2;
        ad.directory[e] = ad.a_rows.len() as u32;
        ad.directory[e + 1] = rank as u32;
        for _ in 0..rank {
            let a = randn(r, in_f, 0.05);
            let b = randn(r, out_f, 0.05);
            ad.a_rows.push(place(&mut pool, &a, d));
            ad.b_rows.push(place(&mut pool, &b, d));
        }
        ad.dtypes.push(d as u32);
    }
    ad.pool = pool;
    ad
}

/// Segment starts and slots from (slot, tokens) pairs.
pub fn segments(seg: &[(u32, usize)]) -> (Vec<u32>, Vec<u32>) {
    let mut starts = vec![0u32];
    let mut slots = vec![];
    for &(s, n) in seg {
        starts.push(starts.last().unwrap() + n as u32);
        slots.push(s);
    }
    (starts, slots)
}

/// `p`'s batch on backend `b`.
pub fn meta<B: Memory>(b: &B, p: &Paged) -> BatchMeta<B::Buffer> {
    BatchMeta {
        num_seqs: p.context_lens.len(),
        num_tokens: p.positions.len(),
        max_blocks_per_seq: p.max_blocks,
        positions: b.upload_u32(&p.positions).unwrap(),
        slots: b.upload_u32(&p.slots).unwrap(),
        seq_starts: b.upload_u32(&p.seq_starts).unwrap(),
        context_lens: b.upload_u32(&p.context_lens).unwrap(),
        block_tables: b.upload_u32(&p.block_tables).unwrap(),
    }
}
