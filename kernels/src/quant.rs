//! GGML tensor types and their dequantization to f32.
//!
//! GGUF files store each tensor as one [`GgmlType`]: a plain float or integer type (one element
//! per "block"), or a block-quantized type, where a fixed number of elements (32 for the legacy
//! `Q4_0`..`Q8_1`, 256 for the K-quants) share one packed block of bytes with their f16 scales.
//! Blocks run along a tensor's innermost dimension, so every row of a quantized matrix is a
//! whole number of blocks.
//!
//! [`dequantize`] decodes the types in [`GgmlType::is_supported`] bit-exactly as ggml's scalar
//! reference (`dequantize_row_*` in `ggml-quants.c`) does: the same exact f16-to-f32 widening,
//! the same float operations in the same order (no fused multiply-adds), so a model dequantized
//! here computes what llama.cpp's reference computes. Every other type is refused with an error
//! naming it. Bytes are read little-endian through `from_le_bytes`, never by casting pointers,
//! and every length is checked first: no input makes this code panic.
//!
//! [`QuantTensor`] is a borrowed, shape-checked view of a tensor's blocks, for kernels that work
//! on quantized weights directly; [`QuantTensor::dequantize_rows`] decodes one in parallel.
//!
//! Block layouts (all scales f16, `qs` packed quants; see `ggml-common.h`):
//!
//! | Type | Elements | Bytes | Fields in order |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18 | d, qs\[16\] (low nibbles: elements 0..16, high nibbles: 16..32) |
//! | Q4_1 | 32 | 20 | d, m, qs\[16\] |
//! | Q5_0 | 32 | 22 | d, qh (u32: the fifth bit of each element), qs\[16\] |
//! | Q5_1 | 32 | 24 | d, m, qh, qs\[16\] |
//! | Q8_0 | 32 | 34 | d, i8 qs\[32\] |
//! | Q4_K | 256 | 144 | d, dmin, scales\[12\] (8 six-bit scales and mins), qs\[128\] |
//! | Q5_K | 256 | 176 | d, dmin, scales\[12\], qh\[32\], qs\[128\] |
//! | Q6_K | 256 | 210 | ql\[128\], qh\[64\], i8 scales\[16\], d |

use rayon::prelude::*;

use crate::{KernelError, Result};

/// Elements per K-quant super-block (ggml's `QK_K`).
const QK_K: usize = 256;

/// A GGML tensor type, by its id in GGUF files (`enum ggml_type` in `ggml.h`). Ids 4, 5 and
/// 31..=33, 36..=38 belonged to types ggml has removed; they, like any id not listed, are not a
/// `GgmlType` ([`GgmlType::from_id`] gives `None`).
#[allow(non_camel_case_types)] // The names are ggml's, as every GGUF tool prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    /// Activations only: Q8_0 with the block sum `d·Σq` stored beside `d`.
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    /// Activations only: 256 i8 quants with an f32 scale and 16 partial sums.
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
    Q2_0 = 42,
}

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 35] = {
        use GgmlType::*;
        [
            F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS,
            I8, I16, I32, I64, F64, IQ1_M, BF16, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0, Q2_0,
        ]
    };

    /// The types [`dequantize`] decodes: those common GGUF files are made of (a "Q4_K_M" file
    /// mixes Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors).
    pub const SUPPORTED: [GgmlType; 11] = {
        use GgmlType::*;
        [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K]
    };

    /// The type with GGUF id `id`, or `None` for an id no current ggml type has.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The id GGUF files store for this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type's name as gguf-py and llama.cpp's tools print it ("Q4_K", "BF16").
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
            Q2_0 => "Q2_0",
        }
    }

    /// Elements per block (1 for the plain float and integer types).
    pub fn block_elems(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 | Q2_0 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block (`sizeof(block_*)` in `ggml-common.h`; the element size for plain types).
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            I8 => 1,
            F16 | BF16 | I16 => 2,
            F32 | I32 => 4,
            F64 | I64 => 8,
            Q4_0 | IQ4_NL => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K | IQ3_S => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS | TQ2_0 => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            MXFP4 => 17,
            NVFP4 => 36,
            Q1_0 | Q2_0 => 18,
        }
    }

    /// Bytes that `elems` consecutive elements take: `None` if `elems` is not a whole number of
    /// blocks, or if the size overflows `usize`.
    pub fn row_bytes(self, elems: usize) -> Option<usize> {
        let block = self.block_elems();
        if !elems.is_multiple_of(block) {
            return None;
        }
        (elems / block).checked_mul(self.block_bytes())
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The names of [`GgmlType::SUPPORTED`], for messages.
fn supported_list() -> String {
    GgmlType::SUPPORTED.map(GgmlType::name).join(", ")
}

/// Decodes `out.len()` elements of type `ty` from `bytes` into `out`.
///
/// `bytes` must hold exactly those elements: `out.len()` a whole number of blocks and
/// `bytes.len() == ty.row_bytes(out.len())`. A length that disagrees, or a type outside
/// [`GgmlType::SUPPORTED`], is a [`KernelError::Shape`]. The values are bit-exact with ggml's
/// scalar `dequantize_row_*` (NaN payloads aside: an f16 signalling NaN may come out quieted).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    const OP: &str = "dequantize";
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| blocks::<4, 1>(b, y, |b, y| y[0] = f32::from_le_bytes(*b)),
        GgmlType::F16 => |b, y| blocks::<2, 1>(b, y, |b, y| y[0] = f16(*b)),
        // bf16 is the upper half of an f32: widening is a shift, exact for every value, NaNs included.
        GgmlType::BF16 => |b, y| blocks::<2, 1>(b, y, |b, y| y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16)),
        GgmlType::Q4_0 => |b, y| blocks(b, y, q4_0),
        GgmlType::Q4_1 => |b, y| blocks(b, y, q4_1),
        GgmlType::Q5_0 => |b, y| blocks(b, y, q5_0),
        GgmlType::Q5_1 => |b, y| blocks(b, y, q5_1),
        GgmlType::Q8_0 => |b, y| blocks(b, y, q8_0),
        GgmlType::Q4_K => |b, y| blocks(b, y, q4_k),
        GgmlType::Q5_K => |b, y| blocks(b, y, q5_k),
        GgmlType::Q6_K => |b, y| blocks(b, y, q6_k),
        _ => return Err(KernelError::Shape { op: OP, detail: format!("GGML type {ty} cannot be dequantized (supported: {})", supported_list()) }),
    };
    let Some(want) = ty.row_bytes(out.len()) else {
        return Err(KernelError::Shape {
            op: OP,
            detail: format!("{} {ty} elements are not a whole number of {}-element blocks", out.len(), ty.block_elems()),
        });
    };
    if bytes.len() != want {
        return Err(KernelError::Shape { op: OP, detail: format!("{} {ty} elements take {want} bytes, got {}", out.len(), bytes.len()) });
    }
    decode(bytes, out);
    Ok(())
}

/// Runs `decode` over each `B`-byte block of `bytes` and its `N` outputs. The caller has
/// checked that both slices hold the same whole number of blocks.
fn blocks<const B: usize, const N: usize>(bytes: &[u8], out: &mut [f32], decode: impl Fn(&[u8; B], &mut [f32; N])) {
    let (input, _) = bytes.as_chunks::<B>();
    let (output, _) = out.as_chunks_mut::<N>();
    debug_assert_eq!(input.len(), output.len());
    for (block, y) in input.iter().zip(output) {
        decode(block, y);
    }
}

/// A little-endian f16 widened to f32 (exact, as ggml's `GGML_FP16_TO_FP32`).
fn f16(b: [u8; 2]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

/// Q4_0: 32 four-bit quants centred on 8, `y = (q - 8) * d`.
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16([b[0], b[1]]);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = (i32::from(q & 0x0F) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1: 32 four-bit quants with a minimum, `y = q * d + m`.
fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16([b[0], b[1]]);
    let m = f16([b[2], b[3]]);
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = f32::from(q & 0x0F) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The fifth bits of a Q5 block: bit `j` of `qh` belongs to element `j`, returned as 0 or 16.
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    let low = (((qh >> j) << 4) & 0x10) as u8;
    let high = ((qh >> (j + 12)) & 0x10) as u8;
    (low, high)
}

/// Q5_0: 32 five-bit quants centred on 16, `y = (q - 16) * d`.
fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16([b[0], b[1]]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = (i32::from((q & 0x0F) | h0) - 16) as f32 * d;
        y[j + 16] = (i32::from((q >> 4) | h1) - 16) as f32 * d;
    }
}

/// Q5_1: 32 five-bit quants with a minimum, `y = q * d + m`.
fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16([b[0], b[1]]);
    let m = f16([b[2], b[3]]);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = f32::from((q & 0x0F) | h0) * d + m;
        y[j + 16] = f32::from((q >> 4) | h1) * d + m;
    }
}

/// Q8_0: 32 signed bytes, `y = q * d`.
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16([b[0], b[1]]);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// The six-bit scale and minimum of sub-block `j` (0..8) of a Q4_K/Q5_K block, from its 12
/// packed bytes (ggml's `get_scale_min_k4`): sub-blocks 0..4 keep theirs in the low six bits of
/// bytes `j` and `j + 4`; sub-blocks 4..8 in the nibbles of byte `j + 4`, with the top two bits
/// borrowed from the spare high bits of bytes `j - 4` and `j`.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) }
}

/// The `(d * scale, dmin * min)` pair of each of the 8 sub-blocks of a Q4_K/Q5_K block.
fn k4_scales(d: f32, dmin: f32, scales: &[u8]) -> [(f32, f32); 8] {
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        (d * f32::from(sc), dmin * f32::from(m))
    })
}

/// Q4_K: 8 sub-blocks of 32 four-bit quants, each with its own scale and minimum,
/// `y = (d * sc) * q - (dmin * m)`. Each 64-element chunk reads 32 bytes of `qs`: the low
/// nibbles are its first sub-block, the high nibbles its second.
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let sub = k4_scales(f16([b[0], b[1]]), f16([b[2], b[3]]), &b[4..16]);
    for c in 0..4 {
        let qs = &b[16 + 32 * c..48 + 32 * c];
        let ((d1, m1), (d2, m2)) = (sub[2 * c], sub[2 * c + 1]);
        let out = &mut y[64 * c..64 * c + 64];
        for (l, &q) in qs.iter().enumerate() {
            out[l] = d1 * f32::from(q & 0x0F) - m1;
            out[l + 32] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// Q5_K: Q4_K with a fifth bit per element: bit `2c` of `qh[l]` for element `l` of chunk
/// `c`'s first sub-block, bit `2c + 1` for its second.
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let sub = k4_scales(f16([b[0], b[1]]), f16([b[2], b[3]]), &b[4..16]);
    let qh = &b[16..48];
    for c in 0..4 {
        let qs = &b[48 + 32 * c..80 + 32 * c];
        let ((d1, m1), (d2, m2)) = (sub[2 * c], sub[2 * c + 1]);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let out = &mut y[64 * c..64 * c + 64];
        for (l, (&q, &h)) in qs.iter().zip(qh).enumerate() {
            let hi1 = if h & u1 != 0 { 16 } else { 0 };
            let hi2 = if h & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * f32::from((q & 0x0F) + hi1) - m1;
            out[l + 32] = d2 * f32::from((q >> 4) + hi2) - m2;
        }
    }
}

/// Q6_K: 16 sub-blocks of 16 six-bit quants centred on 32, each with a signed 8-bit scale,
/// `y = (d * sc) * q`. Each 128-element half reads 64 bytes of `ql` (low four bits) and 32 of
/// `qh` (two high bits each, for four elements 32 apart).
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16([b[208], b[209]]);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..160 + 32 * half];
        let sc = &b[192 + 8 * half..200 + 8 * half];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let h = qh[l];
            let q1 = i32::from((ql[l] & 0x0F) | ((h & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | ((h >> 6) << 4)) - 32;
            let scale = |k: usize| d * f32::from(sc[is + k] as i8);
            out[l] = scale(0) * q1 as f32;
            out[l + 32] = scale(2) * q2 as f32;
            out[l + 64] = scale(4) * q3 as f32;
            out[l + 96] = scale(6) * q4 as f32;
        }
    }
}

/// A tensor's GGML blocks, borrowed from where they are stored (a memory-mapped GGUF), with
/// its shape. Rows are the innermost dimension (the last of `shape`), each a whole number of
/// blocks, stored one after another.
#[derive(Debug, Clone)]
pub struct QuantTensor<'a> {
    pub ty: GgmlType,
    /// Dimensions in PyTorch order, outermost first (a GGUF's `ne` reversed).
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

impl<'a> QuantTensor<'a> {
    /// A view of `bytes` as a `ty` tensor of `shape`, checked: the innermost dimension must be
    /// a whole number of blocks and `bytes` exactly `rows × row_bytes` long.
    pub fn new(ty: GgmlType, shape: Vec<usize>, bytes: &'a [u8]) -> Result<Self> {
        let t = Self { ty, shape, bytes };
        t.layout()?;
        Ok(t)
    }

    /// Elements in the tensor (1 for a shape of no dimensions).
    pub fn elems(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Elements per row: the innermost dimension.
    pub fn row_elems(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// `(rows, elements per row, bytes per row)`, checked against `bytes`.
    fn layout(&self) -> Result<(usize, usize, usize)> {
        const OP: &str = "QuantTensor";
        let ty = self.ty;
        let inner = self.row_elems();
        let elems = self.elems().ok_or_else(|| KernelError::Shape { op: OP, detail: format!("shape {:?} overflows", self.shape) })?;
        let row_bytes = ty.row_bytes(inner).ok_or_else(|| KernelError::Shape {
            op: OP,
            detail: format!("rows of {inner} {ty} elements are not a whole number of {}-element blocks", ty.block_elems()),
        })?;
        let rows = elems.checked_div(inner).unwrap_or(0);
        let want = rows.checked_mul(row_bytes).ok_or_else(|| KernelError::Shape { op: OP, detail: format!("shape {:?} overflows", self.shape) })?;
        if self.bytes.len() != want {
            return Err(KernelError::Shape { op: OP, detail: format!("a {ty} tensor of shape {:?} takes {want} bytes, got {}", self.shape, self.bytes.len()) });
        }
        Ok((rows, inner, row_bytes))
    }

    /// Decodes the whole tensor into `out` (which must hold exactly its elements), rows in
    /// parallel. Errors as [`dequantize`] does, or if the view's fields disagree.
    pub fn dequantize_rows(&self, out: &mut [f32]) -> Result<()> {
        let (rows, inner, row_bytes) = self.layout()?;
        if out.len() != rows * inner {
            return Err(KernelError::Shape { op: "dequantize_rows", detail: format!("{} outputs for a tensor of shape {:?}", out.len(), self.shape) });
        }
        if rows == 0 || inner == 0 {
            return dequantize(self.ty, &[], &mut []);
        }
        // Batch short rows so each rayon task decodes at least ~64k elements.
        let min_rows = (1 << 16) / inner.max(1);
        self.bytes
            .par_chunks_exact(row_bytes)
            .zip(out.par_chunks_exact_mut(inner))
            .with_min_len(min_rows.max(1))
            .try_for_each(|(b, y)| dequantize(self.ty, b, y))
    }

    /// The whole tensor decoded to f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let (rows, inner, _) = self.layout()?;
        let mut out = vec![0.0; rows * inner];
        self.dequantize_rows(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
