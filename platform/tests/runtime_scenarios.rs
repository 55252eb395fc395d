//! Every scenario of `loraplex bench runtime`, at a small size on the tiny synthesized model:
//! what each must guarantee (completions, equal outputs, cache hits, B served ahead of A's
//! backlog), not how fast it runs.

use std::time::Duration;

use loraplex::bench::runtime::{self, ChurnOptions, FairnessOptions, PreemptionOptions, PrefixOptions, Setup};
use loraplex::engine::EngineConfig;
use loraplex::synth::{self, Preset, SynthOptions};

fn setup(dir: &tempfile::TempDir) -> Setup {
    let model = dir.path().join("model");
    synth::synthesize_model(&SynthOptions { out: model.clone(), preset: Preset::Tiny, seed: 0, dtype: synth::FileDType::F32, kv_heads: None }).unwrap();
    runtime::load_setup(loraplex_kernels::cpu::CpuBackend::new(), &model, dir.path()).unwrap()
}

fn engine() -> EngineConfig {
    EngineConfig { max_batch_tokens: 128, max_running: 8, pool_bytes: 64 << 20, ..EngineConfig::default() }
}

#[test]
fn fairness_serves_the_steady_tenant_ahead_of_the_flood() {
    let dir = tempfile::tempdir().unwrap();
    let opts = FairnessOptions { engine: engine(), prompt: 32, max_new_tokens: 16, b_requests: 8, b_interval: Duration::from_millis(25), a_factor: 10 };
    let r = runtime::fairness(&setup(&dir), &opts).unwrap();
    assert!(r.b_all_completed, "{r:?}");
    assert_eq!(r.a_requests_sent, (opts.b_requests - 1) * opts.a_factor, "A's requests go out on schedule until B's last: {r:?}");
    assert!(r.a_completed < r.a_requests_sent, "A sent more than the server could take: {r:?}");
    // A's backlog is still queued when B is done: an A request sent before B's last had not
    // started (first come, first served would have started it first).
    assert!(r.b_overtook_a, "B does not wait behind A's backlog: {r:?}");
}

#[test]
fn prefix_hits_reuse_the_system_prompt_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let opts = PrefixOptions { engine: engine(), system: 64, suffix: 8, max_new_tokens: 8, requests: 3 };
    let r = runtime::prefix(&setup(&dir), &opts).unwrap();
    assert_eq!(r.hit_cached_tokens, [64, 64, 64], "{r:?}");
    assert!(r.hit_equals_miss, "{r:?}");
}

#[test]
fn adapter_churn_gives_the_same_tokens_as_all_resident() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ChurnOptions { engine: engine(), adapters: 40, room: 4, rank: 4, requests: 48, prompt: 16, max_new_tokens: 8, zipf: 1.0 };
    let r = runtime::churn(&setup(&dir), &opts).unwrap();
    assert!(r.outputs_equal, "{r:?}");
    assert!(r.distinct_adapters_requested > opts.room, "more adapters than fit were used: {r:?}");
    assert!(r.evictions > 0, "the pool had to evict: {r:?}");
}

#[test]
fn preemption_completes_everything_with_identical_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let opts = PreemptionOptions { engine: engine(), requests: 8, prompt: 16, max_new_tokens: 48, fraction: 0.5 };
    let r = runtime::preemption(&setup(&dir), &opts).unwrap();
    assert!(r.all_completed && r.outputs_equal, "{r:?}");
    assert!(r.preemptions > 0, "half the pool forces preemption: {r:?}");
    assert_eq!(r.pages_given * 2, r.pages_needed);
}
