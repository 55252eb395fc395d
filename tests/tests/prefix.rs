//! The prefix cache through the engine: who may reuse whose blocks, and that reuse never
//! changes a token. Samples of one prompt share its blocks.

mod common;

use std::sync::Arc;

use loraplex::engine::{Completion, Engine, EngineConfig};
use loraplex::memory::AdapterRef;
use loraplex::model::{self, Model};
use loraplex::request::{GenerationRequest, StopConditions, ValidRequest};
use loraplex::sampling::SamplingParams;
use loraplex::scheduler::{Placement, TenantId};
use loraplex::tokenizer::Tokenizer;
use loraplex_kernels::cpu::CpuBackend;

/// The reference prompt with 300 tokens: 18 full blocks of 16, reusable up to token 288.
const LONG: usize = 5;
const REUSABLE: usize = 288;

fn load() -> (Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
    let dir = common::fixtures().join("llama").join("model-f32");
    let model = model::load(Arc::new(CpuBackend::new()), &dir).unwrap();
    (Arc::new(model), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
}

fn prompt(i: usize) -> Vec<u32> {
    common::ids(&common::reference("llama")["prompts"][i]["token_ids"])
}

fn expected(variant: &str, i: usize) -> Vec<u32> {
    common::ids(&common::reference("llama")["variants"][variant]["results"][i]["greedy_new_tokens"])
}

fn adapter(key: &str, name: &str) -> AdapterRef {
    AdapterRef::new(key, common::fixtures().join("llama").join("adapters").join(name))
}

fn request(model: &Model<CpuBackend>, prompt: Vec<u32>, adapter: Option<AdapterRef>, sampling: SamplingParams, n: u32) -> ValidRequest {
    let stop = StopConditions { max_new_tokens: 16, ignore_eos: true, ..Default::default() };
    GenerationRequest { prompt, sampling, stop, adapter, n, grammar: None }.validate(model.config()).unwrap()
}

fn tenant(name: &str) -> Placement {
    Placement::tenant(TenantId::new(name), 1.0)
}

/// Runs one request to the end; returns its samples.
fn run(engine: &mut Engine<CpuBackend>, req: ValidRequest, placement: Placement) -> Vec<Completion> {
    engine.add_placed(req, placement).unwrap();
    engine.run_to_completion().unwrap()
}

fn cached(c: &Completion) -> usize {
    c.usage.expect("a finished sequence reports its usage").cached_prompt_tokens
}

#[test]
fn a_hit_skips_the_cached_prompt_and_gives_the_same_tokens() {
    let (model, tok) = load();
    let mut engine = Engine::new(model.clone(), tok.clone(), EngineConfig::default()).unwrap();
    let greedy = SamplingParams::greedy;
    let miss = run(&mut engine, request(&model, prompt(LONG), None, greedy(), 1), tenant("acme"));
    assert_eq!((cached(&miss[0]), miss[0].tokens.clone()), (0, expected("base", LONG)));
    assert!(engine.pool_stats().cached >= REUSABLE / 16, "the prompt's full blocks stay cached: {:?}", engine.pool_stats());

    let hit = run(&mut engine, request(&model, prompt(LONG), None, greedy(), 1), tenant("acme"));
    assert_eq!(cached(&hit[0]), REUSABLE, "all but the last partial block is reused");
    assert_eq!(hit[0].tokens, miss[0].tokens, "a hit gives the same tokens as a miss");
    assert_eq!(hit[0].usage.unwrap().prompt_tokens, 300);

    // A longer prompt that starts with the cached one reuses its blocks and computes the rest;
    // its tokens equal those of an engine that caches nothing.
    let mut longer = prompt(LONG);
    longer.extend(prompt(4));
    let extended = run(&mut engine, request(&model, longer.clone(), None, greedy(), 1), tenant("acme"));
    assert_eq!(cached(&extended[0]), REUSABLE);
    let mut cold = Engine::new(model.clone(), tok, EngineConfig { prefix_cache: false, ..EngineConfig::default() }).unwrap();
    let reference = run(&mut cold, request(&model, longer, None, greedy(), 1), tenant("acme"));
    assert_eq!(cached(&reference[0]), 0, "nothing is reused with the cache off");
    assert_eq!(extended[0].tokens, reference[0].tokens);
    assert!(engine.prefix_stats().hits >= 2 * (REUSABLE as u64 / 16));
    let stats = engine.pool_stats();
    assert_eq!((stats.kv, stats.free + stats.reclaimable), (0, stats.total), "nothing left pinned");
}

/// The same tokens under another tenant, another adapter or another version of the same
/// adapter never reuse a block; the same tenant and adapter again does, with PEFT's tokens.
#[test]
fn other_tenants_adapters_and_versions_never_hit() {
    let (model, tok) = load();
    let mut engine = Engine::new(model.clone(), tok, EngineConfig::default()).unwrap();
    let greedy = SamplingParams::greedy;
    let go = |engine: &mut Engine<CpuBackend>, who: &str, a: Option<AdapterRef>| {
        let done = run(engine, request(&model, prompt(LONG), a, greedy(), 1), tenant(who));
        (cached(&done[0]), done[0].tokens.clone())
    };
    let base = expected("base", LONG);
    let lora = expected("a1_r8_qv", LONG);
    assert_eq!(go(&mut engine, "acme", None), (0, base.clone()));
    assert_eq!(go(&mut engine, "globex", None), (0, base.clone()), "another tenant");
    assert_eq!(go(&mut engine, "acme", Some(adapter("acme/support@1", "a1_r8_qv"))), (0, lora.clone()), "with an adapter");
    assert_eq!(go(&mut engine, "acme", Some(adapter("acme/support@2", "a1_r8_qv"))), (0, lora.clone()), "another version");
    assert_eq!(go(&mut engine, "acme", Some(adapter("acme/other@1", "a2_r16_all"))).0, 0, "another adapter");
    assert_eq!(go(&mut engine, "globex", Some(adapter("acme/support@1", "a1_r8_qv"))), (0, lora.clone()), "another tenant, same adapter");
    assert_eq!(go(&mut engine, "acme", Some(adapter("acme/support@1", "a1_r8_qv"))), (REUSABLE, lora), "the same again hits");
    assert_eq!(go(&mut engine, "acme", None), (REUSABLE, base), "so does the base model");

    // A chosen namespace is shared by whoever names it, and is apart from every tenant's own.
    let shared = |who: &str| Placement { cache_namespace: Some("handbook".into()), ..tenant(who) };
    let mut once = |who: &str| {
        let done = run(&mut engine, request(&model, prompt(LONG), None, greedy(), 1), shared(who));
        cached(&done[0])
    };
    assert_eq!(once("acme"), 0, "a namespace is not the tenant's own");
    assert_eq!(once("globex"), REUSABLE, "tenants that name one namespace share it");
}

/// `n` samples split off once the prompt is computed: they share its full blocks, each gets a
/// copy of the partly filled one, and each draws exactly what a lone request with its seed
/// would.
#[test]
fn samples_share_the_prompt_blocks_and_match_lone_requests() {
    let (model, tok) = load();
    let config = EngineConfig { prefix_cache: false, ..EngineConfig::default() };
    let mut engine = Engine::new(model.clone(), tok, config).unwrap();

    let greedy = run(&mut engine, request(&model, prompt(LONG), None, SamplingParams::greedy(), 3), tenant("acme"));
    assert_eq!(greedy.len(), 3);
    for c in &greedy {
        assert_eq!(c.tokens, expected("base", LONG));
        assert_eq!(cached(c), if c.seq == greedy[0].seq { 0 } else { 300 }, "siblings reuse the whole prompt");
    }

    let sampling = SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(7), ..SamplingParams::greedy() };
    let id = engine.add_placed(request(&model, prompt(LONG), None, sampling.clone(), 4), tenant("acme")).unwrap();
    // The first step prefills the 300-token prompt and splits the samples off.
    let first = engine.step().unwrap();
    assert_eq!(first.iter().map(|e| e.seq.0 - id.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    let stats = engine.pool_stats();
    assert_eq!(stats.kv + stats.cached, 19 + 3, "18 shared full blocks, and a copy of the 19th per extra sample: {stats:?}");
    let together = engine.run_to_completion().unwrap();
    assert_eq!(together.len(), 4);
    let mut distinct = std::collections::HashSet::new();
    for (i, c) in together.iter().enumerate() {
        let alone = SamplingParams { seed: Some(7 + i as u64), ..sampling.clone() };
        let alone = run(&mut engine, request(&model, prompt(LONG), None, alone, 1), tenant("acme"));
        let mut want = vec![first[i].token];
        want.extend(&c.tokens);
        assert_eq!(want, alone[0].tokens, "sample {i}");
        distinct.insert(alone[0].tokens.clone());
    }
    assert!(distinct.len() > 1, "different seeds draw different samples");
    let stats = engine.pool_stats();
    assert_eq!((stats.kv, stats.free + stats.reclaimable), (0, stats.total), "nothing left pinned");
}
