//! Checkpoint forms beyond the reference fixtures, built by rewriting them: sharded safetensors,
//! tied embeddings, f16 weights, Mistral's architecture with and without a sliding window.

mod common;

use std::path::Path;
use std::sync::Arc;

use loraplex::engine::scoring;
use loraplex::model;
use loraplex_kernels::RowDType;
use loraplex_kernels::cpu::CpuBackend;
use safetensors::tensor::TensorView;

/// A copy of the f32 llama fixture without its weights; `edit` may change config.json.
fn copy_without_weights(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = common::fixtures().join("llama/model-f32");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    dir
}

/// The fixture's tensors as (name, dtype, shape, bytes).
fn fixture_tensors() -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(common::fixtures().join("llama/model-f32/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write(path: &Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<_> = tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn logits(dir: &Path, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let model = model::load(Arc::new(CpuBackend::new()), dir).unwrap();
    scoring::greedy_logits(&model, prompt, steps, 16, RowDType::F32, None).unwrap()
}

fn fixture_logits(prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    logits(&common::fixtures().join("llama/model-f32"), prompt, steps)
}

fn prompt() -> Vec<u32> {
    common::ids(&common::reference("llama")["prompts"][1]["token_ids"])
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let dir = copy_without_weights(|_| {});
    let tensors = fixture_tensors();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write(&dir.path().join("model-00001-of-00002.safetensors"), a);
    write(&dir.path().join("model-00002-of-00002.safetensors"), b);
    let map: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|t| (t.0.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(b.iter().map(|t| (t.0.clone(), "model-00002-of-00002.safetensors".into())))
        .collect();
    std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    assert_eq!(logits(dir.path(), &prompt(), 4), fixture_logits(&prompt(), 4));
}

#[test]
fn tied_embeddings_use_the_embedding_as_lm_head() {
    let mut tensors = fixture_tensors();
    let embed = tensors.iter().find(|t| t.0 == "model.embed_tokens.weight").unwrap().3.clone();
    // Untied, with lm_head set to a copy of the embedding ...
    let untied = copy_without_weights(|_| {});
    for t in tensors.iter_mut().filter(|t| t.0 == "lm_head.weight") {
        t.3 = embed.clone();
    }
    write(&untied.path().join("model.safetensors"), &tensors);
    // ... equals tied, with no lm_head tensor at all.
    let tied = copy_without_weights(|c| c["tie_word_embeddings"] = true.into());
    tensors.retain(|t| t.0 != "lm_head.weight");
    write(&tied.path().join("model.safetensors"), &tensors);
    let (a, b) = (logits(untied.path(), &prompt(), 3), logits(tied.path(), &prompt(), 3));
    assert_eq!(a, b);
    assert_ne!(a, fixture_logits(&prompt(), 3), "the head really changed");
    // Untied without lm_head is an error naming the tensor.
    let broken = copy_without_weights(|_| {});
    write(&broken.path().join("model.safetensors"), &tensors);
    let err = model::load(Arc::new(CpuBackend::new()), broken.path()).err().unwrap().to_string();
    assert!(err.contains("lm_head.weight"), "{err}");
}

#[test]
fn f16_weights_are_converted_on_load() {
    let dir = copy_without_weights(|c| c["torch_dtype"] = "float16".into());
    let tensors: Vec<_> = fixture_tensors()
        .into_iter()
        .map(|(n, _, s, b)| {
            let halves: Vec<u8> = b.chunks_exact(4).flat_map(|c| half::f16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()).collect();
            (n, safetensors::Dtype::F16, s, halves)
        })
        .collect();
    write(&dir.path().join("model.safetensors"), &tensors);
    let (got, want) = (logits(dir.path(), &prompt(), 1), fixture_logits(&prompt(), 1));
    let err = got[0].iter().zip(&want[0]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err > 0.0 && err < 2e-2, "f16 rounding moves logits a little, not a lot: {err}");
}

#[test]
fn mistral_architecture_and_its_sliding_window() {
    let write_weights = |dir: &Path| write(&dir.join("model.safetensors"), &fixture_tensors());
    // Mistral is Llama without biases: with a window longer than the sequence, identical.
    let wide = copy_without_weights(|c| {
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["model_type"] = "mistral".into();
        c["sliding_window"] = 4096.into();
    });
    write_weights(wide.path());
    let p = prompt();
    assert_eq!(logits(wide.path(), &p, 3), fixture_logits(&p, 3));
    // A window shorter than the prompt changes what the last positions see.
    let narrow = copy_without_weights(|c| {
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["sliding_window"] = 4.into();
    });
    write_weights(narrow.path());
    let (a, b) = (logits(narrow.path(), &p, 1), fixture_logits(&p, 1));
    assert_ne!(a, b);
    // With a 4-token window in each of 4 layers, the last position sees at most 4 * 3 = 12
    // positions back: changing tokens further back leaves its logits bit-identical.
    let far: Vec<u32> = p.iter().enumerate().map(|(i, &t)| if i + 13 < p.len() { 9 } else { t }).collect();
    assert_ne!(far, p);
    assert_eq!(logits(narrow.path(), &far, 1)[0], a[0]);
}
