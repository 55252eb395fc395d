//! The serving runtime through its library API: actors, routing, supervision, cancellation,
//! and refusals at the door.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use loraplex::engine::EngineConfig;
use loraplex::memory::AdapterRef;
use loraplex::model::{self, Model};
use loraplex::request::{GenerationRequest, SeqError, StopConditions};
use loraplex::runtime::{Event, RequestHandle, Runtime, RuntimeError};
use loraplex::sampling::SamplingParams;
use loraplex::scheduler::Placement;
use loraplex::tokenizer::Tokenizer;
use loraplex_kernels::cpu::CpuBackend;

fn load() -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    let dir = common::fixtures().join("llama").join("model-f32");
    let model = model::load(Arc::new(CpuBackend::new()), &dir).unwrap();
    (Arc::new(model), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
}

fn start(workers: usize) -> Runtime<CpuBackend> {
    let (model, tok) = load();
    Runtime::start(vec![model; workers], tok, EngineConfig::default()).unwrap()
}

fn prompt(i: usize) -> Vec<u32> {
    common::ids(&common::reference("llama")["prompts"][i]["token_ids"])
}

fn expected(variant: &str, i: usize) -> Vec<u32> {
    common::ids(&common::reference("llama")["variants"][variant]["results"][i]["greedy_new_tokens"])
}

fn adapter(name: &str) -> AdapterRef {
    AdapterRef::new(format!("llama/{name}"), common::fixtures().join("llama").join("adapters").join(name))
}

fn request(prompt: Vec<u32>, adapter: Option<AdapterRef>, max_new_tokens: u32, n: u32) -> GenerationRequest {
    let stop = StopConditions { max_new_tokens, ignore_eos: true, ..Default::default() };
    GenerationRequest { prompt, sampling: SamplingParams::greedy(), stop, adapter, n, grammar: None }
}

fn submit(rt: &Runtime<CpuBackend>, req: GenerationRequest) -> RequestHandle {
    rt.submit_blocking(req, Placement::default()).unwrap()
}

/// Waits until `cond` holds of the runtime's statistics.
fn wait_for(rt: &Runtime<CpuBackend>, what: &str, cond: impl Fn(&[loraplex::runtime::WorkerStats]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stats = rt.stats_blocking();
        if cond(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {stats:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn requests_stream_their_tokens_and_end_with_usage() {
    let rt = start(1);
    let handles = [
        (submit(&rt, request(prompt(0), None, 16, 1)), "base", 0, 1),
        (submit(&rt, request(prompt(4), Some(adapter("a1_r8_qv")), 16, 2)), "a1_r8_qv", 4, 2),
        (submit(&rt, request(prompt(5), Some(adapter("a2_r16_all")), 16, 1)), "a2_r16_all", 5, 1),
    ];
    for (handle, variant, i, n) in handles {
        let out = handle.collect_blocking().unwrap();
        assert_eq!(out.samples.len(), n);
        for s in &out.samples {
            assert_eq!(s.tokens, expected(variant, i), "{variant} prompt {i}");
            assert!(s.finish_reason.is_some());
        }
        let u = out.usage;
        assert_eq!((u.prompt_tokens, u.completion_tokens), (prompt(i).len(), 16 * n));
        assert!(u.queue_time <= u.time_to_first_token && u.time_to_first_token <= u.total_time, "{u:?}");
        assert!(u.time_to_first_token > Duration::ZERO);
    }
    // The same prompt again reuses its cached blocks, and says so.
    let again = submit(&rt, request(prompt(5), Some(adapter("a2_r16_all")), 16, 1)).collect_blocking().unwrap();
    assert_eq!(again.usage.cached_prompt_tokens, 288);
    assert_eq!(again.samples[0].tokens, expected("a2_r16_all", 5));
    wait_for(&rt, "the worker to go idle", |s| s[0].in_flight == 0 && s[0].pool.kv == 0);
    let stats = rt.stats_blocking();
    assert_eq!(stats[0].generated_tokens, 16 * 5);
}

#[test]
fn bad_requests_are_refused_before_they_are_queued() {
    let rt = start(1);
    let context = rt.model_config().max_position_embeddings;
    let refuse = |req: GenerationRequest| rt.submit_blocking(req, Placement::default()).err().expect("refused").to_string();
    let missing = AdapterRef::new("acme/nope@1", "/nonexistent/adapter");
    assert!(refuse(request(prompt(0), Some(missing), 16, 1)).contains("unknown adapter acme/nope@1"));
    assert!(refuse(request(vec![1; context + 1], None, 16, 1)).contains("context length"));
    assert!(refuse(request(prompt(0), None, 0, 1)).contains("max_new_tokens"));
    assert!(refuse(request(prompt(0), None, 16, 0)).contains("`n`"));
    let mut hot = request(prompt(0), None, 16, 1);
    hot.sampling.temperature = -1.0;
    assert!(refuse(hot).contains("temperature"));
    let mut top_p = request(prompt(0), None, 16, 1);
    top_p.sampling.top_p = 1.5;
    assert!(refuse(top_p).contains("top_p"));
    let stats = rt.stats_blocking();
    assert_eq!((stats[0].in_flight, stats[0].waiting, stats[0].running), (0, 0, 0), "nothing was queued");
    // An adapter directory that exists but holds no valid adapter fails its request with the
    // loader's reason, without disturbing others.
    let bad = tempfile::tempdir().unwrap();
    std::fs::write(bad.path().join("adapter_config.json"), "{\"r\": 8}").unwrap();
    let broken = submit(&rt, request(prompt(0), Some(AdapterRef::new("acme/broken@1", bad.path())), 16, 1));
    let fine = submit(&rt, request(prompt(0), None, 16, 1));
    assert!(matches!(broken.collect_blocking(), Err(RuntimeError::Sequence(SeqError::AdapterFailed(_)))));
    assert_eq!(fine.collect_blocking().unwrap().samples[0].tokens, expected("base", 0));
}

#[test]
fn a_failed_step_errors_every_request_in_flight_and_the_worker_is_rebuilt() {
    let rt = start(1);
    let mut a = submit(&rt, request(prompt(5), None, 200, 1));
    let mut b = submit(&rt, request(prompt(3), Some(adapter("a1_r8_qv")), 200, 1));
    assert!(matches!(a.next_blocking(), Some(Event::Token(_))), "a is running");
    assert!(futures::executor::block_on(rt.inject_fault(0, "device lost", 0)));
    for h in [&mut a, &mut b] {
        let last = std::iter::from_fn(|| h.next_blocking()).last();
        match last {
            Some(Event::Error(RuntimeError::WorkerFailed(why))) => assert!(why.contains("device lost")),
            other => panic!("expected the worker's failure, got {other:?}"),
        }
    }
    wait_for(&rt, "the restart", |s| s[0].restarts == 1);
    let stats = rt.stats_blocking();
    assert_eq!((stats[0].in_flight, stats[0].pool.kv, stats[0].pool.adapter), (0, 0, 0), "a fresh engine: {stats:?}");
    assert!(stats[0].host_adapter_bytes > 0, "the host tier outlives the worker: {stats:?}");
    let after = submit(&rt, request(prompt(4), Some(adapter("a1_r8_qv")), 16, 1)).collect_blocking().unwrap();
    assert_eq!(after.samples[0].tokens, expected("a1_r8_qv", 4), "the rebuilt worker serves again");
}

#[test]
fn a_worker_whose_rebuild_fails_is_unhealthy_and_gets_no_requests_until_it_recovers() {
    let rt = start(2);
    let mut running = submit(&rt, request(prompt(5), None, 200, 1));
    assert!(matches!(running.next_blocking(), Some(Event::Token(_))));
    // The first request went to worker 0 (both idle: the lower index). Its step fails and
    // its next three rebuilds fail too.
    assert!(futures::executor::block_on(rt.inject_fault(0, "device lost", 3)));
    assert!(matches!(std::iter::from_fn(|| running.next_blocking()).last(), Some(Event::Error(RuntimeError::WorkerFailed(_)))));
    wait_for(&rt, "worker 0 to be unhealthy", |s| s[0].unhealthy.is_some());
    // Meanwhile worker 1 serves everything; nothing is routed to the worker without an engine.
    for i in 0..4 {
        let out = submit(&rt, request(prompt(i), None, 8, 1)).collect_blocking().unwrap();
        assert_eq!(out.samples[0].tokens, expected("base", i)[..8]);
    }
    let stats = rt.stats_blocking();
    assert!(stats[1].generated_tokens >= 32, "worker 1 served them: {stats:?}");
    // The rebuild is retried with backoff until it succeeds (50 + 100 + 200 ms here).
    wait_for(&rt, "worker 0 to recover", |s| s[0].unhealthy.is_none());
    assert_eq!(rt.stats_blocking()[0].restarts, 1);
    let before = rt.stats_blocking()[0].steps;
    let mut load = Vec::new();
    for i in 0..6 {
        load.push(submit(&rt, request(prompt(i % 6), None, 64, 1)));
    }
    for h in load {
        h.collect_blocking().unwrap();
    }
    assert!(rt.stats_blocking()[0].steps > before, "worker 0 takes requests again");
}

#[test]
fn cancelled_and_abandoned_requests_free_their_pages() {
    let rt = start(1);
    let mut kept = submit(&rt, request(prompt(0), None, 16, 1));
    let mut cancelled = submit(&rt, request(prompt(5), None, 200, 1));
    assert!(matches!(cancelled.next_blocking(), Some(Event::Token(_))));
    assert!(futures::executor::block_on(rt.cancel(cancelled.id)));
    assert!(matches!(std::iter::from_fn(|| cancelled.next_blocking()).last(), Some(Event::Error(RuntimeError::Cancelled))));
    assert!(!futures::executor::block_on(rt.cancel(cancelled.id)), "already gone");

    let mut abandoned = submit(&rt, request(prompt(5), None, 200, 1));
    assert!(matches!(abandoned.next_blocking(), Some(Event::Token(_))));
    drop(abandoned);
    let mut tokens = Vec::new();
    while let Some(e) = kept.next_blocking() {
        if let Event::Token(t) = e {
            tokens.push(t.token);
        }
    }
    assert_eq!(tokens, expected("base", 0), "the others are untouched");
    wait_for(&rt, "the abandoned request to go", |s| s[0].in_flight == 0 && s[0].pool.kv == 0 && s[0].running == 0);
    assert!(rt.stats_blocking()[0].generated_tokens < 16 + 200, "neither ran to its end");
}

#[test]
fn requests_go_where_their_adapter_is_resident() {
    let rt = start(2);
    // Worker 0 is busy with a long request, so the adapter's first request lands on worker 1.
    let busy = submit(&rt, request(prompt(5), None, 200, 1));
    let first = submit(&rt, request(prompt(0), Some(adapter("a2_r16_all")), 16, 1));
    drop(busy);
    assert_eq!(first.collect_blocking().unwrap().samples[0].tokens, expected("a2_r16_all", 0));
    wait_for(&rt, "both workers to go idle", |s| s.iter().all(|w| w.in_flight == 0));
    let before = rt.stats_blocking();
    assert_eq!(before[1].generated_tokens, 16);
    // Both idle now: least loaded alone would pick worker 0; residency picks worker 1.
    for i in [3, 4] {
        let out = submit(&rt, request(prompt(i), Some(adapter("a2_r16_all")), 16, 1)).collect_blocking().unwrap();
        assert_eq!(out.samples[0].tokens, expected("a2_r16_all", i));
    }
    let after = rt.stats_blocking();
    assert_eq!(after[1].generated_tokens - before[1].generated_tokens, 32, "{after:?}");
    assert_eq!(after[0].generated_tokens, before[0].generated_tokens);
    assert_eq!(after[0].pool.adapter, 0, "worker 0 never loaded the adapter");
    // The host tier is the machine's: worker 0 would get the adapter from memory, not disk.
    assert!(after[0].host_adapter_bytes > 0 && after[0].host_adapter_bytes == after[1].host_adapter_bytes, "{after:?}");
}
