use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::tokenizer::{BpeTables, tokenizer_json, vocab_and_merges};
use super::*;

const FILES: [&str; 6] = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "model.safetensors"];

fn reference(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference").join(path)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// One tiny model (seed 7) shared by the tests that only read it.
fn tiny() -> &'static (tempfile::TempDir, SynthSummary) {
    static TINY: OnceLock<(tempfile::TempDir, SynthSummary)> = OnceLock::new();
    TINY.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let opts = SynthOptions { out: dir.path().join("model"), preset: Preset::Tiny, seed: 7, dtype: crate::synth::FileDType::F32, kv_heads: None };
        let summary = synthesize_model(&opts).unwrap();
        (dir, summary)
    })
}

fn tiny_dir() -> PathBuf {
    tiny().0.path().join("model")
}

#[test]
fn tiny_preset_writes_all_files() {
    let (_, summary) = tiny();
    let dir = tiny_dir();
    let written: Vec<PathBuf> = FILES.iter().map(|f| dir.join(f)).collect();
    assert_eq!(summary.files, written);
    let total: u64 = written.iter().map(|p| p.metadata().unwrap().len()).sum();
    assert_eq!(summary.bytes, total);
    assert_eq!(summary.parameters, Preset::Tiny.dims().parameter_count());
    assert_eq!(summary.parameters, 824_448);
    assert!(!dir.join("model.safetensors.partial").exists());
}

#[test]
fn config_matches_the_reference_layout() {
    let ours = read_json(&tiny_dir().join("config.json"));
    let theirs = read_json(&reference("llama/model-f32/config.json"));
    let mut theirs = theirs.as_object().unwrap().clone();
    theirs.remove("transformers_version");
    assert_eq!(ours, Value::Object(theirs));

    let ours = read_json(&tiny_dir().join("generation_config.json"));
    let mut theirs = read_json(&reference("llama/model-f32/generation_config.json"));
    theirs.as_object_mut().unwrap().remove("transformers_version");
    assert_eq!(ours, theirs);

    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
        let ours = read_json(&tiny_dir().join(name));
        assert_eq!(ours, read_json(&reference(&format!("tokenizer/{name}"))), "{name}");
    }
    let chat = read_json(&tiny_dir().join("tokenizer_config.json"))["chat_template"].clone();
    assert!(chat.as_str().unwrap().starts_with("{{ bos_token }}"));
}

#[test]
fn preset_dimensions() {
    let d = Preset::Small.dims();
    assert_eq!((d.vocab_size, d.hidden_size, d.intermediate_size), (4096, 512, 1408));
    assert_eq!((d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads), (6, 8, 2));
    assert_eq!((d.head_dim, d.max_position_embeddings), (64, 2048));
    let b = Preset::Bench.dims();
    assert_eq!((b.vocab_size, b.hidden_size, b.intermediate_size), (32000, 1024, 2816));
    assert_eq!((b.num_hidden_layers, b.num_attention_heads, b.num_key_value_heads), (8, 16, 4));
    assert_eq!((b.head_dim, b.max_position_embeddings), (64, 4096));
    let params = b.parameter_count();
    assert!((150_000_000..160_000_000).contains(&params), "{params}");
    // Llama 2 7B's and TinyLlama's shapes, and their published parameter counts.
    let s = Preset::SevenB.dims();
    assert_eq!((s.vocab_size, s.hidden_size, s.intermediate_size, s.num_hidden_layers), (32000, 4096, 11008, 32));
    assert_eq!((s.num_attention_heads, s.num_key_value_heads, s.head_dim), (32, 32, 128));
    assert_eq!(s.parameter_count(), 6_738_415_616);
    let o = Preset::OneB.dims();
    assert_eq!((o.hidden_size, o.intermediate_size, o.num_hidden_layers, o.num_key_value_heads), (2048, 5632, 22, 4));
    assert_eq!(o.parameter_count(), 1_100_048_384);
}

#[test]
fn kv_heads_override_the_preset_and_must_divide_the_heads() {
    let gqa = Preset::SevenB.dims().with_kv_heads(Some(8)).unwrap();
    assert_eq!((gqa.num_attention_heads, gqa.num_key_value_heads, gqa.head_dim), (32, 8, 128));
    assert_eq!(Preset::SevenB.dims().with_kv_heads(None).unwrap(), Preset::SevenB.dims());
    for bad in [0, 5, 64] {
        let err = Preset::SevenB.dims().with_kv_heads(Some(bad)).unwrap_err().to_string();
        assert!(err.contains("must divide the 32 attention heads"), "{err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    synthesize_model(&SynthOptions { out: out.clone(), preset: Preset::Tiny, seed: 1, dtype: crate::synth::FileDType::F32, kv_heads: Some(8) }).unwrap();
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_key_value_heads"], 8);
    assert_eq!(crate::model::ModelConfig::from_dir(&out).unwrap().num_kv_heads, 8);
}

/// The tensors of a Llama checkpoint, derived here independently of the writer.
fn expected_tensors(d: &ModelDims) -> BTreeMap<String, Vec<usize>> {
    let (h, v, i) = (d.hidden_size, d.vocab_size, d.intermediate_size);
    let q = d.num_attention_heads * d.head_dim;
    let kv = d.num_key_value_heads * d.head_dim;
    let mut m = BTreeMap::new();
    m.insert("model.embed_tokens.weight".to_string(), vec![v, h]);
    m.insert("lm_head.weight".to_string(), vec![v, h]);
    m.insert("model.norm.weight".to_string(), vec![h]);
    for l in 0..d.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            m.insert(format!("{p}.{name}.weight"), shape);
        }
    }
    m
}

fn f32s(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

#[test]
fn safetensors_has_every_tensor_with_its_shape() {
    let bytes = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let expected = expected_tensors(&Preset::Tiny.dims());
    let got: BTreeMap<String, Vec<usize>> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32, "{name}");
            (name, view.shape().to_vec())
        })
        .collect();
    assert_eq!(got, expected);

    // The same names and shapes as the reference checkpoint, and the same metadata.
    let ref_bytes = std::fs::read(reference("llama/model-f32/model.safetensors")).unwrap();
    let ref_st = SafeTensors::deserialize(&ref_bytes).unwrap();
    let ref_shapes: BTreeMap<String, Vec<usize>> = ref_st.tensors().into_iter().map(|(name, view)| (name, view.shape().to_vec())).collect();
    assert_eq!(got, ref_shapes);
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let format = meta.metadata().as_ref().and_then(|m| m.get("format").cloned());
    assert_eq!(format.as_deref(), Some("pt"));
}

#[test]
fn weights_have_the_intended_statistics() {
    let bytes = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in st.tensors() {
        let x = f32s(&view);
        assert!(x.iter().all(|v| v.is_finite()), "{name}");
        if name.ends_with("norm.weight") {
            assert!(x.iter().all(|&v| (0.5..=1.5).contains(&v)), "{name}");
            assert!(x.iter().any(|&v| (v - 1.0).abs() > 0.1), "{name} looks like all ones");
            let distinct = x.iter().map(|v| v.to_bits()).collect::<std::collections::HashSet<_>>();
            assert!(distinct.len() > x.len() / 2, "{name}");
            continue;
        }
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let std = (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        let want = if name == "model.embed_tokens.weight" { 1.0 } else { 1.0 / (view.shape()[1] as f64).sqrt() };
        assert!(mean.abs() < 0.05 * want.max(0.1), "{name}: mean {mean}");
        assert!((std / want - 1.0).abs() < 0.05, "{name}: std {std}, want {want}");
    }
}

#[test]
fn tokenizer_loads_and_round_trips() {
    let tok = Tokenizer::from_file(tiny_dir().join("tokenizer.json")).unwrap();
    assert_eq!(tok.get_vocab_size(true), 512);
    assert_eq!(tok.get_vocab_size(false), 512);
    for (id, s) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tok.token_to_id(s), Some(id as u32));
    }
    let text = "Hello, world! ünïcödé 😀";
    let enc = tok.encode(text, true).unwrap();
    assert_eq!(enc.get_ids()[0], 1, "BOS first");
    assert!(enc.get_ids().len() < text.len(), "merges apply: {:?}", enc.get_tokens());
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), text);
    let chat = "<|im_start|>user\nthe river<|im_end|>\n";
    let ids = tok.encode(chat, false).unwrap().get_ids().to_vec();
    assert_eq!((ids[0], ids[ids.len() - 2]), (3, 4));
    assert_eq!(tok.decode(&ids, false).unwrap(), chat);

    // The specials and the byte-level symbols have the reference tokenizer's ids.
    let reference = Tokenizer::from_file(reference("tokenizer/tokenizer.json")).unwrap();
    for id in 0..261 {
        assert_eq!(tok.id_to_token(id), reference.id_to_token(id), "id {id}");
    }
}

#[test]
fn vocabularies_of_every_preset_are_exact_and_well_formed() {
    for preset in [Preset::Tiny, Preset::Small, Preset::Bench] {
        let v = preset.dims().vocab_size;
        let BpeTables { tokens, merges } = vocab_and_merges(v).unwrap();
        assert_eq!(tokens.len(), v, "{preset:?}");
        let distinct: std::collections::HashSet<&String> = tokens.iter().collect();
        assert_eq!(distinct.len(), v);
        // Every token after the base is a merge of two tokens that exist before it.
        let ids: std::collections::HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
        for (a, b) in &merges {
            let joined = ids[format!("{a}{b}").as_str()];
            assert!(ids[a.as_str()] < joined && ids[b.as_str()] < joined, "{a} + {b}");
        }
        assert!(merges.len() >= v - 261);
    }
    let json = tokenizer_json(4096).unwrap();
    let tok: Tokenizer = json.parse().unwrap();
    assert_eq!(tok.get_vocab_size(true), 4096);
    let text = "Filler tokens, the river and 42 ünïcödé 😀\ttabs";
    let ids = tok.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
    assert!(ids.len() < text.len(), "{ids:?}");
}

#[test]
fn same_seed_gives_identical_files_and_another_seed_other_weights() {
    let dir = tempfile::tempdir().unwrap();
    let write = |sub: &str, seed| {
        let out = dir.path().join(sub);
        synthesize_model(&SynthOptions { out: out.clone(), preset: Preset::Tiny, seed, dtype: crate::synth::FileDType::F32, kv_heads: None }).unwrap();
        out
    };
    let again = write("again", 7);
    let other = write("other", 8);
    for f in FILES {
        let a = std::fs::read(tiny_dir().join(f)).unwrap();
        assert_eq!(a, std::fs::read(again.join(f)).unwrap(), "{f}");
        let b = std::fs::read(other.join(f)).unwrap();
        if f == "model.safetensors" {
            assert_eq!(a.len(), b.len());
            assert_ne!(a, b);
        } else {
            // Only the weights depend on the seed.
            assert_eq!(a, b, "{f}");
        }
    }
    // Rewriting into an existing directory replaces the files.
    synthesize_model(&SynthOptions { out: other.clone(), preset: Preset::Tiny, seed: 7, dtype: crate::synth::FileDType::F32, kv_heads: None }).unwrap();
    let a = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    assert_eq!(a, std::fs::read(other.join("model.safetensors")).unwrap());
}

#[test]
fn weights_are_pinned_across_builds() {
    // The first values of a tensor for seed 7: a change here changes every synthesized model.
    let bytes = std::fs::read(tiny_dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let x = f32s(&st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap());
    let bits: Vec<u32> = x[..4].iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, PINNED_Q_PROJ);
}

// -0.0845, 0.0539, -0.2398, 0.1207; also reproduced by an independent implementation.
const PINNED_Q_PROJ: [u32; 4] = [3182234801, 1029477544, 3195374722, 1039606579];

#[test]
fn unwritable_output_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = synthesize_model(&SynthOptions { out: file.join("m"), preset: Preset::Tiny, seed: 0, dtype: crate::synth::FileDType::F32, kv_heads: None })
        .unwrap_err();
    assert!(matches!(err, SynthError::Io { .. }), "{err}");
}
