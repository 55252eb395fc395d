//! Every CUDA op against the CPU op on fresh random inputs, for f32, f16 and bf16 storage: sizes
//! that are not multiples of the block shapes, outputs poisoned with NaN before each run, and the
//! relative error norm ‖cuda − cpu‖ / ‖cpu‖ printed and bounded. The CPU runs on the same inputs
//! rounded to the storage type, so the bound measures the kernel, not the rounding of inputs.
//!
//! These need a CUDA device: `cargo test -p loraplex-kernels --test cuda_vs_cpu -- --ignored`.

use loraplex_kernels::cpu::CpuBackend;
use loraplex_kernels::cuda::{CudaBackend, CudaBuffer, round_to};
use loraplex_kernels::{
    AttentionOps, AttentionParams, DType, DenseOps, KvLayout, LoraOps, LoraRows, LoraSegments, LoraTarget, Memory, NO_ADAPTER, RowDType, SampleParams,
    SamplingOps,
};
use rand::{Rng, rngs::StdRng};

mod common;
use common::{Adapters, Case, DTYPES, adapters, check, meta, paged, randn, rng, segments};

fn gpu() -> CudaBackend {
    let dir = std::env::temp_dir().join("loraplex-test-kernels");
    CudaBackend::new(0, Some(dir)).expect("a CUDA device (these tests are ignored without one)")
}

/// A buffer of `n` NaNs of `dtype`: anything the op does not write stays NaN.
fn poisoned(g: &CudaBackend, n: usize, dtype: DType) -> CudaBuffer {
    g.upload_as(&vec![f32::NAN; n], dtype).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_ops_match_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    for dtype in DTYPES {
        // embedding
        let (vocab, hidden, n) = (1000, 333, 37);
        let table = round_to(&randn(&mut r, vocab * hidden, 1.0), dtype);
        let ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
        let mut go = poisoned(&g, n * hidden, dtype);
        g.embedding(&g.upload_as(&table, dtype).unwrap(), &g.upload_u32(&ids).unwrap(), &mut go, hidden).unwrap();
        let mut co = c.zeros(n * hidden).unwrap();
        c.embedding(&c.upload_f32(&table).unwrap(), &c.upload_u32(&ids).unwrap(), &mut co, hidden).unwrap();
        check("embedding", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());

        // rms_norm, plain and fused with the residual add
        let (rows, dim) = (13, 1000);
        let x = round_to(&randn(&mut r, rows * dim, 2.0), dtype);
        let res = round_to(&randn(&mut r, rows * dim, 2.0), dtype);
        let w = round_to(&randn(&mut r, dim, 1.0), dtype);
        let (gx, gw) = (g.upload_as(&x, dtype).unwrap(), g.upload_as(&w, dtype).unwrap());
        let mut go = poisoned(&g, rows * dim, dtype);
        g.rms_norm(&gx, &gw, &mut go, 1e-5).unwrap();
        let mut co = c.zeros(rows * dim).unwrap();
        let (cx, cw) = (c.upload_f32(&x).unwrap(), c.upload_f32(&w).unwrap());
        c.rms_norm(&cx, &cw, &mut co, 1e-5).unwrap();
        check("rms_norm", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
        let mut gres = g.upload_as(&res, dtype).unwrap();
        let mut go = poisoned(&g, rows * dim, dtype);
        g.rms_norm_residual(&gx, &mut gres, &gw, &mut go, 1e-5).unwrap();
        let mut cres = c.upload_f32(&res).unwrap();
        c.add_assign(&mut cres, &cx).unwrap();
        let cres_rounded = c.upload_f32(&round_to(&c.download_f32(&cres).unwrap(), dtype)).unwrap();
        c.rms_norm(&cres_rounded, &cw, &mut co, 1e-5).unwrap();
        check("rms_norm residual (sum)", dtype, &g.download_f32(&gres).unwrap(), &c.download_f32(&cres).unwrap());
        check("rms_norm residual (norm)", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());

        // matmul with bias
        let (rows, k, n) = (7, 301, 517);
        let x = round_to(&randn(&mut r, rows * k, 1.0), dtype);
        let w = round_to(&randn(&mut r, n * k, 0.1), dtype);
        let b = round_to(&randn(&mut r, n, 1.0), dtype);
        let gw = g.load_weight_as(&w, n, k, dtype).unwrap();
        let mut go = poisoned(&g, rows * n, dtype);
        g.matmul(&g.upload_as(&x, dtype).unwrap(), &gw, Some(&g.upload_as(&b, dtype).unwrap()), &mut go, rows).unwrap();
        let cw = c.load_weight(&w, n, k).unwrap();
        let mut co = c.zeros(rows * n).unwrap();
        c.matmul(&c.upload_f32(&x).unwrap(), &cw, Some(&c.upload_f32(&b).unwrap()), &mut co, rows).unwrap();
        check("matmul + bias", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());

        // silu_mul, add_assign, gather_rows
        let n = 100_003;
        let (a, b) = (round_to(&randn(&mut r, n, 4.0), dtype), round_to(&randn(&mut r, n, 4.0), dtype));
        let (ga, gb) = (g.upload_as(&a, dtype).unwrap(), g.upload_as(&b, dtype).unwrap());
        let (ca, cb) = (c.upload_f32(&a).unwrap(), c.upload_f32(&b).unwrap());
        let mut go = poisoned(&g, n, dtype);
        g.silu_mul(&ga, &gb, &mut go).unwrap();
        let mut co = c.zeros(n).unwrap();
        c.silu_mul(&ca, &cb, &mut co).unwrap();
        check("silu_mul", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
        let mut gacc = g.upload_as(&a, dtype).unwrap();
        g.add_assign(&mut gacc, &gb).unwrap();
        let mut cacc = c.upload_f32(&a).unwrap();
        c.add_assign(&mut cacc, &cb).unwrap();
        check("add_assign", dtype, &g.download_f32(&gacc).unwrap(), &c.download_f32(&cacc).unwrap());
        // silu_mul_fused and split_columns over 1,000 rows of 100 (the first 100,000 values)
        let head = c.upload_f32(&a[..100_000]).unwrap();
        let ghead = g.upload_as(&a[..100_000], dtype).unwrap();
        let mut go = poisoned(&g, 50_000, dtype);
        g.silu_mul_fused(&ghead, &mut go, 50).unwrap();
        let mut co = c.zeros(50_000).unwrap();
        c.silu_mul_fused(&head, &mut co, 50).unwrap();
        check("silu_mul_fused", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
        for widths in [&[64, 20, 16][..], &[50, 50], &[100]] {
            let mut gp: Vec<_> = widths.iter().map(|&w| (poisoned(&g, 1000 * w, dtype), w)).collect();
            g.split_columns(&ghead, 1000, &mut gp.iter_mut().map(|(b, w)| (b, *w)).collect::<Vec<_>>()).unwrap();
            let mut cp: Vec<_> = widths.iter().map(|&w| (c.zeros(1000 * w).unwrap(), w)).collect();
            c.split_columns(&head, 1000, &mut cp.iter_mut().map(|(b, w)| (b, *w)).collect::<Vec<_>>()).unwrap();
            for ((gb, w), (cb, _)) in gp.iter().zip(&cp) {
                check(&format!("split_columns {widths:?} width {w}"), dtype, &g.download_f32(gb).unwrap(), &c.download_f32(cb).unwrap());
            }
        }
        let (dim, rows) = (77, 1000);
        let picks: Vec<u32> = (0..33).map(|_| r.random_range(0..rows as u32)).collect();
        let mut go = poisoned(&g, picks.len() * dim, dtype);
        g.gather_rows(&ga, &g.upload_u32(&picks).unwrap(), &mut go, dim).unwrap_err(); // 100003 is not rows of 77
        let x = round_to(&randn(&mut r, rows * dim, 1.0), dtype);
        g.gather_rows(&g.upload_as(&x, dtype).unwrap(), &g.upload_u32(&picks).unwrap(), &mut go, dim).unwrap();
        let mut co = c.zeros(picks.len() * dim).unwrap();
        c.gather_rows(&c.upload_f32(&x).unwrap(), &c.upload_u32(&picks).unwrap(), &mut co, dim).unwrap();
        check("gather_rows", dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());

        // rope (the table encodes the variant: check tables with different frequency spreads)
        let (tokens, heads, hd, max_pos) = (9, 5, 64, 300);
        for theta in [10_000.0f64, 500_000.0] {
            let mut table = vec![0f32; max_pos * hd];
            for p in 0..max_pos {
                for i in 0..hd / 2 {
                    let a = p as f64 / theta.powf(2.0 * i as f64 / hd as f64);
                    table[p * hd + i] = a.cos() as f32;
                    table[p * hd + hd / 2 + i] = a.sin() as f32;
                }
            }
            let pos: Vec<u32> = (0..tokens).map(|_| r.random_range(0..max_pos as u32)).collect();
            let x = round_to(&randn(&mut r, tokens * heads * hd, 1.0), dtype);
            let mut gx = g.upload_as(&x, dtype).unwrap();
            g.rope(&mut gx, &g.upload_u32(&pos).unwrap(), &g.upload_f32(&table).unwrap(), heads, hd).unwrap();
            let mut cx = c.upload_f32(&x).unwrap();
            c.rope(&mut cx, &c.upload_u32(&pos).unwrap(), &c.upload_f32(&table).unwrap(), heads, hd).unwrap();
            check("rope", dtype, &g.download_f32(&gx).unwrap(), &c.download_f32(&cx).unwrap());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_write_kv_matches_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    for dtype in DTYPES {
        let (heads, kv_heads, hd) = (32, 8, 128);
        let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 16, dtype: RowDType::F32 };
        let p = paged(&mut r, 16, &[(5, 1), (300, 1), (9, 40)]);
        let t = p.positions.len();
        let table_cs = randn(&mut r, 512 * hd, 1.0);
        let cache = round_to(&randn(&mut r, p.pages * layout.page_elems(), 1.0), dtype);
        let [q, k, v] = [heads, kv_heads, kv_heads].map(|h| round_to(&randn(&mut r, t * h * hd, 1.0), dtype));
        let (gm, cm) = (meta(&g, &p), meta(&c, &p));
        let (mut gq, mut gk, mut gcache) = (g.upload_as(&q, dtype).unwrap(), g.upload_as(&k, dtype).unwrap(), g.upload_as(&cache, dtype).unwrap());
        let gv = g.upload_as(&v, dtype).unwrap();
        g.rope_write_kv(&mut gq, &mut gk, &gv, &g.upload_f32(&table_cs).unwrap(), heads, &mut gcache, &gm, &layout, 1).unwrap();
        let (mut cq, mut ck, mut ccache) = (c.upload_f32(&q).unwrap(), c.upload_f32(&k).unwrap(), c.upload_f32(&cache).unwrap());
        c.rope_write_kv(&mut cq, &mut ck, &c.upload_f32(&v).unwrap(), &c.upload_f32(&table_cs).unwrap(), heads, &mut ccache, &cm, &layout, 1).unwrap();
        check("rope_write_kv q", dtype, &g.download_f32(&gq).unwrap(), &c.download_f32(&cq).unwrap());
        check("rope_write_kv k", dtype, &g.download_f32(&gk).unwrap(), &c.download_f32(&ck).unwrap());
        check("rope_write_kv cache", dtype, &g.download_f32(&gcache).unwrap(), &c.download_f32(&ccache).unwrap());
    }
}

/// Fills every cached token's K and V (the prefix) with random values, then runs write_kv for
/// the batch's new tokens and attention on both backends.
fn attention_case(g: &CudaBackend, c: &CpuBackend, r: &mut StdRng, dtype: DType, case: Case<'_>) {
    let Case { what, heads, kv_heads, hd, seqs, window } = case;
    let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 16, dtype: RowDType::F32 };
    let p = paged(r, layout.block_size, seqs);
    let cache = round_to(&randn(r, p.pages * layout.page_elems(), 1.0), dtype);
    let t = p.positions.len();
    let k = round_to(&randn(r, t * kv_heads * hd, 1.0), dtype);
    let v = round_to(&randn(r, t * kv_heads * hd, 1.0), dtype);
    let q = round_to(&randn(r, t * heads * hd, 1.0), dtype);
    let params = AttentionParams { layer: 1, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), sliding_window: window };

    let gm = meta(g, &p);
    let mut gcache = g.upload_as(&cache, dtype).unwrap();
    g.write_kv(&g.upload_as(&k, dtype).unwrap(), &g.upload_as(&v, dtype).unwrap(), &mut gcache, &gm, &layout, 1).unwrap();
    let mut go = poisoned(g, t * heads * hd, dtype);
    g.attention(&g.upload_as(&q, dtype).unwrap(), &gcache, &mut go, &gm, &layout, &params).unwrap();

    let cm = meta(c, &p);
    let mut ccache = c.upload_f32(&cache).unwrap();
    c.write_kv(&c.upload_f32(&k).unwrap(), &c.upload_f32(&v).unwrap(), &mut ccache, &cm, &layout, 1).unwrap();
    let mut co = c.zeros(t * heads * hd).unwrap();
    c.attention(&c.upload_f32(&q).unwrap(), &ccache, &mut co, &cm, &layout, &params).unwrap();

    check(&format!("write_kv {what}"), dtype, &g.download_f32(&gcache).unwrap(), &c.download_f32(&ccache).unwrap());
    check(&format!("attention {what}"), dtype, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_matches_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    for dtype in DTYPES {
        // Decode: one token per sequence; a long single sequence is split into partitions. Each
        // case a block per query head, then through the grouped kernels where the grouping has
        // one (groups of 2, 4 and 8).
        for grouped in [false, true] {
            g.set_grouped_decode(grouped);
            let decode = [
                Case { what: "decode gqa", heads: 8, kv_heads: 2, hd: 128, seqs: &[(40, 1), (1, 1), (200, 1), (17, 1)], window: None },
                Case { what: "decode long (partitions)", heads: 8, kv_heads: 8, hd: 64, seqs: &[(3000, 1)], window: None },
                Case { what: "decode gqa long (partitions)", heads: 32, kv_heads: 8, hd: 128, seqs: &[(3000, 1)], window: None },
                Case { what: "decode gqa group 8 head_dim 256", heads: 16, kv_heads: 2, hd: 256, seqs: &[(700, 1), (3, 1)], window: None },
                Case { what: "decode gqa group 2 many rows", heads: 4, kv_heads: 2, hd: 64, seqs: &[(65, 1); 40], window: None },
                Case { what: "decode window", heads: 4, kv_heads: 2, hd: 80, seqs: &[(300, 1), (20, 1)], window: Some(64) },
            ];
            for case in decode {
                let what = format!("{}{}", case.what, if grouped { ", grouped" } else { "" });
                attention_case(&g, &c, &mut r, dtype, Case { what: &what, ..case });
            }
        }
        g.set_grouped_decode(true);
        // Prefill with a cached prefix, chunks not multiples of the tile, mixed with decode rows.
        attention_case(
            &g,
            &c,
            &mut r,
            dtype,
            Case { what: "prefill cached prefix", heads: 8, kv_heads: 2, hd: 128, seqs: &[(50, 17), (0, 33), (5, 1), (64, 40)], window: None },
        );
        attention_case(&g, &c, &mut r, dtype, Case { what: "prefill window", heads: 6, kv_heads: 3, hd: 64, seqs: &[(70, 45), (0, 9)], window: Some(40) });
        attention_case(&g, &c, &mut r, dtype, Case { what: "prefill head_dim 256", heads: 4, kv_heads: 1, hd: 256, seqs: &[(10, 20), (0, 3)], window: None });
        attention_case(&g, &c, &mut r, dtype, Case { what: "prefill head_dim 40", heads: 3, kv_heads: 3, hd: 40, seqs: &[(0, 37)], window: None });
    }
}

/// bf16 values packed two to an f32 slot, the lower-addressed first (the pool's bf16 pages).
fn pack_bf16(values: &[f32]) -> Vec<f32> {
    let bits: Vec<u16> = values.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    bits.chunks(2).map(|p| f32::from_bits(p[0] as u32 | (p.get(1).copied().unwrap_or(0) as u32) << 16)).collect()
}

/// A bf16 backend's KV pages: bf16 packed two to an f32 slot of the pool. write_kv writes the
/// same bits as the CPU backend's bf16 pages and attention reads them as the CPU does.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_pages_packed_in_the_f32_pool_match_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    let g = gpu().with_compute_dtype(DType::Bf16).unwrap();
    let bf = DType::Bf16;
    for (what, heads, kv_heads, hd, seqs) in [
        ("decode gqa", 8, 2, 128, &[(40, 1), (1, 1), (200, 1)][..]),
        ("decode long (partitions)", 8, 8, 64, &[(3000, 1)][..]),
        ("prefill cached prefix", 8, 2, 128, &[(50, 17), (0, 33), (5, 1)][..]),
    ] {
        let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 16, dtype: RowDType::Bf16 };
        let p = paged(&mut r, layout.block_size, seqs);
        let cache = pack_bf16(&randn(&mut r, p.pages * layout.page_values(), 1.0));
        assert_eq!(cache.len(), p.pages * layout.page_elems());
        let t = p.positions.len();
        let k = round_to(&randn(&mut r, t * kv_heads * hd, 1.0), bf);
        let v = round_to(&randn(&mut r, t * kv_heads * hd, 1.0), bf);
        let q = round_to(&randn(&mut r, t * heads * hd, 1.0), bf);
        let params =
            AttentionParams { layer: 1, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), sliding_window: None };

        let gm = meta(&g, &p);
        let mut gcache = g.upload_as(&cache, DType::F32).unwrap();
        // The backend's own buffers: activations in bf16, the pool in f32 slots.
        assert_eq!(g.upload_f32(&k).unwrap().dtype(), bf);
        assert_eq!(g.zeros_f32(1).unwrap().dtype(), DType::F32);
        g.write_kv(&g.upload_f32(&k).unwrap(), &g.upload_f32(&v).unwrap(), &mut gcache, &gm, &layout, 1).unwrap();
        let mut go = poisoned(&g, t * heads * hd, bf);
        g.attention(&g.upload_f32(&q).unwrap(), &gcache, &mut go, &gm, &layout, &params).unwrap();

        let cm = meta(&c, &p);
        let mut ccache = c.upload_f32(&cache).unwrap();
        c.write_kv(&c.upload_f32(&k).unwrap(), &c.upload_f32(&v).unwrap(), &mut ccache, &cm, &layout, 1).unwrap();
        let mut co = c.zeros(t * heads * hd).unwrap();
        c.attention(&c.upload_f32(&q).unwrap(), &ccache, &mut co, &cm, &layout, &params).unwrap();

        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        let (gb, cb) = (bits(g.download_f32(&gcache).unwrap()), bits(c.download_f32(&ccache).unwrap()));
        let differ = gb.iter().zip(&cb).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "write_kv {what}: {differ} pool slots differ from the CPU's bf16 pages");
        check(&format!("attention bf16 pages {what}"), bf, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
        // An f32 activation on a bf16 pool is refused, not misread.
        let q32 = g.upload_as(&q, DType::F32).unwrap();
        let mut o32 = g.zeros_as(t * heads * hd, DType::F32).unwrap();
        assert!(g.attention(&q32, &gcache, &mut o32, &gm, &layout, &params).is_err(), "{what}: f32 queries read bf16 pages");
    }
}

/// A bf16 backend's matmul writes f32 logits from bf16 activations and weights.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_matmul_writes_f32_logits() {
    let (c, mut r) = (CpuBackend::new(), rng());
    let g = gpu().with_compute_dtype(DType::Bf16).unwrap();
    let (rows, k, n) = (5, 96, 300);
    let x = round_to(&randn(&mut r, rows * k, 1.0), DType::Bf16);
    let w = round_to(&randn(&mut r, n * k, 0.1), DType::Bf16);
    let gw = g.load_weight(&w, n, k).unwrap();
    let mut go = poisoned(&g, rows * n, DType::F32);
    g.matmul(&g.upload_f32(&x).unwrap(), &gw, None, &mut go, rows).unwrap();
    let mut co = c.zeros(rows * n).unwrap();
    c.matmul(&c.upload_f32(&x).unwrap(), &c.load_weight(&w, n, k).unwrap(), None, &mut co, rows).unwrap();
    check("matmul bf16 -> f32", DType::Bf16, &g.download_f32(&go).unwrap(), &c.download_f32(&co).unwrap());
}

/// Uploads on the copy stream land where they were aimed, after compute queued before them
/// (writes and a copy within the pool queued first), reusing staging chunks; scattered pages,
/// consecutive ones (one copy) and an upload of several staging chunks (40 MiB, split across
/// them); one dropped in flight waits for its copy; bad ranges are refused before anything is
/// queued.
#[test]
#[ignore = "needs a CUDA GPU"]
fn uploads_on_the_copy_stream_land_in_order() {
    let (g, mut r) = (gpu(), rng());
    let n = 10 << 20;
    let mut pool = g.zeros_f32(n).unwrap();
    let mut want = vec![0f32; n];
    for round in 0..3 {
        // Queued on the compute stream first: every value of the pool becomes `round`, then
        // half of it is copied over the other half; the upload must land after both.
        g.write_f32(&mut pool, 0, &vec![round as f32; n]).unwrap();
        g.copy_within(&mut pool, 0, n / 2, n / 2).unwrap();
        want.iter_mut().for_each(|w| *w = round as f32);
        // Scattered pages in the first rounds; in the last, consecutive pages that straddle a
        // staging chunk's end.
        let pages: Vec<(usize, Vec<f32>)> = if round < 2 {
            (0..5).map(|i| (i * 2_000_003 + round, randn(&mut r, 100_000 + i * 77, 1.0))).collect()
        } else {
            (0..80).map(|i| (3_000_000 + i * 65_536, randn(&mut r, 65_536, 1.0))).collect()
        };
        let writes: Vec<(usize, &[f32])> = pages.iter().map(|(o, v)| (*o, v.as_slice())).collect();
        let mut up = g.start_upload(&mut pool, &writes).unwrap();
        let mut polls = 0u64;
        while !up.is_landed().unwrap() {
            polls += 1;
            std::thread::yield_now();
        }
        for (o, v) in &pages {
            want[*o..*o + v.len()].copy_from_slice(v);
        }
        assert_eq!(g.download_f32(&pool).unwrap(), want, "round {round} ({polls} polls before it landed)");
    }
    let big = randn(&mut r, n, 1.0);
    let up = g.start_upload(&mut pool, &[(0, &big)]).unwrap();
    drop(up);
    assert_eq!(g.download_f32(&pool).unwrap(), big, "a dropped upload still lands");
    assert!(g.start_upload(&mut pool, &[(n - 1, &[1.0, 2.0])]).is_err(), "past the end");
    let mut half = g.upload_as(&[0.0; 8], DType::Bf16).unwrap();
    assert!(g.start_upload(&mut half, &[(0, &[1.0])]).is_err(), "only f32 buffers");
}

/// Where an adapter's residency from host memory goes (printed, not asserted: a measurement):
/// 80 MB in 160 pool-page writes of 512 KiB, as a 7b rank-16 adapter lands. The upload call
/// itself (filling the page-locked chunks and queueing their copies) against the wait for the
/// copies after it returns, beside a plain host copy of the same values (what filling costs at
/// best) and a synchronous write from pageable memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn upload_time_is_split_between_filling_and_copying() {
    let (g, mut r) = (gpu(), rng());
    let (page, pages) = (1 << 17, 160);
    let n = page * pages;
    let mut pool = g.zeros_f32(2 * n).unwrap();
    // Half the pages one after another, the other half every other page, as in a pool in use.
    let dst: Vec<usize> = (0..pages).map(|i| if i < pages / 2 { i * page } else { (2 * i - pages / 2) * page }).collect();
    let values: Vec<Vec<f32>> = (0..pages).map(|_| randn(&mut r, page, 1.0)).collect();
    let writes: Vec<(usize, &[f32])> = dst.iter().zip(&values).map(|(d, v)| (*d, v.as_slice())).collect();
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut call, mut total, mut host, mut pageable) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut scratch = vec![0f32; n];
    for round in 0..7 {
        g.synchronize().unwrap();
        let t = std::time::Instant::now();
        let mut up = g.start_upload(&mut pool, &writes).unwrap();
        let returned = ms(t);
        while !up.is_landed().unwrap() {
            std::hint::spin_loop();
        }
        let landed = ms(t);
        let t = std::time::Instant::now();
        for (i, v) in values.iter().enumerate() {
            scratch[i * page..(i + 1) * page].copy_from_slice(v);
        }
        std::hint::black_box(&scratch);
        let copied = ms(t);
        let t = std::time::Instant::now();
        for (d, v) in &writes {
            g.write_f32(&mut pool, *d, v).unwrap();
        }
        g.synchronize().unwrap();
        let written = ms(t);
        if round > 0 {
            // The first round allocates the staging chunks.
            call.push(returned);
            total.push(landed);
            host.push(copied);
            pageable.push(written);
        } else {
            println!("upload of {} MB, first (allocates staging): call {returned:.2} ms, landed {landed:.2} ms", (n * 4) >> 20);
        }
    }
    let got = g.download_f32(&pool).unwrap();
    for (d, v) in &writes {
        assert_eq!(&got[*d..*d + v.len()], *v);
    }
    let (call, total) = (median(call), median(total));
    println!(
        "upload of {} MB, median of 6: call (fill + queue) {call:.2} ms, landed {total:.2} ms ({:.2} after the call; {:.1} GB/s end to end); \
         plain host copy {:.2} ms; synchronous pageable writes {:.2} ms",
        (n * 4) >> 20,
        total - call,
        (n * 4) as f64 / total / 1e6,
        median(host),
        median(pageable)
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_helpers_match_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    let (rows, vocab) = (64, 5003);
    let mut logits = randn(&mut r, rows * vocab, 6.0);
    logits[17] = f32::NAN;
    logits[vocab + 3] = 1000.0;
    logits[vocab + 9] = 1000.0; // a tie: the first wins
    let (gl, cl) = (g.upload_f32(&logits).unwrap(), c.upload_f32(&logits).unwrap());
    assert_eq!(g.argmax_rows(&gl, vocab).unwrap(), c.argmax_rows(&cl, vocab).unwrap());
    let params: Vec<SampleParams> = (0..rows)
        .map(|i| SampleParams {
            temperature: [0.3, 0.7, 1.0, 1.5][i % 4],
            top_k: [0, 1, 5, 50, 4000][i % 5],
            top_p: [1.0, 0.9, 0.5, 0.99][(i / 4) % 4],
            uniform: r.random::<f32>() * 0.999,
        })
        .collect();
    let got = g.sample_rows(&gl, vocab, &params).unwrap();
    let want = c.sample_rows(&cl, vocab, &params).unwrap();
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    println!("sample_rows: {differ} of {rows} rows differ (f32 sums against f64)");
    // A row may land on the other side of a threshold by rounding; more than that is a bug.
    assert!(differ <= 2, "{differ} rows differ: {got:?} vs {want:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn logprobs_on_the_device_match_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    let (rows, vocab) = (40, 32000);
    let mut logits = randn(&mut r, rows * vocab, 6.0);
    logits[17] = f32::NAN;
    logits[vocab + 3] = 1000.0;
    logits[vocab + 9] = 1000.0;
    logits[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
    let tokens: Vec<u32> = (0..rows as u32).map(|i| (i * 7919 + 11) % vocab as u32).collect();
    let (gl, cl) = (g.upload_f32(&logits).unwrap(), c.upload_f32(&logits).unwrap());
    for n in [0, 1, 20] {
        let got = g.row_logprobs(&gl, vocab, &tokens, n).unwrap();
        let want = c.row_logprobs(&cl, vocab, &tokens, n).unwrap();
        let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-4 * (1.0 + b.abs());
        for (row, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(close(a.logprob, b.logprob), "row {row}: {a:?} vs {b:?}");
            assert_eq!(a.top.iter().map(|e| e.0).collect::<Vec<_>>(), b.top.iter().map(|e| e.0).collect::<Vec<_>>(), "row {row}");
            assert!(a.top.iter().zip(&b.top).all(|(x, y)| close(x.1, y.1)), "row {row}: {a:?} vs {b:?}");
        }
    }
}

fn rows<B: Memory>(b: &B, ad: &Adapters) -> LoraRows<B::Buffer> {
    LoraRows {
        num_slots: ad.dtypes.len(),
        num_layers: 1,
        directory: b.upload_u32(&ad.directory).unwrap(),
        a_rows: b.upload_u32(&ad.a_rows).unwrap(),
        b_rows: b.upload_u32(&ad.b_rows).unwrap(),
        slot_dtypes: b.upload_u32(&ad.dtypes).unwrap(),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgmv_and_bgmv_match_the_cpu() {
    let (g, c, mut r) = (gpu(), CpuBackend::new(), rng());
    let slots = [(8, RowDType::Bf16), (16, RowDType::F32), (64, RowDType::Bf16), (0, RowDType::F32), (13, RowDType::Bf16), (32, RowDType::F32)];
    for (in_f, out_f) in [(4096, 4096), (53, 100), (4096, 1027)] {
        let module = 3;
        let ad = adapters(&mut r, module, &slots, in_f, out_f);
        let target = LoraTarget { layer: 0, module, in_features: in_f, out_features: out_f, max_rank: 64 };
        // Segments of uneven lengths, one without an adapter, one empty.
        let seg = [(2u32, 19usize), (NO_ADAPTER, 5), (0, 8), (4, 0), (1, 3), (5, 30), (3, 4)];
        let (starts, seg_slots) = segments(&seg);
        let tokens = *starts.last().unwrap() as usize;
        let decode_slots: Vec<u32> = (0..37).map(|i| [0, 1, 2, NO_ADAPTER, 3, 4, 5, 2, 2][i % 9]).collect();
        for dtype in DTYPES {
            let x = round_to(&randn(&mut r, tokens * in_f, 1.0), dtype);
            let y0 = round_to(&randn(&mut r, tokens * out_f, 1.0), dtype);
            let (gr, cr) = (rows(&g, &ad), rows(&c, &ad));
            let (gp, cp) = (g.upload_f32(&ad.pool).unwrap(), c.upload_f32(&ad.pool).unwrap());
            let gs = LoraSegments { num_segments: seg.len(), seg_starts: g.upload_u32(&starts).unwrap(), seg_slots: g.upload_u32(&seg_slots).unwrap() };
            let cs = LoraSegments { num_segments: seg.len(), seg_starts: c.upload_u32(&starts).unwrap(), seg_slots: c.upload_u32(&seg_slots).unwrap() };
            let mut gv = poisoned(&g, tokens * 64, DType::F32);
            g.sgmv_shrink(&g.upload_as(&x, dtype).unwrap(), &gp, &gr, &gs, &target, &mut gv).unwrap();
            let mut cv = c.zeros(tokens * 64).unwrap();
            c.sgmv_shrink(&c.upload_f32(&x).unwrap(), &cp, &cr, &cs, &target, &mut cv).unwrap();
            let (gvh, cvh) = (g.download_f32(&gv).unwrap(), c.download_f32(&cv).unwrap());
            check(&format!("sgmv_shrink {in_f}->{out_f}"), DType::F32, &gvh, &cvh);
            // Expand from the same v on both sides.
            let gv = g.upload_f32(&cvh).unwrap();
            let mut gy = g.upload_as(&y0, dtype).unwrap();
            g.sgmv_expand(&gv, &gp, &gr, &gs, &target, &mut gy).unwrap();
            let mut cy = c.upload_f32(&y0).unwrap();
            c.sgmv_expand(&cv, &cp, &cr, &cs, &target, &mut cy).unwrap();
            check(&format!("sgmv_expand {in_f}->{out_f}"), dtype, &g.download_f32(&gy).unwrap(), &c.download_f32(&cy).unwrap());

            let n = decode_slots.len();
            let x = round_to(&randn(&mut r, n * in_f, 1.0), dtype);
            let y0 = round_to(&randn(&mut r, n * out_f, 1.0), dtype);
            let mut gy = g.upload_as(&y0, dtype).unwrap();
            g.bgmv(&g.upload_as(&x, dtype).unwrap(), &gp, &gr, &g.upload_u32(&decode_slots).unwrap(), &target, &mut gy).unwrap();
            let mut cy = c.upload_f32(&y0).unwrap();
            c.bgmv(&c.upload_f32(&x).unwrap(), &cp, &cr, &c.upload_u32(&decode_slots).unwrap(), &target, &mut cy).unwrap();
            check(&format!("bgmv {in_f}->{out_f}"), dtype, &g.download_f32(&gy).unwrap(), &c.download_f32(&cy).unwrap());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_indices_are_refused_before_any_launch() {
    let g = gpu();
    let table = g.upload_f32(&[0.0; 12]).unwrap();
    let mut out = g.upload_f32(&[7.0; 4]).unwrap();
    assert!(g.embedding(&table, &g.upload_u32(&[3, 0]).unwrap(), &mut out, 4).is_err());
    assert_eq!(g.download_f32(&out).unwrap(), vec![7.0; 4], "an error leaves the output as it was");
}
