//! `loraplex bench structured`: decode throughput of a batch whose every row follows a JSON
//! schema, against the same batch unconstrained, on the same engine and prompts, and what the
//! grammar masks cost per step (computed on their own thread while the forward runs; the step
//! waits only for what is left when the forward is done). Rounds alternate the two modes and the
//! median is reported, so the machine's drift touches both alike. Target: the constrained batch
//! decodes at most 10% slower.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;
use serde_json::json;

use crate::config::BenchStructuredArgs;
use crate::engine::{Engine, EngineConfig};
use crate::grammar::{CompiledGrammar, GrammarCompiler, GrammarLimits, GrammarSpec};
use crate::model::{self, Model};
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use loraplex_kernels::Backend;

/// The largest slowdown of the constrained batch.
pub const TARGET: f64 = 0.10;

/// A schema of nested objects, enums, bounded numbers, patterns and arrays that no row can
/// finish within the timed steps (64 records at least), so every row decodes every step.
pub fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "source": {"type": "string", "maxLength": 24},
            "records": {
                "type": "array",
                "minItems": 64,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "status": {"enum": ["open", "shipped", "returned", "lost"]},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "vip": {"type": "boolean"}}, "required": ["name"]}
                    },
                    "required": ["id", "sku", "status", "price", "owner"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["source", "records"],
        "additionalProperties": false
    })
}

#[derive(Debug, Serialize)]
struct Sample {
    mode: &'static str,
    round: usize,
    tokens_per_s: f64,
    step_ms_median: f64,
    /// Masks computed over the timed steps, per step: their time on their own thread, and what
    /// the steps waited for them after the forward.
    masks_per_step: f64,
    mask_ms_per_step: f64,
    wait_ms_per_step: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: super::Machine,
    model: String,
    batch: usize,
    context: usize,
    steps: usize,
    schema_compile_ms: f64,
    samples: Vec<Sample>,
    free_tokens_per_s: f64,
    constrained_tokens_per_s: f64,
    /// The median over rounds of each round's slowdown (1 - constrained / free).
    overhead: f64,
    round_overheads: Vec<f64>,
    mask_ms_per_step: f64,
    wait_ms_per_step: f64,
    target: f64,
}

pub fn run(args: &BenchStructuredArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.threads)?;
    anyhow::ensure!(args.batch > 0 && args.steps > 0 && args.rounds > 0, "--batch, --steps and --rounds must be positive");
    let tmp = tempfile::tempdir().context("creating a directory for the synthesized model")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, None, tmp.path())?;
    let backend = args.matmul_dtype.cpu_backend();
    let machine = super::Machine::with_kernels(backend.describe());
    println!("machine: {machine}");
    eprintln!("loading {source} ...");
    let model = Arc::new(model::load(Arc::new(backend), &dir)?);
    let tokenizer = Arc::new(Tokenizer::open(&dir)?);
    let eos = crate::engine::end_tokens(&tokenizer, model.config());
    let compiler = GrammarCompiler::new(tokenizer.clone(), &eos, GrammarLimits::default()).context("structured output for this tokenizer")?;
    let began = Instant::now();
    let grammar = compiler.compile(&GrammarSpec::json_schema(schema(), true))?;
    let schema_compile_ms = began.elapsed().as_secs_f64() * 1e3;
    println!(
        "model: {source} (vocab {}), batch {}, {}-token prompts, {} timed decode steps; schema compiled in {schema_compile_ms:.1} ms",
        model.config().vocab_size,
        args.batch,
        args.context,
        args.steps
    );
    let mut samples = Vec::new();
    for round in 0..args.rounds {
        for (mode, g) in [("free", None), ("constrained", Some(&grammar))] {
            eprintln!("round {round}, {mode} ...");
            let s = measure(&model, &tokenizer, g, args, mode, round)?;
            println!(
                "round {round} {mode:<11}: {:>8.1} tokens/s, step {:>6.2} ms; masks {:>5.1}/step, {:>6.2} ms/step on their thread, the step waited {:>5.2} ms",
                s.tokens_per_s, s.step_ms_median, s.masks_per_step, s.mask_ms_per_step, s.wait_ms_per_step
            );
            samples.push(s);
        }
    }
    let median = |mode: &str, f: fn(&Sample) -> f64| {
        let v: Vec<f64> = samples.iter().filter(|s| s.mode == mode).map(f).collect();
        super::quantile(&v, 0.5)
    };
    let (free, constrained) = (median("free", |s| s.tokens_per_s), median("constrained", |s| s.tokens_per_s));
    // Each round's two runs are next to each other in time: the median of their ratios is
    // what the machine's drift between rounds moves least.
    let ratios: Vec<f64> = samples.chunks_exact(2).map(|p| 1.0 - p[1].tokens_per_s / p[0].tokens_per_s).collect();
    let report = Report {
        machine,
        model: source,
        batch: args.batch,
        context: args.context,
        steps: args.steps,
        schema_compile_ms,
        free_tokens_per_s: free,
        constrained_tokens_per_s: constrained,
        overhead: super::quantile(&ratios, 0.5),
        round_overheads: ratios.clone(),
        mask_ms_per_step: median("constrained", |s| s.mask_ms_per_step),
        wait_ms_per_step: median("constrained", |s| s.wait_ms_per_step),
        target: TARGET,
        samples,
    };
    println!(
        "median of {} rounds: free {:.1} tokens/s, every row constrained {:.1} tokens/s; overhead (the median of the rounds' {}) {:.1}% (target <= {:.0}%); masks {:.2} ms per step on their thread, {:.2} ms of it waited for",
        args.rounds,
        report.free_tokens_per_s,
        report.constrained_tokens_per_s,
        report.round_overheads.iter().map(|r| format!("{:.1}%", r * 100.0)).collect::<Vec<_>>().join(", "),
        report.overhead * 100.0,
        TARGET * 100.0,
        report.mask_ms_per_step,
        report.wait_ms_per_step
    );
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    Ok(())
}

/// One round of one mode: a fresh engine, every prompt prefilled, two untimed steps, then the
/// timed ones.
fn measure<B: Backend>(
    model: &Arc<Model<B>>,
    tokenizer: &Arc<Tokenizer>,
    grammar: Option<&CompiledGrammar>,
    args: &BenchStructuredArgs,
    mode: &'static str,
    round: usize,
) -> anyhow::Result<Sample> {
    let (batch, ctx, steps, warmup) = (args.batch, args.context, args.steps, 2);
    let new_tokens = warmup + steps + batch + 1;
    let layout = model.kv_layout(16, loraplex_kernels::RowDType::F32);
    let pages = batch * ((ctx + new_tokens).div_ceil(16) + 1) + 1;
    let config = EngineConfig {
        block_size: 16,
        pool_bytes: pages * layout.page_bytes(),
        max_batch_tokens: ctx * batch.min(16),
        max_running: batch,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model.clone(), tokenizer.clone(), config)?;
    let vocab = model.config().vocab_size;
    for s in 0..batch {
        let stop = StopConditions { max_new_tokens: u32::try_from(new_tokens)?, ignore_eos: true, ..Default::default() };
        let request = GenerationRequest {
            prompt: super::prompt(ctx, vocab, s),
            sampling: SamplingParams::greedy(),
            stop,
            adapter: None,
            n: 1,
            grammar: grammar.cloned(),
        };
        engine.add(request.validate(model.config())?)?;
    }
    let mut started = std::collections::HashSet::new();
    while started.len() < batch {
        for e in engine.step()? {
            started.insert(e.seq);
        }
    }
    for _ in 0..warmup {
        engine.step()?;
    }
    let before = engine.grammar_time();
    let (mut times, mut produced) = (Vec::with_capacity(steps), 0);
    let began = Instant::now();
    for _ in 0..steps {
        let t = Instant::now();
        produced += engine.step()?.len();
        times.push(t.elapsed().as_secs_f64());
    }
    let total = began.elapsed().as_secs_f64();
    anyhow::ensure!(produced == batch * steps, "{mode}: expected {} tokens, the engine produced {produced} (a row ended early)", batch * steps);
    let after = engine.grammar_time();
    let per_step = |ns: u64| ns as f64 / 1e6 / steps as f64;
    Ok(Sample {
        mode,
        round,
        tokens_per_s: produced as f64 / total,
        step_ms_median: super::quantile(&times, 0.5) * 1e3,
        masks_per_step: (after.masks - before.masks) as f64 / steps as f64,
        mask_ms_per_step: per_step(after.mask_ns - before.mask_ns),
        wait_ms_per_step: per_step(after.wait_ns - before.wait_ns),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bench runs end to end at a small size and reports both modes; what it measures
    /// (speed) is not checked.
    #[test]
    fn the_bench_runs_both_modes_and_reports_the_masks() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("bench-structured.json");
        let args = BenchStructuredArgs {
            preset: crate::synth::Preset::Tiny,
            model_dtype: crate::synth::FileDType::F32,
            matmul_dtype: crate::config::MatmulDType::F32,
            model: None,
            hub: Default::default(),
            batch: 4,
            context: 8,
            steps: 4,
            rounds: 1,
            threads: None,
            out: out.clone(),
        };
        run(&args).unwrap();
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        let modes: Vec<&str> = report["samples"].as_array().unwrap().iter().map(|s| s["mode"].as_str().unwrap()).collect();
        assert_eq!(modes, ["free", "constrained"]);
        assert_eq!(report["samples"][0]["masks_per_step"], 0.0);
        assert_eq!(report["samples"][1]["masks_per_step"], 4.0, "every row computes a mask each step: {report}");
        assert!(report["constrained_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
}
