//! `loraplex bench kernels` (needs a CUDA GPU): the batched LoRA kernels at decode (BGMV) and
//! prefill (SGMV) shapes, paged decode attention (a block per query head, and the grouped
//! kernel: a block per KV head), and cuBLAS at decode-sized matmuls, each as achieved bandwidth against the
//! device-to-device copy bandwidth this run measures, and the LoRA kernels against two PyTorch
//! baselines run on the same machine (a per-adapter loop of matmuls, and a gather + bmm).
//!
//! Bytes counted are the fewest any kernel must move: each adapter row used, the activations read
//! and the outputs read and written once. Inputs rotate among several sets so repeated runs do
//! not measure the L2 cache.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use loraplex_kernels::cuda::{CudaBackend, CudaBuffer};
use loraplex_kernels::{
    AttentionOps, AttentionParams, BatchMeta, DType, DenseOps, KvLayout, LORA_ROW_ALIGN, LoraOps, LoraRows, LoraSegments, LoraTarget, Memory, NUM_MODULES,
    RowDType,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::config::{BenchKernelsArgs, Device};

const HIDDEN: usize = 4096;
/// Input sets rotated through (each set of 32 rank-64 adapters is 33 MiB; the L2 is 50-60 MiB).
const SETS: usize = 4;
const WARMUP: usize = 5;
const ITERS: usize = 50;
/// Decode rows must reach this share of the copy bandwidth.
const DECODE_TARGET: f64 = 0.7;
/// With 32+ distinct adapters, speedup over the faster PyTorch baseline.
const SPEEDUP_TARGET: f64 = 3.0;

#[derive(Debug, Serialize)]
struct Row {
    kernel: &'static str,
    name: String,
    tokens: usize,
    rank: usize,
    adapters: usize,
    us: f64,
    bytes: u64,
    gbs: f64,
    of_copy: f64,
    torch_loop_us: Option<f64>,
    torch_bmm_us: Option<f64>,
    speedup: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    copy_gbs: f64,
    rows: Vec<Row>,
}

/// One LoRA shape: `tokens` rows in runs of `segment` tokens per adapter, `adapters` distinct.
#[derive(Debug, Clone, Serialize)]
struct Shape {
    name: String,
    tokens: usize,
    rank: usize,
    hidden: usize,
    adapters: usize,
    segment: usize,
}

#[derive(Debug, Deserialize)]
struct TorchRow {
    name: String,
    loop_us: f64,
    bmm_us: f64,
}

fn shapes() -> Vec<(&'static str, Shape)> {
    let mut out = Vec::new();
    for rank in [8, 16, 32, 64] {
        for batch in [1, 16, 64, 256] {
            let adapters = batch.min(32);
            out.push(("bgmv", Shape { name: format!("decode b{batch} r{rank}"), tokens: batch, rank, hidden: HIDDEN, adapters, segment: 1 }));
        }
        for (tokens, segment) in [(512, 64), (2048, 64)] {
            let adapters = (tokens / segment).min(32);
            out.push(("sgmv", Shape { name: format!("prefill t{tokens} r{rank}"), tokens, rank, hidden: HIDDEN, adapters, segment }));
        }
    }
    out
}

/// `SETS` copies of `adapters` adapters of `rank` (module 0 of one layer, bf16 rows) in one pool.
struct Pool {
    pool: CudaBuffer,
    rows: Vec<LoraRows<CudaBuffer>>,
}

fn pool(g: &CudaBackend, rng: &mut StdRng, adapters: usize, rank: usize) -> anyhow::Result<Pool> {
    let units = RowDType::Bf16.slots(HIDDEN).div_ceil(LORA_ROW_ALIGN);
    let per_set = adapters * rank * 2;
    let mut host = vec![0f32; SETS * per_set * units * LORA_ROW_ALIGN];
    {
        let bits: &mut [u16] = bytemuck::cast_slice_mut(&mut host);
        for b in bits.iter_mut() {
            *b = half::bf16::from_f32((rng.random::<f32>() - 0.5) * 0.04).to_bits();
        }
    }
    let mut rows = Vec::new();
    for set in 0..SETS {
        let mut directory = vec![0u32; adapters * NUM_MODULES * 2];
        let (mut a_rows, mut b_rows) = (Vec::new(), Vec::new());
        for slot in 0..adapters {
            directory[slot * NUM_MODULES * 2] = a_rows.len() as u32;
            directory[slot * NUM_MODULES * 2 + 1] = rank as u32;
            for r in 0..rank {
                let base = (set * per_set + (slot * rank + r) * 2) * units;
                a_rows.push(base as u32);
                b_rows.push((base + units) as u32);
            }
        }
        rows.push(LoraRows {
            num_slots: adapters,
            num_layers: 1,
            directory: g.upload_u32(&directory)?,
            a_rows: g.upload_u32(&a_rows)?,
            b_rows: g.upload_u32(&b_rows)?,
            slot_dtypes: g.upload_u32(&vec![RowDType::Bf16 as u32; adapters])?,
        });
    }
    Ok(Pool { pool: g.upload_f32(&host)?, rows })
}

fn lora_row(g: &CudaBackend, rng: &mut StdRng, kernel: &'static str, s: &Shape, copy_gbs: f64) -> anyhow::Result<Row> {
    let p = pool(g, rng, s.adapters, s.rank)?;
    let target = LoraTarget { layer: 0, module: 0, in_features: HIDDEN, out_features: HIDDEN, max_rank: s.rank };
    let rand = |rng: &mut StdRng, n: usize| (0..n).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<f32>>();
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for _ in 0..SETS {
        xs.push(g.upload_as(&rand(rng, s.tokens * HIDDEN), DType::Bf16)?);
        ys.push(g.upload_as(&rand(rng, s.tokens * HIDDEN), DType::Bf16)?);
    }
    let slots: Vec<u32> = (0..s.tokens).map(|t| ((t / s.segment) % s.adapters) as u32).collect();
    let secs = if kernel == "bgmv" {
        let slots = g.upload_u32(&slots)?;
        g.time_runs(WARMUP, ITERS, |i| {
            let k = i % SETS;
            g.bgmv(&xs[k], &p.pool, &p.rows[k], &slots, &target, &mut ys[k])
        })?
    } else {
        let mut starts = vec![0u32];
        let mut seg_slots = Vec::new();
        for t0 in (0..s.tokens).step_by(s.segment) {
            starts.push((t0 + s.segment).min(s.tokens) as u32);
            seg_slots.push(slots[t0]);
        }
        let segs = LoraSegments { num_segments: seg_slots.len(), seg_starts: g.upload_u32(&starts)?, seg_slots: g.upload_u32(&seg_slots)? };
        let mut v = g.zeros(s.tokens * s.rank)?;
        g.time_runs(WARMUP, ITERS, |i| {
            let k = i % SETS;
            g.sgmv_shrink(&xs[k], &p.pool, &p.rows[k], &segs, &target, &mut v)?;
            g.sgmv_expand(&v, &p.pool, &p.rows[k], &segs, &target, &mut ys[k])
        })?
    };
    let used = s.adapters.min(s.tokens.div_ceil(s.segment));
    // A and B rows of every adapter used, x read, y read and written (bf16).
    let bytes = (used * s.rank * HIDDEN * 2 * 2 + s.tokens * HIDDEN * 2 * 3) as u64;
    Ok(Row { tokens: s.tokens, rank: s.rank, adapters: s.adapters, ..measured(kernel, &s.name, secs, bytes, copy_gbs) })
}

/// A row's timing and bandwidth; the shape fields are left at zero.
fn measured(kernel: &'static str, name: &str, secs: f64, bytes: u64, copy_gbs: f64) -> Row {
    let gbs = bytes as f64 / secs / 1e9;
    Row {
        kernel,
        name: name.to_string(),
        tokens: 0,
        rank: 0,
        adapters: 0,
        us: secs * 1e6,
        bytes,
        gbs,
        of_copy: gbs / copy_gbs,
        torch_loop_us: None,
        torch_bmm_us: None,
        speedup: None,
    }
}

/// Decode attention: `batch` sequences of `context` tokens, 32 heads over 8 KV heads of 128, bf16;
/// with `grouped`, through the grouped kernel (a block per KV head for its 4 query heads).
fn attention_row(g: &CudaBackend, rng: &mut StdRng, batch: usize, context: usize, grouped: bool, copy_gbs: f64) -> anyhow::Result<Row> {
    let (heads, kv_heads, hd, block) = (32, 8, 128, 16);
    let layout = KvLayout { num_layers: 1, num_kv_heads: kv_heads, head_dim: hd, block_size: block, dtype: RowDType::F32 };
    let blocks = context.div_ceil(block);
    let pages = batch * blocks;
    // Several caches' worth of pages would not fit for the largest shapes; one cache, with the
    // sequences' pages spread over it, already exceeds the L2 for all but the smallest rows.
    let cache = g.upload_as(&(0..pages * layout.page_elems()).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<_>>(), DType::Bf16)?;
    let mut order: Vec<u32> = (0..pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let meta = BatchMeta {
        num_seqs: batch,
        num_tokens: batch,
        max_blocks_per_seq: blocks,
        positions: g.upload_u32(&vec![context as u32 - 1; batch])?,
        slots: g
            .upload_u32(&(0..batch).map(|s| order[s * blocks + (context - 1) / block] * block as u32 + ((context - 1) % block) as u32).collect::<Vec<_>>())?,
        seq_starts: g.upload_u32(&(0..=batch as u32).collect::<Vec<_>>())?,
        context_lens: g.upload_u32(&vec![context as u32; batch])?,
        block_tables: g.upload_u32(&order)?,
    };
    let q = g.upload_as(&(0..batch * heads * hd).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<_>>(), DType::Bf16)?;
    let mut out = g.zeros_as(batch * heads * hd, DType::Bf16)?;
    let params = AttentionParams { layer: 0, num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), sliding_window: None };
    let before = g.grouped_decode();
    g.set_grouped_decode(grouped);
    let secs = g.time_runs(WARMUP, ITERS, |_| g.attention(&q, &cache, &mut out, &meta, &layout, &params));
    g.set_grouped_decode(before);
    let bytes = (batch * context * kv_heads * hd * 2 * 2 + batch * heads * hd * 2 * 2) as u64;
    let kernel = if grouped { "attn group" } else { "attention" };
    Ok(Row { tokens: batch, ..measured(kernel, &format!("decode b{batch} ctx{context}"), secs?, bytes, copy_gbs) })
}

/// cuBLAS at decode-sized matmuls (1 and 8 rows) on a 7b's projection shapes in bf16, the
/// part of a decode step that is not loraplex's kernels; weights rotate among `SETS` copies so
/// the L2 does not hold them.
fn matmul_rows(g: &CudaBackend, rng: &mut StdRng, copy_gbs: f64) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (what, n, k) in [("qkvo", 4096, 4096), ("gate/up", 11008, 4096), ("down", 4096, 11008), ("lm_head", 32000, 4096)] {
        let weights = (0..SETS)
            .map(|_| g.load_weight_as(&(0..n * k).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<_>>(), n, k, DType::Bf16))
            .collect::<Result<Vec<_>, _>>()?;
        for tokens in [1, 8] {
            let x = g.upload_as(&(0..tokens * k).map(|_| rng.random::<f32>() - 0.5).collect::<Vec<_>>(), DType::Bf16)?;
            let mut out = g.zeros_as(tokens * n, DType::Bf16)?;
            let secs = g.time_runs(WARMUP, ITERS, |i| g.matmul(&x, &weights[i % SETS], None, &mut out, tokens))?;
            let bytes = ((n * k + tokens * k + tokens * n) * 2) as u64;
            rows.push(Row { tokens, ..measured("cublas", &format!("{what} b{tokens} {n}x{k}"), secs, bytes, copy_gbs) });
        }
    }
    Ok(rows)
}

/// Runs the PyTorch baselines with `python` for `shapes`.
fn torch_baselines(python: &str, shapes: &[Shape]) -> anyhow::Result<Vec<TorchRow>> {
    let script = std::env::temp_dir().join(format!("loraplex-torch-lora-{}.py", std::process::id()));
    std::fs::write(&script, include_str!("torch_lora.py"))?;
    let mut child = Command::new(python).arg(&script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().with_context(|| format!("running {python}"))?;
    child.stdin.take().context("stdin")?.write_all(serde_json::to_string(shapes)?.as_bytes())?;
    let out = child.wait_with_output()?;
    let _ = std::fs::remove_file(&script);
    if !out.status.success() {
        bail!("the PyTorch baseline failed ({})", out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("baseline line `{l}`")))
        .collect()
}

pub fn run(args: &BenchKernelsArgs) -> anyhow::Result<()> {
    let ordinal = match args.device {
        Device::Cuda(n) => n.unwrap_or(0),
        other => bail!("bench kernels measures a CUDA device: use --device cuda or cuda:N, not {other}"),
    };
    let g = super::open_cuda(ordinal, loraplex_kernels::DType::F32, "bench kernels")?;
    let copy_gbs = g.copy_bandwidth(1 << 30)? / 1e9;
    println!("{}: device-to-device copy {copy_gbs:.0} GB/s (read + write)", g.device_name());
    let mut rng = StdRng::seed_from_u64(args.seed);
    let shapes = shapes();
    let mut rows = Vec::new();
    for (kernel, s) in &shapes {
        rows.push(lora_row(&g, &mut rng, kernel, s, copy_gbs)?);
    }
    if let Some(python) = &args.torch_python {
        let baselines = torch_baselines(python, &shapes.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>())?;
        for row in rows.iter_mut() {
            if let Some(b) = baselines.iter().find(|b| b.name == row.name) {
                row.torch_loop_us = Some(b.loop_us);
                row.torch_bmm_us = Some(b.bmm_us);
                row.speedup = Some(b.loop_us.min(b.bmm_us) / row.us);
            }
        }
    }
    for batch in [1, 16, 64, 256] {
        for context in [1024, 4096] {
            for grouped in [false, true] {
                rows.push(attention_row(&g, &mut rng, batch, context, grouped, copy_gbs)?);
            }
        }
    }
    rows.extend(matmul_rows(&g, &mut rng, copy_gbs)?);
    println!("{:<10} {:<22} {:>10} {:>9} {:>8} {:>11} {:>11} {:>8}", "kernel", "shape", "us", "GB/s", "of copy", "torch loop", "torch bmm", "speedup");
    for r in &rows {
        let opt = |v: Option<f64>, unit: &str| v.map_or("-".to_string(), |v| format!("{v:.1}{unit}"));
        println!(
            "{:<10} {:<22} {:>10.1} {:>9.0} {:>7.0}% {:>11} {:>11} {:>8}",
            r.kernel,
            r.name,
            r.us,
            r.gbs,
            r.of_copy * 100.0,
            opt(r.torch_loop_us, ""),
            opt(r.torch_bmm_us, ""),
            opt(r.speedup, "x")
        );
    }
    let decode: Vec<&Row> = rows.iter().filter(|r| r.name.starts_with("decode")).collect();
    let met = decode.iter().filter(|r| r.of_copy >= DECODE_TARGET).count();
    println!("decode rows at >= {:.0}% of the copy bandwidth: {met} of {}", DECODE_TARGET * 100.0, decode.len());
    let many: Vec<&Row> = rows.iter().filter(|r| r.adapters >= 32 && r.speedup.is_some()).collect();
    if !many.is_empty() {
        let met = many.iter().filter(|r| r.speedup.is_some_and(|s| s >= SPEEDUP_TARGET)).count();
        println!("rows with 32+ adapters at >= {SPEEDUP_TARGET}x the faster PyTorch baseline: {met} of {}", many.len());
    }
    if let Some(path) = &args.out {
        let report = Report { device: g.device_name(), copy_gbs, rows };
        std::fs::write(path, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
