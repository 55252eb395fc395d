//! Property tests: whatever a tenant uploads, the loaders return `Ok` or a typed
//! [`AdapterError`] about a file of the adapter's directory, and never panic. Generated inputs:
//! config text and JSON trees built from PEFT's keys, a valid weights file with random edits or
//! random bytes, and manifests built from the manifest's keys or edited from a valid one.

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::Value;

use crate::peft::{CONFIG_FILE, WEIGHTS_FILE};
use crate::testutil::*;
use crate::{AdapterError, AdapterLimits, LoraAdapter, MANIFEST_FILE};

const PEFT_KEYS: &[&str] = &[
    "peft_type",
    "r",
    "lora_alpha",
    "bias",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "fan_in_fan_out",
    "modules_to_save",
    "lora_bias",
    "use_qalora",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "task_type",
];

const MANIFEST_KEYS: &[&str] = &["format_version", "use_rslora", "modules", "content_hash", "layer", "module", "rank", "alpha", "scaling", "lora_a", "lora_b"];

/// Strings that mean something to the parsers: module names, regexes (some too big to
/// compile), PEFT values, tensor names of the tiny adapter.
const WORDS: &[&str] = &[
    "q_proj",
    "v_proj",
    "down_proj",
    "lm_head",
    "all-linear",
    "none",
    "LORA",
    "layers",
    "model.layers.1.self_attn.q_proj",
    "layers.0.self_attn.v_proj",
    ".*",
    ".*\\.(q|v)_proj",
    "(q|v)_proj",
    "(",
    "\\w{1000}",
    "(a{1000}){1000}",
    "layers\\.\\d+",
    "",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight",
    "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight",
];

fn word() -> impl Strategy<Value = String> {
    prop_oneof![prop::sample::select(WORDS).prop_map(String::from), "[a-z_.0-9\\\\()|*+?{},^$-]{0,16}", any::<String>()]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (-2i64..40).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(&[0.5, 2.0, 8.0, 1e39, -1e39, 3.4e38, 3e38, 1e-45, -0.0, 4.5][..]).prop_map(Value::from),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::Bool), number(), word().prop_map(Value::String)]
}

fn key(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![3 => prop::sample::select(keys).prop_map(String::from), 1 => word()]
}

/// JSON trees of depth at most 3 whose object keys are mostly from `keys`.
fn json(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key(keys), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A top-level object with up to 12 entries.
fn object(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    prop::collection::vec((key(keys), json(keys)), 0..12).prop_map(|kv| Value::Object(kv.into_iter().collect()))
}

/// An edit of a byte string.
#[derive(Debug, Clone)]
enum Edit {
    Xor(Index, u8),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Remove(Index, usize),
    /// Replaces the 8-byte header length of a safetensors file.
    HeaderLen(u64),
}

fn edit() -> impl Strategy<Value = Edit> {
    let token = prop_oneof![
        prop::collection::vec(any::<u8>(), 1..8),
        prop::sample::select(&["\"", "{", "}", "[", "]", ",", ":", "0", "-1", "99999999999999999999", "\"F16\"", "\"I64\"", "\"shape\""][..])
            .prop_map(|s| s.as_bytes().to_vec()),
    ];
    prop_oneof![
        4 => (any::<Index>(), 1..=255u8).prop_map(|(i, x)| Edit::Xor(i, x)),
        1 => any::<Index>().prop_map(Edit::Truncate),
        2 => (any::<Index>(), token).prop_map(|(i, t)| Edit::Insert(i, t)),
        1 => (any::<Index>(), 1..16usize).prop_map(|(i, n)| Edit::Remove(i, n)),
        1 => prop_oneof![0..4096u64, any::<u64>()].prop_map(Edit::HeaderLen),
    ]
}

fn apply(bytes: &mut Vec<u8>, e: &Edit) {
    let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len) };
    match e {
        Edit::Xor(i, x) => {
            if !bytes.is_empty() {
                let p = at(i, bytes.len());
                bytes[p] ^= x;
            }
        }
        Edit::Truncate(i) => bytes.truncate(at(i, bytes.len())),
        Edit::Insert(i, t) => {
            let p = at(i, bytes.len() + 1);
            bytes.splice(p..p, t.iter().copied());
        }
        Edit::Remove(i, n) => {
            let p = at(i, bytes.len());
            bytes.drain(p..(p + n).min(bytes.len()));
        }
        Edit::HeaderLen(n) => {
            if bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&n.to_le_bytes());
            }
        }
    }
}

/// The tiny q+v adapter: config text, weights bytes, manifest JSON, and the adapter itself.
struct Valid {
    config: String,
    weights: Vec<u8>,
    manifest: Value,
    adapter: LoraAdapter,
}

fn valid() -> &'static Valid {
    static VALID: OnceLock<Valid> = OnceLock::new();
    VALID.get_or_init(|| {
        let config = config(&[]);
        let dir = write_dir(&config, &qv_tensors());
        let (adapter, manifest) = LoraAdapter::load_with_manifest(dir.path(), &tiny_base(), &AdapterLimits::default()).unwrap();
        let weights = std::fs::read(dir.path().join(WEIGHTS_FILE)).unwrap();
        Valid { config, weights, manifest: serde_json::to_value(&manifest).unwrap(), adapter }
    })
}

/// A directory holding the given files (those that are `Some`).
fn dir_with(config: Option<&[u8]>, weights: Option<&[u8]>, manifest: Option<&[u8]>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, content) in [(CONFIG_FILE, config), (WEIGHTS_FILE, weights), (MANIFEST_FILE, manifest)] {
        if let Some(c) = content {
            std::fs::write(dir.path().join(name), c).unwrap();
        }
    }
    dir
}

/// Every error is about one of the files of `dir`, and says something.
fn check_error(dir: &Path, result: &Result<LoraAdapter, AdapterError>) -> Result<(), TestCaseError> {
    let Err(e) = result else { return Ok(()) };
    let path = match e {
        AdapterError::Io { path, .. }
        | AdapterError::MissingFile { path, .. }
        | AdapterError::PickleCheckpoint { path }
        | AdapterError::ConfigJson { path, .. }
        | AdapterError::Config { path, .. }
        | AdapterError::Safetensors { path, .. }
        | AdapterError::Tensor { path, .. } => path,
    };
    prop_assert_eq!(path.parent(), Some(dir), "{}", e);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    prop_assert!([CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE].contains(&name), "{}", e);
    prop_assert!(e.to_string().contains(name));
    Ok(())
}

/// Loads `dir` through the PEFT path; when that succeeds, the manifest path must give the same.
fn check_peft(dir: &Path) -> Result<(), TestCaseError> {
    let limits = AdapterLimits::default();
    let loaded = LoraAdapter::load(dir, &tiny_base(), &limits);
    check_error(dir, &loaded)?;
    if let Ok(adapter) = loaded {
        let (again, manifest) = LoraAdapter::load_with_manifest(dir, &tiny_base(), &limits).unwrap();
        prop_assert_eq!(&again, &adapter);
        manifest.write(dir).unwrap();
        prop_assert_eq!(LoraAdapter::load_validated(dir, &tiny_base(), &limits).unwrap(), adapter);
    }
    Ok(())
}

/// Loads `dir` through the manifest path: an adapter it accepts computes exactly what was
/// validated (alpha and use_rslora are descriptive, see [`crate::validated`]).
fn check_validated(dir: &Path) -> Result<(), TestCaseError> {
    let result = LoraAdapter::load_validated(dir, &tiny_base(), &AdapterLimits::default());
    check_error(dir, &result)?;
    if let Ok(adapter) = result {
        let original = &valid().adapter;
        prop_assert_eq!(adapter.content_hash(), original.content_hash());
        for (m, o) in adapter.modules().zip(original.modules()) {
            prop_assert_eq!((m.layer, m.module, m.rank, m.scaling.to_bits()), (o.layer, o.module, o.rank, o.scaling.to_bits()));
            prop_assert!(m.a == o.a && m.b == o.b);
        }
    }
    Ok(())
}

fn edited(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for e in edits {
        apply(&mut b, e);
    }
    b
}

/// Config file contents: arbitrary strings, or the valid config with byte edits (which may
/// leave it invalid UTF-8).
fn config_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![any::<String>().prop_map(String::into_bytes), prop::collection::vec(edit(), 1..4).prop_map(|edits| edited(valid().config.as_bytes(), &edits)),]
}

/// Config JSON: objects and trees of PEFT keys, and the valid config with keys replaced.
fn config_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        2 => object(PEFT_KEYS),
        1 => json(PEFT_KEYS),
        4 => prop::collection::vec((key(PEFT_KEYS), json(PEFT_KEYS)), 1..4).prop_map(|kv| {
            let mut v: Value = serde_json::from_str(&valid().config).unwrap();
            for (k, x) in kv {
                v[k] = x;
            }
            v
        }),
    ]
}

/// The header JSON and the data of a safetensors file.
fn split_safetensors(bytes: &[u8]) -> (Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), &bytes[8 + n..])
}

fn join_safetensors(header: &Value, data: &[u8]) -> Vec<u8> {
    let header = header.to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// Values that mean something in a safetensors header.
fn header_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(&["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3"][..]).prop_map(Value::from),
        prop::collection::vec(0..10u64, 0..4).prop_map(Value::from),
        (0..2048u64, 0..2048u64).prop_map(|(a, b)| Value::from(vec![a, b])),
        (0..9u64).prop_map(Value::from),
        json(&["dtype", "shape", "data_offsets", "__metadata__"]),
    ]
}

/// An edit of a safetensors file that keeps its framing, so that it reaches the checks past
/// the header parser.
#[derive(Debug, Clone)]
enum StEdit {
    /// Replaces a node of the header JSON.
    Node(Index, Value),
    /// Renames a tensor.
    Rename(Index, String),
    /// Flips bits in the data.
    Data(Index, u8),
}

fn st_edit() -> impl Strategy<Value = StEdit> {
    prop_oneof![
        3 => (any::<Index>(), header_value()).prop_map(|(i, v)| StEdit::Node(i, v)),
        1 => (any::<Index>(), word()).prop_map(|(i, w)| StEdit::Rename(i, w)),
        2 => (any::<Index>(), 1..=255u8).prop_map(|(i, x)| StEdit::Data(i, x)),
    ]
}

fn st_edited(edits: &[StEdit]) -> Vec<u8> {
    let (mut header, data) = split_safetensors(&valid().weights);
    let mut data = data.to_vec();
    for e in edits {
        match e {
            StEdit::Node(i, v) => replace_node(&mut header, i, v.clone()),
            StEdit::Rename(i, name) => {
                if let Value::Object(map) = &mut header
                    && !map.is_empty()
                {
                    let old = map.keys().nth(i.index(map.len())).unwrap().clone();
                    let v = map.remove(&old).unwrap();
                    map.insert(name.clone(), v);
                }
            }
            StEdit::Data(i, x) => {
                let p = i.index(data.len());
                data[p] ^= x;
            }
        }
    }
    join_safetensors(&header, &data)
}

/// Weights: the valid file with structured edits, with raw byte edits, random bytes, and
/// random bytes behind a header length that fits them.
fn weights_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(st_edit(), 1..4).prop_map(|edits| st_edited(&edits)),
        2 => prop::collection::vec(edit(), 1..4).prop_map(|edits| edited(&valid().weights, &edits)),
        1 => prop::collection::vec(any::<u8>(), 0..2048),
        1 => prop::collection::vec(any::<u8>(), 0..512).prop_map(|b| {
            let mut out = (b.len() as u64).to_le_bytes().to_vec();
            out.extend(b);
            out
        }),
    ]
}

/// JSON pointers to every node of `v`.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(map) => {
            for (k, x) in map {
                pointers(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// Replaces the node of `v` that `i` picks (any node, the root included).
fn replace_node(v: &mut Value, i: &Index, x: Value) {
    let mut all = Vec::new();
    pointers(v, String::new(), &mut all);
    if let Some(node) = v.pointer_mut(&all[i.index(all.len())]) {
        *node = x;
    }
}

/// Values of the types the manifest's fields have, near the valid ones.
fn manifest_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => (0..6u64).prop_map(Value::from),
        2 => number(),
        3 => word().prop_map(Value::from),
        1 => prop::sample::select(&["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"][..]).prop_map(Value::from),
        1 => any::<bool>().prop_map(Value::from),
        1 => json(MANIFEST_KEYS),
    ]
}

/// An edit of the valid manifest.
#[derive(Debug, Clone)]
enum ManifestEdit {
    Node(Index, Value),
    /// Removes the module entry `Index` picks, or duplicates it.
    Entry(Index, bool),
    /// Removes a key of an entry.
    Key(Index, Index),
}

fn manifest_edit() -> impl Strategy<Value = ManifestEdit> {
    prop_oneof![
        4 => (any::<Index>(), manifest_value()).prop_map(|(i, v)| ManifestEdit::Node(i, v)),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(i, dup)| ManifestEdit::Entry(i, dup)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(i, k)| ManifestEdit::Key(i, k)),
    ]
}

fn manifest_edited(edits: &[ManifestEdit]) -> Vec<u8> {
    let mut m = valid().manifest.clone();
    for e in edits {
        match e {
            ManifestEdit::Node(i, x) => replace_node(&mut m, i, x.clone()),
            ManifestEdit::Entry(i, dup) => {
                if let Some(entries) = m.get_mut("modules").and_then(Value::as_array_mut)
                    && !entries.is_empty()
                {
                    let p = i.index(entries.len());
                    if *dup {
                        let x = entries[p].clone();
                        entries.push(x);
                    } else {
                        entries.remove(p);
                    }
                }
            }
            ManifestEdit::Key(i, k) => {
                if let Some(entries) = m.get_mut("modules").and_then(Value::as_array_mut)
                    && !entries.is_empty()
                {
                    let p = i.index(entries.len());
                    if let Some(map) = entries[p].as_object_mut()
                        && !map.is_empty()
                    {
                        let key = map.keys().nth(k.index(map.len())).unwrap().clone();
                        map.remove(&key);
                    }
                }
            }
        }
    }
    m.to_string().into_bytes()
}

/// Manifest contents: the valid manifest with edits, objects of manifest keys, and arbitrary
/// strings.
fn manifest_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => prop::collection::vec(manifest_edit(), 1..3).prop_map(|edits| manifest_edited(&edits)),
        2 => object(MANIFEST_KEYS).prop_map(|v| v.to_string().into_bytes()),
        1 => any::<String>().prop_map(String::into_bytes),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (a) Arbitrary text as adapter_config.json, next to valid weights.
    #[test]
    fn any_config_text_is_ok_or_a_typed_error(config in config_bytes()) {
        let dir = dir_with(Some(&config), Some(&valid().weights), None);
        check_peft(dir.path())?;
    }

    /// (a) Arbitrary JSON values as adapter_config.json, next to valid weights.
    #[test]
    fn any_config_json_is_ok_or_a_typed_error(config in config_json()) {
        let dir = dir_with(Some(config.to_string().as_bytes()), Some(&valid().weights), None);
        check_peft(dir.path())?;
    }

    /// (b) Edited or random weights, through the manifest path and the PEFT path.
    #[test]
    fn any_weights_are_ok_or_a_typed_error(weights in weights_bytes()) {
        let manifest = valid().manifest.to_string();
        let dir = dir_with(Some(valid().config.as_bytes()), Some(&weights), Some(manifest.as_bytes()));
        check_validated(dir.path())?;
        check_peft(dir.path())?;
    }

    /// (c) Arbitrary manifests next to valid weights.
    #[test]
    fn any_manifest_is_ok_or_a_typed_error(manifest in manifest_bytes()) {
        let dir = dir_with(None, Some(&valid().weights), Some(&manifest));
        check_validated(dir.path())?;
    }
}
