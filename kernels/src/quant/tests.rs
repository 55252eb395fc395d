use proptest::prelude::*;

use super::*;

/// Blocks and the values gguf-py dequantizes them to; see the generator's docstring for how it
/// is made and laid out.
const VECTORS: &[u8] = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/gguf/quant_vectors.bin"));

struct Vector {
    ty: GgmlType,
    bytes: Vec<u8>,
    expected: Vec<f32>,
}

fn read_vectors() -> Vec<Vector> {
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (head, tail) = rest.split_at(n);
        *rest = tail;
        head
    }
    fn u32_at(rest: &mut &[u8]) -> u32 {
        u32::from_le_bytes(take(rest, 4).try_into().unwrap())
    }
    let mut rest = VECTORS;
    assert_eq!(take(&mut rest, 4), b"LPQV");
    assert_eq!(u32_at(&mut rest), 1, "fixture version");
    let count = u32_at(&mut rest);
    let mut out = Vec::new();
    for _ in 0..count {
        let ty = GgmlType::from_id(u32_at(&mut rest)).unwrap();
        let (elems, nb) = (u32_at(&mut rest) as usize, u32_at(&mut rest) as usize);
        let bytes = take(&mut rest, nb).to_vec();
        let expected = take(&mut rest, 4 * elems).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        out.push(Vector { ty, bytes, expected });
    }
    assert!(rest.is_empty(), "trailing bytes in the fixture");
    out
}

/// Bit-exact equality (NaN included, as bits).
fn assert_bits_eq(ty: GgmlType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{ty}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{ty} element {i}: got {g:e} ({:#010x}), gguf-py {w:e} ({:#010x})", g.to_bits(), w.to_bits());
    }
}

#[test]
fn every_supported_type_matches_gguf_py_bit_for_bit() {
    let vectors = read_vectors();
    let covered: Vec<GgmlType> = vectors.iter().map(|v| v.ty).collect();
    for ty in GgmlType::SUPPORTED {
        assert!(covered.contains(&ty), "the fixture has no {ty} vector");
    }
    for v in &vectors {
        let mut out = vec![0.0; v.expected.len()];
        dequantize(v.ty, &v.bytes, &mut out).unwrap();
        assert_bits_eq(v.ty, &out, &v.expected);
        // Block by block gives the same values as the whole run.
        let (be, bb) = (v.ty.block_elems(), v.ty.block_bytes());
        for (b, want) in v.bytes.chunks(bb).zip(v.expected.chunks(be)).take(3) {
            let mut one = vec![0.0; be];
            dequantize(v.ty, b, &mut one).unwrap();
            assert_bits_eq(v.ty, &one, want);
        }
    }
}

#[test]
fn quant_tensor_rows_decode_in_parallel_as_one_run() {
    for v in read_vectors() {
        let width = if v.ty.block_elems() == 1 { 64 } else { 2 * v.ty.block_elems() };
        let rows = v.expected.len() / width;
        let elems = rows * width;
        let bytes = &v.bytes[..v.ty.row_bytes(elems).unwrap()];
        let t = QuantTensor::new(v.ty, vec![rows, width], bytes).unwrap();
        assert_eq!((t.elems(), t.row_elems()), (Some(elems), width));
        assert_bits_eq(v.ty, &t.to_f32().unwrap(), &v.expected[..elems]);
        let mut wrong = vec![0.0; elems + 1];
        assert!(t.dequantize_rows(&mut wrong).is_err());
    }
}

#[test]
fn quant_tensor_checks_its_shape() {
    let bytes = [0u8; 34 * 4];
    assert!(QuantTensor::new(GgmlType::Q8_0, vec![2, 64], &bytes).is_ok());
    assert!(QuantTensor::new(GgmlType::Q8_0, vec![4, 1, 32], &bytes).is_ok());
    let e = QuantTensor::new(GgmlType::Q8_0, vec![3, 64], &bytes).unwrap_err().to_string();
    assert!(e.contains("Q8_0") && e.contains("[3, 64]") && e.contains("204") && e.contains("136"), "{e}");
    let e = QuantTensor::new(GgmlType::Q8_0, vec![8, 16], &bytes).unwrap_err().to_string();
    assert!(e.contains("16") && e.contains("32-element"), "{e}");
    assert!(QuantTensor::new(GgmlType::Q8_0, vec![usize::MAX, 64], &bytes).is_err());
    assert!(QuantTensor::new(GgmlType::F32, vec![usize::MAX / 2, 4], &bytes).is_err());
    // Empty tensors and scalars.
    let t = QuantTensor::new(GgmlType::Q4_K, vec![0, 256], &[]).unwrap();
    assert_eq!(t.to_f32().unwrap(), Vec::<f32>::new());
    let one = 1.5f32.to_le_bytes();
    assert_eq!(QuantTensor::new(GgmlType::F32, vec![], &one).unwrap().to_f32().unwrap(), vec![1.5]);
    // Fields set by hand are checked again.
    let t = QuantTensor { ty: GgmlType::Q8_0, shape: vec![5, 32], bytes: &bytes };
    assert!(t.to_f32().is_err());
    // A known type that cannot be decoded is refused by name, after the shape check passes.
    let t = QuantTensor::new(GgmlType::Q2_K, vec![1, 256], &[0; 84]).unwrap();
    assert!(t.to_f32().unwrap_err().to_string().contains("Q2_K"));
}

#[test]
fn wrong_lengths_are_errors() {
    let mut out = vec![0.0; 512];
    for ty in GgmlType::SUPPORTED {
        let right = ty.row_bytes(512).unwrap();
        assert!(dequantize(ty, &vec![0; right], &mut out).is_ok(), "{ty}");
        for wrong in [0, right - 1, right + 1, 2 * right] {
            let e = dequantize(ty, &vec![0; wrong], &mut out).unwrap_err().to_string();
            assert!(e.contains(ty.name()) && e.contains(&right.to_string()) && e.contains(&wrong.to_string()), "{ty}: {e}");
        }
    }
    // Not a whole number of blocks.
    let e = dequantize(GgmlType::Q4_K, &[0; 144], &mut [0.0; 255]).unwrap_err().to_string();
    assert!(e.contains("255") && e.contains("256-element"), "{e}");
    assert!(dequantize(GgmlType::Q4_0, &[0; 18], &mut [0.0; 33]).is_err());
    // Nothing is decoded from nothing.
    assert!(dequantize(GgmlType::Q6_K, &[], &mut []).is_ok());
}

#[test]
fn unsupported_types_are_refused_by_name() {
    for ty in GgmlType::ALL {
        let elems = ty.block_elems();
        let bytes = vec![0; ty.block_bytes()];
        let result = dequantize(ty, &bytes, &mut vec![0.0; elems]);
        assert_eq!(result.is_ok(), ty.is_supported(), "{ty}");
        if let Err(e) = result {
            let e = e.to_string();
            assert!(e.contains(&format!("type {ty} ")) && e.contains("Q4_K"), "{e}");
        }
    }
}

#[test]
fn type_ids_round_trip_and_unknown_ids_are_none() {
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        assert_eq!(ty.to_string(), ty.name());
        assert!(ty.block_elems() > 0 && ty.block_bytes() > 0);
    }
    for id in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000, u32::MAX] {
        assert_eq!(GgmlType::from_id(id), None, "{id}");
    }
    assert_eq!(GgmlType::from_id(12), Some(GgmlType::Q4_K));
    assert_eq!(GgmlType::from_id(30).map(GgmlType::name), Some("BF16"));
    assert_eq!(GgmlType::from_id(39), Some(GgmlType::MXFP4));
}

#[test]
fn row_bytes_follow_the_block_table() {
    use GgmlType::*;
    let table = [(F32, 1, 4), (F16, 1, 2), (BF16, 1, 2), (Q4_0, 32, 18), (Q4_1, 32, 20), (Q5_0, 32, 22), (Q5_1, 32, 24), (Q8_0, 32, 34), (Q8_1, 32, 36)];
    let k = [(Q2_K, 84), (Q3_K, 110), (Q4_K, 144), (Q5_K, 176), (Q6_K, 210), (Q8_K, 292), (IQ2_XS, 74), (IQ4_XS, 136), (TQ1_0, 54), (TQ2_0, 66)];
    for (ty, elems, bytes) in table.into_iter().chain(k.map(|(t, b)| (t, 256, b))) {
        assert_eq!((ty.block_elems(), ty.block_bytes()), (elems, bytes), "{ty}");
    }
    assert_eq!(Q4_K.row_bytes(576 * 256), Some(576 * 144));
    assert_eq!(Q4_K.row_bytes(576), None);
    assert_eq!(Q8_0.row_bytes(0), Some(0));
    assert_eq!(F32.row_bytes(usize::MAX), None);
    assert_eq!(Q8_K.row_bytes(usize::MAX / 256 * 256), None); // 2^56 blocks of 292 bytes
}

/// Where each quantized type keeps its f16 scales, within a block.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Any bytes of the right length decode without panicking; a quantized block whose f16
    /// scales are finite decodes to finite values, and the float types widen exactly.
    #[test]
    fn random_blocks_decode_without_panicking(which in 0..GgmlType::SUPPORTED.len(), raw in proptest::collection::vec(any::<u8>(), 0..1500)) {
        let ty = GgmlType::SUPPORTED[which];
        let blocks = raw.len() / ty.block_bytes();
        let bytes = &raw[..blocks * ty.block_bytes()];
        let elems = blocks * ty.block_elems();
        let mut out = vec![0.0; elems];
        prop_assert!(dequantize(ty, bytes, &mut out).is_ok());
        let bb = ty.block_bytes();
        for (b, block) in bytes.chunks(bb).enumerate() {
            let finite_scales = scale_offsets(ty).iter().all(|&o| half::f16::from_le_bytes([block[o], block[o + 1]]).is_finite());
            if !scale_offsets(ty).is_empty() && finite_scales {
                let ys = &out[b * ty.block_elems()..(b + 1) * ty.block_elems()];
                prop_assert!(ys.iter().all(|y| y.is_finite()), "{ty} block {b}: {ys:?}");
            }
        }
        if ty == GgmlType::BF16 {
            for (y, b) in out.iter().zip(bytes.chunks(2)) {
                prop_assert_eq!(y.to_bits() >> 16, u32::from(u16::from_le_bytes([b[0], b[1]])));
            }
        }
    }

    /// Any lengths at all are either right (and decoded) or an error, never a panic.
    #[test]
    fn any_lengths_are_decoded_or_refused(id in 0u32..45, nbytes in 0usize..2000, elems in 0usize..2000) {
        if let Some(ty) = GgmlType::from_id(id) {
            let ok = dequantize(ty, &vec![0x5A; nbytes], &mut vec![0.0; elems]).is_ok();
            prop_assert_eq!(ok, ty.is_supported() && ty.row_bytes(elems) == Some(nbytes));
        }
    }
}
