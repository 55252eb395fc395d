//! `loraplex bench lora` end to end on the tiny model: every scenario runs and is reported,
//! the rounds are counted, and the serving runtime's share of time inside engine steps is a
//! share. What it measures (speed) is not checked.

use loraplex::config::{BenchLoraArgs, Device, MatmulDType};
use loraplex::synth::{FileDType, Preset};

#[test]
fn bench_lora_reports_every_scenario() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench-lora.json");
    let args = BenchLoraArgs {
        preset: Preset::Tiny,
        model_dtype: FileDType::F32,
        matmul_dtype: MatmulDType::F32,
        model: None,
        hub: Default::default(),
        kv_heads: None,
        device: Device::Cpu,
        batch: 4,
        rank: 4,
        adapter_dtype: FileDType::Bf16,
        context: 8,
        // Enough tokens that every request is decoding at once even when the machine is
        // loaded and the requests reach the runtime a few milliseconds apart.
        steps: 16,
        rounds: 2,
        pool_mb: 64,
        out: out.clone(),
        threads: None,
    };
    loraplex::bench::lora::run(&args).unwrap();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let names: Vec<&str> = report["scenarios"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["base", "one", "distinct", "runtime", "naive", "distinct-f32"]);
    assert_eq!(report["rounds"], 2);
    for s in report["scenarios"].as_array().unwrap() {
        let (rate, step, mean) = (s["tokens_per_s"].as_f64().unwrap(), s["step_ms"].as_f64().unwrap(), s["mean_step_ms"].as_f64().unwrap());
        assert!(rate > 0.0 && step > 0.0 && mean > 0.0, "{s}");
    }
    let share = report["runtime_time_in_steps"].as_f64().unwrap();
    assert!(share > 0.0 && share <= 1.0, "the runtime's time inside steps is a share of its run: {share}");
    assert!(report["runtime_over_mean_steps"].as_f64().unwrap() > 0.0);
}
