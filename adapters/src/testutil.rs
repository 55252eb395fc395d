//! Helpers shared by the crate's tests: the reference fixtures, tiny synthesized adapters, and
//! writing them as PEFT directories.

use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::{AdapterError, AdapterLimits, BaseShape, LoraAdapter, TargetModule};

pub(crate) const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/reference");
pub(crate) const ARCHS: [&str; 2] = ["llama", "qwen2"];
pub(crate) const VARIANTS: [&str; 3] = ["a1_r8_qv", "a2_r16_all", "a3_r4_rslora"];

pub(crate) fn fixture(arch: &str, variant: &str) -> PathBuf {
    Path::new(REFERENCE).join(arch).join("adapters").join(variant)
}

/// The reference models: hidden 128, intermediate 344, 8 heads, 2 KV heads of 16, 4 layers.
pub(crate) fn reference_base() -> BaseShape {
    BaseShape::llama(128, 344, 8, 2, 16, 4)
}

/// A tiny base for synthesized adapters: q/o 8x8, k/v 8->4, gate/up 8->12, down 12->8.
pub(crate) fn tiny_base() -> BaseShape {
    BaseShape::llama(8, 12, 2, 1, 4, 2)
}

pub(crate) fn load(dir: &Path, base: &BaseShape) -> Result<LoraAdapter, AdapterError> {
    LoraAdapter::load(dir, base, &AdapterLimits::default())
}

/// One tensor to write: name, dtype to store as, shape, values (converted from f32).
#[derive(Clone)]
pub(crate) struct T {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) values: Vec<f32>,
}

pub(crate) fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::F64 => values.iter().flat_map(|v| f64::from(*v).to_le_bytes()).collect(),
        Dtype::I32 => values.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect(),
        other => panic!("test encoder has no {other:?}"),
    }
}

/// Writes tensors with the safetensors crate (which orders them its own way).
pub(crate) fn save(path: &Path, tensors: &[T]) {
    let data: Vec<(String, Vec<u8>)> = tensors.iter().map(|t| (t.name.clone(), encode(t.dtype, &t.values))).collect();
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().zip(&data).map(|(t, (name, bytes))| (name.clone(), TensorView::new(t.dtype, t.shape.clone(), bytes).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Writes a safetensors file by hand with header entries and data in exactly the given order.
pub(crate) fn save_in_order(path: &Path, tensors: &[T]) {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let bytes = encode(t.dtype, &t.values);
        let dtype = match t.dtype {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            other => panic!("{other:?}"),
        };
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(r#""{}":{{"dtype":"{dtype}","shape":{:?},"data_offsets":[{},{}]}}"#, t.name, t.shape, data.len(), data.len() + bytes.len()));
        data.extend(bytes);
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// Reads every tensor of a fixture back as f32 `T`s (all fixtures are f32).
pub(crate) fn fixture_tensors(dir: &Path) -> Vec<T> {
    let bytes = std::fs::read(dir.join(crate::peft::WEIGHTS_FILE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<T> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| T {
            name,
            dtype: Dtype::F32,
            shape: v.shape().to_vec(),
            values: v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

pub(crate) fn tensor_name(layer: usize, m: TargetModule, half: &str) -> String {
    format!("base_model.model.model.layers.{layer}.{}.{}.lora_{half}.weight", m.hf_parent(), m.hf_name())
}

/// A and B for `(layer, module)` of the tiny base with rank `r`, values distinct per tensor and
/// exactly representable in f16 and bf16.
pub(crate) fn lora_pair(layer: usize, m: TargetModule, r: usize) -> [T; 2] {
    let (i, o) = tiny_base().dims(m);
    let val = |seed: usize, k: usize| ((seed * 31 + k * 7) % 61) as f32 / 32.0 - 0.9375;
    let seed = layer * 10 + m.index();
    [
        T { name: tensor_name(layer, m, "A"), dtype: Dtype::F32, shape: vec![r, i], values: (0..r * i).map(|k| val(seed, k)).collect() },
        T { name: tensor_name(layer, m, "B"), dtype: Dtype::F32, shape: vec![o, r], values: (0..o * r).map(|k| val(seed + 5, k)).collect() },
    ]
}

/// Config text from key/value pairs (values as raw JSON), written in the given order. The
/// defaults describe a q+v adapter with r=4, alpha=8 and carry keys the loader must ignore.
pub(crate) fn config(overrides: &[(&str, &str)]) -> String {
    let mut pairs: Vec<(String, String)> = [
        ("peft_type", r#""LORA""#),
        ("r", "4"),
        ("lora_alpha", "8"),
        ("bias", r#""none""#),
        ("use_dora", "false"),
        ("fan_in_fan_out", "false"),
        ("modules_to_save", "null"),
        ("target_modules", r#"["q_proj", "v_proj"]"#),
        ("some_future_option", r#"{"nested": [1, 2.5, null]}"#),
        ("task_type", r#""CAUSAL_LM""#),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for (k, v) in overrides {
        match pairs.iter_mut().find(|(key, _)| key == k) {
            Some(slot) => slot.1 = v.to_string(),
            None => pairs.push((k.to_string(), v.to_string())),
        }
    }
    let body: Vec<String> = pairs.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
    format!("{{{}}}", body.join(", "))
}

/// Tensors for q and v in both tiny layers at rank 4.
pub(crate) fn qv_tensors() -> Vec<T> {
    (0..2).flat_map(|l| [TargetModule::Q, TargetModule::V].into_iter().flat_map(move |m| lora_pair(l, m, 4))).collect()
}

pub(crate) fn write_dir(config_text: &str, tensors: &[T]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(crate::peft::CONFIG_FILE), config_text).unwrap();
    save(&dir.path().join(crate::peft::WEIGHTS_FILE), tensors);
    dir
}

/// Asserts that loading fails and that the message contains every needle.
pub(crate) fn assert_refused(dir: &Path, base: &BaseShape, limits: &AdapterLimits, needles: &[&str]) -> String {
    let msg = match LoraAdapter::load(dir, base, limits) {
        Ok(a) => panic!("expected a refusal mentioning {needles:?}, loaded {} modules", a.len()),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} does not mention {n:?}");
    }
    msg
}

pub(crate) fn refused(config_text: &str, tensors: &[T], needles: &[&str]) -> String {
    let dir = write_dir(config_text, tensors);
    assert_refused(dir.path(), &tiny_base(), &AdapterLimits::default(), needles)
}
