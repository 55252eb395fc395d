//! `loraplex bench engine`: decode throughput at several batch sizes and prefill throughput of
//! the base model, each as model FLOP utilization (MFU, against the matmul peak) and model
//! bandwidth utilization (MBU, against the memory read bandwidth), both measured in this run.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use loraplex_kernels::cpu::{CpuBackend, probe};
use loraplex_kernels::cuda::CudaBackend;
use loraplex_kernels::{Backend, DenseOps, Memory};
use serde::Serialize;

use crate::config::{BenchEngineArgs, Device};
use crate::engine::{Engine, EngineConfig};
use crate::model::{self, Model, ModelConfig};
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;

/// MFU target at the largest decode batch and MBU target at batch 1.
const MFU_TARGET: f64 = 0.5;
const MBU_TARGET: f64 = 0.6;

/// The machine's limits, measured right before each row: on shared machines they drift over
/// minutes, so each figure is compared with limits taken under the same conditions.
#[derive(Debug, Serialize)]
struct Machine {
    /// The device the rows ran on (`cpu`, or the GPU's name).
    device: String,
    /// CPU threads (the CPU backend), 0 on a GPU.
    threads: usize,
    matmul_peak_gflops: f64,
    /// On the CPU, a read-only sweep; on a GPU, a device-to-device copy counting bytes read
    /// and written.
    read_bandwidth_gbs: f64,
}

impl Machine {
    fn measure_cpu(backend: &CpuBackend) -> anyhow::Result<Self> {
        Ok(Machine {
            device: "cpu".into(),
            threads: rayon::current_num_threads(),
            matmul_peak_gflops: probe::matmul_peak(backend, 2048, 3)? / 1e9,
            read_bandwidth_gbs: probe::read_bandwidth(1 << 30, 3) / 1e9,
        })
    }

    /// The GPU's limits in the model's own arithmetic: the backend's matmul (cuBLAS, operands
    /// of the type the model computes in) on a 4096×4096×4096 product, and a 1 GiB copy.
    fn measure_cuda(g: &CudaBackend) -> anyhow::Result<Self> {
        const N: usize = 4096;
        let x = g.upload_f32(&(0..N * N).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect::<Vec<_>>())?;
        let w = g.load_weight(&(0..N * N).map(|i| ((i % 89) as f32 - 44.0) / 512.0).collect::<Vec<_>>(), N, N)?;
        let mut out = g.zeros(N * N)?;
        let secs = g.time_runs(2, 10, |_| g.matmul(&x, &w, None, &mut out, N))?;
        Ok(Machine {
            device: g.device_name(),
            threads: 0,
            matmul_peak_gflops: 2.0 * (N * N * N) as f64 / secs / 1e9,
            read_bandwidth_gbs: g.copy_bandwidth(1 << 30)? / 1e9,
        })
    }
}

#[derive(Debug, Serialize)]
struct ModelInfo {
    source: String,
    parameters: u64,
    weight_bytes: u64,
    kv_dtype: crate::config::KvDType,
}

#[derive(Debug, Serialize)]
struct Row {
    phase: &'static str,
    batch: usize,
    context: usize,
    tokens_per_s: f64,
    step_ms: f64,
    machine: Machine,
    gflops: f64,
    mfu: f64,
    gbs: f64,
    mbu: f64,
    /// Decode: where a timed step's host time went, mean milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    host_split: Option<HostSplit>,
}

/// The engine's [`crate::engine::StepTime`] over a row's timed steps, mean milliseconds a step.
/// With a device, `forward_ms` is the time to queue the kernels; when it is close to the whole
/// step the device waits on the host.
#[derive(Debug, Clone, Copy, Serialize)]
struct HostSplit {
    schedule_ms: f64,
    prepare_ms: f64,
    forward_ms: f64,
    finish_ms: f64,
}

impl HostSplit {
    fn between(before: crate::engine::StepTime, after: crate::engine::StepTime) -> Option<Self> {
        let steps = after.steps.checked_sub(before.steps).filter(|&n| n > 0)? as f64;
        let ms = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e6 / steps;
        Some(Self {
            schedule_ms: ms(after.schedule_ns, before.schedule_ns),
            prepare_ms: ms(after.prepare_ns, before.prepare_ns),
            forward_ms: ms(after.forward_ns, before.forward_ns),
            finish_ms: ms(after.finish_ns, before.finish_ns),
        })
    }
}

#[derive(Debug, Serialize)]
struct Report {
    host: super::Machine,
    model: ModelInfo,
    rows: Vec<Row>,
    /// CUDA: whether decode attention went through the grouped kernels where the model's
    /// grouping has one (the default) or a block per query head; absent on the CPU.
    grouped_decode: Option<bool>,
    mfu_target_at_largest_batch: f64,
    mbu_target_at_batch_1: f64,
}

/// FLOPs and bytes of the model, for utilization figures.
struct Costs {
    /// Matmul FLOPs of one token through every layer (without the LM head).
    layer_flops_per_token: f64,
    head_flops: f64,
    /// Weight bytes read by one forward (every linear layer, the LM head, the norms).
    weight_bytes: f64,
    /// Attention FLOPs per (query, key) pair summed over layers.
    attn_flops_per_pair: f64,
    /// KV bytes per cached token summed over layers.
    kv_bytes_per_token: f64,
}

impl Costs {
    /// Costs of a model whose linear layers store `linear_bytes` per weight (norms and KV are
    /// f32).
    fn of(c: &ModelConfig, linear_bytes: f64, kv_bytes: f64) -> Self {
        let (h, i) = (c.hidden_size as f64, c.intermediate_size as f64);
        let (q, kv) = ((c.num_heads * c.head_dim) as f64, (c.num_kv_heads * c.head_dim) as f64);
        let per_layer = h * q + 2.0 * h * kv + q * h + 3.0 * h * i;
        let layers = c.num_layers as f64;
        let head = h * c.vocab_size as f64;
        Costs {
            layer_flops_per_token: 2.0 * per_layer * layers,
            head_flops: 2.0 * head,
            // A head tied to the embeddings is built from the f32 embedding table.
            weight_bytes: linear_bytes * per_layer * layers + if c.tie_word_embeddings { 4.0 } else { linear_bytes } * head + 4.0 * (2.0 * layers + 1.0) * h,
            attn_flops_per_pair: 4.0 * q * layers,
            kv_bytes_per_token: kv_bytes * 2.0 * kv * layers,
        }
    }
}

pub fn run(args: &BenchEngineArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.threads)?;
    let tmp = tempfile::tempdir().context("creating a directory for the synthesized model")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, args.kv_heads, tmp.path())?;
    match args.device {
        Device::Cpu => {
            // The linear layers keep the checkpoint's element type in memory (f32, or half-size
            // bf16/f16).
            let linear_bytes = model::weights::Checkpoint::open(&dir)?.element_bytes("model.layers.0.self_attn.q_proj.weight").unwrap_or(4);
            let backend = args.matmul_dtype.cpu_backend();
            let host = super::Machine::with_kernels(backend.describe());
            measure(Arc::new(backend), Machine::measure_cpu, host, &dir, source, linear_bytes, args)
        }
        Device::Cuda(n) => {
            crate::config::check_cuda_dtypes(args.matmul_dtype, args.kv_dtype).map_err(anyhow::Error::msg)?;
            let compute = args.matmul_dtype.cuda_compute();
            let g = Arc::new(super::open_cuda(n.unwrap_or(0), compute, &format!("bench engine --device {}", args.device))?);
            g.set_grouped_decode(!args.no_grouped_decode);
            // The CUDA backend stores every weight in the type it computes in.
            measure(g, Machine::measure_cuda, super::Machine::here(), &dir, source, compute.size(), args)
        }
        Device::Auto => anyhow::bail!("bench engine measures one named device: use --device cpu, cuda or cuda:N"),
    }
}

fn measure<B: Backend>(
    backend: Arc<B>,
    limits: impl Fn(&B) -> anyhow::Result<Machine>,
    host: super::Machine,
    dir: &std::path::Path,
    source: String,
    linear_bytes: usize,
    args: &BenchEngineArgs,
) -> anyhow::Result<()> {
    eprintln!("loading {source} ...");
    let model = Arc::new(model::load(backend.clone(), dir)?);
    let tokenizer = Arc::new(Tokenizer::open(dir)?);
    let c = model.config().clone();
    let kv_bytes = args.kv_dtype.row_dtype().dtype().size() as f64;
    let costs = Costs::of(&c, linear_bytes as f64, kv_bytes);
    let f32_costs = Costs::of(&c, 4.0, 4.0);
    let info = ModelInfo {
        source,
        parameters: (f32_costs.weight_bytes / 4.0 + if c.tie_word_embeddings { 0.0 } else { (c.vocab_size * c.hidden_size) as f64 }) as u64,
        weight_bytes: costs.weight_bytes as u64,
        kv_dtype: args.kv_dtype,
    };
    let mut rows = Vec::new();
    for &batch in &args.batches {
        eprintln!("decode, batch {batch} ...");
        rows.push(decode_row(&model, &tokenizer, &costs, limits(&backend)?, batch, args)?);
    }
    if args.prefill_tokens > 0 {
        eprintln!("prefill, {} tokens ...", args.prefill_tokens);
        rows.push(prefill_row(&model, &tokenizer, &costs, limits(&backend)?, args)?);
    }
    let grouped_decode = matches!(args.device, Device::Cuda(_)).then_some(!args.no_grouped_decode);
    let report = Report { host, model: info, rows, grouped_decode, mfu_target_at_largest_batch: MFU_TARGET, mbu_target_at_batch_1: MBU_TARGET };
    print_table(&report);
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    Ok(())
}

fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    // Deterministic, varied ids; id 0..5 are special tokens in synthesized vocabularies.
    (0..len).map(|i| (5 + (i * 7919 + salt * 104_729) % (vocab - 5)) as u32).collect()
}

fn engine_for<B: Backend>(
    model: &Arc<Model<B>>,
    tok: &Arc<Tokenizer>,
    args: &BenchEngineArgs,
    seqs: usize,
    tokens: usize,
    batch_tokens: usize,
) -> anyhow::Result<Engine<B>> {
    let kv_dtype = args.kv_dtype.row_dtype();
    let layout = model.kv_layout(16, kv_dtype);
    // A page of headroom per sequence: a prompt that fills its last page exactly still needs
    // the next one for its first generated token.
    let pages = seqs * (tokens.div_ceil(16) + 1) + 1;
    let config = EngineConfig {
        block_size: 16,
        kv_dtype,
        pool_bytes: pages * layout.page_bytes(),
        max_batch_tokens: batch_tokens,
        max_running: seqs,
        ..EngineConfig::default()
    };
    Ok(Engine::new(model.clone(), tok.clone(), config)?)
}

fn request<B: Backend>(model: &Model<B>, prompt: Vec<u32>, new_tokens: usize) -> anyhow::Result<crate::request::ValidRequest> {
    let stop = StopConditions { max_new_tokens: u32::try_from(new_tokens)?, ignore_eos: true, ..Default::default() };
    Ok(GenerationRequest { prompt, sampling: SamplingParams::greedy(), stop, adapter: None, n: 1, grammar: None }.validate(model.config())?)
}

fn decode_row<B: Backend>(model: &Arc<Model<B>>, tok: &Arc<Tokenizer>, costs: &Costs, m: Machine, batch: usize, args: &BenchEngineArgs) -> anyhow::Result<Row> {
    let (ctx, steps) = (args.context, args.steps.max(1));
    let warmup = 2;
    // Prompts are prefilled a few per step while earlier ones already decode; every sequence
    // gets enough headroom to still be running through the timed steps.
    let new_tokens = warmup + steps + batch + 1;
    let mut engine = engine_for(model, tok, args, batch, ctx + new_tokens, ctx * batch.min(16))?;
    for s in 0..batch {
        engine.add(request(model, prompt(ctx, model.config().vocab_size, s), new_tokens)?)?;
    }
    // Prefill every prompt and take a couple of untimed decode steps, counting what each
    // sequence generated so far to know the contexts of the timed steps.
    let mut generated: std::collections::HashMap<crate::engine::SeqId, usize> = Default::default();
    while generated.len() < batch {
        for e in engine.step()? {
            *generated.entry(e.seq).or_default() += 1;
        }
    }
    for _ in 0..warmup {
        for e in engine.step()? {
            *generated.entry(e.seq).or_default() += 1;
        }
    }
    let mut times = Vec::with_capacity(steps);
    let mut produced = 0;
    let before = engine.step_time();
    for _ in 0..steps {
        let t = Instant::now();
        produced += engine.step()?.len();
        times.push(t.elapsed().as_secs_f64());
    }
    anyhow::ensure!(produced == batch * steps, "expected {} tokens, the engine produced {produced}", batch * steps);
    let split = HostSplit::between(before, engine.step_time());
    times.sort_by(f64::total_cmp);
    let avg_ctx = ctx as f64 + generated.values().sum::<usize>() as f64 / batch as f64 + steps as f64 / 2.0;
    let step_s = times[times.len() / 2];
    let flops = batch as f64 * (costs.layer_flops_per_token + costs.head_flops + costs.attn_flops_per_pair * avg_ctx);
    let bytes = costs.weight_bytes + batch as f64 * avg_ctx * costs.kv_bytes_per_token;
    let row = Measured { phase: "decode", batch, context: ctx, tokens: batch, seconds: step_s, flops, bytes }.row(m);
    Ok(Row { host_split: split, ..row })
}

fn prefill_row<B: Backend>(model: &Arc<Model<B>>, tok: &Arc<Tokenizer>, costs: &Costs, m: Machine, args: &BenchEngineArgs) -> anyhow::Result<Row> {
    let n = args.prefill_tokens.min(model.config().max_position_embeddings - 1);
    let mut best = f64::INFINITY;
    for rep in 0..3 {
        let mut engine = engine_for(model, tok, args, 1, n + 1, n)?;
        engine.add(request(model, prompt(n, model.config().vocab_size, rep), 1)?)?;
        // The scheduler may cut a long prompt into chunks (its step-cost bound): time every step
        // until the first token.
        let t = Instant::now();
        let mut events = Vec::new();
        for _ in 0..n {
            events = engine.step()?;
            if !events.is_empty() {
                break;
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
        anyhow::ensure!(events.len() == 1, "the prefill produced {} tokens", events.len());
    }
    let pairs = (n * (n + 1) / 2) as f64;
    let flops = n as f64 * costs.layer_flops_per_token + costs.head_flops + costs.attn_flops_per_pair * pairs;
    let bytes = costs.weight_bytes + n as f64 * costs.kv_bytes_per_token;
    Ok(Measured { phase: "prefill", batch: 1, context: n, tokens: n, seconds: best, flops, bytes }.row(m))
}

/// One timed step and the work it did.
struct Measured {
    phase: &'static str,
    batch: usize,
    context: usize,
    /// Tokens the step processed.
    tokens: usize,
    seconds: f64,
    flops: f64,
    bytes: f64,
}

impl Measured {
    fn row(&self, m: Machine) -> Row {
        let (gflops, gbs) = (self.flops / self.seconds / 1e9, self.bytes / self.seconds / 1e9);
        Row {
            phase: self.phase,
            batch: self.batch,
            context: self.context,
            tokens_per_s: self.tokens as f64 / self.seconds,
            step_ms: self.seconds * 1e3,
            gflops,
            mfu: gflops / m.matmul_peak_gflops,
            gbs,
            mbu: gbs / m.read_bandwidth_gbs,
            machine: m,
            host_split: None,
        }
    }
}

fn print_table(r: &Report) {
    println!("machine: {}", r.host);
    match r.grouped_decode {
        Some(true) => println!("decode attention: the grouped kernels where the heads' grouping has one"),
        Some(false) => println!("decode attention: a block per query head (--no-grouped-decode)"),
        None => {}
    }
    println!(
        "model: {} ({:.1} M parameters, {:.0} MB of weights read per step), KV pool in {:?}",
        r.model.source,
        r.model.parameters as f64 / 1e6,
        r.model.weight_bytes as f64 / 1e6,
        r.model.kv_dtype
    );
    println!(
        "{:<8} {:>5} {:>7} {:>10} {:>9} {:>8} {:>6} {:>7} {:>6} {:>6} {:>6}",
        "phase", "batch", "context", "tokens/s", "step ms", "GFLOP/s", "MFU", "GB/s", "MBU", "peak", "bw"
    );
    for row in &r.rows {
        println!(
            "{:<8} {:>5} {:>7} {:>10.1} {:>9.2} {:>8.1} {:>5.1}% {:>7.1} {:>5.1}% {:>6.0} {:>6.1}",
            row.phase,
            row.batch,
            row.context,
            row.tokens_per_s,
            row.step_ms,
            row.gflops,
            row.mfu * 100.0,
            row.gbs,
            row.mbu * 100.0,
            row.machine.matmul_peak_gflops,
            row.machine.read_bandwidth_gbs
        );
    }
    match r.rows.first() {
        Some(x) if x.machine.threads > 0 => {
            println!("(peak: matmul GFLOP/s and bw: read GB/s, measured right before each row on {} threads)", x.machine.threads)
        }
        Some(x) => {
            println!("(peak: matmul GFLOP/s in the compute type and bw: copy GB/s read + written, measured right before each row on {})", x.machine.device)
        }
        None => {}
    }
    let decode: Vec<&Row> = r.rows.iter().filter(|x| x.phase == "decode").collect();
    for row in &decode {
        if let Some(h) = row.host_split {
            println!(
                "decode batch {}: host ms a step (means): schedule {:.3}, prepare {:.3}, forward {:.3}, finish {:.3}",
                row.batch, h.schedule_ms, h.prepare_ms, h.forward_ms, h.finish_ms
            );
        }
    }
    if let Some(largest) = decode.iter().max_by_key(|x| x.batch) {
        println!("target: MFU >= {:.0}% at batch {}: {:.1}%", MFU_TARGET * 100.0, largest.batch, largest.mfu * 100.0);
    }
    if let Some(one) = decode.iter().find(|x| x.batch == 1) {
        println!("target: MBU >= {:.0}% at batch 1: {:.1}%", MBU_TARGET * 100.0, one.mbu * 100.0);
    }
}
