use super::*;
use crate::Memory;
use crate::cpu::Path;

fn rand_vec(len: usize, seed: &mut u64) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Heads {
    heads: usize,
    kv_heads: usize,
    hd: usize,
}

/// Dense causal attention of the last `new` positions of one sequence over all `len` of them.
fn dense_attention(q: &[f32], k: &[f32], v: &[f32], len: usize, new: usize, shape: &Heads, window: Option<usize>) -> Vec<f32> {
    let Heads { heads, kv_heads, hd } = *shape;
    let group = heads / kv_heads;
    let mut out = vec![0f32; new * heads * hd];
    for t in 0..new {
        let pos = len - new + t;
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..heads {
            let kvh = h / group;
            let qh = &q[(t * heads + h) * hd..][..hd];
            let scores: Vec<f64> = (first..=pos)
                .map(|j| {
                    let kj = &k[(j * kv_heads + kvh) * hd..][..hd];
                    qh.iter().zip(kj).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for d in 0..hd {
                let acc: f64 = (first..=pos).zip(&exps).map(|(j, e)| e / sum * v[(j * kv_heads + kvh) * hd + d] as f64).sum();
                out[(t * heads + h) * hd + d] = acc as f32;
            }
        }
    }
    out
}

/// Values as a bf16 KV page holds them: rounded to nearest even.
fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect()
}

/// Writes the cached prefixes and the batch's K/V of three sequences (a decode, a prefill with a
/// cached prefix, a fresh prefill) into scattered pages of a `dtype` cache and attends; returns
/// the output and dense attention over the values (rounded first when `round` is set).
fn paged_case(cpu: &CpuBackend, dtype: RowDType, round: bool, window: Option<usize>) -> (Vec<f32>, Vec<f32>) {
    let (heads, kv_heads, hd) = (6, 2, 8);
    let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 4, dtype };
    let num_pages = 32;
    // (total length, new tokens)
    let seqs = [(9usize, 1usize), (13, 5), (7, 7)];
    let mut seed = 42u64;
    let mut cache = cpu.zeros(num_pages * layout.page_elems()).unwrap();
    // Scattered, non-contiguous pages for each sequence.
    let mut next_page = num_pages as u32 - 1;
    let mut tables = Vec::new();
    let max_blocks = 4;
    let (mut positions, mut slots, mut seq_starts, mut ctx) = (vec![], vec![], vec![0u32], vec![]);
    let (mut all_q, mut dense) = (vec![], vec![]);
    let mut ks = vec![];
    let mut vs = vec![];
    for &(len, new) in &seqs {
        let mut table = vec![0u32; max_blocks];
        for entry in table.iter_mut().take(len.div_ceil(layout.block_size)) {
            *entry = next_page;
            next_page -= 3;
        }
        let (mut k, mut v) = (rand_vec(len * kv_heads * hd, &mut seed), rand_vec(len * kv_heads * hd, &mut seed));
        if round {
            (k, v) = (round_bf16(&k), round_bf16(&v));
        }
        let q = rand_vec(new * heads * hd, &mut seed);
        // The cached prefix goes in through one write, the new tokens through the batch.
        let prefix = len - new;
        if prefix > 0 {
            let pm = BatchMeta {
                num_seqs: 1,
                num_tokens: prefix,
                max_blocks_per_seq: max_blocks,
                positions: cpu.upload_u32(&(0..prefix as u32).collect::<Vec<_>>()).unwrap(),
                slots: cpu.upload_u32(&(0..prefix).map(|p| table[p / 4] * 4 + (p % 4) as u32).collect::<Vec<_>>()).unwrap(),
                seq_starts: cpu.upload_u32(&[0, prefix as u32]).unwrap(),
                context_lens: cpu.upload_u32(&[prefix as u32]).unwrap(),
                block_tables: cpu.upload_u32(&table).unwrap(),
            };
            let kp = cpu.upload_f32(&k[..prefix * kv_heads * hd]).unwrap();
            let vp = cpu.upload_f32(&v[..prefix * kv_heads * hd]).unwrap();
            cpu.write_kv(&kp, &vp, &mut cache, &pm, &layout, 1).unwrap();
        }
        for p in prefix..len {
            positions.push(p as u32);
            slots.push(table[p / 4] * 4 + (p % 4) as u32);
        }
        ks.extend_from_slice(&k[prefix * kv_heads * hd..]);
        vs.extend_from_slice(&v[prefix * kv_heads * hd..]);
        seq_starts.push(seq_starts.last().unwrap() + new as u32);
        ctx.push(len as u32);
        tables.extend_from_slice(&table);
        all_q.extend_from_slice(&q);
        dense.extend(dense_attention(&q, &k, &v, len, new, &Heads { heads, kv_heads, hd }, window));
    }
    let tokens = positions.len();
    let meta = BatchMeta {
        num_seqs: seqs.len(),
        num_tokens: tokens,
        max_blocks_per_seq: max_blocks,
        positions: cpu.upload_u32(&positions).unwrap(),
        slots: cpu.upload_u32(&slots).unwrap(),
        seq_starts: cpu.upload_u32(&seq_starts).unwrap(),
        context_lens: cpu.upload_u32(&ctx).unwrap(),
        block_tables: cpu.upload_u32(&tables).unwrap(),
    };
    cpu.write_kv(&cpu.upload_f32(&ks).unwrap(), &cpu.upload_f32(&vs).unwrap(), &mut cache, &meta, &layout, 1).unwrap();
    let params = AttentionParams { layer: 1, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), sliding_window: window };
    let mut out = cpu.upload_f32(&vec![f32::NAN; tokens * heads * hd]).unwrap();
    cpu.attention(&cpu.upload_f32(&all_q).unwrap(), &cache, &mut out, &meta, &layout, &params).unwrap();
    (cpu.download_f32(&out).unwrap(), dense)
}

fn max_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

#[test]
fn paged_attention_matches_dense_for_mixed_prefill_and_decode() {
    for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
        for window in [None, Some(3)] {
            let (got, dense) = paged_case(&cpu, RowDType::F32, false, window);
            let err = max_error(&got, &dense);
            assert!(err < 1e-5, "{:?}, window {window:?}: max error {err}", cpu.path());
        }
    }
}

/// A bf16 KV page rounds each value once, on write, to nearest even, and attention widens it
/// exactly: the result equals f32 attention over the rounded values bit for bit, on every path.
#[test]
fn bf16_kv_pages_round_on_write_and_attend_like_f32_pages_of_the_rounded_values() {
    for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
        for window in [None, Some(3)] {
            let (half, dense_raw) = paged_case(&cpu, RowDType::Bf16, false, window);
            let (full_rounded, dense_rounded) = paged_case(&cpu, RowDType::F32, true, window);
            assert!(max_error(&full_rounded, &dense_rounded) < 1e-5);
            let same = half.iter().zip(&full_rounded).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{:?}, window {window:?}: bf16 pages differ from f32 pages of the rounded values", cpu.path());
            let err = max_error(&half, &dense_raw);
            assert!(err > 0.0 && err < 2e-2, "{:?}: bf16 KV error {err} against f32 values", cpu.path());
        }
    }
}

/// A bf16 page is half the bytes of an f32 page and every value lands where the layout says.
#[test]
fn bf16_kv_layout_halves_the_page_and_writes_only_its_slots() {
    let cpu = CpuBackend::new();
    let f32_layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 2, dtype: RowDType::F32 };
    let layout = KvLayout { dtype: RowDType::Bf16, ..f32_layout };
    assert_eq!(layout.page_values(), f32_layout.page_elems());
    assert_eq!(2 * layout.page_bytes(), f32_layout.page_bytes());
    let mut cache = cpu.zeros(3 * layout.page_elems()).unwrap();
    let meta = BatchMeta {
        num_seqs: 1,
        num_tokens: 1,
        max_blocks_per_seq: 1,
        positions: cpu.upload_u32(&[1]).unwrap(),
        slots: cpu.upload_u32(&[2 * 2 + 1]).unwrap(),
        seq_starts: cpu.upload_u32(&[0, 1]).unwrap(),
        context_lens: cpu.upload_u32(&[2]).unwrap(),
        block_tables: cpu.upload_u32(&[2]).unwrap(),
    };
    let (k, v) = ([1.0, -2.0, 1.0 + 1.0 / 256.0, 3.0], [0.5, 0.25, -0.125, 1.0 + 3.0 / 256.0]);
    cpu.write_kv(&cpu.upload_f32(&k).unwrap(), &cpu.upload_f32(&v).unwrap(), &mut cache, &meta, &layout, 1).unwrap();
    let slots = cpu.download_f32(&cache).unwrap();
    let values: &[u16] = bytemuck::cast_slice(&slots);
    let kd = layout.offset(2, 1, 0, 0, 1);
    let vd = layout.offset(2, 1, 1, 0, 1);
    let widen = |b: &[u16]| b.iter().map(|&x| f32::from_bits((x as u32) << 16)).collect::<Vec<_>>();
    // 1 + 1/256 is a tie between 1 and 1 + 1/128: to even (1); 1 + 3/256 rounds up to 1 + 1/64.
    assert_eq!(widen(&values[kd..kd + 4]), [1.0, -2.0, 1.0, 3.0]);
    assert_eq!(widen(&values[vd..vd + 4]), [0.5, 0.25, -0.125, 1.0 + 1.0 / 64.0]);
    let written = values.iter().filter(|&&x| x != 0).count();
    assert_eq!(written, 8, "only the token's K and V rows are written");
    assert!(kd >= 2 * layout.page_values() && vd + 4 <= 3 * layout.page_values(), "inside page 2");
}

#[test]
fn attention_rejects_positions_beyond_context_and_bad_pages() {
    let cpu = CpuBackend::new();
    let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, block_size: 2, dtype: RowDType::F32 };
    let cache = cpu.zeros(2 * layout.page_elems()).unwrap();
    let params = AttentionParams { layer: 0, num_heads: 1, num_kv_heads: 1, head_dim: 2, scale: 1.0, sliding_window: None };
    let meta = |pos: u32, page: u32| BatchMeta {
        num_seqs: 1,
        num_tokens: 1,
        max_blocks_per_seq: 2,
        positions: cpu.upload_u32(&[pos]).unwrap(),
        slots: cpu.upload_u32(&[0]).unwrap(),
        seq_starts: cpu.upload_u32(&[0, 1]).unwrap(),
        context_lens: cpu.upload_u32(&[3]).unwrap(),
        block_tables: cpu.upload_u32(&[0, page]).unwrap(),
    };
    let q = cpu.upload_f32(&[1.0, 1.0]).unwrap();
    let mut out = cpu.zeros(2).unwrap();
    cpu.attention(&q, &cache, &mut out, &meta(2, 1), &layout, &params).unwrap();
    assert!(cpu.attention(&q, &cache, &mut out, &meta(3, 1), &layout, &params).is_err());
    assert!(cpu.attention(&q, &cache, &mut out, &meta(2, 5), &layout, &params).is_err());
}

#[test]
fn rope_rotates_halves() {
    let cpu = CpuBackend::new();
    // head_dim 4, one head; position 1 has angles (a, b).
    let (a, b) = (0.3f32, 1.1f32);
    let table = cpu.upload_f32(&[1.0, 1.0, 0.0, 0.0, a.cos(), b.cos(), a.sin(), b.sin()]).unwrap();
    let mut x = cpu.upload_f32(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    cpu.rope(&mut x, &cpu.upload_u32(&[1]).unwrap(), &table, 1, 4).unwrap();
    let got = cpu.download_f32(&x).unwrap();
    let want = [1.0 * a.cos() - 3.0 * a.sin(), 2.0 * b.cos() - 4.0 * b.sin(), 3.0 * a.cos() + 1.0 * a.sin(), 4.0 * b.cos() + 2.0 * b.sin()];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6);
    }
    assert!(cpu.rope(&mut x, &cpu.upload_u32(&[2]).unwrap(), &table, 1, 4).is_err());
}

/// A token's output does not depend on the batch it is attended in: a prompt's 21 tokens and
/// the last 3 of a second sequence (at positions 21-23, right after the first's 20) attended
/// together give each token the same bits as attending it alone, as a decode step would: with
/// and without a sliding window, with f32 and bf16 pages, on every path.
#[test]
fn tokens_attended_together_equal_tokens_attended_alone() {
    let (heads, kv_heads, hd) = (4, 2, 16);
    let (lens, max_blocks) = ([21usize, 24], 6);
    for dtype in [RowDType::F32, RowDType::Bf16] {
        for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
            let layout = KvLayout { num_layers: 1, num_kv_heads: kv_heads, head_dim: hd, block_size: 4, dtype };
            let mut cache = cpu.zeros(16 * layout.page_elems()).unwrap();
            let mut seed = 7u64;
            // Sequence 0 on pages 15, 13, .., 5; sequence 1 on pages 14, 12, .., 4.
            let tables: Vec<u32> = [15u32, 13, 11, 9, 7, 5, 14, 12, 10, 8, 6, 4].to_vec();
            // Every position of both sequences (written first), and the batch: all of sequence
            // 0 and the last three of sequence 1.
            let (mut positions, mut slots, mut seqs) = (vec![], vec![], vec![]);
            for (s, &len) in lens.iter().enumerate() {
                for p in 0..len {
                    positions.push(p as u32);
                    slots.push(tables[s * max_blocks + p / 4] * 4 + (p % 4) as u32);
                    seqs.push(s);
                }
            }
            let written: Vec<usize> = (0..positions.len()).collect();
            let batch: Vec<usize> = (0..lens[0]).chain(lens[0] + lens[1] - 3..lens[0] + lens[1]).collect();
            let meta = |t: &[usize]| BatchMeta {
                num_seqs: 2,
                num_tokens: t.len(),
                max_blocks_per_seq: max_blocks,
                positions: cpu.upload_u32(&t.iter().map(|&t| positions[t]).collect::<Vec<_>>()).unwrap(),
                slots: cpu.upload_u32(&t.iter().map(|&t| slots[t]).collect::<Vec<_>>()).unwrap(),
                seq_starts: cpu.upload_u32(&[0, t.iter().filter(|&&t| seqs[t] == 0).count() as u32, t.len() as u32]).unwrap(),
                context_lens: cpu.upload_u32(&[lens[0] as u32, lens[1] as u32]).unwrap(),
                block_tables: cpu.upload_u32(&tables).unwrap(),
            };
            let (k, v) = (rand_vec(written.len() * kv_heads * hd, &mut seed), rand_vec(written.len() * kv_heads * hd, &mut seed));
            cpu.write_kv(&cpu.upload_f32(&k).unwrap(), &cpu.upload_f32(&v).unwrap(), &mut cache, &meta(&written), &layout, 0).unwrap();
            let row = heads * hd;
            let q = rand_vec(batch.len() * row, &mut seed);
            for window in [None, Some(6)] {
                let params = AttentionParams { layer: 0, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 0.25, sliding_window: window };
                let mut out = cpu.upload_f32(&vec![f32::NAN; batch.len() * row]).unwrap();
                cpu.attention(&cpu.upload_f32(&q).unwrap(), &cache, &mut out, &meta(&batch), &layout, &params).unwrap();
                let together = cpu.download_f32(&out).unwrap();
                for (i, &t) in batch.iter().enumerate() {
                    let mut one = cpu.upload_f32(&vec![f32::NAN; row]).unwrap();
                    cpu.attention(&cpu.upload_f32(&q[i * row..(i + 1) * row]).unwrap(), &cache, &mut one, &meta(&[t]), &layout, &params).unwrap();
                    let alone = cpu.download_f32(&one).unwrap();
                    let same = alone.iter().zip(&together[i * row..(i + 1) * row]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{:?} {dtype:?}, window {window:?}: token {t} differs alone and in the batch", cpu.path());
                }
            }
        }
    }
}
