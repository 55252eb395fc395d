//! A step in which one sequence fails: that sequence ends with its error, the others in the
//! batch go on, and the engine keeps serving.

use std::sync::Arc;

use loraplex_kernels::cpu::CpuBackend;

use super::*;
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::synth::{Preset, SynthOptions};

fn request(model: &Model<CpuBackend>, first: u32, max_new_tokens: u32) -> ValidRequest {
    let stop = StopConditions { max_new_tokens, ignore_eos: true, ..Default::default() };
    GenerationRequest { prompt: vec![first, 7, 9], sampling: SamplingParams::greedy(), stop, adapter: None, n: 1 }.validate(model.config()).unwrap()
}

#[test]
fn a_sequence_that_fails_inside_a_step_ends_alone_and_the_batch_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    crate::synth::synthesize_model(&SynthOptions { out: m.clone(), preset: Preset::Tiny, seed: 0, dtype: crate::synth::FileDType::F32, kv_heads: None })
        .unwrap();
    // A tokenizer with fewer tokens than the model has logits: a sequence whose next token is
    // one it cannot decode fails, inside the step.
    const KNOWN: u32 = 300;
    std::fs::write(m.join("tokenizer.json"), crate::synth::tokenizer::tokenizer_json(KNOWN as usize).unwrap()).unwrap();
    let model = Arc::new(crate::model::load(Arc::new(CpuBackend::new()), &m).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_dir(&m).unwrap());
    let config = EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() };
    let mut engine = Engine::new(model.clone(), tokenizer.clone(), config).unwrap();

    // Prompts whose greedy first token the tokenizer knows, and one whose it does not.
    let first_token = |first: u32| {
        let mut e = Engine::new(model.clone(), tokenizer.clone(), EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() }).unwrap();
        e.add(request(&model, first, 1)).unwrap();
        let events = e.step().unwrap();
        (events.first().map(|ev| ev.token), e.take_failures())
    };
    let mut good = Vec::new();
    let mut bad = None;
    for first in 10..200 {
        match first_token(first) {
            (Some(t), f) if t < KNOWN && f.is_empty() => good.push(first),
            (None, f) if f.len() == 1 => bad = bad.or(Some(first)),
            _ => {}
        }
        if good.len() >= 2 && bad.is_some() {
            break;
        }
    }
    let bad = bad.expect("a prompt whose first token the tokenizer cannot decode");
    assert!(good.len() >= 2, "{good:?}");

    // All three in one batch: the bad one fails, the others get their token.
    let a = engine.add(request(&model, good[0], 1)).unwrap();
    let broken = engine.add(request(&model, bad, 8)).unwrap();
    let b = engine.add(request(&model, good[1], 1)).unwrap();
    let events = engine.step().expect("the step itself succeeds");
    let failures = engine.take_failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].seq, broken);
    assert!(matches!(&failures[0].error, SeqError::Failed(why) if why.contains("vocabulary")), "{:?}", failures[0].error);
    let done: Vec<SeqId> = events.iter().filter(|e| e.finish.is_some()).map(|e| e.seq).collect();
    assert_eq!(done, [a, b]);
    assert!(!engine.has_work(), "the failed sequence left the engine and gave its pages back");
    assert_eq!(engine.pool_stats().kv, 0);
    // And the engine serves on.
    engine.add(request(&model, good[0], 1)).unwrap();
    assert_eq!(engine.step().unwrap().len(), 1);
}
