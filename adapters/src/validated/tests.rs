//! The manifest path gives what the PEFT path gives, and refuses a manifest that disagrees with
//! the weights or the base model.

use std::path::Path;

use safetensors::Dtype;

use super::*;
use crate::peft::{CONFIG_FILE, WEIGHTS_FILE};
use crate::testutil::*;

/// Validates the adapter in `dir`, writes its manifest, and checks that loading it back through
/// the manifest gives exactly what `load` gives.
fn round_trip(dir: &Path, base: &BaseShape) -> (LoraAdapter, Manifest) {
    let limits = AdapterLimits::default();
    let (adapter, manifest) = LoraAdapter::load_with_manifest(dir, base, &limits).unwrap_or_else(|e| panic!("{e}"));
    let loaded = LoraAdapter::load(dir, base, &limits).unwrap();
    assert_eq!(adapter, loaded);
    manifest.write(dir).unwrap();
    assert_eq!(Manifest::read(dir).unwrap(), manifest);
    let again = LoraAdapter::load_validated(dir, base, &limits).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, loaded);
    assert_eq!(again.content_hash(), loaded.content_hash());
    assert_eq!(manifest.content_hash, loaded.content_hash_hex());
    assert_eq!(manifest.modules.len(), loaded.len());
    for (m, e) in again.modules().zip(loaded.modules()) {
        assert_eq!((m.alpha.to_bits(), m.scaling.to_bits()), (e.alpha.to_bits(), e.scaling.to_bits()), "layer {} {:?}", m.layer, m.module);
    }
    (loaded, manifest)
}

/// A copy of a reference fixture in a temporary directory (the fixtures stay untouched).
fn copy_fixture(arch: &str, variant: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in [CONFIG_FILE, WEIGHTS_FILE] {
        std::fs::copy(fixture(arch, variant).join(file), dir.path().join(file)).unwrap();
    }
    dir
}

#[test]
fn load_validated_equals_load_on_reference_fixtures() {
    for arch in ARCHS {
        for variant in VARIANTS {
            let dir = copy_fixture(arch, variant);
            let (adapter, manifest) = round_trip(dir.path(), &reference_base());
            assert_eq!(manifest.use_rslora, variant == "a3_r4_rslora");
            for (m, e) in adapter.modules().zip(&manifest.modules) {
                assert_eq!((e.layer, e.module.as_str(), e.rank, e.alpha, e.scaling), (m.layer, m.module.hf_name(), m.rank, m.alpha, m.scaling));
                assert_eq!(e.lora_a, tensor_name(m.layer, m.module, "A"));
                assert_eq!(e.lora_b, tensor_name(m.layer, m.module, "B"));
            }
        }
    }
}

#[test]
fn load_validated_equals_load_with_patterns_dtypes_and_default_names() {
    // Ranks 4, 2, 3 and alphas from alpha_pattern that f32 does not hold exactly, stored in
    // three dtypes under `.default.weight` names.
    let mut tensors = Vec::new();
    tensors.extend(lora_pair(0, TargetModule::Q, 4));
    tensors.extend(lora_pair(1, TargetModule::Q, 2));
    tensors.extend(lora_pair(0, TargetModule::V, 3));
    tensors.extend(lora_pair(1, TargetModule::V, 3));
    for (i, t) in tensors.iter_mut().enumerate() {
        t.dtype = [Dtype::F32, Dtype::F16, Dtype::BF16][i % 3];
        t.name = t.name.replace(".weight", ".default.weight");
    }
    let patterns = [
        ("rank_pattern", r#"{"layers.1.self_attn.q_proj": 2, "q_proj": 4}"#),
        ("alpha_pattern", r#"{"v_proj": 0.1, "model.layers.0.self_attn.v_proj": 100, "layers.1.self_attn.q_proj": 1.7e-3}"#),
    ];
    for rslora in ["false", "true"] {
        let text = config(&[("r", "3"), patterns[0], patterns[1], ("use_rslora", rslora)]);
        let dir = write_dir(&text, &tensors);
        let (adapter, manifest) = round_trip(dir.path(), &tiny_base());
        assert_eq!(adapter.get(1, TargetModule::V).unwrap().alpha, 0.1);
        assert_eq!(adapter.get(1, TargetModule::Q).unwrap().rank, 2);
        assert!(manifest.modules.iter().all(|e| e.lora_a.ends_with(".lora_A.default.weight") && e.lora_b.ends_with(".lora_B.default.weight")));
    }
}

#[test]
fn load_validated_reads_neither_config_nor_regexes() {
    // A config whose regex selects the modules; once validated, the config may be gone or
    // garbage: the manifest path never opens it.
    let text = config(&[("target_modules", r#"".*\\.(q|v)_proj""#), ("rank_pattern", r#"{"(q|v)_proj": 4}"#)]);
    let dir = write_dir(&text, &qv_tensors());
    let (adapter, _) = round_trip(dir.path(), &tiny_base());
    let config_path = dir.path().join(CONFIG_FILE);
    std::fs::write(&config_path, "{not json").unwrap();
    assert!(LoraAdapter::load(dir.path(), &tiny_base(), &AdapterLimits::default()).is_err());
    assert_eq!(LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap(), adapter);
    std::fs::remove_file(&config_path).unwrap();
    assert_eq!(LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap(), adapter);
}

#[test]
fn missing_manifest_or_weights_are_missing_files() {
    let dir = write_dir(&config(&[]), &qv_tensors());
    let err = LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap_err();
    assert!(matches!(&err, AdapterError::MissingFile { path, .. } if path.ends_with(MANIFEST_FILE)), "{err}");
    round_trip(dir.path(), &tiny_base());
    std::fs::remove_file(dir.path().join(WEIGHTS_FILE)).unwrap();
    let err = LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap_err();
    assert!(matches!(&err, AdapterError::MissingFile { path, .. } if path.ends_with(WEIGHTS_FILE)), "{err}");
}

#[test]
fn write_replaces_the_manifest_atomically() {
    let dir = write_dir(&config(&[]), &qv_tensors());
    let (_, manifest) = round_trip(dir.path(), &tiny_base());
    let mut other = manifest.clone();
    other.content_hash = "0".repeat(64);
    other.write(dir.path()).unwrap();
    assert_eq!(Manifest::read(dir.path()).unwrap(), other);
    manifest.write(dir.path()).unwrap();
    assert_eq!(Manifest::read(dir.path()).unwrap(), manifest);
    // Only the three files: no temporary left behind.
    let mut files: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, [CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE]);
    let err = manifest.write(&dir.path().join("missing")).unwrap_err();
    assert!(matches!(err, AdapterError::Io { .. }) && err.to_string().contains(MANIFEST_FILE), "{err}");
}

/// A validated tiny q+v adapter (one B value is 2, for the overflow case) and its manifest as
/// JSON.
fn validated_dir() -> (tempfile::TempDir, serde_json::Value) {
    let mut t = qv_tensors();
    let b = t.iter_mut().find(|x| x.name == tensor_name(1, TargetModule::V, "B")).unwrap();
    b.values[3] = 2.0;
    let dir = write_dir(&config(&[]), &t);
    let (_, manifest) = round_trip(dir.path(), &tiny_base());
    (dir, serde_json::to_value(&manifest).unwrap())
}

/// Writes `edit` of the manifest and returns the error load_validated gives, checking that its
/// message contains every needle.
fn refused_with(edit: impl FnOnce(&mut serde_json::Value), base: &BaseShape, limits: &AdapterLimits, needles: &[&str]) -> AdapterError {
    let (dir, mut manifest) = validated_dir();
    edit(&mut manifest);
    std::fs::write(dir.path().join(MANIFEST_FILE), serde_json::to_vec(&manifest).unwrap()).unwrap();
    let err = match LoraAdapter::load_validated(dir.path(), base, limits) {
        Ok(a) => panic!("expected a refusal mentioning {needles:?}, loaded {} modules", a.len()),
        Err(e) => e,
    };
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} does not mention {n:?}");
    }
    err
}

fn refused(edit: impl FnOnce(&mut serde_json::Value), needles: &[&str]) -> AdapterError {
    refused_with(edit, &tiny_base(), &AdapterLimits::default(), needles)
}

fn is_config(e: &AdapterError, key: &str) -> bool {
    matches!(e, AdapterError::Config { key: k, path, .. } if k == key && path.ends_with(MANIFEST_FILE))
}

fn is_tensor(e: &AdapterError, tensor: &str) -> bool {
    matches!(e, AdapterError::Tensor { tensor: t, path, .. } if t == tensor && path.ends_with(WEIGHTS_FILE))
}

#[test]
fn manifest_that_disagrees_with_the_weights_is_refused() {
    let (q0a, q0b, v1b) = (tensor_name(0, TargetModule::Q, "A"), tensor_name(0, TargetModule::Q, "B"), tensor_name(1, TargetModule::V, "B"));
    // Entry 0 is layer 0 q_proj (entries are sorted), rank 4.
    let e = refused(|m| m["modules"][0]["rank"] = 2.into(), &["key `modules[0].rank`", "has rank 4"]);
    assert!(is_config(&e, "modules[0].rank"), "{e}");
    let missing = q0a.replace(".weight", ".default.weight");
    let e = refused(|m| m["modules"][0]["lora_a"] = missing.clone().into(), &[&missing]);
    assert!(is_tensor(&e, &missing), "{e}");
    let e = refused(|m| m["modules"][0]["lora_b"] = v1b.clone().into(), &["not the lora_B tensor of layer 0 q_proj"]);
    assert!(is_config(&e, "modules[0].lora_b"), "{e}");
    let e = refused(|m| m["modules"][0]["module"] = "lm_head".into(), &["\"lm_head\""]);
    assert!(is_config(&e, "modules[0].module"), "{e}");
    // A layer beyond the base, with tensor names that agree with it.
    let e = refused(
        |m| {
            let entry = &mut m["modules"][0];
            entry["layer"] = 2.into();
            entry["lora_a"] = tensor_name(2, TargetModule::Q, "A").into();
            entry["lora_b"] = tensor_name(2, TargetModule::Q, "B").into();
        },
        &["layer 2 does not exist", "2 layers"],
    );
    assert!(is_tensor(&e, &tensor_name(2, TargetModule::Q, "A")), "{e}");
    let e = refused(
        |m| {
            let first = m["modules"][0].clone();
            m["modules"].as_array_mut().unwrap().push(first);
        },
        &["listed twice", "modules[0]"],
    );
    assert!(is_config(&e, "modules[4]"), "{e}");
    let e = refused(
        |m| {
            m["modules"].as_array_mut().unwrap().remove(0);
        },
        &["not listed in", MANIFEST_FILE],
    );
    assert!(is_tensor(&e, &q0a) || is_tensor(&e, &q0b), "{e}");
    let e = refused(|m| m["modules"] = serde_json::json!([]), &["no modules"]);
    assert!(is_config(&e, "modules"), "{e}");
    // A scaling that is not what was validated: the weights no longer hash to the record.
    let e = refused(|m| m["modules"][0]["scaling"] = 4.0.into(), &["hash to"]);
    assert!(is_config(&e, "content_hash"), "{e}");
    let e = refused(|m| m["content_hash"] = "0".repeat(64).into(), &["hash to"]);
    assert!(is_config(&e, "content_hash"), "{e}");
}

#[test]
fn manifest_with_scaling_out_of_f32_range_is_refused() {
    let e = refused(|m| m["modules"][0]["scaling"] = 1e39.into(), &["must be finite"]);
    assert!(is_config(&e, "modules[0].scaling"), "{e}");
    let e = refused(|m| m["modules"][1]["alpha"] = (-1e39).into(), &["must be finite"]);
    assert!(is_config(&e, "modules[1].scaling"), "{e}");
    // Finite, but times lora_B's value 2 it overflows f32. Entry 3 is layer 1 v_proj.
    let v1b = tensor_name(1, TargetModule::V, "B");
    let e = refused(|m| m["modules"][3]["scaling"] = 3e38.into(), &["value 2.0 at flat index 3", "not finite in f32"]);
    assert!(is_tensor(&e, &v1b), "{e}");
}

#[test]
fn manifest_outside_the_schema_is_refused() {
    let e = refused(|m| m["format_version"] = 2.into(), &["2 is not supported"]);
    assert!(is_config(&e, "format_version"), "{e}");
    type Edit = fn(&mut serde_json::Value);
    let cases: [(Edit, &str); 5] = [
        (|m| m["extra"] = 1.into(), "unknown field `extra`"),
        (|m| m["modules"][0]["bias"] = true.into(), "unknown field `bias`"),
        (|m| m["modules"][0]["rank"] = (-4).into(), "invalid value"),
        (|m| *m = serde_json::json!([1, 2]), "invalid type"),
        (
            |m| {
                m.as_object_mut().unwrap().remove("content_hash");
            },
            "missing field `content_hash`",
        ),
    ];
    for (edit, needle) in cases {
        let e = refused(edit, &[MANIFEST_FILE, needle]);
        assert!(matches!(e, AdapterError::ConfigJson { .. }), "{e}");
    }
    let (dir, _) = validated_dir();
    let path = dir.path().join(MANIFEST_FILE);
    std::fs::write(&path, vec![b' '; MAX_MANIFEST_BYTES as usize + 1]).unwrap();
    let e = LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap_err();
    assert!(matches!(e, AdapterError::ConfigJson { .. }) && e.to_string().contains("more than the limit"), "{e}");
}

#[test]
fn weights_changed_after_validation_are_refused() {
    let (dir, _) = validated_dir();
    let mut t = fixture_tensors(dir.path());
    t[0].values[0] += 1.0 / 64.0;
    save(&dir.path().join(WEIGHTS_FILE), &t);
    let e = LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap_err();
    assert!(is_config(&e, "content_hash"), "{e}");
    // An extra tensor that the manifest does not list.
    let (dir, _) = validated_dir();
    let mut t = fixture_tensors(dir.path());
    t.extend(lora_pair(0, TargetModule::K, 4));
    save(&dir.path().join(WEIGHTS_FILE), &t);
    let e = LoraAdapter::load_validated(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap_err();
    assert!(is_tensor(&e, &tensor_name(0, TargetModule::K, "A")) || is_tensor(&e, &tensor_name(0, TargetModule::K, "B")), "{e}");
}

#[test]
fn limits_and_base_apply_to_the_manifest_path() {
    let q0a = tensor_name(0, TargetModule::Q, "A");
    let e = refused_with(|_| {}, &tiny_base(), &AdapterLimits { max_rank: 3, ..AdapterLimits::default() }, &["rank 4 exceeds the limit of 3"]);
    assert!(is_tensor(&e, &q0a), "{e}");
    let e = refused_with(|_| {}, &tiny_base(), &AdapterLimits { max_file_bytes: 64, ..AdapterLimits::default() }, &["exceeds the limit of 64 bytes"]);
    assert!(matches!(e, AdapterError::Safetensors { .. }), "{e}");
    let wider = BaseShape::llama(16, 12, 2, 1, 4, 2);
    let e = refused_with(|_| {}, &wider, &AdapterLimits::default(), &["in_features 8", "input size 16"]);
    assert!(is_tensor(&e, &q0a), "{e}");
}
