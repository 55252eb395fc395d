//! The engine's steps over mixed batches: constrained and free rows, device draws beside
//! argmax and host rows. (A sequence whose token cannot be made into text fails in the
//! runtime's text stage: `crate::actors`' tests.)

use std::sync::Arc;

use loraplex_kernels::cpu::CpuBackend;

use super::*;
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::synth::{Preset, SynthOptions};

mod structured {
    //! Constrained and free rows in one batch, with adapters: every constrained output matches
    //! its grammar; every free row gets exactly the tokens it gets alone.

    use std::path::PathBuf;

    use serde_json::json;

    use super::*;
    use crate::grammar::{GrammarCompiler, GrammarLimits, GrammarSpec};
    use crate::memory::AdapterRef;

    fn fixture(path: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference/llama").join(path)
    }

    struct Setup {
        model: Arc<Model<CpuBackend>>,
        tokenizer: Arc<Tokenizer>,
        grammars: GrammarCompiler,
    }

    impl Setup {
        fn new() -> Self {
            let model = Arc::new(crate::model::load(Arc::new(CpuBackend::new()), &fixture("model-f32")).unwrap());
            let tokenizer = Arc::new(Tokenizer::from_dir(&fixture("model-f32")).unwrap());
            let eos = end_tokens(&tokenizer, model.config());
            let grammars = GrammarCompiler::new(tokenizer.clone(), &eos, GrammarLimits::default()).unwrap();
            Self { model, tokenizer, grammars }
        }

        fn engine(&self) -> Engine<CpuBackend> {
            Engine::new(self.model.clone(), self.tokenizer.clone(), EngineConfig { pool_bytes: 32 << 20, ..EngineConfig::default() }).unwrap()
        }

        /// A request: the prompt `text`, an adapter (or none), greedy or seeded sampling, and a
        /// grammar (or none).
        fn request(&self, text: &str, adapter: Option<&str>, seed: Option<u64>, grammar: Option<&GrammarSpec>, max_new_tokens: u32) -> ValidRequest {
            let sampling = match seed {
                None => SamplingParams::greedy(),
                Some(seed) => SamplingParams { temperature: 1.0, seed: Some(seed), ..SamplingParams::default() },
            };
            let stop = StopConditions { max_new_tokens, ..Default::default() };
            GenerationRequest {
                prompt: self.tokenizer.encode(text, true).unwrap(),
                sampling,
                stop,
                adapter: adapter.map(|a| AdapterRef::new(a, fixture(&format!("adapters/{a}")))),
                n: 1,
                grammar: grammar.map(|g| self.grammars.compile(g).unwrap()),
            }
            .validate(self.model.config())
            .unwrap()
        }
    }

    #[test]
    fn constrained_and_free_rows_share_batches_with_adapters() {
        let s = Setup::new();
        let schema = json!({"type": "object", "properties": {
            "label": {"enum": ["spam", "ham"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "maxItems": 3}
        }, "required": ["label", "score", "tags"], "additionalProperties": false});
        let json_spec = GrammarSpec::JsonSchema(schema.clone());
        let regex_spec = GrammarSpec::Regex("[A-Z]{2}-[0-9]{3}".into());
        let choice_spec = GrammarSpec::Choice(vec!["yes".into(), "no".into(), "unsure".into()]);
        // (prompt, adapter, seed, grammar): free and constrained, greedy and sampled, base and adapters.
        type Row<'a> = (&'a str, Option<&'a str>, Option<u64>, Option<&'a GrammarSpec>);
        let rows: Vec<Row<'_>> = vec![
            ("hello world", None, None, None),
            ("classify this message", Some("a1_r8_qv"), None, Some(&json_spec)),
            ("the quick brown fox", Some("a2_r16_all"), None, None),
            ("give me a code", None, Some(3), Some(&regex_spec)),
            ("once upon a time", Some("a3_r4_rslora"), Some(9), None),
            ("is it true", Some("a2_r16_all"), Some(5), Some(&choice_spec)),
            ("another json please", None, Some(11), Some(&json_spec)),
            ("a sampled free row", Some("a1_r8_qv"), Some(21), None),
        ];
        let max_new = 160;
        let alone: Vec<Completion> = rows
            .iter()
            .map(|&(text, adapter, seed, grammar)| {
                let mut e = s.engine();
                e.add(s.request(text, adapter, seed, grammar, max_new)).unwrap();
                e.run_to_completion().unwrap().remove(0)
            })
            .collect();
        let mut e = s.engine();
        for &(text, adapter, seed, grammar) in &rows {
            e.add(s.request(text, adapter, seed, grammar, max_new)).unwrap();
        }
        let together = e.run_to_completion().unwrap();
        assert!(e.take_failures().is_empty());
        let validator = jsonschema::validator_for(&schema).unwrap();
        let code = regex::Regex::new("^[A-Z]{2}-[0-9]{3}$").unwrap();
        for (i, ((row, a), t)) in rows.iter().zip(&alone).zip(&together).enumerate() {
            match row.3 {
                None => assert_eq!(a.tokens, t.tokens, "free row {i} changed in a batch with constrained rows"),
                Some(spec) => {
                    for c in [a, t] {
                        assert_eq!(c.finish_reason, FinishReason::Stop, "row {i} ended by its grammar: {:?}", c.text);
                        match spec {
                            GrammarSpec::JsonSchema(_) => {
                                let v: serde_json::Value = serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("row {i}: {:?}: {e}", c.text));
                                assert!(validator.is_valid(&v), "row {i}: {v}");
                            }
                            GrammarSpec::Regex(_) => assert!(code.is_match(&c.text), "row {i}: {:?}", c.text),
                            _ => assert!(["yes", "no", "unsure"].contains(&c.text.as_str()), "row {i}: {:?}", c.text),
                        }
                    }
                    // Alone or batched, a constrained row is the same (batch invariance holds under masks).
                    assert_eq!(a.tokens, t.tokens, "constrained row {i}");
                }
            }
        }
        // Random weights never make such text by themselves.
        let free = &together[0].text;
        assert!(serde_json::from_str::<serde_json::Value>(free).is_err(), "{free:?}");
    }

    #[test]
    fn ignore_eos_does_not_run_past_a_complete_grammar_and_samples_get_their_own() {
        let s = Setup::new();
        let spec = GrammarSpec::Choice(vec!["alpha".into(), "beta".into()]);
        let mut e = s.engine();
        let mut req = s.request("pick one", None, Some(4), Some(&spec), 64).into_inner();
        req.stop.ignore_eos = true;
        req.n = 4;
        e.add(req.validate(s.model.config()).unwrap()).unwrap();
        let done = e.run_to_completion().unwrap();
        assert_eq!(done.len(), 4);
        for c in &done {
            assert!(c.text == "alpha" || c.text == "beta", "{:?}", c.text);
            assert_eq!(c.finish_reason, FinishReason::Stop);
            assert!(c.tokens.len() < 10, "{:?}", c.tokens);
        }
    }
}

mod device_sampling {
    //! Rows drawn by the backend's `sample_rows` beside argmax rows and rows sampled on the host,
    //! in one batch (the CPU backend standing in for a device).

    use std::collections::HashMap;

    use super::*;

    fn tiny() -> (tempfile::TempDir, Arc<Model<CpuBackend>>, Arc<Tokenizer>) {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m");
        crate::synth::synthesize_model(&SynthOptions { out: m.clone(), preset: Preset::Tiny, seed: 0, dtype: crate::synth::FileDType::F32, kv_heads: None })
            .unwrap();
        let model = Arc::new(crate::model::load(Arc::new(CpuBackend::new()), &m).unwrap());
        let tokenizer = Arc::new(Tokenizer::from_dir(&m).unwrap());
        (dir, model, tokenizer)
    }

    fn engine(model: &Arc<Model<CpuBackend>>, tokenizer: &Arc<Tokenizer>, device: bool) -> Engine<CpuBackend> {
        let mut e = Engine::new(model.clone(), tokenizer.clone(), EngineConfig { pool_bytes: 16 << 20, ..EngineConfig::default() }).unwrap();
        e.set_device_sampling(device);
        e
    }

    fn sampled(model: &Model<CpuBackend>, first: u32, max_new_tokens: u32, sampling: SamplingParams) -> ValidRequest {
        let stop = StopConditions { max_new_tokens, ignore_eos: true, ..Default::default() };
        GenerationRequest { prompt: vec![first, 11, 5, first + 1], sampling, stop, adapter: None, n: 1, grammar: None }.validate(model.config()).unwrap()
    }

    /// Every sequence's tokens, stepping until the engine is idle.
    fn run(e: &mut Engine<CpuBackend>) -> HashMap<SeqId, Vec<u32>> {
        let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
        while e.has_work() {
            for ev in e.step().unwrap() {
                out.entry(ev.seq).or_default().push(ev.token);
            }
        }
        assert!(e.take_failures().is_empty());
        out
    }

    /// With top-k 1 a draw can only be the row's argmax, so each sequence of a batch mixing
    /// greedy rows, device draws and host-sampled rows (seeded, or asking for logprobs) must
    /// continue exactly as it does alone and greedily: a row handed another row's logits or
    /// token would not.
    #[test]
    fn device_draws_sit_beside_argmax_and_host_rows() {
        let (_dir, model, tokenizer) = tiny();
        let top1 = SamplingParams { temperature: 0.7, top_k: 1, ..SamplingParams::default() };
        let kinds = [
            SamplingParams::greedy(),
            top1.clone(),
            SamplingParams { seed: Some(5), ..top1.clone() },
            SamplingParams { logprobs: Some(2), ..top1.clone() },
            top1.clone(),
        ];
        let firsts: Vec<u32> = (0..10).map(|i| 20 + 7 * i).collect();
        let alone: Vec<Vec<u32>> = firsts
            .iter()
            .map(|&f| {
                let mut e = engine(&model, &tokenizer, false);
                let id = e.add(sampled(&model, f, 6, SamplingParams::greedy())).unwrap();
                run(&mut e).remove(&id).unwrap()
            })
            .collect();
        for device in [true, false] {
            let mut e = engine(&model, &tokenizer, device);
            let ids: Vec<SeqId> = firsts.iter().zip(kinds.iter().cycle()).map(|(&f, k)| e.add(sampled(&model, f, 6, k.clone())).unwrap()).collect();
            let got = run(&mut e);
            for (i, id) in ids.iter().enumerate() {
                assert_eq!(got[id], alone[i], "sequence {i} ({:?}), device sampling {device}", kinds[i % kinds.len()]);
            }
            let t = e.step_time();
            // Per token: 4 of 10 rows are plain draws, 2 draws with logprobs, 2 seeded, 2 greedy.
            if device {
                assert_eq!((t.drawn_rows, t.copied_rows, t.logprob_rows), (6 * 6, 2 * 6, 2 * 6), "{t:?}");
            } else {
                assert_eq!((t.drawn_rows, t.copied_rows, t.logprob_rows), (0, 8 * 6, 0), "{t:?}");
            }
        }
    }

    /// Logprobs the device gives (argmax and drawn rows) are the host sampler's: the same
    /// alternatives in the same order, values within rounding, and no row crosses to the host.
    #[test]
    fn logprobs_from_the_device_match_the_host_sampler() {
        let (_dir, model, tokenizer) = tiny();
        let kinds = [
            SamplingParams { logprobs: Some(3), ..SamplingParams::greedy() },
            SamplingParams { logprobs: Some(0), ..SamplingParams::greedy() },
            SamplingParams { temperature: 0.7, top_k: 1, logprobs: Some(5), ..SamplingParams::default() },
            SamplingParams { logprobs: Some(20), ..SamplingParams::greedy() },
        ];
        let events = |device: bool| {
            let mut e = engine(&model, &tokenizer, device);
            let ids: Vec<SeqId> = kinds.iter().enumerate().map(|(i, k)| e.add(sampled(&model, 30 + 9 * i as u32, 5, k.clone())).unwrap()).collect();
            let mut out: HashMap<SeqId, Vec<TokenEvent>> = HashMap::new();
            while e.has_work() {
                for ev in e.step().unwrap() {
                    out.entry(ev.seq).or_default().push(ev);
                }
            }
            (ids.iter().map(|id| out.remove(id).unwrap()).collect::<Vec<_>>(), e.step_time())
        };
        let ((host, ht), (device, dt)) = (events(false), events(true));
        assert_eq!((ht.logprob_rows, ht.copied_rows), (0, 4 * 5), "{ht:?}");
        assert_eq!((dt.logprob_rows, dt.copied_rows, dt.drawn_rows), (4 * 5, 0, 5), "{dt:?}");
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * (1.0 + b.abs());
        for (i, (h, d)) in host.iter().zip(&device).enumerate() {
            assert_eq!(h.len(), 5);
            for (h, d) in h.iter().zip(d) {
                assert_eq!(h.token, d.token, "row {i}");
                assert!(close(h.logprob.unwrap(), d.logprob.unwrap()), "row {i}: {h:?} vs {d:?}");
                assert_eq!(h.top_logprobs.len(), kinds[i].logprobs.unwrap());
                assert_eq!(h.top_logprobs.iter().map(|e| e.0).collect::<Vec<_>>(), d.top_logprobs.iter().map(|e| e.0).collect::<Vec<_>>(), "row {i}");
                assert!(h.top_logprobs.iter().zip(&d.top_logprobs).all(|(a, b)| close(a.1, b.1)), "row {i}: {h:?} vs {d:?}");
            }
        }
    }

    /// Device draws honour their settings: with top-k 3 and a high temperature every first
    /// token is one of the row's 3 most likely, and they are not all the same.
    #[test]
    fn device_draws_keep_to_top_k() {
        let (_dir, model, tokenizer) = tiny();
        let mut e = engine(&model, &tokenizer, false);
        let probe = e.add(sampled(&model, 33, 1, SamplingParams { logprobs: Some(3), ..SamplingParams::greedy() })).unwrap();
        let events = e.step().unwrap();
        let top3: Vec<u32> = events.iter().find(|ev| ev.seq == probe).unwrap().top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(top3.len(), 3);
        let mut e = engine(&model, &tokenizer, true);
        let ids: Vec<SeqId> =
            (0..24).map(|_| e.add(sampled(&model, 33, 1, SamplingParams { temperature: 50.0, top_k: 3, ..SamplingParams::default() })).unwrap()).collect();
        let got = run(&mut e);
        let firsts: Vec<u32> = ids.iter().map(|id| got[id][0]).collect();
        assert!(firsts.iter().all(|t| top3.contains(t)), "{firsts:?} outside {top3:?}");
        assert!(firsts.iter().any(|&t| t != firsts[0]), "24 draws at temperature 50 all gave {}", firsts[0]);
        assert_eq!(e.step_time().drawn_rows, 24);
    }
}
