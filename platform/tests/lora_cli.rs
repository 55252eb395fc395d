//! `loraplex generate` with adapters: one request with `--adapter`, and `--batch` files mixing
//! adapters and the base model in one continuous batch.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference")
}

fn reference(arch: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(arch).join("reference.json")).unwrap()).unwrap()
}

fn loraplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loraplex")).args(args).output().expect("the binary runs")
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn model(arch: &str) -> String {
    fixtures().join(arch).join("model-f32").display().to_string()
}

fn adapter(arch: &str, name: &str) -> String {
    fixtures().join(arch).join("adapters").join(name).display().to_string()
}

fn write_batch(lines: &[serde_json::Value]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
    f
}

fn assert_fails_with(o: &Output, needles: &[&str]) {
    assert!(!o.status.success(), "expected failure, stdout: {}", String::from_utf8_lossy(&o.stdout));
    let err = String::from_utf8_lossy(&o.stderr);
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn generate_with_an_adapter_gives_pefts_tokens() {
    let r = reference("qwen2");
    let prompt: Vec<String> = ids(&r["prompts"][1]["token_ids"]).iter().map(u64::to_string).collect();
    let o = loraplex(&[
        "generate",
        "--model",
        &model("qwen2"),
        "--adapter",
        &adapter("qwen2", "a3_r4_rslora"),
        "--prompt-ids",
        &prompt.join(","),
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids(&out["tokens"]), ids(&r["variants"]["a3_r4_rslora"]["results"][1]["greedy_new_tokens"]));
}

/// Every adapter and the base, every prompt, in one `--batch` run: one output line per input
/// line, in input order, each with exactly the tokens PEFT gives it alone.
#[test]
fn a_mixed_batch_file_runs_together_in_input_order() {
    let r = reference("llama");
    let variants = ["a2_r16_all", "base", "a1_r8_qv", "a3_r4_rslora"];
    let mut lines = Vec::new();
    let mut want = Vec::new();
    for (i, p) in r["prompts"].as_array().unwrap().iter().enumerate() {
        for (k, v) in variants.iter().enumerate() {
            let adapter = if *v == "base" { serde_json::Value::Null } else { adapter("llama", v).into() };
            // Alternate the two prompt forms where the prompt has a text form; the text must
            // tokenize to the same ids.
            let mut line = serde_json::json!({"id": format!("{v}-{i}"), "adapter": adapter, "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": true});
            if k % 2 == 0 || !p["text"].is_string() {
                line["prompt_ids"] = p["token_ids"].clone();
            } else {
                line["prompt"] = p["text"].clone();
            }
            lines.push(line);
            want.push((format!("{v}-{i}"), ids(&r["variants"][v]["results"][i]["greedy_new_tokens"])));
        }
    }
    let file = write_batch(&lines);
    let o = loraplex(&["generate", "--model", &model("llama"), "--batch", file.path().to_str().unwrap(), "--json", "--max-batch-tokens", "13"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out: Vec<serde_json::Value> = String::from_utf8(o.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(out.len(), want.len());
    for (got, (id, tokens)) in out.iter().zip(&want) {
        assert_eq!(got["id"], *id);
        assert_eq!(ids(&got["tokens"]), *tokens, "{id}");
        assert_eq!(got["finish_reason"], "length");
        assert!(got["text"].is_string());
    }
}

#[test]
fn bad_batch_lines_are_refused_with_their_line_number() {
    let m = model("llama");
    let cases: Vec<(serde_json::Value, Vec<&str>)> = vec![
        (serde_json::json!({"id": "x"}), vec!["line 2", "exactly one of"]),
        (serde_json::json!({"id": "x", "prompt": "hi", "temprature": 1.0}), vec!["line 2", "temprature"]),
        (serde_json::json!({"id": "x", "prompt_ids": [1, 99999]}), vec!["line 2", "99999"]),
        (serde_json::json!({"id": "x", "prompt": "hi", "adapter": "/nonexistent/adapter"}), vec!["line 2", "/nonexistent/adapter"]),
    ];
    for (bad, needles) in cases {
        let file = write_batch(&[serde_json::json!({"id": "ok", "prompt": "hello"}), bad]);
        let o = loraplex(&["generate", "--model", &m, "--batch", file.path().to_str().unwrap()]);
        assert_fails_with(&o, &needles);
        assert!(o.stdout.is_empty(), "nothing runs when a line is bad");
    }
}

#[test]
fn broken_adapter_files_and_rank_limits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("llama/adapters/a2_r16_all");
    std::fs::copy(src.join("adapter_config.json"), dir.path().join("adapter_config.json")).unwrap();
    let weights = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), &weights[..weights.len() - 100]).unwrap();
    let o = loraplex(&["generate", "--model", &model("llama"), "--adapter", dir.path().to_str().unwrap(), "--prompt", "hi"]);
    assert_fails_with(&o, &["adapter_model.safetensors"]);

    let wrong_rank_limit =
        loraplex(&["generate", "--model", &model("llama"), "--adapter", &adapter("llama", "a2_r16_all"), "--prompt", "hi", "--max-lora-rank", "8"]);
    assert_fails_with(&wrong_rank_limit, &["rank 16", "8"]);
}
