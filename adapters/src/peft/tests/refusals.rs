//! Everything the loader must refuse, each with a message naming the file and key or tensor.

use safetensors::Dtype;

use super::*;

#[test]
fn missing_files_and_pickles_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let limits = AdapterLimits::default();
    assert_refused(dir.path(), &tiny_base(), &limits, &["adapter_model.safetensors", "not found"]);
    std::fs::write(dir.path().join(crate::peft::CONFIG_FILE), config(&[])).unwrap();
    std::fs::write(dir.path().join(crate::peft::PICKLE_FILE), b"\x80\x02}q\x00.").unwrap();
    assert_refused(dir.path(), &tiny_base(), &limits, &["adapter_model.bin", "pickle", "safetensors"]);
    let dir = tempfile::tempdir().unwrap();
    save(&dir.path().join(crate::peft::WEIGHTS_FILE), &qv_tensors());
    assert_refused(dir.path(), &tiny_base(), &limits, &["adapter_config.json", "not found"]);
}

#[test]
fn unsupported_config_options_are_refused() {
    let cases: &[(&str, &str)] = &[
        ("use_dora", "true"),
        ("modules_to_save", r#"["lm_head"]"#),
        ("bias", r#""all""#),
        ("bias", r#""lora_only""#),
        ("fan_in_fan_out", "true"),
        ("lora_bias", "true"),
        ("peft_type", r#""IA3""#),
        ("r", "0"),
        ("lora_alpha", r#""16""#),
        ("use_rslora", r#""yes""#),
        ("target_modules", "null"),
        ("target_modules", "[1]"),
        ("target_modules", r#""(q_proj""#),
        ("layer_replication", "[[0, 2]]"),
    ];
    for (key, value) in cases {
        refused(&config(&[(key, value)]), &qv_tensors(), &["adapter_config.json", &format!("key `{key}`")]);
    }
    // Empty or false forms of the refused options are fine.
    let ok = config(&[("modules_to_save", "[]"), ("lora_bias", "false"), ("layer_replication", "null")]);
    assert!(load(write_dir(&ok, &qv_tensors()).path(), &tiny_base()).is_ok());
    refused("{not json", &qv_tensors(), &["adapter_config.json", "invalid JSON"]);
    refused("[1, 2]", &qv_tensors(), &["adapter_config.json", "top level"]);
    refused(r#"{"target_modules": ["q_proj"], "target_modules": ["v_proj"]}"#, &qv_tensors(), &["adapter_config.json", "duplicate key"]);
}

#[test]
fn rank_above_the_limit_is_refused() {
    let dir = write_dir(&config(&[]), &qv_tensors());
    let limits = AdapterLimits { max_rank: 3, ..AdapterLimits::default() };
    assert_refused(dir.path(), &tiny_base(), &limits, &["adapter_model.safetensors", "lora_A.weight", "rank 4 exceeds the limit of 3"]);
    assert!(LoraAdapter::load(dir.path(), &tiny_base(), &AdapterLimits { max_rank: 4, ..limits }).is_ok());
    let small = AdapterLimits { max_file_bytes: 64, ..AdapterLimits::default() };
    assert_refused(dir.path(), &tiny_base(), &small, &["adapter_model.safetensors", "exceeds the limit of 64 bytes"]);
}

#[test]
fn truncated_or_corrupt_safetensors_are_refused_without_panic() {
    let dir = write_dir(&config(&[]), &qv_tensors());
    let path = dir.path().join(crate::peft::WEIGHTS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    assert_refused(dir.path(), &tiny_base(), &AdapterLimits::default(), &["adapter_model.safetensors", "invalid safetensors"]);

    // Every truncation and a byte flip at every position: errors, never panics.
    let cfg_path = dir.path().join(crate::peft::CONFIG_FILE);
    let cfg = PeftConfig::parse(&cfg_path, &config(&[])).unwrap();
    let limits = AdapterLimits::default();
    let try_bytes = |b: &[u8]| LoraAdapter::from_parts(&cfg_path, &cfg, &path, b, &tiny_base(), &limits);
    assert!(try_bytes(&bytes).is_ok());
    for len in 0..bytes.len() {
        assert!(try_bytes(&bytes[..len]).is_err(), "truncated to {len}");
    }
    for pos in 0..bytes.len() {
        let mut b = bytes.clone();
        b[pos] ^= 0xa5;
        let _ = try_bytes(&b);
    }
}

#[test]
fn lora_a_without_lora_b_is_refused() {
    let mut t = qv_tensors();
    t.retain(|t| t.name != tensor_name(1, TargetModule::V, "B"));
    refused(&config(&[]), &t, &["adapter_model.safetensors", &tensor_name(1, TargetModule::V, "A"), "without its lora_B"]);
    let mut t = qv_tensors();
    t.retain(|t| t.name != tensor_name(0, TargetModule::Q, "A"));
    refused(&config(&[]), &t, &[&tensor_name(0, TargetModule::Q, "B"), "without its lora_A"]);
}

#[test]
fn layer_beyond_the_base_is_refused() {
    let mut t = qv_tensors();
    t.extend(lora_pair(1, TargetModule::Q, 4).map(|mut x| {
        x.name = x.name.replace("layers.1.", "layers.2.");
        x
    }));
    refused(&config(&[]), &t, &["adapter_model.safetensors", "layers.2.self_attn.q_proj.lora_A.weight", "layer 2 does not exist", "2 layers"]);
}

#[test]
fn dimensions_that_do_not_match_the_base_are_refused() {
    // lora_A with one column too many for q_proj's input.
    let mut t = qv_tensors();
    t[0].shape = vec![4, 9];
    t[0].values.extend([0.0; 4]);
    refused(&config(&[]), &t, &[&tensor_name(0, TargetModule::Q, "A"), "in_features 9", "input size 8"]);
    // lora_B of v_proj shaped like q_proj's output (8 instead of 4).
    let mut t = qv_tensors();
    let b = t.iter_mut().find(|x| x.name == tensor_name(0, TargetModule::V, "B")).unwrap();
    b.shape = vec![8, 4];
    b.values.extend([0.0; 16]);
    refused(&config(&[]), &t, &[&tensor_name(0, TargetModule::V, "B"), "[8, 4]", "expected [4, 4]"]);
    // lora_B's rank disagreeing with lora_A's.
    let mut t = qv_tensors();
    let b = t.iter_mut().find(|x| x.name == tensor_name(1, TargetModule::Q, "B")).unwrap();
    b.shape = vec![4, 8];
    refused(&config(&[]), &t, &[&tensor_name(1, TargetModule::Q, "B"), "expected [8, 4]"]);
    // A 3-d lora_A.
    let mut t = qv_tensors();
    t[0].shape = vec![2, 2, 8];
    refused(&config(&[]), &t, &[&tensor_name(0, TargetModule::Q, "A"), "is not [r, in]"]);
}

#[test]
fn unsupported_dtypes_are_refused() {
    for dtype in [Dtype::F64, Dtype::I32] {
        let mut t = qv_tensors();
        t[1].dtype = dtype;
        refused(&config(&[]), &t, &[&tensor_name(0, TargetModule::Q, "B"), "dtype", "not supported"]);
    }
}

#[test]
fn weights_whose_products_can_overflow_a_forward_are_refused_by_a_bound() {
    // Finite, and finite after scaling, but a million times any trained adapter's.
    let mut t = qv_tensors();
    let b_name = t[1].name.clone();
    for v in &mut t[1].values {
        *v = 1e18;
    }
    refused(&config(&[]), &t, &[&b_name, "can amplify an input", "at most 1e6"]);
    // The tiny test adapters, and a large but plausible one (alpha 256 at rank 4), load.
    load(write_dir(&config(&[]), &qv_tensors()).path(), &tiny_base()).unwrap();
    load(write_dir(&config(&[("lora_alpha", "256")]), &qv_tensors()).path(), &tiny_base()).unwrap();
}

#[test]
fn non_finite_weights_are_refused() {
    let mut t = qv_tensors();
    t[2].values[3] = f32::NAN;
    refused(&config(&[]), &t, &[&t[2].name.clone(), "not finite"]);
}

#[test]
fn tensors_other_than_projection_loras_are_refused() {
    let extra = [
        ("base_model.model.lm_head.lora_A.weight", vec![4, 8]),
        ("base_model.model.model.embed_tokens.lora_embedding_A", vec![4, 16]),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias", vec![4]),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", vec![4, 8]),
        ("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", vec![4, 8]),
        ("base_model.model.model.layers.x1.self_attn.q_proj.lora_A.weight", vec![4, 8]),
        ("base_model.model.model.layers.+1.self_attn.q_proj.lora_A.weight", vec![4, 8]),
        ("model.layers.0.self_attn.q_proj.lora_A.weight", vec![4, 8]),
        ("base_model.model.model.layers.0.input_layernorm.weight", vec![8]),
    ];
    for (name, shape) in extra {
        let mut t = qv_tensors();
        let n = shape.iter().product();
        t.push(T { name: name.to_string(), dtype: Dtype::F32, shape, values: vec![0.5; n] });
        refused(&config(&[]), &t, &["adapter_model.safetensors", name, "not a LoRA weight"]);
    }
}

#[test]
fn tensor_for_an_untargeted_module_is_refused() {
    let mut t = qv_tensors();
    t.extend(lora_pair(0, TargetModule::K, 4));
    refused(&config(&[]), &t, &["adapter_model.safetensors", &tensor_name(0, TargetModule::K, "A"), "model.layers.0.self_attn.k_proj", "not selected"]);
    refused(&config(&[]), &[], &["adapter_model.safetensors", "no LoRA tensors"]);
}

#[test]
fn a_tensor_of_rank_zero_is_refused() {
    let mut t = qv_tensors();
    t.retain(|t| !t.name.contains("layers.1.self_attn.v_proj"));
    t.extend(lora_pair(1, TargetModule::V, 0));
    refused(&config(&[]), &t, &["adapter_model.safetensors", &tensor_name(1, TargetModule::V, "A"), "rank 0"]);
}

#[test]
fn alpha_out_of_the_range_of_f32_is_refused() {
    // The largest finite f32 is about 3.4e38: an alpha above it has no f32 value to store.
    refused(&config(&[("lora_alpha", "1e39")]), &qv_tensors(), &["adapter_config.json", "key `lora_alpha`", "out of the range of f32"]);
    let text = config(&[("alpha_pattern", r#"{"q_proj": 16, "v_proj": -1e39}"#)]);
    refused(&text, &qv_tensors(), &["adapter_config.json", "key `alpha_pattern.v_proj`", "model.layers.0.self_attn.v_proj", "out of the range of f32"]);
}

#[test]
fn scaled_lora_b_that_overflows_f32_is_refused() {
    // alpha 3e38 at rank 4: scaling 7.5e37, finite; with every |b| below 1 every product is,
    // but the module's gain is far past the bound.
    let text = config(&[("lora_alpha", "3e38")]);
    refused(&text, &qv_tensors(), &["can amplify an input", "at most 1e6"]);
    // One b of 8 makes scaling * b 6e38: infinite in f32, which is what the device would store;
    // that is said first (the first module, layer 0 q_proj, holds it here).
    let mut t = qv_tensors();
    let b_name = tensor_name(0, TargetModule::Q, "B");
    t.iter_mut().find(|x| x.name == b_name).unwrap().values[5] = 8.0;
    let msg = refused(&text, &t, &["adapter_model.safetensors", &b_name, "value 8.0 at flat index 5", "not finite in f32"]);
    assert!(msg.contains("7.5e37"), "{msg}");
    // The same weights with an ordinary alpha load.
    assert!(load(write_dir(&config(&[]), &t).path(), &tiny_base()).is_ok());
}
