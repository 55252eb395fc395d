//! The CUDA kernels, built as C++ for the CPU simulator (`kernels/cuda/sim`), run with the launch
//! shapes their plans give and checked against the CPU backend on random inputs, for f32, f16 and
//! bf16 storage, outputs poisoned with NaN first. This checks each kernel's indexing, masking,
//! tiling, reductions and online softmax on any machine; what it cannot check (speed, the real
//! memory model, cuBLAS, the driver calls) is left to the GPU tests in `cuda_vs_cpu.rs`.
//!
//! The simulator reads, on stdin: u32 buffer count, then per buffer u64 length and bytes; u32
//! launch count, then per launch u32 name length, name, u32 grid x, y, z, block, shared memory,
//! u32 argument count, then per argument a kind byte (0: buffer, u32 index; 1: null pointer;
//! 2: scalar, u32 length and bytes). It writes back every buffer the same way.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use loraplex_kernels::cpu::CpuBackend;
use loraplex_kernels::cuda::plan::{self, AttentionPlan, Launch, Limits};
use loraplex_kernels::cuda::{from_bits, round_to, to_bits};
use loraplex_kernels::{
    AttentionOps, AttentionParams, DType, DenseOps, KvLayout, LoraOps, LoraRows, LoraSegments, LoraTarget, Memory, NO_ADAPTER, RowDType, SampleParams,
    SamplingOps,
};
use rand::{Rng, rngs::StdRng};

mod common;
use common::{Adapters, Case, DTYPES, adapters, check, meta, paged, randn, rng, segments};

const SOURCES: [&str; 7] = [
    include_str!("../cuda/sim/sim.h"),
    include_str!("../cuda/common.cuh"),
    include_str!("../cuda/dense.cu"),
    include_str!("../cuda/attention.cu"),
    include_str!("../cuda/lora.cu"),
    include_str!("../cuda/sampling.cu"),
    include_str!("../cuda/sim/driver.cpp"),
];

/// The simulator binary for the current sources, built once (per source hash) with the C++
/// compiler (`CXX`, else `c++`): once per process (tests run as threads), and atomically
/// across processes (each builds under its own name, then renames).
fn simulator() -> PathBuf {
    static SIM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SIM.get_or_init(build_simulator).clone()
}

fn build_simulator() -> PathBuf {
    let text = SOURCES.join("\n");
    let hash = text.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let bin = dir.join(format!("loraplex-kernel-sim-{hash:016x}"));
    if bin.exists() {
        return bin;
    }
    let src = dir.join(format!("loraplex-kernel-sim-{hash:016x}-{}.cpp", std::process::id()));
    std::fs::write(&src, &text).unwrap();
    let tmp = bin.with_extension(format!("tmp{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-parameter", "-o"])
        .arg(&tmp)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("the kernel simulator needs a C++20 compiler ({cxx}): {e}"));
    let _ = std::fs::remove_file(&src);
    assert!(out.status.success(), "the kernels do not build for the simulator:\n{}", String::from_utf8_lossy(&out.stderr));
    std::fs::rename(&tmp, &bin).unwrap();
    bin
}

#[derive(Clone, Copy)]
enum Arg {
    Buf(usize),
    Null,
    U32(u32),
    U64(u64),
    F32(f32),
}

#[derive(Default)]
struct Sim {
    bufs: Vec<Vec<u8>>,
    launches: Vec<u8>,
    count: u32,
}

fn storage(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(v).to_vec(),
        _ => bytemuck::cast_slice(&to_bits(v, dtype)).to_vec(),
    }
}

fn pod<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn values(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => pod(bytes),
        _ => from_bits(&pod::<u16>(bytes), dtype),
    }
}

impl Sim {
    fn floats(&mut self, v: &[f32], dtype: DType) -> Arg {
        self.bufs.push(storage(v, dtype));
        Arg::Buf(self.bufs.len() - 1)
    }

    fn nans(&mut self, n: usize, dtype: DType) -> Arg {
        self.floats(&vec![f32::NAN; n], dtype)
    }

    fn u32s(&mut self, v: &[u32]) -> Arg {
        self.bufs.push(bytemuck::cast_slice(v).to_vec());
        Arg::Buf(self.bufs.len() - 1)
    }

    fn launch(&mut self, name: &str, l: &Launch, args: &[Arg]) {
        let b = &mut self.launches;
        b.extend((name.len() as u32).to_le_bytes());
        b.extend(name.as_bytes());
        for v in [l.grid.0, l.grid.1, l.grid.2, l.block, l.smem, args.len() as u32] {
            b.extend(v.to_le_bytes());
        }
        for a in args {
            match *a {
                Arg::Buf(i) => {
                    b.push(0);
                    b.extend((i as u32).to_le_bytes());
                }
                Arg::Null => b.push(1),
                Arg::U32(v) => {
                    b.push(2);
                    b.extend(4u32.to_le_bytes());
                    b.extend(v.to_le_bytes());
                }
                Arg::U64(v) => {
                    b.push(2);
                    b.extend(8u32.to_le_bytes());
                    b.extend(v.to_le_bytes());
                }
                Arg::F32(v) => {
                    b.push(2);
                    b.extend(4u32.to_le_bytes());
                    b.extend(v.to_le_bytes());
                }
            }
        }
        self.count += 1;
    }

    /// Runs the launches; every buffer's final bytes.
    fn run(self) -> Vec<Vec<u8>> {
        let mut input = Vec::new();
        input.extend((self.bufs.len() as u32).to_le_bytes());
        for b in &self.bufs {
            input.extend((b.len() as u64).to_le_bytes());
            input.extend(b);
        }
        input.extend(self.count.to_le_bytes());
        input.extend(&self.launches);
        let mut child = Command::new(simulator()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(&input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "simulator failed: {}", String::from_utf8_lossy(&out.stderr));
        let mut rest = &out.stdout[..];
        let mut bufs = Vec::new();
        while !rest.is_empty() {
            let n = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            bufs.push(rest[8..8 + n].to_vec());
            rest = &rest[8 + n..];
        }
        assert_eq!(bufs.len(), self.bufs.len());
        bufs
    }
}

fn buf(a: Arg) -> usize {
    match a {
        Arg::Buf(i) => i,
        _ => unreachable!("not a buffer"),
    }
}

fn sfx(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        _ => "bf16",
    }
}

#[test]
fn dense_kernels_match_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    for dtype in DTYPES {
        let s = sfx(dtype);
        let mut sim = Sim::default();
        // embedding
        let (vocab, hidden, n) = (50, 70, 9);
        let table = round_to(&randn(&mut r, vocab * hidden, 1.0), dtype);
        let ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
        let (t, i, emb) = (sim.floats(&table, dtype), sim.u32s(&ids), sim.nans(n * hidden, dtype));
        sim.launch(&format!("gather_rows_{s}"), &plan::per_row("t", n, hidden).unwrap(), &[t, i, emb, Arg::U32(hidden as u32)]);
        // rms_norm plain and with the residual
        let (rows, dim) = (5, 300);
        let x = round_to(&randn(&mut r, rows * dim, 2.0), dtype);
        let res = round_to(&randn(&mut r, rows * dim, 2.0), dtype);
        let w = round_to(&randn(&mut r, dim, 1.0), dtype);
        let (sx, sw, sres) = (sim.floats(&x, dtype), sim.floats(&w, dtype), sim.floats(&res, dtype));
        let (norm, norm_res) = (sim.nans(rows * dim, dtype), sim.nans(rows * dim, dtype));
        let l = plan::per_row("t", rows, dim).unwrap();
        sim.launch(&format!("rms_norm_{s}"), &l, &[sx, Arg::Null, sw, norm, Arg::U32(dim as u32), Arg::F32(1e-5)]);
        sim.launch(&format!("rms_norm_{s}"), &l, &[sx, sres, sw, norm_res, Arg::U32(dim as u32), Arg::F32(1e-5)]);
        // silu_mul, add_assign, add_bias
        let n2 = 1000;
        let (a, b) = (round_to(&randn(&mut r, n2, 4.0), dtype), round_to(&randn(&mut r, n2, 4.0), dtype));
        let (sa, sb, silu) = (sim.floats(&a, dtype), sim.floats(&b, dtype), sim.nans(n2, dtype));
        let le = plan::elementwise("t", n2).unwrap();
        sim.launch(&format!("silu_mul_{s}"), &le, &[sa, sb, silu, Arg::U64(n2 as u64)]);
        let acc = sim.floats(&a, dtype);
        sim.launch(&format!("add_assign_{s}"), &le, &[acc, sb, Arg::U64(n2 as u64)]);
        let bias = round_to(&randn(&mut r, 40, 1.0), dtype);
        let (biased, sbias) = (sim.floats(&a, dtype), sim.floats(&bias, dtype));
        sim.launch(&format!("add_bias_{s}"), &le, &[biased, sbias, Arg::U64(n2 as u64), Arg::U32(40)]);
        // silu_mul_fused over 5 rows of 2 x 100; split_columns into three parts and into two
        let fused = sim.nans(n2 / 2, dtype);
        sim.launch(&format!("silu_mul_fused_{s}"), &plan::elementwise("t", n2 / 2).unwrap(), &[sa, fused, Arg::U64(n2 as u64 / 2), Arg::U32(100)]);
        let l8 = plan::per_row("t", 8, 125).unwrap();
        let (p0, p1, p2) = (sim.nans(8 * 60, dtype), sim.nans(8 * 40, dtype), sim.nans(8 * 25, dtype));
        sim.launch(&format!("split_columns_{s}"), &l8, &[sa, p0, p1, p2, Arg::U32(60), Arg::U32(40), Arg::U32(25)]);
        let (q0, q1) = (sim.nans(8 * 100, dtype), sim.nans(8 * 25, dtype));
        sim.launch(&format!("split_columns_{s}"), &l8, &[sa, q0, q1, q0, Arg::U32(100), Arg::U32(25), Arg::U32(0)]);
        // gather_rows
        let picks: Vec<u32> = (0..7).map(|_| r.random_range(0..25u32)).collect();
        let (sp, gathered) = (sim.u32s(&picks), sim.nans(7 * 40, dtype));
        sim.launch(&format!("gather_rows_{s}"), &plan::per_row("t", 7, 40).unwrap(), &[sa, sp, gathered, Arg::U32(40)]);
        // rope
        let (tokens, heads, hd, max_pos) = (4, 3, 10, 20);
        let table_cs = randn(&mut r, max_pos * hd, 1.0);
        let pos: Vec<u32> = (0..tokens).map(|_| r.random_range(0..max_pos as u32)).collect();
        let xr = round_to(&randn(&mut r, tokens * heads * hd, 1.0), dtype);
        let (sxr, spos, scs) = (sim.floats(&xr, dtype), sim.u32s(&pos), sim.floats(&table_cs, DType::F32));
        sim.launch(&format!("rope_{s}"), &plan::rope("t", tokens, heads, hd).unwrap(), &[sxr, spos, scs, Arg::U32(heads as u32), Arg::U32(hd as u32)]);

        let out = sim.run();
        let got = |a: Arg| values(&out[buf(a)], dtype);

        let mut co = c.zeros(n * hidden).unwrap();
        c.embedding(&c.upload_f32(&table).unwrap(), &c.upload_u32(&ids).unwrap(), &mut co, hidden).unwrap();
        check("embedding", dtype, &got(emb), &c.download_f32(&co).unwrap());
        let (cx, cw) = (c.upload_f32(&x).unwrap(), c.upload_f32(&w).unwrap());
        let mut co = c.zeros(rows * dim).unwrap();
        c.rms_norm(&cx, &cw, &mut co, 1e-5).unwrap();
        check("rms_norm", dtype, &got(norm), &c.download_f32(&co).unwrap());
        let mut cres = c.upload_f32(&res).unwrap();
        c.add_assign(&mut cres, &cx).unwrap();
        let summed = c.download_f32(&cres).unwrap();
        check("rms_norm residual (sum)", dtype, &got(sres), &summed);
        c.rms_norm(&c.upload_f32(&round_to(&summed, dtype)).unwrap(), &cw, &mut co, 1e-5).unwrap();
        check("rms_norm residual (norm)", dtype, &got(norm_res), &c.download_f32(&co).unwrap());
        let (ca, cb) = (c.upload_f32(&a).unwrap(), c.upload_f32(&b).unwrap());
        let mut co = c.zeros(n2).unwrap();
        c.silu_mul(&ca, &cb, &mut co).unwrap();
        check("silu_mul", dtype, &got(silu), &c.download_f32(&co).unwrap());
        let mut co = c.zeros(n2 / 2).unwrap();
        c.silu_mul_fused(&ca, &mut co, 100).unwrap();
        check("silu_mul_fused", dtype, &got(fused), &c.download_f32(&co).unwrap());
        for widths in [&[60, 40, 25][..], &[100, 25]] {
            let mut parts: Vec<_> = widths.iter().map(|&w| (c.zeros(8 * w).unwrap(), w)).collect();
            let mut refs: Vec<_> = parts.iter_mut().map(|(b, w)| (b, *w)).collect();
            c.split_columns(&ca, 8, &mut refs).unwrap();
            let sims = if widths.len() == 3 { vec![p0, p1, p2] } else { vec![q0, q1] };
            for ((b, w), sp) in parts.iter().zip(sims) {
                check(&format!("split_columns {widths:?} width {w}"), dtype, &got(sp), &c.download_f32(b).unwrap());
            }
        }
        let mut cacc = c.upload_f32(&a).unwrap();
        c.add_assign(&mut cacc, &cb).unwrap();
        check("add_assign", dtype, &got(acc), &c.download_f32(&cacc).unwrap());
        let want: Vec<f32> = a.iter().enumerate().map(|(i, v)| v + bias[i % 40]).collect();
        check("add_bias", dtype, &got(biased), &want);
        let mut co = c.zeros(7 * 40).unwrap();
        c.gather_rows(&ca, &c.upload_u32(&picks).unwrap(), &mut co, 40).unwrap();
        check("gather_rows", dtype, &got(gathered), &c.download_f32(&co).unwrap());
        let mut cxr = c.upload_f32(&xr).unwrap();
        c.rope(&mut cxr, &c.upload_u32(&pos).unwrap(), &c.upload_f32(&table_cs).unwrap(), heads, hd).unwrap();
        check("rope", dtype, &got(sxr), &c.download_f32(&cxr).unwrap());
    }
}

fn attention_case(c: &CpuBackend, r: &mut StdRng, dtype: DType, case: Case<'_>) {
    // Decode both ways where the heads' grouping has a grouped kernel.
    let group = case.heads / case.kv_heads;
    attention_case_with(c, r, dtype, case, false);
    if case.seqs.iter().all(|&(_, new)| new == 1) && plan::grouped_decode_kernel(group, case.hd).is_some() {
        attention_case_with(c, r, dtype, case, true);
    }
}

fn attention_case_with(c: &CpuBackend, r: &mut StdRng, dtype: DType, case: Case<'_>, grouped_decode: bool) {
    let Case { what, heads, kv_heads, hd, seqs, window } = case;
    let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 16, dtype: RowDType::F32 };
    let p = paged(r, 16, seqs);
    let t = p.positions.len();
    let cache = round_to(&randn(r, p.pages * layout.page_elems(), 1.0), dtype);
    let k = round_to(&randn(r, t * kv_heads * hd, 1.0), dtype);
    let v = round_to(&randn(r, t * kv_heads * hd, 1.0), dtype);
    let q = round_to(&randn(r, t * heads * hd, 1.0), dtype);
    let params = AttentionParams { layer: 1, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), sliding_window: window };
    let s = sfx(dtype);

    let mut sim = Sim::default();
    let (sk, sv, scache, sq) = (sim.floats(&k, dtype), sim.floats(&v, dtype), sim.floats(&cache, dtype), sim.floats(&q, dtype));
    let (sslots, spos, stables) = (sim.u32s(&p.slots), sim.u32s(&p.positions), sim.u32s(&p.block_tables));
    let out = sim.nans(t * heads * hd, dtype);
    let (bs, pe, layer) = (Arg::U32(16), Arg::U64(layout.page_elems() as u64), Arg::U32(1));
    sim.launch(
        &format!("write_kv_{s}"),
        &plan::per_row("t", t, kv_heads * hd).unwrap(),
        &[sk, sv, scache, sslots, Arg::U32(kv_heads as u32), Arg::U32(hd as u32), bs, pe, layer],
    );
    let limits = Limits { sm_count: 132, max_smem: 227 * 1024, grouped_decode };
    let common = [
        Arg::U32(p.max_blocks as u32),
        Arg::U32(heads as u32),
        Arg::U32(kv_heads as u32),
        Arg::U32(hd as u32),
        bs,
        pe,
        layer,
        Arg::F32(params.scale),
        Arg::U32(window.unwrap_or(0) as u32),
    ];
    let attn = plan::attention("t", &p.seq_starts, &p.positions, heads, kv_heads, hd, window, limits).unwrap();
    let kind = match &attn {
        AttentionPlan::Decode { parts, kernel, .. } => format!("{kernel}, {parts} part(s)"),
        AttentionPlan::Prefill { tiles, .. } => format!("prefill, {} tile(s)", tiles.len() / 3),
    };
    match attn {
        AttentionPlan::Decode { launch, part_size, parts, combine, kernel } => {
            let token_seq: Vec<u32> = (0..t as u32).collect();
            let sts = sim.u32s(&token_seq);
            let rows = t * heads * parts as usize;
            let (acc, ml) = if parts > 1 { (sim.nans(rows * hd, DType::F32), sim.nans(rows * 2, DType::F32)) } else { (Arg::Null, Arg::Null) };
            let mut args = vec![sq, scache, out, acc, ml, sts, spos, stables];
            args.extend(common);
            args.push(Arg::U32(part_size));
            sim.launch(&format!("{kernel}_{s}"), &launch, &args);
            if let Some(cl) = combine {
                sim.launch(&format!("attn_combine_{s}"), &cl, &[acc, ml, out, Arg::U32(heads as u32), Arg::U32(hd as u32), Arg::U32(parts)]);
            }
        }
        AttentionPlan::Prefill { launch, tiles } => {
            let st = sim.u32s(&tiles);
            let mut args = vec![sq, scache, out, st, spos, stables];
            args.extend(common);
            sim.launch(&format!("attn_prefill_{s}"), &launch, &args);
        }
    }
    let res = sim.run();

    let meta = meta(c, &p);
    let mut ccache = c.upload_f32(&cache).unwrap();
    c.write_kv(&c.upload_f32(&k).unwrap(), &c.upload_f32(&v).unwrap(), &mut ccache, &meta, &layout, 1).unwrap();
    let mut co = c.zeros(t * heads * hd).unwrap();
    c.attention(&c.upload_f32(&q).unwrap(), &ccache, &mut co, &meta, &layout, &params).unwrap();
    check(&format!("write_kv {what}"), dtype, &values(&res[buf(scache)], dtype), &c.download_f32(&ccache).unwrap());
    check(&format!("attention {what} ({kind})"), dtype, &values(&res[buf(out)], dtype), &c.download_f32(&co).unwrap());
}

#[test]
fn attention_kernels_match_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    for dtype in DTYPES {
        attention_case(&c, &mut r, dtype, Case { what: "decode gqa", heads: 4, kv_heads: 2, hd: 64, seqs: &[(40, 1), (0, 1), (70, 1)], window: None });
        attention_case(&c, &mut r, dtype, Case { what: "decode partitions", heads: 2, kv_heads: 1, hd: 40, seqs: &[(600, 1)], window: None });
        attention_case(&c, &mut r, dtype, Case { what: "decode window", heads: 2, kv_heads: 2, hd: 32, seqs: &[(100, 1), (5, 1)], window: Some(24) });
        // Rows of 72 bytes in 16-bit types: the element-by-element key loads.
        attention_case(&c, &mut r, dtype, Case { what: "decode head_dim 36", heads: 3, kv_heads: 1, hd: 36, seqs: &[(50, 1), (33, 1)], window: None });
        // Grouped decode: 4 and 8 query heads a KV head, head_dim over 128, a window, partitions.
        attention_case(&c, &mut r, dtype, Case { what: "decode groups of 4", heads: 8, kv_heads: 2, hd: 128, seqs: &[(600, 1), (17, 1)], window: None });
        attention_case(&c, &mut r, dtype, Case { what: "decode groups of 8", heads: 8, kv_heads: 1, hd: 200, seqs: &[(70, 1), (40, 1)], window: Some(50) });
        attention_case(&c, &mut r, dtype, Case { what: "decode groups of 2, head_dim 36", heads: 4, kv_heads: 2, hd: 36, seqs: &[(45, 1)], window: None });
        attention_case(
            &c,
            &mut r,
            dtype,
            Case { what: "prefill cached prefix", heads: 4, kv_heads: 2, hd: 40, seqs: &[(20, 17), (0, 5), (3, 1)], window: None },
        );
        attention_case(&c, &mut r, dtype, Case { what: "prefill window", heads: 2, kv_heads: 1, hd: 64, seqs: &[(30, 40)], window: Some(20) });
    }
}

#[test]
fn lora_kernels_match_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    let slots = [(8, RowDType::Bf16), (3, RowDType::F32), (20, RowDType::Bf16), (0, RowDType::F32), (13, RowDType::F32)];
    for (in_f, out_f) in [(53, 100), (300, 257)] {
        let module = 5;
        let Adapters { pool, directory, a_rows, b_rows, dtypes } = adapters(&mut r, module, &slots, in_f, out_f);
        let max_rank = 24;
        let target = LoraTarget { layer: 0, module, in_features: in_f, out_features: out_f, max_rank };
        let seg = [(2u32, 11usize), (NO_ADAPTER, 3), (0, 8), (3, 2), (1, 1), (4, 9)];
        let (starts, seg_slots) = segments(&seg);
        let tokens = *starts.last().unwrap() as usize;
        let decode: Vec<u32> = (0..13).map(|i| [0, 2, 2, NO_ADAPTER, 3, 1, 4][i % 7]).collect();
        let active = |s: u32| s != NO_ADAPTER && slots[s as usize].0 > 0;
        for dtype in DTYPES {
            let s = sfx(dtype);
            let x = round_to(&randn(&mut r, tokens * in_f, 1.0), dtype);
            let y0 = round_to(&randn(&mut r, tokens * out_f, 1.0), dtype);
            let xd = round_to(&randn(&mut r, decode.len() * in_f, 1.0), dtype);
            let yd = round_to(&randn(&mut r, decode.len() * out_f, 1.0), dtype);

            let mut sim = Sim::default();
            let (sx, spool, sdir, sa, sb, sdt) =
                (sim.floats(&x, dtype), sim.floats(&pool, DType::F32), sim.u32s(&directory), sim.u32s(&a_rows), sim.u32s(&b_rows), sim.u32s(&dtypes));
            let sv = sim.nans(tokens * max_rank, DType::F32);
            let sy = sim.floats(&y0, dtype);
            let tail = |n: usize| [Arg::U32(n as u32), Arg::U32(max_rank as u32), Arg::U32(1), Arg::U32(0), Arg::U32(module as u32)];
            let shrink_tiles = plan::segment_tiles(&starts, &seg_slots, |_| true);
            let st = sim.u32s(&shrink_tiles);
            let mut args = vec![sx, spool, sdir, sa, sdt, st, sv];
            args.extend(tail(in_f));
            sim.launch(&format!("lora_shrink_{s}"), &plan::lora_shrink("t", shrink_tiles.len() / 3, max_rank).unwrap(), &args);
            let expand_tiles = plan::segment_tiles(&starts, &seg_slots, active);
            let et = sim.u32s(&expand_tiles);
            let mut args = vec![sv, spool, sdir, sb, sdt, et, sy];
            args.extend(tail(out_f));
            sim.launch(&format!("lora_expand_{s}"), &plan::lora_expand("t", expand_tiles.len() / 3, out_f).unwrap(), &args);
            // BGMV: shrink and expand over row tiles. The backend's v is a reused scratch buffer,
            // never zeroed: poisoned here, so a value expand reads that shrink did not write
            // turns the output NaN.
            let (sxd, syd, svd) = (sim.floats(&xd, dtype), sim.floats(&yd, dtype), sim.nans(decode.len() * max_rank, DType::F32));
            let rt = plan::row_tiles(&decode, active);
            let srt = sim.u32s(&rt);
            let mut args = vec![sxd, spool, sdir, sa, sdt, srt, svd];
            args.extend(tail(in_f));
            sim.launch(&format!("lora_shrink_{s}"), &plan::lora_shrink("t", rt.len() / 3, max_rank).unwrap(), &args);
            let mut args = vec![svd, spool, sdir, sb, sdt, srt, syd];
            args.extend(tail(out_f));
            sim.launch(&format!("lora_expand_{s}"), &plan::lora_expand("t", rt.len() / 3, out_f).unwrap(), &args);
            let res = sim.run();

            let rows = LoraRows {
                num_slots: slots.len(),
                num_layers: 1,
                directory: c.upload_u32(&directory).unwrap(),
                a_rows: c.upload_u32(&a_rows).unwrap(),
                b_rows: c.upload_u32(&b_rows).unwrap(),
                slot_dtypes: c.upload_u32(&dtypes).unwrap(),
            };
            let cpool = c.upload_f32(&pool).unwrap();
            let segs = LoraSegments { num_segments: seg.len(), seg_starts: c.upload_u32(&starts).unwrap(), seg_slots: c.upload_u32(&seg_slots).unwrap() };
            let mut cv = c.zeros(tokens * max_rank).unwrap();
            c.sgmv_shrink(&c.upload_f32(&x).unwrap(), &cpool, &rows, &segs, &target, &mut cv).unwrap();
            check(&format!("sgmv_shrink {in_f}->{out_f}"), DType::F32, &values(&res[buf(sv)], DType::F32), &c.download_f32(&cv).unwrap());
            let mut cy = c.upload_f32(&y0).unwrap();
            c.sgmv_expand(&cv, &cpool, &rows, &segs, &target, &mut cy).unwrap();
            check(&format!("sgmv_expand {in_f}->{out_f}"), dtype, &values(&res[buf(sy)], dtype), &c.download_f32(&cy).unwrap());
            let mut cy = c.upload_f32(&yd).unwrap();
            c.bgmv(&c.upload_f32(&xd).unwrap(), &cpool, &rows, &c.upload_u32(&decode).unwrap(), &target, &mut cy).unwrap();
            check(&format!("bgmv {in_f}->{out_f}"), dtype, &values(&res[buf(syd)], dtype), &c.download_f32(&cy).unwrap());
        }
    }
}

#[test]
fn sampling_kernels_match_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    let (rows, vocab) = (12, 700);
    let mut logits = randn(&mut r, rows * vocab, 6.0);
    logits[17] = f32::NAN;
    logits[vocab + 3] = 100.0;
    logits[vocab + 9] = 100.0;
    logits[2 * vocab..3 * vocab].fill(f32::NAN);
    let params: Vec<SampleParams> = (0..rows)
        .map(|i| SampleParams {
            temperature: [0.3, 0.7, 1.0, 1.5][i % 4],
            top_k: [0, 1, 5, 50, 699, 0][i % 6],
            top_p: [1.0, 0.9, 0.5][i % 3],
            uniform: r.random::<f32>() * 0.999,
        })
        .collect();
    let mut sim = Sim::default();
    let sl = sim.floats(&logits, DType::F32);
    let am = sim.u32s(&vec![u32::MAX; rows]);
    let l = plan::per_row("t", rows, vocab).unwrap();
    sim.launch("argmax_rows", &l, &[sl, am, Arg::U32(vocab as u32)]);
    let temps = sim.floats(&params.iter().map(|p| p.temperature).collect::<Vec<_>>(), DType::F32);
    let ks = sim.u32s(&params.iter().map(|p| p.top_k).collect::<Vec<_>>());
    let ps = sim.floats(&params.iter().map(|p| p.top_p).collect::<Vec<_>>(), DType::F32);
    let us = sim.floats(&params.iter().map(|p| p.uniform).collect::<Vec<_>>(), DType::F32);
    let sampled = sim.u32s(&vec![u32::MAX; rows]);
    sim.launch("sample_rows", &l, &[sl, temps, ks, ps, us, sampled, Arg::U32(vocab as u32)]);
    let res = sim.run();
    let cl = c.upload_f32(&logits).unwrap();
    let got_argmax: Vec<u32> = pod(&res[buf(am)]);
    assert_eq!(got_argmax, c.argmax_rows(&cl, vocab).unwrap());
    let got: Vec<u32> = pod(&res[buf(sampled)]);
    let want = c.sample_rows(&cl, vocab, &params).unwrap();
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    println!("sample_rows: {differ} of {rows} rows differ: {got:?} vs {want:?}");
    assert!(differ <= 1, "{got:?} vs {want:?}");
}

#[test]
fn logprob_kernel_matches_the_cpu() {
    let (c, mut r) = (CpuBackend::new(), rng());
    let (rows, vocab) = (6, 700);
    let mut logits = randn(&mut r, rows * vocab, 6.0);
    logits[17] = f32::NAN;
    // Ties: the lower id ranks first.
    logits[vocab + 3] = 100.0;
    logits[vocab + 9] = 100.0;
    logits[vocab + 5] = 99.0;
    logits[vocab + 600] = 99.0;
    // A row with nothing finite, and one with +inf (counted as the largest finite value).
    logits[2 * vocab..3 * vocab].fill(f32::NAN);
    logits[3 * vocab + 42] = f32::INFINITY;
    let tokens: Vec<u32> = (0..rows as u32).map(|i| (i * 97 + 5) % vocab as u32).collect();
    let cl = c.upload_f32(&logits).unwrap();
    for n in [0usize, 1, 5, 20] {
        let mut sim = Sim::default();
        let sl = sim.floats(&logits, DType::F32);
        let st = sim.u32s(&tokens);
        let vals = sim.floats(&vec![f32::NAN; rows * (n + 1)], DType::F32);
        let ids = sim.u32s(&vec![u32::MAX; rows * n.max(1)]);
        let l = plan::per_row("t", rows, vocab).unwrap();
        sim.launch("row_logprobs", &l, &[sl, st, vals, ids, Arg::U32(n as u32), Arg::U32(vocab as u32)]);
        let res = sim.run();
        let (got_vals, got_ids): (Vec<f32>, Vec<u32>) = (values(&res[buf(vals)], DType::F32), pod(&res[buf(ids)]));
        let want = c.row_logprobs(&cl, vocab, &tokens, n).unwrap();
        let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-4 * (1.0 + b.abs());
        for (row, w) in want.iter().enumerate() {
            let at = row * (n + 1);
            assert!(close(got_vals[at], w.logprob), "row {row}: {} vs {}", got_vals[at], w.logprob);
            assert_eq!(w.top.len(), n);
            for (j, &(id, lp)) in w.top.iter().enumerate() {
                assert_eq!(got_ids[row * n + j], id, "row {row} entry {j} (n {n})");
                assert!(close(got_vals[at + 1 + j], lp), "row {row} entry {j}: {} vs {lp}", got_vals[at + 1 + j]);
            }
        }
        if n >= 5 {
            assert_eq!(want[1].top.iter().take(4).map(|e| e.0).collect::<Vec<_>>(), [3, 9, 5, 600]);
            assert!(want[2].top.iter().enumerate().all(|(j, &(id, lp))| id == j as u32 && lp == f32::NEG_INFINITY));
            assert_eq!((want[3].top[0].0, want[3].top[0].1), (42, 0.0));
        }
    }
}

/// The fused `rope_write_kv` gives what `rope` (q), `rope` (k) and `write_kv` give one after the
/// other, bit for bit, and what the CPU backend's three ops give.
#[test]
fn rope_write_kv_is_the_three_kernels_in_one() {
    let (c, mut r) = (CpuBackend::new(), rng());
    for dtype in DTYPES {
        let s = sfx(dtype);
        // 6 query heads over 2 KV heads of 16; decodes and a prefill chunk crossing a block.
        let (heads, kv_heads, hd) = (6, 2, 16);
        let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: 16, dtype: RowDType::F32 };
        let p = paged(&mut r, 16, &[(5, 1), (30, 1), (9, 20)]);
        let t = p.positions.len();
        let max_pos = 64;
        let table_cs = randn(&mut r, max_pos * hd, 1.0);
        let cache = round_to(&randn(&mut r, p.pages * layout.page_elems(), 1.0), dtype);
        let q = round_to(&randn(&mut r, t * heads * hd, 1.0), dtype);
        let k = round_to(&randn(&mut r, t * kv_heads * hd, 1.0), dtype);
        let v = round_to(&randn(&mut r, t * kv_heads * hd, 1.0), dtype);
        let (bs, pe, layer) = (Arg::U32(16), Arg::U64(layout.page_elems() as u64), Arg::U32(1));
        let run = |fused: bool| {
            let mut sim = Sim::default();
            let (sq, sk, sv, scache) = (sim.floats(&q, dtype), sim.floats(&k, dtype), sim.floats(&v, dtype), sim.floats(&cache, dtype));
            let (spos, scs, sslots) = (sim.u32s(&p.positions), sim.floats(&table_cs, DType::F32), sim.u32s(&p.slots));
            let (h, kvh, d) = (Arg::U32(heads as u32), Arg::U32(kv_heads as u32), Arg::U32(hd as u32));
            if fused {
                let l = plan::per_row("t", t, (heads * hd / 2).max(kv_heads * hd)).unwrap();
                sim.launch(&format!("rope_write_kv_{s}"), &l, &[sq, sk, sv, scache, spos, scs, sslots, h, kvh, d, bs, pe, layer]);
            } else {
                sim.launch(&format!("rope_{s}"), &plan::rope("t", t, heads, hd).unwrap(), &[sq, spos, scs, h, d]);
                sim.launch(&format!("rope_{s}"), &plan::rope("t", t, kv_heads, hd).unwrap(), &[sk, spos, scs, kvh, d]);
                sim.launch(&format!("write_kv_{s}"), &plan::per_row("t", t, kv_heads * hd).unwrap(), &[sk, sv, scache, sslots, kvh, d, bs, pe, layer]);
            }
            let res = sim.run();
            [sq, sk, scache].map(|a| res[buf(a)].clone())
        };
        let (fused, apart) = (run(true), run(false));
        for (what, (a, b)) in ["q", "k", "cache"].iter().zip(fused.iter().zip(&apart)) {
            assert!(a == b, "{what} ({s}): the fused kernel differs from the three");
        }

        let meta = meta(&c, &p);
        let (mut cq, mut ck, mut ccache) = (c.upload_f32(&q).unwrap(), c.upload_f32(&k).unwrap(), c.upload_f32(&cache).unwrap());
        c.rope_write_kv(&mut cq, &mut ck, &c.upload_f32(&v).unwrap(), &c.upload_f32(&table_cs).unwrap(), heads, &mut ccache, &meta, &layout, 1).unwrap();
        check(&format!("rope_write_kv q {s}"), dtype, &values(&fused[0], dtype), &c.download_f32(&cq).unwrap());
        check(&format!("rope_write_kv k {s}"), dtype, &values(&fused[1], dtype), &c.download_f32(&ck).unwrap());
        check(&format!("rope_write_kv cache {s}"), dtype, &values(&fused[2], dtype), &c.download_f32(&ccache).unwrap());
    }
}
