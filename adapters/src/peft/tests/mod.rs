//! Loading the reference PEFT adapters and synthesized variants of them.

mod caps;
mod refusals;

use std::path::Path;

use safetensors::Dtype;

use super::config::PeftConfig;
use crate::testutil::*;
use crate::{AdapterLimits, BaseShape, LoraAdapter, TargetModule};

// ---------------------------------------------------------------- reference fixtures

#[test]
fn fixtures_match_reference_effective_values() {
    for arch in ARCHS {
        let text = std::fs::read_to_string(Path::new(REFERENCE).join(arch).join("reference.json")).unwrap();
        let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
        for variant in VARIANTS {
            let adapter = load(&fixture(arch, variant), &reference_base()).unwrap_or_else(|e| panic!("{arch}/{variant}: {e}"));
            let effective = reference["variants"][variant]["effective_modules"].as_object().unwrap();
            assert!(!effective.is_empty());
            assert_eq!(adapter.len(), effective.len(), "{arch}/{variant}");
            for (name, eff) in effective {
                let parts: Vec<&str> = name.split('.').collect();
                let layer: usize = parts[2].parse().unwrap();
                let module = TargetModule::from_hf_name(parts[4]).unwrap();
                let m = adapter.get(layer, module).unwrap_or_else(|| panic!("{arch}/{variant}: {name} missing"));
                assert_eq!(m.rank as u64, eff["r"].as_u64().unwrap(), "{arch}/{variant} {name}");
                assert_eq!(m.alpha, eff["lora_alpha"].as_f64().unwrap() as f32, "{arch}/{variant} {name}");
                assert_eq!(m.scaling, eff["scaling"].as_f64().unwrap() as f32, "{arch}/{variant} {name}");
                let (i, o) = reference_base().dims(module);
                assert_eq!((m.in_features, m.out_features), (i, o));
                assert_eq!((m.a.len(), m.b.len()), (m.rank * i, o * m.rank));
            }
        }
    }
}

#[test]
fn fixture_weights_are_the_file_values_row_major() {
    let dir = fixture("llama", "a2_r16_all");
    let adapter = load(&dir, &reference_base()).unwrap();
    let tensors = fixture_tensors(&dir);
    for m in adapter.modules() {
        let a = tensors.iter().find(|t| t.name == tensor_name(m.layer, m.module, "A")).unwrap();
        let b = tensors.iter().find(|t| t.name == tensor_name(m.layer, m.module, "B")).unwrap();
        assert_eq!(a.values, m.a);
        assert_eq!(b.values, m.b);
    }
    assert_eq!(adapter.total_rank_rows(), 16 * 7 * 4);
    let floats: usize = 4 * 16 * (2 * (128 + 128) + 2 * (128 + 32) + 3 * (128 + 344));
    assert_eq!(adapter.bytes(), floats * 4);
    assert_eq!(adapter.target_modules(), TargetModule::ALL);
}

#[test]
fn rslora_scaling_is_alpha_over_sqrt_rank() {
    for arch in ARCHS {
        let adapter = load(&fixture(arch, "a3_r4_rslora"), &reference_base()).unwrap();
        assert!(adapter.use_rslora());
        assert_eq!(adapter.len(), 16);
        for m in adapter.modules() {
            assert_eq!((m.rank, m.alpha), (4, 8.0));
            assert_eq!(m.scaling, 4.0, "8 / sqrt(4), not 8 / 4");
        }
        let plain = load(&fixture(arch, "a1_r8_qv"), &reference_base()).unwrap();
        assert!(!plain.use_rslora());
        assert!(plain.modules().all(|m| m.scaling == 2.0));
    }
}

#[test]
fn fixture_against_a_different_base_is_refused() {
    let dir = fixture("llama", "a1_r8_qv");
    // Two layers instead of four.
    assert_refused(
        &dir,
        &BaseShape::llama(128, 344, 8, 2, 16, 2),
        &AdapterLimits::default(),
        &["adapter_model.safetensors", "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight", "layer 2 does not exist"],
    );
    // A wider hidden size: lora_A's in_features no longer match.
    assert_refused(&dir, &BaseShape::llama(256, 344, 8, 2, 16, 4), &AdapterLimits::default(), &["lora_A.weight", "in_features 128", "256"]);
}

// ---------------------------------------------------------------- patterns and targets

#[test]
fn rank_and_alpha_patterns_take_the_first_matching_key_in_file_order() {
    let mut tensors = Vec::new();
    tensors.extend(lora_pair(0, TargetModule::Q, 4));
    tensors.extend(lora_pair(1, TargetModule::Q, 2));
    tensors.extend(lora_pair(0, TargetModule::V, 3));
    tensors.extend(lora_pair(1, TargetModule::V, 3));
    // Both rank keys match layer 1's q_proj; the specific one comes first, so it wins there.
    // Both alpha keys match layer 0's v_proj; the generic one comes first, so it wins there.
    let text = config(&[
        ("r", "3"),
        ("rank_pattern", r#"{"layers.1.self_attn.q_proj": 2, "q_proj": 4}"#),
        ("alpha_pattern", r#"{"v_proj": 6, "model.layers.0.self_attn.v_proj": 100, "layers.1.self_attn.q_proj": 1.5}"#),
    ]);
    let dir = write_dir(&text, &tensors);
    let a = load(dir.path(), &tiny_base()).unwrap();
    let get = |l, m| a.get(l, m).unwrap();
    assert_eq!((get(0, TargetModule::Q).rank, get(0, TargetModule::Q).alpha), (4, 8.0));
    assert_eq!(get(0, TargetModule::Q).scaling, 2.0);
    assert_eq!((get(1, TargetModule::Q).rank, get(1, TargetModule::Q).alpha), (2, 1.5));
    assert_eq!(get(1, TargetModule::Q).scaling, 0.75);
    assert_eq!((get(0, TargetModule::V).rank, get(0, TargetModule::V).alpha), (3, 6.0));
    assert_eq!((get(1, TargetModule::V).rank, get(1, TargetModule::V).alpha), (3, 6.0));
    assert_eq!(get(1, TargetModule::V).scaling, 2.0);

    // The same keys in the other order: `q_proj` now decides layer 1's rank (4), which the
    // tensors contradict.
    let text = config(&[("r", "3"), ("rank_pattern", r#"{"q_proj": 4, "layers.1.self_attn.q_proj": 2}"#)]);
    let msg = refused(&text, &tensors, &["adapter_config.json", "rank_pattern.q_proj", "model.layers.1.self_attn.q_proj", "rank 2"]);
    assert!(msg.contains("lora_A.weight"), "{msg}");

    // And the alpha order flipped: the specific key now decides layer 0's v_proj.
    let text = config(&[
        ("r", "3"),
        ("rank_pattern", r#"{"layers.1.self_attn.q_proj": 2, "q_proj": 4}"#),
        ("alpha_pattern", r#"{"model.layers.0.self_attn.v_proj": 100, "v_proj": 6}"#),
    ]);
    let dir = write_dir(&text, &tensors);
    let a = load(dir.path(), &tiny_base()).unwrap();
    assert_eq!(a.get(0, TargetModule::V).unwrap().alpha, 100.0);
    assert_eq!(a.get(1, TargetModule::V).unwrap().alpha, 6.0);
}

#[test]
fn pattern_keys_are_regexes() {
    let mut tensors = Vec::new();
    for l in 0..2 {
        tensors.extend(lora_pair(l, TargetModule::Q, 2));
        tensors.extend(lora_pair(l, TargetModule::V, 4));
    }
    let text = config(&[("rank_pattern", r#"{"layers\\.\\d+\\.self_attn\\.q_proj": 2}"#), ("use_rslora", "true")]);
    let dir = write_dir(&text, &tensors);
    let a = load(dir.path(), &tiny_base()).unwrap();
    assert!(a.modules().filter(|m| m.module == TargetModule::Q).all(|m| m.rank == 2));
    assert_eq!(a.get(0, TargetModule::V).unwrap().scaling, 4.0);
    assert_eq!(a.get(0, TargetModule::Q).unwrap().scaling, (8.0 / 2f64.sqrt()) as f32);

    refused(&config(&[("rank_pattern", r#"{"q_proj(": 2}"#)]), &tensors, &["adapter_config.json", "rank_pattern.q_proj(", "invalid regex"]);
    refused(&config(&[("rank_pattern", r#"{"q_proj": "two"}"#)]), &tensors, &["rank_pattern.q_proj", "positive integer"]);
    refused(&config(&[("alpha_pattern", r#"[1]"#)]), &tensors, &["alpha_pattern", "expected an object"]);
}

#[test]
fn target_modules_as_regex() {
    let mut tensors = Vec::new();
    tensors.extend(lora_pair(1, TargetModule::Q, 4));
    tensors.extend(lora_pair(1, TargetModule::V, 4));
    let text = config(&[("target_modules", r#"".*\\.layers\\.1\\.self_attn\\.(q|v)_proj""#)]);
    let dir = write_dir(&text, &tensors);
    let a = load(dir.path(), &tiny_base()).unwrap();
    assert_eq!(a.len(), 2);
    assert!(a.get(0, TargetModule::Q).is_none());

    // A tensor for a module the regex does not select.
    let mut more = tensors.clone();
    more.extend(lora_pair(0, TargetModule::Q, 4));
    refused(&text, &more, &["adapter_model.safetensors", "layers.0.self_attn.q_proj.lora_A.weight", "not selected", "adapter_config.json"]);
    // PEFT refuses layers_to_transform with a regex too.
    let bad = config(&[("target_modules", r#""q_proj""#), ("layers_to_transform", "[1]")]);
    refused(&bad, &tensors, &["adapter_config.json", "layers_to_transform", "regex"]);
}

#[test]
fn layers_to_transform_restricts_layers() {
    let tensors: Vec<T> = lora_pair(1, TargetModule::Q, 4).into_iter().chain(lora_pair(1, TargetModule::V, 4)).collect();
    for layers in ["[1]", "1"] {
        let text = config(&[("layers_to_transform", layers), ("layers_pattern", r#""layers""#)]);
        let dir = write_dir(&text, &tensors);
        let a = load(dir.path(), &tiny_base()).unwrap();
        assert_eq!(a.modules().map(|m| m.layer).collect::<Vec<_>>(), [1, 1]);
    }
    let text = config(&[("layers_to_transform", "[1]")]);
    let mut more = tensors.clone();
    more.extend(lora_pair(0, TargetModule::V, 4));
    refused(&text, &more, &["layers.0.self_attn.v_proj.lora_A.weight", "not selected"]);
    refused(&config(&[("layers_to_transform", r#"["one"]"#)]), &tensors, &["adapter_config.json", "layers_to_transform"]);
}

#[test]
fn selected_module_without_tensors_is_refused() {
    let mut tensors = qv_tensors();
    tensors.retain(|t| !t.name.contains("layers.1.self_attn.v_proj"));
    refused(&config(&[]), &tensors, &["adapter_model.safetensors", "model.layers.1.self_attn.v_proj", "adapter_config.json"]);
}

#[test]
fn default_adapter_name_is_accepted() {
    let plain = write_dir(&config(&[]), &qv_tensors());
    let renamed: Vec<T> = qv_tensors()
        .into_iter()
        .map(|mut t| {
            t.name = t.name.replace(".weight", ".default.weight");
            t
        })
        .collect();
    let named = write_dir(&config(&[]), &renamed);
    let a = load(plain.path(), &tiny_base()).unwrap();
    let b = load(named.path(), &tiny_base()).unwrap();
    assert_eq!(a.len(), 4);
    assert_eq!(a, b);

    // Both spellings of the same tensor at once, or another adapter name, are refused.
    let mut both = qv_tensors();
    both.push(renamed[0].clone());
    refused(&config(&[]), &both, &["lora_A", "duplicates"]);
    let mut other = qv_tensors();
    other[0].name = other[0].name.replace(".weight", ".mine.weight");
    refused(&config(&[]), &other, &["lora_A.mine.weight", "adapter name `mine`"]);
}

// ---------------------------------------------------------------- dtypes and hashing

fn with_dtype(tensors: &[T], dtype: Dtype) -> Vec<T> {
    tensors.iter().cloned().map(|t| T { dtype, ..t }).collect()
}

#[test]
fn f16_and_bf16_tensors_load_as_f32() {
    let f32_dir = write_dir(&config(&[]), &qv_tensors());
    let reference = load(f32_dir.path(), &tiny_base()).unwrap();
    for dtype in [Dtype::F16, Dtype::BF16] {
        let dir = write_dir(&config(&[]), &with_dtype(&qv_tensors(), dtype));
        let a = load(dir.path(), &tiny_base()).unwrap();
        assert_eq!(a, reference, "{dtype:?}");
    }
    // A value that bf16 rounds: 1 + 2^-10 is exact in f16, not in bf16.
    let mut t = qv_tensors();
    t[0].values[0] = 1.0 + 1.0 / 1024.0;
    let dir = write_dir(&config(&[]), &with_dtype(&t, Dtype::F16));
    assert_eq!(load(dir.path(), &tiny_base()).unwrap().get(0, TargetModule::Q).unwrap().a[0], 1.0 + 1.0 / 1024.0);
    let dir = write_dir(&config(&[]), &with_dtype(&t, Dtype::BF16));
    assert_eq!(load(dir.path(), &tiny_base()).unwrap().get(0, TargetModule::Q).unwrap().a[0], 1.0);
}

#[test]
fn content_hash_ignores_tensor_order_and_storage_dtype() {
    let dir = fixture("qwen2", "a1_r8_qv");
    let original = load(&dir, &reference_base()).unwrap();
    let hash = original.content_hash();
    assert_eq!(load(&dir, &reference_base()).unwrap().content_hash(), hash);
    assert_eq!(original.content_hash_hex().len(), 64);
    assert!(original.content_hash_hex().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));

    let config_text = std::fs::read_to_string(dir.join(crate::peft::CONFIG_FILE)).unwrap();
    let mut tensors = fixture_tensors(&dir);
    tensors.reverse();
    let reordered = tempfile::tempdir().unwrap();
    std::fs::write(reordered.path().join(crate::peft::CONFIG_FILE), &config_text).unwrap();
    save_in_order(&reordered.path().join(crate::peft::WEIGHTS_FILE), &tensors);
    let first = std::fs::read(reordered.path().join(crate::peft::WEIGHTS_FILE)).unwrap();
    assert_ne!(first, std::fs::read(dir.join(crate::peft::WEIGHTS_FILE)).unwrap(), "the file really differs");
    assert_eq!(load(reordered.path(), &reference_base()).unwrap().content_hash(), hash);

    // Tiny adapter: f32, f16, bf16 and a mixed-dtype file in reverse order all hash alike.
    let base_hash = load(write_dir(&config(&[]), &qv_tensors()).path(), &tiny_base()).unwrap().content_hash();
    for dtype in [Dtype::F16, Dtype::BF16] {
        let d = write_dir(&config(&[]), &with_dtype(&qv_tensors(), dtype));
        assert_eq!(load(d.path(), &tiny_base()).unwrap().content_hash(), base_hash);
    }
    let mut mixed = qv_tensors();
    for (i, t) in mixed.iter_mut().enumerate() {
        t.dtype = [Dtype::F32, Dtype::F16, Dtype::BF16][i % 3];
    }
    mixed.reverse();
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join(crate::peft::CONFIG_FILE), config(&[])).unwrap();
    save_in_order(&d.path().join(crate::peft::WEIGHTS_FILE), &mixed);
    assert_eq!(load(d.path(), &tiny_base()).unwrap().content_hash(), base_hash);
}

#[test]
fn content_hash_changes_with_any_weight_or_scaling() {
    let base_hash = load(write_dir(&config(&[]), &qv_tensors()).path(), &tiny_base()).unwrap().content_hash();
    for (ti, vi) in [(0, 0), (3, 5), (7, 15)] {
        let mut t = qv_tensors();
        t[ti].values[vi] += 1.0 / 64.0;
        let a = load(write_dir(&config(&[]), &t).path(), &tiny_base()).unwrap();
        assert_ne!(a.content_hash(), base_hash, "tensor {ti} value {vi}");
    }
    let alpha = load(write_dir(&config(&[("lora_alpha", "16")]), &qv_tensors()).path(), &tiny_base()).unwrap();
    assert_ne!(alpha.content_hash(), base_hash);
    let rs = load(write_dir(&config(&[("use_rslora", "true")]), &qv_tensors()).path(), &tiny_base()).unwrap();
    assert_ne!(rs.content_hash(), base_hash);
    // Same values, different layer assignment: swap layer 0 and layer 1 names.
    let swapped: Vec<T> = qv_tensors()
        .into_iter()
        .map(|mut t| {
            t.name = t.name.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.").replace("layers.X.", "layers.1.");
            t
        })
        .collect();
    let a = load(write_dir(&config(&[]), &swapped).path(), &tiny_base()).unwrap();
    assert_ne!(a.content_hash(), base_hash);
}
