//! Parity with HuggingFace transformers: greedy tokens and logits of the reference fixtures.

mod common;

use std::sync::Arc;

use loraplex::engine::{Engine, EngineConfig, scoring};
use loraplex::model::{self, Model};
use loraplex::request::{GenerationRequest, StopConditions};
use loraplex::sampling::SamplingParams;
use loraplex::tokenizer::Tokenizer;
use loraplex_kernels::RowDType;
use loraplex_kernels::cpu::{CpuBackend, MatmulInputs};

const LOGIT_TOL: f32 = 1e-4;

struct Variant {
    arch: &'static str,
    name: &'static str,
    dir: &'static str,
}

const VARIANTS: [Variant; 4] = [
    Variant { arch: "llama", name: "base", dir: "model-f32" },
    Variant { arch: "llama", name: "base_bf16_weights", dir: "model-bf16" },
    Variant { arch: "qwen2", name: "base", dir: "model-f32" },
    Variant { arch: "qwen2", name: "base_bf16_weights", dir: "model-bf16" },
];

fn load(v: &Variant) -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    load_on(v, CpuBackend::new())
}

fn load_on(v: &Variant, backend: CpuBackend) -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    let dir = common::fixtures().join(v.arch).join(v.dir);
    let model = model::load(Arc::new(backend), &dir).unwrap();
    (Arc::new(model), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
}

fn greedy_request(model: &Model<CpuBackend>, prompt: Vec<u32>, n: usize) -> loraplex::request::ValidRequest {
    let stop = StopConditions { max_new_tokens: n as u32, ignore_eos: true, ..Default::default() };
    GenerationRequest { prompt, sampling: SamplingParams::greedy(), stop, adapter: None, n: 1, grammar: None }.validate(model.config()).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// For every prompt: the logits at the last prompt position and at every greedy decode step,
/// computed through the paged cache one token at a time, are within tolerance of transformers'.
#[test]
fn logits_match_reference_at_prefill_and_every_decode_step() {
    for v in &VARIANTS {
        let (model, _) = load(v);
        let reference = common::reference(v.arch);
        let results = &reference["variants"][v.name]["results"];
        for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
            let prompt = common::ids(&p["token_ids"]);
            let dir = common::fixtures().join(v.arch).join("logits").join(v.name);
            let (_, last) = common::read_npy(&dir.join(format!("p{i}_last.npy")));
            let (shape, decode) = common::read_npy(&dir.join(format!("p{i}_decode.npy")));
            let rows = scoring::greedy_logits(&model, &prompt, shape[0], 16, RowDType::F32, None).unwrap();
            let err = max_abs_diff(&rows[0], &last);
            assert!(err <= LOGIT_TOL, "{} {} prompt {i}: last-position logits differ by {err}", v.arch, v.name);
            for (k, row) in rows.iter().enumerate() {
                let err = max_abs_diff(row, &decode[k * shape[1]..(k + 1) * shape[1]]);
                assert!(err <= LOGIT_TOL, "{} {} prompt {i}: decode step {k} logits differ by {err}", v.arch, v.name);
            }
            let expected = common::ids(&results[i]["greedy_new_tokens"]);
            assert_eq!(expected.len(), 16);
        }
    }
}

/// `loraplex logits` (teacher forcing): fed the reference's own greedy tokens it gives the
/// reference's rows, with and without an adapter; fed other tokens, row `k` is the logits of the
/// prompt extended by the first `k` fed tokens, not of the model's own argmax.
#[test]
fn forced_logits_follow_the_given_tokens() {
    use loraplex::cli::logits::{Case, run_cases};
    let (model, _) = load(&VARIANTS[0]);
    let reference = common::reference("llama");
    let prompts = reference["prompts"].as_array().unwrap();
    let dir = common::fixtures().join("llama");
    let mut cases = Vec::new();
    for (variant, adapter) in [("base", None), ("a2_r16_all", Some(dir.join("adapters/a2_r16_all")))] {
        for i in [0, 4] {
            let follow = common::ids(&reference["variants"][variant]["results"][i]["greedy_new_tokens"]);
            cases.push(Case {
                name: format!("{variant} p{i}"),
                prompt_ids: common::ids(&prompts[i]["token_ids"]),
                follow,
                rows: None,
                adapter: adapter.clone(),
            });
        }
    }
    let results = run_cases(&model, &cases, RowDType::F32).unwrap();
    for (case, got) in cases.iter().zip(&results) {
        let (variant, i) = case.name.split_once(" p").unwrap();
        let (shape, decode) = common::read_npy(&dir.join("logits").join(variant).join(format!("p{i}_decode.npy")));
        assert_eq!(got.logits.len(), shape[0], "{}", case.name);
        for (k, row) in got.logits.iter().enumerate() {
            let err = max_abs_diff(row, &decode[k * shape[1]..(k + 1) * shape[1]]);
            assert!(err <= LOGIT_TOL, "{} row {k}: differs from the reference by {err}", case.name);
        }
    }
    // Tokens the model would not choose: each row is the prompt-plus-prefix's last logits.
    let prompt = common::ids(&prompts[0]["token_ids"]);
    let follow = vec![7, 7, 300, 11];
    let forced =
        run_cases(&model, &[Case { name: "forced".into(), prompt_ids: prompt.clone(), follow: follow.clone(), rows: None, adapter: None }], RowDType::F32)
            .unwrap();
    let greedy = scoring::greedy_logits(&model, &prompt, 4, 16, RowDType::F32, None).unwrap();
    assert!(max_abs_diff(&forced[0].logits[1], &greedy[1]) > 1e-3, "the fed token changed nothing");
    for k in 1..4 {
        let extended: Vec<u32> = prompt.iter().chain(&follow[..k]).copied().collect();
        let alone = scoring::greedy_logits(&model, &extended, 1, 16, RowDType::F32, None).unwrap();
        let err = max_abs_diff(&forced[0].logits[k], &alone[0]);
        assert!(err <= LOGIT_TOL, "row {k} is not the logits after the fed prefix ({err})");
    }
}

/// Logits with the KV pool in bf16 (`--kv-dtype bf16`) against transformers' (f32 cache): the
/// rounding of keys and values moves them by at most this much on the reference fixtures.
const BF16_KV_LOGIT_TOL: f32 = 5e-3;

/// With a bf16 KV pool every step's logits stay within [`BF16_KV_LOGIT_TOL`] of transformers',
/// yet differ from the f32 pool's (the values really are rounded), and the same pool bytes hold
/// twice the pages.
#[test]
fn bf16_kv_pool_logits_are_close_to_reference_and_the_pool_holds_twice_the_tokens() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    let mut worst = 0f32;
    for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = common::ids(&p["token_ids"]);
        let dir = common::fixtures().join(v.arch).join("logits").join(v.name);
        let (shape, decode) = common::read_npy(&dir.join(format!("p{i}_decode.npy")));
        let half = scoring::greedy_logits(&model, &prompt, shape[0], 16, RowDType::Bf16, None).unwrap();
        let full = scoring::greedy_logits(&model, &prompt, shape[0], 16, RowDType::F32, None).unwrap();
        assert!(max_abs_diff(&half[1], &full[1]) > 0.0, "prompt {i}: bf16 pages gave the f32 logits exactly");
        for (k, row) in half.iter().enumerate() {
            worst = worst.max(max_abs_diff(row, &decode[k * shape[1]..(k + 1) * shape[1]]));
        }
    }
    eprintln!("bf16 KV: largest logit difference from transformers {worst}");
    assert!(worst <= BF16_KV_LOGIT_TOL, "bf16 KV logits differ from transformers' by {worst}");
    let pages = |kv_dtype| {
        let config = EngineConfig { kv_dtype, pool_bytes: 1 << 20, ..EngineConfig::default() };
        Engine::new(model.clone(), tok.clone(), config).unwrap().pool_stats().total
    };
    assert_eq!(pages(RowDType::Bf16), 2 * pages(RowDType::F32));
}

/// With a bf16 KV pool, all prompts in one continuous batch (with chunked prefills) give the
/// same tokens as one at a time: rounding on write does not depend on the batch.
#[test]
fn bf16_kv_batched_generation_equals_one_by_one() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    batched_equals_alone(v, &model, &tok, RowDType::Bf16);
}

/// The reference prompts of `v`, all in one continuous batch of 7 tokens a step (chunked
/// prefills), give each the 16 greedy tokens it gets alone.
fn batched_equals_alone(v: &Variant, model: &Arc<Model<CpuBackend>>, tok: &Arc<Tokenizer>, kv_dtype: RowDType) {
    let reference = common::reference(v.arch);
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).collect();
    let config = |budget| EngineConfig { kv_dtype, max_batch_tokens: budget, block_size: 4, ..EngineConfig::default() };
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut engine = Engine::new(model.clone(), tok.clone(), config(2048)).unwrap();
            engine.add(greedy_request(model, p.clone(), 16)).unwrap();
            engine.run_to_completion().unwrap().remove(0).tokens
        })
        .collect();
    let mut engine = Engine::new(model.clone(), tok.clone(), config(7)).unwrap();
    for p in &prompts {
        engine.add(greedy_request(model, p.clone(), 16)).unwrap();
    }
    let done = engine.run_to_completion().unwrap();
    for (i, c) in done.iter().enumerate() {
        assert_eq!(c.tokens, alone[i], "prompt {i}");
    }
}

/// Logits of the bf16 checkpoints with bf16 matmul inputs (`--matmul-dtype bf16`) against
/// transformers' (which multiplies the same bf16 weights in f32): rounding the activations at
/// each matmul moves them by at most this much on the reference fixtures.
const BF16_MATMUL_LOGIT_TOL: f32 = 1e-2;

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
}

/// With bf16 matmul inputs every step's logits stay within [`BF16_MATMUL_LOGIT_TOL`] of
/// transformers', yet differ from the exact path's (the inputs really are rounded); on the
/// bf16 dot product (AVX-512 BF16, Arm's BF16) where this CPU has one.
#[test]
fn bf16_matmul_inputs_keep_logits_close_to_reference() {
    let backend = CpuBackend::new().with_matmul_inputs(MatmulInputs::Bf16);
    eprintln!("kernels: {}", backend.describe());
    for v in VARIANTS.iter().filter(|v| v.dir == "model-bf16") {
        let (model, _) = load_on(v, backend.clone());
        let (exact, _) = load(v);
        let reference = common::reference(v.arch);
        let (mut worst, mut compared) = (0f32, 0);
        for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
            let prompt = common::ids(&p["token_ids"]);
            let dir = common::fixtures().join(v.arch).join("logits").join(v.name);
            let (shape, decode) = common::read_npy(&dir.join(format!("p{i}_decode.npy")));
            let rounded = scoring::greedy_logits(&model, &prompt, shape[0], 16, RowDType::F32, None).unwrap();
            let full = scoring::greedy_logits(&exact, &prompt, shape[0], 16, RowDType::F32, None).unwrap();
            assert!(max_abs_diff(&rounded[0], &full[0]) > 0.0, "{} prompt {i}: bf16 inputs gave the exact logits", v.arch);
            // Row k's context holds the tokens chosen at rows 0..k: once a near tie picks
            // another token than transformers did, later rows see other text, so compare up to
            // and including that row.
            for (k, row) in rounded.iter().enumerate() {
                let want = &decode[k * shape[1]..(k + 1) * shape[1]];
                worst = worst.max(max_abs_diff(row, want));
                compared += 1;
                if argmax(row) != argmax(want) {
                    break;
                }
            }
        }
        assert!(compared >= 32, "{}: only {compared} steps compared", v.arch);
        eprintln!("{} bf16 matmul inputs: largest logit difference from transformers {worst} over {compared} steps", v.arch);
        assert!(worst <= BF16_MATMUL_LOGIT_TOL, "{}: bf16 matmul inputs move the logits by {worst}", v.arch);
    }
}

/// With bf16 matmul inputs, all prompts in one continuous batch (with chunked prefills) give
/// the same tokens as one at a time: the rounding and the dot products do not depend on the
/// batch.
#[test]
fn bf16_matmul_batched_generation_equals_one_by_one() {
    let v = &VARIANTS[1];
    let (model, tok) = load_on(v, CpuBackend::new().with_matmul_inputs(MatmulInputs::Bf16));
    batched_equals_alone(v, &model, &tok, RowDType::F32);
}

/// The engine, one request at a time, reproduces transformers' 16 greedy tokens exactly.
#[test]
fn greedy_tokens_match_reference_one_by_one() {
    for v in &VARIANTS {
        let (model, tok) = load(v);
        let reference = common::reference(v.arch);
        for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
            let mut engine = Engine::new(model.clone(), tok.clone(), EngineConfig::default()).unwrap();
            engine.add(greedy_request(&model, common::ids(&p["token_ids"]), 16)).unwrap();
            let done = engine.run_to_completion().unwrap();
            let expected = common::ids(&reference["variants"][v.name]["results"][i]["greedy_new_tokens"]);
            assert_eq!(done[0].tokens, expected, "{} {} prompt {i}", v.arch, v.name);
        }
    }
}

/// All prompts in one continuous batch (prefills of different lengths mixed with decodes, and
/// with prompts split into chunks by a small token budget) give the same tokens as one by one.
#[test]
fn batched_generation_equals_one_by_one() {
    for v in VARIANTS.iter().filter(|v| v.name == "base") {
        let (model, tok) = load(v);
        let reference = common::reference(v.arch);
        let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).collect();
        for budget in [2048, 7] {
            let config = EngineConfig { max_batch_tokens: budget, block_size: 4, ..EngineConfig::default() };
            let mut engine = Engine::new(model.clone(), tok.clone(), config).unwrap();
            for p in &prompts {
                engine.add(greedy_request(&model, p.clone(), 16)).unwrap();
            }
            let done = engine.run_to_completion().unwrap();
            assert_eq!(done.len(), prompts.len());
            for (i, c) in done.iter().enumerate() {
                let expected = common::ids(&reference["variants"]["base"]["results"][i]["greedy_new_tokens"]);
                assert_eq!(c.tokens, expected, "{} prompt {i}, budget {budget}", v.arch);
            }
        }
    }
}

/// A pool with room for only part of the batch: sequences are preempted when the pool cannot
/// give them their next block, recompute when they resume, and still produce exactly the tokens
/// of an unconstrained run, greedy and sampled alike; every page comes back.
#[test]
fn preempted_sequences_resume_with_identical_output() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    // The short prompts: all of them start together, then outgrow the pool as they decode.
    let (index, prompts): (Vec<usize>, Vec<Vec<u32>>) =
        reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).enumerate().filter(|(_, p)| p.len() < 100).unzip();
    assert!(prompts.len() >= 4);
    let new_tokens = 24;
    let block = 4;
    let page_bytes = model.kv_layout(block, RowDType::F32).page_bytes();
    let blocks_needed: usize = prompts.iter().map(|p| (p.len() + new_tokens).div_ceil(block)).sum();
    let largest = prompts.iter().map(|p| (p.len() + new_tokens).div_ceil(block)).max().unwrap();
    let requests = |sampled: bool| -> Vec<loraplex::request::ValidRequest> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let sampling = if sampled {
                    SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(7 + i as u64), ..SamplingParams::greedy() }
                } else {
                    SamplingParams::greedy()
                };
                let stop = StopConditions { max_new_tokens: new_tokens as u32, ignore_eos: true, ..Default::default() };
                GenerationRequest { prompt: p.clone(), sampling, stop, adapter: None, n: 1, grammar: None }.validate(model.config()).unwrap()
            })
            .collect()
    };
    for sampled in [false, true] {
        let run = |pool_blocks: usize| {
            let config = EngineConfig { block_size: block, pool_bytes: pool_blocks * page_bytes, ..EngineConfig::default() };
            let mut engine = Engine::new(model.clone(), tok.clone(), config).unwrap();
            for r in requests(sampled) {
                engine.add(r).unwrap();
            }
            let done = engine.run_to_completion().unwrap();
            all_pages_returned(&engine.pool_stats());
            (done.into_iter().map(|c| c.tokens).collect::<Vec<_>>(), engine.preemptions())
        };
        let (free, none) = run(blocks_needed * 2);
        assert_eq!(none, 0);
        let (tight, preempted) = run((blocks_needed / 2).max(largest));
        assert!(preempted > 0, "half the pool the batch needs must force preemption");
        assert_eq!(tight, free, "sampled={sampled}: outputs differ after {preempted} preemptions");
        if !sampled {
            for (i, tokens) in free.iter().enumerate() {
                let expected = common::ids(&reference["variants"]["base"]["results"][index[i]]["greedy_new_tokens"]);
                let n = expected.len().min(tokens.len());
                assert_eq!(tokens[..n], expected[..n], "prompt {}", index[i]);
            }
        }
    }
}

/// Requests that arrive while others are mid-generation join the running batch and still get
/// exactly their one-by-one tokens.
#[test]
fn late_arrivals_join_a_running_batch() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).collect();
    let mut engine = Engine::new(model.clone(), tok, EngineConfig::default()).unwrap();
    let mut got: std::collections::HashMap<_, Vec<u32>> = Default::default();
    let mut ids = Vec::new();
    for p in &prompts {
        ids.push(engine.add(greedy_request(&model, p.clone(), 16)).unwrap());
        for _ in 0..3 {
            for e in engine.step().unwrap() {
                got.entry(e.seq).or_default().push(e.token);
            }
        }
    }
    while engine.has_work() {
        for e in engine.step().unwrap() {
            got.entry(e.seq).or_default().push(e.token);
        }
    }
    for (i, id) in ids.iter().enumerate() {
        let expected = common::ids(&reference["variants"]["base"]["results"][i]["greedy_new_tokens"]);
        assert_eq!(got[id], expected, "prompt {i}");
    }
    all_pages_returned(&engine.pool_stats());
}

/// Asking for logprobs takes the host sampler instead of the device argmax: same tokens, and
/// each token is the most likely entry of its own top logprobs.
#[test]
fn greedy_with_logprobs_agrees_with_device_argmax() {
    let v = &VARIANTS[2];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let mut req = greedy_request(&model, common::ids(&p["token_ids"]), 16).into_inner();
        req.sampling.logprobs = Some(3);
        let mut engine = Engine::new(model.clone(), tok.clone(), EngineConfig::default()).unwrap();
        engine.add(req.validate(model.config()).unwrap()).unwrap();
        let done = engine.run_to_completion().unwrap();
        let expected = common::ids(&reference["variants"]["base"]["results"][i]["greedy_new_tokens"]);
        assert_eq!(done[0].tokens, expected, "prompt {i}");
        for lp in &done[0].logprobs {
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0].0, lp.token);
            assert_eq!(Some(lp.top[0].1), lp.logprob);
        }
    }
}

/// Stop strings cut the text before the match; stop tokens end the sequence without text.
#[test]
fn stop_strings_and_stop_tokens_end_generation() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    let prompt = common::ids(&reference["prompts"][0]["token_ids"]);
    let expected_tokens = common::ids(&reference["variants"]["base"]["results"][0]["greedy_new_tokens"]);
    let full_text = reference["variants"]["base"]["results"][0]["greedy_text"].as_str().unwrap().to_string();
    let run = |stop: StopConditions| {
        let req = GenerationRequest { prompt: prompt.clone(), sampling: SamplingParams::greedy(), stop, adapter: None, n: 1, grammar: None };
        let mut engine = Engine::new(model.clone(), tok.clone(), EngineConfig::default()).unwrap();
        engine.add(req.validate(model.config()).unwrap()).unwrap();
        engine.run_to_completion().unwrap().remove(0)
    };
    let all = run(StopConditions { max_new_tokens: 16, ignore_eos: true, ..Default::default() });
    assert_eq!(all.text, full_text);
    assert_eq!(all.finish_reason.as_str(), "length");

    let cut = full_text.find("them").unwrap();
    let stopped = run(StopConditions { max_new_tokens: 16, stop_strings: vec!["them".into()], ..Default::default() });
    assert_eq!(stopped.text, full_text[..cut]);
    assert_eq!(stopped.finish_reason.as_str(), "stop");
    assert!(stopped.tokens.len() < 16);

    // The fourth generated token as a stop token: three tokens of text, four tokens generated.
    let stop_id = expected_tokens[3];
    let first = expected_tokens.iter().position(|&t| t == stop_id).unwrap();
    let by_token = run(StopConditions { max_new_tokens: 16, stop_token_ids: vec![stop_id], ..Default::default() });
    assert_eq!(by_token.tokens, expected_tokens[..=first]);
    assert_eq!(by_token.text, tok.decode(&expected_tokens[..first], true).unwrap());
    assert_eq!(by_token.finish_reason.as_str(), "stop");
}

/// A cancelled sequence leaves at once, its pages return to the pool, and the others go on
/// with exactly their one-by-one tokens.
#[test]
fn cancel_frees_pages_and_leaves_the_others_untouched() {
    let v = &VARIANTS[0];
    let (model, tok) = load(v);
    let reference = common::reference(v.arch);
    let prompts: Vec<Vec<u32>> = reference["prompts"].as_array().unwrap().iter().map(|p| common::ids(&p["token_ids"])).collect();
    let mut engine = Engine::new(model.clone(), tok, EngineConfig::default()).unwrap();
    let total = engine.pool_stats().total;
    let keep = engine.add(greedy_request(&model, prompts[0].clone(), 16)).unwrap();
    let gone = engine.add(greedy_request(&model, prompts[1].clone(), 16)).unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(engine.step().unwrap().into_iter().filter(|e| e.seq == keep).map(|e| e.token));
    }
    let before = engine.pool_stats();
    assert!(engine.cancel(gone));
    assert!(!engine.cancel(gone), "already gone");
    let after = engine.pool_stats();
    assert!(after.kv < before.kv, "its pages came back at once");
    assert!(after.free + after.reclaimable > before.free + before.reclaimable);
    while engine.has_work() {
        for e in engine.step().unwrap() {
            assert_ne!(e.seq, gone);
            got.push(e.token);
        }
    }
    assert_eq!(got, common::ids(&reference["variants"]["base"]["results"][0]["greedy_new_tokens"]));
    all_pages_returned(&engine.pool_stats());
    assert_eq!(engine.pool_stats().total, total);
}

/// Nothing is held once every request is done: each page is free or an unpinned cached block.
fn all_pages_returned(stats: &loraplex::memory::PoolStats) {
    assert_eq!(stats.kv, 0, "every KV page returned: {stats:?}");
    assert_eq!(stats.free + stats.reclaimable, stats.total, "nothing left pinned: {stats:?}");
}
