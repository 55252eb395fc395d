//! `loraplex generate`: one prompt through the engine (streamed or as one JSON object), or a
//! JSON-lines file of requests run together in one continuous batch.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use loraplex_adapters::LoraAdapter;
use loraplex_kernels::cpu::CpuBackend;
use serde::{Deserialize, Serialize};

use crate::config::{GenerateArgs, PromptArgs};
use crate::engine::{Engine, EngineError, TokenLogprobs};
use crate::memory::AdapterRef;
use crate::model::{self, Model};
use crate::request::{GenerationRequest, StopConditions, ValidRequest};
use crate::runtime::Runtime;
use crate::scheduler::Placement;
use crate::tokenizer::{ChatMessage, Tokenizer};

#[derive(Serialize)]
struct JsonOutput<'a> {
    prompt_tokens: usize,
    tokens: &'a [u32],
    text: &'a str,
    finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<&'a [TokenLogprobs]>,
}

/// The prompt's token ids, from whichever form the user gave.
pub fn prompt_ids(input: &PromptArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    if let Some(text) = &input.prompt {
        return Ok(tokenizer.encode(text, true)?);
    }
    if let Some(ids) = &input.prompt_ids {
        return Ok(ids.clone());
    }
    if let Some(chat) = &input.chat {
        let messages: Vec<ChatMessage> = serde_json::from_str(chat).context("--chat must be a JSON array of {\"role\", \"content\"} messages")?;
        return Ok(tokenizer.encode_chat(&messages, true)?);
    }
    bail!("give one of --prompt, --prompt-ids, --chat or --batch")
}

/// An adapter named on the command line: keyed by its canonical path, so two spellings of one
/// directory are one adapter.
pub fn adapter_ref(dir: &Path) -> anyhow::Result<AdapterRef> {
    let canonical = dir.canonicalize().with_context(|| format!("adapter directory {}", dir.display()))?;
    Ok(AdapterRef::new(canonical.display().to_string(), canonical))
}

/// The engine's settings on the CPU, the only device `generate` runs on.
fn engine_config(args: &GenerateArgs) -> anyhow::Result<crate::engine::EngineConfig> {
    let (_, kv) = args.engine.dtypes(false).map_err(anyhow::Error::msg)?;
    Ok(args.engine.engine_config(kv))
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.engine.threads)?;
    let (matmul, _) = args.engine.dtypes(false).map_err(anyhow::Error::msg)?;
    let backend = Arc::new(matmul.cpu_backend());
    let path = args.hub.resolve(&args.model)?.files.path().to_path_buf();
    let model = Arc::new(model::load(backend, &path)?);
    let tokenizer = Arc::new(Tokenizer::open(&path)?);
    if let Some(path) = &args.input.batch {
        return run_batch(args, path, model, tokenizer);
    }
    let mut engine = Engine::new(model.clone(), tokenizer.clone(), engine_config(args)?)?;
    let adapter = args.adapter.as_deref().map(adapter_ref).transpose()?;
    if let Some(a) = &adapter {
        engine.load_adapter(a)?;
    }
    let request = GenerationRequest {
        prompt: prompt_ids(&args.input, &tokenizer)?,
        sampling: args.sampling.params(),
        stop: StopConditions { max_new_tokens: args.max_new_tokens, stop_token_ids: Vec::new(), stop_strings: args.stop.clone(), ignore_eos: args.ignore_eos },
        adapter,
        n: 1,
        grammar: None,
    }
    .validate(model.config())?;
    let mut text = crate::engine::SeqText::new(request.get().stop.stop_strings.clone());
    engine.add(request)?;
    if args.json {
        let done = engine.run_to_completion()?;
        let c = done.first().context("the engine returned no completion")?;
        let logprobs = args.sampling.logprobs.map(|_| c.logprobs.as_slice());
        let out = JsonOutput { prompt_tokens: c.prompt_tokens, tokens: &c.tokens, text: &c.text, finish_reason: c.finish_reason.as_str(), logprobs };
        println!("{}", serde_json::to_string(&out)?);
    } else {
        let mut stdout = std::io::stdout().lock();
        while engine.has_work() {
            let events = engine.step()?;
            if let Some(f) = engine.take_failures().into_iter().next() {
                return Err(EngineError::Failed { seq: f.seq, error: f.error }.into());
            }
            for event in events {
                let Some(piece) = text.push(&tokenizer, event.token, event.finish)? else { continue };
                stdout.write_all(piece.text.as_bytes())?;
                stdout.flush()?;
                if piece.cut {
                    engine.cancel(event.seq);
                }
            }
        }
        writeln!(stdout)?;
    }
    Ok(())
}

/// One line of a `--batch` file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchLine {
    /// Echoed back as given (a string or a number).
    id: serde_json::Value,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    adapter: Option<PathBuf>,
    max_new_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
    ignore_eos: Option<bool>,
}

#[derive(Serialize)]
struct BatchOutput<'a> {
    id: &'a serde_json::Value,
    prompt_tokens: usize,
    cached_prompt_tokens: usize,
    tokens: &'a [u32],
    text: &'a str,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct BatchError<'a> {
    id: &'a serde_json::Value,
    error: String,
}

/// Parses and validates every line (adapters included: each is read and checked against the
/// model) before anything runs, so a bad line fails the command with its line number and
/// nothing half-done.
fn parse_batch(args: &GenerateArgs, path: &Path, model: &Model<CpuBackend>, tokenizer: &Tokenizer) -> anyhow::Result<Vec<(serde_json::Value, ValidRequest)>> {
    let limits = engine_config(args)?.adapters.limits;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), n + 1);
        let l: BatchLine = serde_json::from_str(line).with_context(at)?;
        let prompt = match (&l.prompt, &l.prompt_ids) {
            (Some(text), None) => tokenizer.encode(text, true).with_context(at)?,
            (None, Some(ids)) => ids.clone(),
            _ => bail!("{}: give exactly one of \"prompt\" and \"prompt_ids\"", at()),
        };
        let adapter = match &l.adapter {
            Some(dir) => {
                let a = adapter_ref(dir).with_context(at)?;
                LoraAdapter::load(&a.dir, &model.base_shape(), &limits).with_context(at)?;
                Some(a)
            }
            None => None,
        };
        let mut sampling = args.sampling.params();
        sampling.temperature = l.temperature.unwrap_or(sampling.temperature);
        sampling.top_p = l.top_p.unwrap_or(sampling.top_p);
        sampling.top_k = l.top_k.unwrap_or(sampling.top_k);
        sampling.seed = l.seed.or(sampling.seed);
        let stop = StopConditions {
            max_new_tokens: l.max_new_tokens.unwrap_or(args.max_new_tokens),
            stop_token_ids: Vec::new(),
            stop_strings: l.stop.clone().unwrap_or_else(|| args.stop.clone()),
            ignore_eos: l.ignore_eos.unwrap_or(args.ignore_eos),
        };
        let request = GenerationRequest { prompt, sampling, stop, adapter, n: 1, grammar: None }.validate(model.config()).with_context(at)?;
        requests.push((l.id, request));
    }
    if requests.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(requests)
}

/// Runs every line through the serving runtime at once (one continuous batch); prints one
/// line per input, in input order. A request that fails prints `{"id", "error"}` and makes the
/// command fail once all lines are out.
fn run_batch(args: &GenerateArgs, path: &Path, model: Arc<Model<CpuBackend>>, tokenizer: Arc<Tokenizer>) -> anyhow::Result<()> {
    let requests = parse_batch(args, path, &model, &tokenizer)?;
    let runtime = Runtime::start(vec![model], tokenizer, engine_config(args)?)?;
    let mut handles = Vec::with_capacity(requests.len());
    for (id, request) in requests {
        let handle = futures::executor::block_on(runtime.submit_valid(request, Placement::default()))?;
        handles.push((id, handle));
    }
    let mut stdout = std::io::stdout().lock();
    let mut failed = 0;
    for (id, handle) in handles {
        match handle.collect_blocking() {
            Ok(out) => {
                let s = out.samples.first().context("a finished request has its sample")?;
                let finish_reason = s.finish_reason.map_or("length", |r| r.as_str());
                let line = BatchOutput {
                    id: &id,
                    prompt_tokens: out.usage.prompt_tokens,
                    cached_prompt_tokens: out.usage.cached_prompt_tokens,
                    tokens: &s.tokens,
                    text: &s.text,
                    finish_reason,
                };
                writeln!(stdout, "{}", serde_json::to_string(&line)?)?;
            }
            Err(e) => {
                failed += 1;
                writeln!(stdout, "{}", serde_json::to_string(&BatchError { id: &id, error: e.to_string() })?)?;
            }
        }
    }
    runtime.shutdown();
    if failed > 0 {
        bail!("{failed} request(s) failed");
    }
    Ok(())
}
