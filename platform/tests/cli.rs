//! The `loraplex` binary as a user runs it: outputs, exit codes and error messages.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference")
}

fn loraplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_loraplex")).args(args).output().expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A copy of the f32 llama fixture that a test may break.
fn model_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join("llama/model-f32")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn generate_ids(model: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,307,430,450,497,309,82,299,402"];
    args.extend_from_slice(extra);
    loraplex(&args)
}

fn assert_fails_with(o: &Output, needles: &[&str]) {
    assert!(!o.status.success(), "expected failure, stdout: {}", String::from_utf8_lossy(&o.stdout));
    let err = stderr(o);
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn json_output_matches_the_reference() {
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("qwen2/reference.json")).unwrap()).unwrap();
    let case = &reference["variants"]["base"]["results"][1];
    let prompt: Vec<String> = reference["prompts"][1]["token_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    let o = loraplex(&[
        "generate",
        "--model",
        fixtures().join("qwen2/model-f32").to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(","),
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["prompt_tokens"], prompt.len());
    assert_eq!(out["tokens"], case["greedy_new_tokens"]);
    assert_eq!(out["text"], case["greedy_text"]);
    assert_eq!(out["finish_reason"], "length");
}

#[test]
fn text_prompt_and_chat_go_through_the_tokenizer() {
    let model = fixtures().join("llama/model-f32");
    let o = loraplex(&["generate", "--model", model.to_str().unwrap(), "--prompt", "The quick brown fox", "--max-new-tokens", "3", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["prompt_tokens"], 9, "BOS plus 8 tokens, as transformers encodes it");
    let chat = r#"[{"role": "user", "content": "Hi"}]"#;
    let o =
        loraplex(&["generate", "--model", model.to_str().unwrap(), "--chat", chat, "--max-new-tokens", "2", "--json", "--temperature", "0.7", "--seed", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bad = loraplex(&["generate", "--model", model.to_str().unwrap(), "--chat", "{not json", "--max-new-tokens", "2"]);
    assert_fails_with(&bad, &["--chat"]);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let model = fixtures().join("llama/model-f32");
    let run = |seed: &str| {
        let o = generate_ids(&model, &["--max-new-tokens", "12", "--ignore-eos", "--temperature", "1.0", "--top-p", "0.9", "--seed", seed, "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn missing_and_truncated_files_are_named() {
    let o = generate_ids(Path::new("/nonexistent/model"), &[]);
    assert_fails_with(&o, &["model /nonexistent/model: no such file or directory"]);
    // A directory without a config names the file it lacks.
    let empty = tempfile::tempdir().unwrap();
    let o = generate_ids(empty.path(), &[]);
    assert_fails_with(&o, &["config.json"]);

    let dir = model_copy();
    let weights = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    assert_fails_with(&generate_ids(dir.path(), &[]), &[weights.to_str().unwrap(), "truncated"]);

    std::fs::remove_file(&weights).unwrap();
    assert_fails_with(&generate_ids(dir.path(), &[]), &["model.safetensors"]);

    let dir = model_copy();
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    assert_fails_with(&generate_ids(dir.path(), &[]), &["tokenizer.json"]);
}

#[test]
fn unknown_architecture_is_named() {
    let dir = model_copy();
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("LlamaForCausalLM", "GPTNeoXForCausalLM");
    std::fs::write(&path, text).unwrap();
    assert_fails_with(&generate_ids(dir.path(), &[]), &["config.json", "GPTNeoXForCausalLM"]);
}

/// Rewrites one tensor of the fixture with another shape or dtype.
fn with_tensor(name: &str, dtype: safetensors::Dtype, shape: Vec<usize>) -> tempfile::TempDir {
    let dir = model_copy();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let elems: usize = shape.iter().product();
    let replacement = vec![0u8; elems * dtype.bitsize() / 8];
    let mut tensors = Vec::new();
    for (n, view) in st.tensors() {
        if n == name {
            tensors.push((n, safetensors::tensor::TensorView::new(dtype, shape.clone(), &replacement).unwrap()));
        } else {
            tensors.push((n, view));
        }
    }
    let out = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(&path, out).unwrap();
    dir
}

#[test]
fn wrong_tensor_shape_or_dtype_is_named() {
    let name = "model.layers.2.self_attn.k_proj.weight";
    let dir = with_tensor(name, safetensors::Dtype::F32, vec![16, 128]);
    assert_fails_with(&generate_ids(dir.path(), &[]), &[name, "[16, 128]", "[32, 128]", "model.safetensors"]);
    let dir = with_tensor(name, safetensors::Dtype::I32, vec![32, 128]);
    assert_fails_with(&generate_ids(dir.path(), &[]), &[name, "I32"]);
}

#[test]
fn prompts_beyond_the_context_are_refused_with_the_limit() {
    let model = fixtures().join("llama/model-f32");
    let long: Vec<String> = (0..513).map(|i| (5 + i % 400).to_string()).collect();
    let o = loraplex(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", &long.join(","), "--max-new-tokens", "1"]);
    assert_fails_with(&o, &["513 tokens", "512"]);
    let fits: Vec<String> = (0..500).map(|i| (5 + i % 400).to_string()).collect();
    let o = loraplex(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", &fits.join(","), "--max-new-tokens", "20"]);
    assert_fails_with(&o, &["500 tokens", "max_new_tokens (20)", "512"]);
    let o = generate_ids(&model, &["--top-p", "1.5"]);
    assert_fails_with(&o, &["top_p"]);
    let o = loraplex(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,99999"]);
    assert_fails_with(&o, &["99999", "512"]);
    let o = loraplex(&["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "1,x"]);
    assert_fails_with(&o, &["--prompt-ids"]);
}

#[test]
fn synth_writes_a_model_that_generates() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny");
    let o = loraplex(&["synth", "--out", out.to_str().unwrap(), "--preset", "tiny", "--seed", "5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = loraplex(&["generate", "--model", out.to_str().unwrap(), "--prompt", "Hello world", "--max-new-tokens", "8", "--ignore-eos", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8);
}

#[test]
fn eos_comes_from_config_json_without_generation_config() {
    // The reference continuation of prompt "fox" starts 449, 449, 449, 272: make 272 the only
    // end-of-sequence id, declared in config.json alone.
    let dir = model_copy();
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("\"eos_token_id\": 2", "\"eos_token_id\": 272");
    std::fs::write(&path, text).unwrap();
    let o = generate_ids(dir.path(), &["--max-new-tokens", "16", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], serde_json::json!([449, 449, 449, 272]));
    assert_eq!(v["finish_reason"], "stop");
}
