//! The worker's text stage through the runtime: stop strings end a sample's text after the
//! step that completed it and stop the sample in the engine; a token that cannot be made into
//! text fails its request alone.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use loraplex_kernels::cpu::CpuBackend;

use super::{Event, RuntimeError};
use crate::engine::EngineConfig;
use crate::model::Model;
use crate::request::{FinishReason, GenerationRequest, SeqError, StopConditions};
use crate::runtime::{Output, Runtime};
use crate::sampling::SamplingParams;
use crate::synth::{FileDType, Preset, SynthOptions};
use crate::tokenizer::Tokenizer;

fn model(dir: &Path) -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    crate::synth::synthesize_model(&SynthOptions { out: dir.to_path_buf(), preset: Preset::Tiny, seed: 0, dtype: FileDType::F32, kv_heads: None }).unwrap();
    (Arc::new(crate::model::load(Arc::new(CpuBackend::new()), dir).unwrap()), Arc::new(Tokenizer::from_dir(dir).unwrap()))
}

fn runtime(model: &Arc<Model<CpuBackend>>, tokenizer: &Arc<Tokenizer>) -> Runtime<CpuBackend> {
    Runtime::start(vec![model.clone()], tokenizer.clone(), EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() }).unwrap()
}

fn request(prompt: Vec<u32>, max_new_tokens: u32, stop_strings: &[String], sampling: SamplingParams, n: u32) -> GenerationRequest {
    let stop = StopConditions { max_new_tokens, ignore_eos: true, stop_strings: stop_strings.to_vec(), ..Default::default() };
    GenerationRequest { prompt, sampling, stop, adapter: None, n, grammar: None }
}

fn run(rt: &Runtime<CpuBackend>, r: GenerationRequest) -> Result<Output, RuntimeError> {
    rt.submit_blocking(r, Default::default()).unwrap().collect_blocking()
}

/// Waits until the worker holds no request and its pool no KV page.
fn settles(rt: &Runtime<CpuBackend>) {
    let began = Instant::now();
    loop {
        let s = &rt.stats_blocking()[0];
        if s.in_flight == 0 && s.running == 0 && s.pool.kv == 0 {
            return;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "the worker still holds a request: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, top_k: 40, seed: Some(seed), ..Default::default() }
}

#[test]
fn a_stop_string_ends_one_samples_text_and_its_sequence_while_its_sibling_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tokenizer) = model(dir.path());
    let rt = runtime(&model, &tokenizer);
    let prompt = vec![1, 40, 41, 42];
    const LEN: u32 = 48;

    // Two seeded samples run to their length; then a stop string that occurs in the first
    // sample's text only, a few tokens in.
    let (free, stop, seed) = (1..40)
        .find_map(|seed| {
            let free = run(&rt, request(prompt.clone(), LEN, &[], sampled(seed), 2)).unwrap();
            let (a, b) = (&free.samples[0].text, &free.samples[1].text);
            let chars: Vec<char> = a.chars().collect();
            (4..chars.len().min(16)).find_map(|at| {
                let stop: String = chars[at..at + 3].iter().collect();
                let first = a.find(&stop)?;
                (first > 0 && !stop.contains('\u{fffd}') && !b.contains(&stop)).then(|| (free.clone(), stop, seed))
            })
        })
        .expect("a seed whose first sample has a stop string the second lacks");
    settles(&rt);

    let generated = rt.stats_blocking()[0].generated_tokens;
    let cut = run(&rt, request(prompt, LEN, std::slice::from_ref(&stop), sampled(seed), 2)).unwrap();
    let (a, whole) = (&cut.samples[0], &free.samples[0]);
    let at = whole.text.find(&stop).unwrap();
    assert_eq!(a.text, whole.text[..at], "the text ends just before the stop string {stop:?}");
    assert_eq!(a.finish_reason, Some(FinishReason::Stop));
    // Its tokens are the free run's up to the one that completed the stop string, and no more.
    assert!(a.tokens.len() < whole.tokens.len(), "{a:?}");
    assert_eq!(a.tokens, whole.tokens[..a.tokens.len()]);
    let through = tokenizer.decode(&a.tokens, true).unwrap();
    let before = tokenizer.decode(&a.tokens[..a.tokens.len() - 1], true).unwrap();
    assert!(through.contains(&stop) && !before.contains(&stop), "{before:?} / {through:?}");
    // The sibling is untouched, and the usage counts what each sample streamed.
    assert_eq!(cut.samples[1], free.samples[1]);
    assert_eq!(cut.usage.completion_tokens, a.tokens.len() + LEN as usize);
    // The engine stopped the cut sample soon after (not at its length), and nothing of it stays
    // behind.
    settles(&rt);
    let more = rt.stats_blocking()[0].generated_tokens - generated;
    assert!(more < 2 * LEN as u64 - 8, "the engine generated {more} tokens; the text kept {}", cut.usage.completion_tokens);
    rt.shutdown();
}

#[test]
fn a_token_without_text_fails_its_request_alone_and_the_worker_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _) = model(dir.path());
    // A tokenizer with fewer tokens than the model has logits: a request whose next token is
    // one it cannot decode fails, in the text stage.
    const KNOWN: u32 = 300;
    std::fs::write(dir.path().join("tokenizer.json"), crate::synth::tokenizer::tokenizer_json(KNOWN as usize).unwrap()).unwrap();
    let (model, tokenizer) =
        (Arc::new(crate::model::load(Arc::new(CpuBackend::new()), dir.path()).unwrap()), Arc::new(Tokenizer::from_dir(dir.path()).unwrap()));
    let rt = runtime(&model, &tokenizer);
    let greedy = |first: u32, len: u32| request(vec![first, 7, 9], len, &[], SamplingParams::greedy(), 1);

    // Prompts whose six greedy tokens the tokenizer knows, and one whose it does not.
    let mut good = Vec::new();
    let mut bad = None;
    for first in 10..200 {
        match run(&rt, greedy(first, 6)) {
            Ok(out) if out.samples[0].tokens.len() == 6 => good.push(first),
            Err(RuntimeError::Sequence(SeqError::Failed(why))) if why.contains("vocabulary") => bad = bad.or(Some(first)),
            other => panic!("{other:?}"),
        }
        if good.len() >= 2 && bad.is_some() {
            break;
        }
    }
    let bad = bad.expect("a prompt whose output the tokenizer cannot decode");
    assert!(good.len() >= 2, "{good:?}");
    settles(&rt);

    // All three at once: the bad one fails, the others complete.
    let generated = rt.stats_blocking()[0].generated_tokens;
    let handles: Vec<_> =
        [greedy(good[0], 6), greedy(bad, 16), greedy(good[1], 6)].into_iter().map(|r| rt.submit_blocking(r, Default::default()).unwrap()).collect();
    let outs: Vec<_> = handles.into_iter().map(|h| h.collect_blocking()).collect();
    assert!(matches!(&outs[1], Err(RuntimeError::Sequence(SeqError::Failed(why))) if why.contains("vocabulary")), "{:?}", outs[1]);
    for out in [&outs[0], &outs[2]] {
        let out = out.as_ref().unwrap();
        assert_eq!((out.samples[0].tokens.len(), out.usage.completion_tokens), (6, 6));
    }
    // The failed request's sequence left the engine and gave its pages back; the worker serves on.
    settles(&rt);
    let more = rt.stats_blocking()[0].generated_tokens - generated;
    assert!(more < 6 + 6 + 12, "the engine generated {more} tokens: the failed request ran on");
    assert_eq!(rt.stats_blocking()[0].restarts, 0);
    assert_eq!(run(&rt, greedy(good[0], 6)).unwrap().samples[0].tokens, outs[0].as_ref().unwrap().samples[0].tokens);
    rt.shutdown();
}

#[test]
fn a_stream_ends_with_its_tokens_then_done_and_its_usage() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tokenizer) = model(dir.path());
    let rt = runtime(&model, &tokenizer);
    let mut h = rt.submit_blocking(request(vec![1, 50, 51], 9, &[], SamplingParams::greedy(), 1), Default::default()).unwrap();
    let mut tokens = Vec::new();
    let usage = loop {
        match h.next_blocking() {
            Some(Event::Token(t)) => tokens.push(t),
            Some(Event::Done(usage)) => break usage,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(tokens.len(), 9);
    assert!(tokens[..8].iter().all(|t| t.finish.is_none()) && tokens[8].finish == Some(FinishReason::Length));
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (3, 9));
    assert!(usage.time_to_first_token <= usage.total_time && usage.queue_time <= usage.time_to_first_token, "{usage:?}");
    let ids: Vec<u32> = tokens.iter().map(|t| t.token).collect();
    assert_eq!(tokens.iter().map(|t| t.text.as_str()).collect::<String>(), tokenizer.decode(&ids, true).unwrap());
    settles(&rt);
    rt.shutdown();
}

/// Requests go from the caller straight to a worker, chosen by what the workers publish of
/// themselves: spread over the idle ones, and none to a worker whose engine is being rebuilt.
#[test]
fn requests_spread_over_the_workers_and_skip_one_without_an_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tokenizer) = model(dir.path());
    let config = EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() };
    let rt = Runtime::start(vec![model.clone(), model.clone()], tokenizer.clone(), config).unwrap();
    let generated = |rt: &Runtime<CpuBackend>| rt.stats_blocking().iter().map(|s| s.generated_tokens).collect::<Vec<_>>();
    // Two long requests sent back to back: the second finds the first counted on worker 0.
    let long = || rt.validate(request(vec![1, 40], 64, &[], Default::default(), 1)).unwrap();
    let handles: Vec<_> = (0..2).map(|_| rt.submit_detached(long(), Default::default())).collect();
    for h in handles {
        h.collect_blocking().unwrap();
    }
    assert_eq!(generated(&rt), [64, 64]);

    // Worker 1 fails and its rebuilds keep failing for a while: it gets nothing meanwhile.
    assert!(futures::executor::block_on(rt.inject_fault(1, "drill", 3)));
    let began = Instant::now();
    while rt.stats_blocking()[1].unhealthy.is_none() {
        assert!(began.elapsed() < Duration::from_secs(10), "worker 1 never became unhealthy");
        std::thread::sleep(Duration::from_millis(1));
    }
    let handles: Vec<_> = (0..4).map(|_| rt.submit_blocking(request(vec![1, 40], 2, &[], Default::default(), 1), Default::default()).unwrap()).collect();
    for h in handles {
        h.collect_blocking().unwrap();
    }
    let now = generated(&rt);
    assert_eq!(now, [64 + 8, 64]);
    // Rebuilt, it takes requests again.
    let began = Instant::now();
    while rt.stats_blocking()[1].unhealthy.is_some() {
        assert!(began.elapsed() < Duration::from_secs(20), "worker 1 was never rebuilt");
        std::thread::sleep(Duration::from_millis(5));
    }
    let handles: Vec<_> = (0..2).map(|_| rt.submit_detached(long(), Default::default())).collect();
    for h in handles {
        h.collect_blocking().unwrap();
    }
    assert_eq!(generated(&rt), [64 + 8 + 64, 64 + 64]);
}

#[test]
fn shutdown_returns_once_every_worker_has_dropped_its_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tokenizer) = model(dir.path());
    for round in 0..3 {
        let config = EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() };
        let rt = Runtime::start(vec![model.clone(), model.clone()], tokenizer.clone(), config).unwrap();
        // Work in flight on both workers when the runtime stops.
        let handles: Vec<_> =
            (0..6).map(|i| rt.submit_blocking(request(vec![1, 2, 3 + i], 500, &[], SamplingParams::greedy(), 1), Default::default()).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(20));
        rt.shutdown();
        // The workers' engines hold the model: with their threads over, only this test does.
        assert_eq!(Arc::strong_count(&model), 1, "round {round}: a worker still held the model after shutdown returned");
        drop(handles);
    }
}
