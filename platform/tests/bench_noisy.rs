//! `loraplex bench noisy-neighbor` end to end on the tiny model at a small size: every pattern
//! runs, A's requests are counted, B's all complete, and the report has a row per phase. What
//! it measures (speed) is not checked.

use std::path::Path;

use loraplex::config::BenchNoisyArgs;
use loraplex::synth::Preset;

#[test]
fn noisy_neighbor_runs_every_pattern_and_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench-noisy.json");
    let args = BenchNoisyArgs {
        preset: Preset::Tiny,
        model_dtype: loraplex::synth::FileDType::Bf16,
        model: None,
        hub: Default::default(),
        patterns: vec!["all".into()],
        b_fraction: 0.15,
        b_requests: 6,
        b_prompt: "text".into(),
        max_tokens: 4,
        capacity_seconds: 1.0,
        a_share: 0.5,
        a_concurrent: 2,
        a_retry_ms: 20,
        // Long enough for the batch pattern's first lines to finish before B is measured on a
        // slow machine (a 2-core Zen 3 ran none within 400 ms with the debug build).
        a_warmup_ms: 1500,
        stalled: 4,
        pin_adapters: 2,
        batch_lines: 400,
        max_running: 4,
        max_batch_tokens: 64,
        serve_args: Vec::new(),
        shared_b: false,
        repeat_alone: false,
        out: out.clone(),
    };
    loraplex::bench::noisy::run_with(&args, Path::new(env!("CARGO_BIN_EXE_loraplex"))).unwrap();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let phases: Vec<&str> = rows.iter().map(|r| r["phase"].as_str().unwrap()).collect();
    assert_eq!(phases, ["alone", "plain", "huge-prompts", "stop-lists", "adapter-configs", "pin-storms", "disconnects", "stalled-bodies", "batch"]);
    for r in rows {
        assert_eq!(r["b"]["failed"], 0, "every request of B completes: {r}");
        assert_eq!(r["b_samples"].as_array().unwrap().len(), 6);
    }
    for r in &rows[1..] {
        assert!(r["a_total"]["sent"].as_u64().unwrap() > 0, "A sent its pattern: {r}");
    }
    // The kinds each pattern alternates between were all sent.
    let kinds = |phase: usize| rows[phase]["a_kinds"].as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(kinds(2).len(), 3, "{:?}", kinds(2));
    assert_eq!(kinds(4).len(), 2, "{:?}", kinds(4));
    // A heavy config within the caps is accepted; one past them is refused.
    let uploads = &rows[4]["a_kinds"];
    assert!(uploads["heavy config (allowed)"]["ok"].as_u64().unwrap() > 0, "{uploads}");
    assert_eq!(uploads["heavy config (over a cap)"]["ok"], 0, "{uploads}");
    // The batch ran some of its lines while B was measured, and was cancelled.
    let batch = &rows[8]["a_kinds"];
    assert!(batch["batch lines"]["ok"].as_u64().unwrap() > 0 && batch["cancel"]["ok"] == 1, "{batch}");
    assert!(report["capacity"]["requests_per_s"].as_f64().unwrap() > 0.0);
}
