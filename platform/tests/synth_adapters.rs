//! `loraplex synth --adapters`: random PEFT adapters next to a synthesized model.

use std::path::Path;
use std::process::{Command, Output};

fn loraplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loraplex")).args(args).output().expect("the binary runs")
}

fn config(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).expect("config written");
    serde_json::from_str(&text).expect("config is JSON")
}

#[test]
fn writes_the_requested_adapters_beside_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let o = loraplex(&["synth", "--out", out.to_str().unwrap(), "--preset", "tiny", "--adapters", "3", "--ranks", "4,8", "--targets", "qv"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("model.safetensors").is_file());
    let adapters = out.join("adapters");
    assert!(stdout.contains("wrote 3 LoRA adapters"), "{stdout}");
    assert!(stdout.contains(adapters.to_str().unwrap()), "{stdout}");

    let mut names: Vec<String> = std::fs::read_dir(&adapters).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["lora-000-r4-qv", "lora-001-r8-qv", "lora-002-r4-qv"]);
    for (name, rank) in names.iter().zip([4, 8, 4]) {
        let dir = adapters.join(name);
        assert!(dir.join("adapter_model.safetensors").is_file(), "{name}");
        let c = config(&dir);
        assert_eq!(c["peft_type"], "LORA", "{name}");
        assert_eq!(c["r"], rank, "{name}");
        assert_eq!(c["lora_alpha"], 2 * rank, "{name}");
        assert_eq!(c["target_modules"], serde_json::json!(["q_proj", "v_proj"]), "{name}");
    }
}

#[test]
fn adapters_out_and_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let elsewhere = tmp.path().join("loras");
    let o = loraplex(&["synth", "--out", out.to_str().unwrap(), "--adapters", "1", "--ranks", "16", "--adapters-out", elsewhere.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.join("adapters").exists());
    let c = config(&elsewhere.join("lora-000-r16-all"));
    assert_eq!(c["target_modules"].as_array().map(Vec::len), Some(7));

    // Without --adapters nothing but the model is written.
    let plain = tmp.path().join("plain");
    let o = loraplex(&["synth", "--out", plain.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!plain.join("adapters").exists());
    assert!(!String::from_utf8_lossy(&o.stdout).contains("LoRA"));
}

#[test]
fn bad_ranks_fail_with_a_message_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    for (ranks, needle) in [("0", "rank 0"), ("8,64", "at most 32")] {
        let out = tmp.path().join(format!("model-{ranks}"));
        let o = loraplex(&["synth", "--out", out.to_str().unwrap(), "--adapters", "2", "--ranks", ranks]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--ranks {ranks} was accepted");
        assert!(stderr.contains(needle), "--ranks {ranks}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!out.exists(), "--ranks {ranks} still wrote {}", out.display());
    }
}
