//! Multi-LoRA parity with HuggingFace transformers + PEFT: every reference adapter on every
//! prompt, alone and mixed in one batch with the other adapters and the base model.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use loraplex::engine::{Engine, EngineConfig, scoring};
use loraplex::memory::AdapterRef;
use loraplex::model::{self, Model};
use loraplex::request::{GenerationRequest, StopConditions, ValidRequest};
use loraplex::sampling::SamplingParams;
use loraplex::tokenizer::Tokenizer;
use loraplex_adapters::{AdapterLimits, LoraAdapter};
use loraplex_kernels::RowDType;
use loraplex_kernels::cpu::CpuBackend;

const LOGIT_TOL: f32 = 1e-4;
const ARCHS: [&str; 2] = ["llama", "qwen2"];
const ADAPTERS: [&str; 3] = ["a1_r8_qv", "a2_r16_all", "a3_r4_rslora"];

fn load(arch: &str) -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    load_on(arch, CpuBackend::new())
}

fn load_on(arch: &str, backend: CpuBackend) -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    let dir = common::fixtures().join(arch).join("model-f32");
    let model = model::load(Arc::new(backend), &dir).unwrap();
    (Arc::new(model), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
}

fn adapter_ref(arch: &str, name: &str) -> AdapterRef {
    AdapterRef::new(format!("{arch}/{name}"), common::fixtures().join(arch).join("adapters").join(name))
}

fn request(model: &Model<CpuBackend>, prompt: Vec<u32>, adapter: Option<AdapterRef>) -> ValidRequest {
    let stop = StopConditions { max_new_tokens: 16, ignore_eos: true, ..Default::default() };
    GenerationRequest { prompt, sampling: SamplingParams::greedy(), stop, adapter, n: 1, grammar: None }.validate(model.config()).unwrap()
}

fn prompts(reference: &serde_json::Value) -> Vec<Vec<u32>> {
    reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).collect()
}

fn expected(reference: &serde_json::Value, variant: &str, i: usize) -> Vec<u32> {
    common::ids(&reference["variants"][variant]["results"][i]["greedy_new_tokens"])
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The CPU backend as it runs (each LoRA delta computed beside its base matmul, then added)
/// and as a GPU backend runs the model (the deltas added in place after the matmul).
fn both_lora_paths() -> [(&'static str, CpuBackend); 2] {
    [("beside", CpuBackend::new()), ("in place", CpuBackend::new().serial())]
}

/// Logits with each adapter, at the last prompt position (prefill: SGMV) and at every decode
/// step (BGMV), are within tolerance of PEFT's, on both ways of adding the deltas.
#[test]
fn adapter_logits_match_peft_at_prefill_and_every_decode_step() {
    for (arch, (path, backend)) in ARCHS.into_iter().flat_map(|a| both_lora_paths().map(|b| (a, b))) {
        let (model, _) = load_on(arch, backend);
        let reference = common::reference(arch);
        for name in ADAPTERS {
            let dir = common::fixtures().join(arch).join("adapters").join(name);
            let adapter = LoraAdapter::load(&dir, &model.base_shape(), &AdapterLimits::default()).unwrap();
            for (i, prompt) in prompts(&reference).iter().enumerate() {
                let logits = common::fixtures().join(arch).join("logits").join(name);
                let (_, last) = common::read_npy(&logits.join(format!("p{i}_last.npy")));
                let (shape, decode) = common::read_npy(&logits.join(format!("p{i}_decode.npy")));
                let rows = scoring::greedy_logits(&model, prompt, shape[0], 16, RowDType::F32, Some(&adapter)).unwrap();
                let err = max_abs_diff(&rows[0], &last);
                assert!(err <= LOGIT_TOL, "{arch} {path} {name} prompt {i}: last-position logits differ by {err}");
                for (k, row) in rows.iter().enumerate() {
                    let err = max_abs_diff(row, &decode[k * shape[1]..(k + 1) * shape[1]]);
                    assert!(err <= LOGIT_TOL, "{arch} {path} {name} prompt {i}: decode step {k} logits differ by {err}");
                }
                let (_, base_last) = common::read_npy(&common::fixtures().join(arch).join("logits/base").join(format!("p{i}_last.npy")));
                assert!(max_abs_diff(&rows[0], &base_last) > 1e-2, "{arch} {name}: the adapter must change the logits");
            }
        }
    }
}

/// Through the engine, one request at a time: PEFT's 16 greedy tokens exactly.
#[test]
fn adapter_greedy_tokens_match_peft_one_by_one() {
    for arch in ARCHS {
        let (model, tok) = load(arch);
        let reference = common::reference(arch);
        let mut engine = Engine::new(model.clone(), tok, EngineConfig::default()).unwrap();
        for name in ADAPTERS {
            for (i, prompt) in prompts(&reference).into_iter().enumerate() {
                engine.add(request(&model, prompt, Some(adapter_ref(arch, name)))).unwrap();
                let done = engine.run_to_completion().unwrap();
                assert_eq!(done[0].tokens, expected(&reference, name, i), "{arch} {name} prompt {i}");
            }
        }
    }
}

/// Every adapter and the base model, every prompt, all in one continuous batch (with a budget
/// that splits prompts into chunks, so prefill segments and decodes of different adapters
/// share steps): each request gets exactly its one-by-one tokens, on both ways of adding the
/// deltas.
#[test]
fn a_mixed_batch_equals_each_request_alone() {
    for (arch, (path, backend)) in ARCHS.into_iter().flat_map(|a| both_lora_paths().map(|b| (a, b))) {
        let (model, tok) = load_on(arch, backend);
        let reference = common::reference(arch);
        for budget in [4096, 11] {
            let config = EngineConfig { max_batch_tokens: budget, ..EngineConfig::default() };
            let mut engine = Engine::new(model.clone(), tok.clone(), config).unwrap();
            let mut want = HashMap::new();
            for (i, prompt) in prompts(&reference).into_iter().enumerate() {
                for variant in ["base", ADAPTERS[0], ADAPTERS[1], ADAPTERS[2]] {
                    let adapter = (variant != "base").then(|| adapter_ref(arch, variant));
                    let id = engine.add(request(&model, prompt.clone(), adapter)).unwrap();
                    want.insert(id, (variant, i));
                }
            }
            let done = engine.run_to_completion().unwrap();
            assert_eq!(done.len(), want.len());
            for c in &done {
                let (variant, i) = want[&c.seq];
                assert_eq!(c.tokens, expected(&reference, variant, i), "{arch} {path} {variant} prompt {i}, budget {budget}");
            }
            let stats = engine.pool_stats();
            assert_eq!(stats.kv, 0, "every KV page returned");
            assert_eq!(stats.reclaimable, stats.adapter + stats.cached, "no adapter or cached block left pinned");
        }
    }
}

/// With a pool too small to keep every adapter resident, adapters are evicted and brought
/// back between requests, and the tokens do not change.
#[test]
fn adapters_swapped_under_pressure_give_the_same_tokens() {
    let arch = "llama";
    let (model, tok) = load(arch);
    let reference = common::reference(arch);
    let page_bytes = model.kv_layout(16, RowDType::F32).page_bytes();
    // a2 (rank 16, all modules) needs 36 pages: a pool of 48 cannot hold it with a1 and a3 and
    // the KV blocks of a batch.
    let config = EngineConfig { pool_bytes: 48 * page_bytes, max_running: 4, ..EngineConfig::default() };
    let mut engine = Engine::new(model.clone(), tok, config).unwrap();
    let mut want = HashMap::new();
    for round in 0..2 {
        for (i, prompt) in prompts(&reference).into_iter().enumerate().take(3) {
            for name in ADAPTERS {
                let id = engine.add(request(&model, prompt.clone(), Some(adapter_ref(arch, name)))).unwrap();
                want.insert(id, (name, i, round));
            }
        }
    }
    let done = engine.run_to_completion().unwrap();
    assert_eq!(done.len(), want.len());
    for c in &done {
        let (name, i, round) = want[&c.seq];
        assert_eq!(c.tokens, expected(&reference, name, i), "{name} prompt {i} round {round}");
    }
    assert!(engine.pool_stats().evictions > 0, "the pool was meant to be under pressure");
}

/// With adapter copies that stay in flight for several polls (as on a device's copy queue),
/// requests on the base model decode while their neighbours' adapters travel, no request uses
/// an adapter before its copy lands, and every request still gets PEFT's tokens, under a pool
/// small enough that adapters are evicted and copied again.
#[test]
fn adapter_copies_in_flight_do_not_hold_up_steps_or_change_tokens() {
    let arch = "llama";
    let (model, tok) = load_on(arch, CpuBackend::new().with_upload_polls(3));
    let reference = common::reference(arch);
    let page_bytes = model.kv_layout(16, RowDType::F32).page_bytes();
    let config = EngineConfig { pool_bytes: 48 * page_bytes, max_running: 4, ..EngineConfig::default() };
    let mut engine = Engine::new(model.clone(), tok, config).unwrap();
    let mut want = HashMap::new();
    for (i, prompt) in prompts(&reference).into_iter().enumerate().take(3) {
        for variant in ["base", ADAPTERS[0], ADAPTERS[1], ADAPTERS[2]] {
            let adapter = (variant != "base").then(|| adapter_ref(arch, variant));
            let id = engine.add(request(&model, prompt.clone(), adapter)).unwrap();
            want.insert(id, (variant, i));
        }
    }
    let mut tokens: HashMap<_, Vec<u32>> = HashMap::new();
    let mut base_while_copying = 0;
    while engine.has_work() {
        let copying = engine.adapters().is_copying();
        for e in engine.step().unwrap() {
            if copying && want[&e.seq].0 == "base" {
                base_while_copying += 1;
            }
            tokens.entry(e.seq).or_default().push(e.token);
        }
        assert!(engine.take_failures().is_empty());
    }
    assert!(base_while_copying > 0, "base requests decode while adapters are copied");
    assert_eq!(tokens.len(), want.len());
    for (id, got) in &tokens {
        let (variant, i) = want[id];
        assert_eq!(got, &expected(&reference, variant, i), "{variant} prompt {i}");
    }
    assert!(engine.pool_stats().evictions > 0, "the pool was meant to be under pressure");
}

/// An adapter that cannot be loaded fails its requests with a message naming the problem;
/// other requests in the same engine are unaffected.
#[test]
fn a_bad_adapter_fails_its_requests_only() {
    let arch = "llama";
    let (model, tok) = load(arch);
    let reference = common::reference(arch);
    let dir = tempfile::tempdir().unwrap();
    let src = common::fixtures().join(arch).join("adapters/a1_r8_qv");
    std::fs::copy(src.join("adapter_config.json"), dir.path().join("adapter_config.json")).unwrap();
    let bad = AdapterRef::new("missing-weights", dir.path());
    let mut engine = Engine::new(model.clone(), tok, EngineConfig::default()).unwrap();
    let prompt = prompts(&reference).remove(0);
    let good = engine.add(request(&model, prompt.clone(), None)).unwrap();
    let doomed = engine.add(request(&model, prompt, Some(bad))).unwrap();
    let mut failures = Vec::new();
    let mut tokens = Vec::new();
    while engine.has_work() {
        for e in engine.step().unwrap() {
            assert_eq!(e.seq, good);
            tokens.push(e.token);
        }
        failures.extend(engine.take_failures());
    }
    assert_eq!(tokens, expected(&reference, "base", 0));
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].seq, doomed);
    assert!(failures[0].error.to_string().contains("adapter_model.safetensors"), "{}", failures[0].error);
}
