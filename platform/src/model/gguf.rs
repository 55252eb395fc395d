//! GGUF files (llama.cpp's model format): typed metadata and GGML tensors, memory-mapped.
//!
//! Layout (all little-endian; `string` is a u64 byte length followed by that many UTF-8 bytes):
//!
//! ```text
//! u32 magic "GGUF" | u32 version (2 or 3) | u64 tensor count | u64 metadata count
//! metadata:  string key | u32 value type | value                  (metadata count times)
//! tensors:   string name | u32 n_dims | u64 ne[n_dims] | u32 GGML type | u64 offset
//! padding to `general.alignment` (a u32 power of two, 32 if absent)
//! tensor data; each tensor at data start + its offset, a multiple of the alignment
//! ```
//!
//! Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (one byte, 0 or 1),
//! 8 string, 9 array (u32 element type, u64 count, the elements; arrays nest), 10 u64, 11 i64,
//! 12 f64. `ne[0]` is the innermost (contiguous) dimension, so a PyTorch `[out, in]` weight is
//! stored as `ne = [in, out]`; [`TensorInfo::shape`] gives the PyTorch order back.
//!
//! The file is untrusted input. Everything is checked before it is used, and a hostile or
//! corrupt file is an error, never a panic, an out-of-bounds read, an overflow or an allocation
//! larger than the file warrants:
//! - lengths: a key is at most [`MAX_KEY_LEN`] bytes, a string value [`MAX_STRING_LEN`], a
//!   tensor name [`MAX_TENSOR_NAME_LEN`], all valid UTF-8; every length and count is checked
//!   against the bytes left in the file before anything is allocated for it (a count of
//!   elements that cannot fit in what is left is an error);
//! - arrays nest at most [`MAX_ARRAY_DEPTH`] deep;
//! - duplicate keys and duplicate tensor names are refused;
//! - a tensor has at most [`MAX_DIMS`] dimensions, each non-zero, its innermost a whole number
//!   of its type's blocks; its byte size is computed with checked arithmetic; its offset is a
//!   multiple of the alignment; its bytes lie inside the file and overlap no other tensor's;
//! - versions 2 and 3 are read; version 1 (u32 lengths) and big-endian files (recognized by a
//!   byte-swapped version) are refused, each with a message saying so;
//! - an unknown GGML type id is refused with the id. A tensor of a known type that loraplex
//!   cannot decode (Q2_K, the IQ types, ...) parses, and reading it as f32
//!   ([`GgufFile::dequantize_f32`]) is the error, naming the type and the tensor.
//!
//! Tensor bytes are never copied at open: [`GgufFile::tensor`] borrows them from the mapping,
//! so quantized blocks can reach a backend as they are stored.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::{Path, PathBuf};

use loraplex_kernels::mmap::MappedFile;
use loraplex_kernels::quant::{GgmlType, QuantTensor};

use super::ModelError;

pub mod convert;

/// Longest metadata key read, in bytes.
pub const MAX_KEY_LEN: usize = 64 << 10;
/// Longest string value read (a chat template, a `tokenizer.huggingface.json`), in bytes.
pub const MAX_STRING_LEN: usize = 64 << 20;
/// Longest tensor name read, in bytes (llama.cpp itself stops at 63).
pub const MAX_TENSOR_NAME_LEN: usize = 64 << 10;
/// Deepest nesting of arrays read: an array of arrays is depth 2.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;

const MAGIC: &[u8; 4] = b"GGUF";
const ALIGNMENT_KEY: &str = "general.alignment";

/// The fewest bytes each element of an array of a value type takes, by type id: scalars their
/// size, a string its u64 length, an array its u32 element type and u64 count.
const MIN_VALUE_BYTES: [usize; 13] = [1, 1, 2, 2, 4, 4, 4, 1, 8, 12, 8, 8, 8];
/// The fewest bytes a metadata entry takes: key length, value type, a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// The fewest bytes a tensor info takes: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;
/// Most entries reserved ahead for a table or an array of strings or arrays, whose entries are
/// larger in memory than their least size in the file: past this, vectors grow as entries are
/// actually read, so a count that only just fits the file cannot reserve several times its size.
const PREALLOCATE: usize = 1 << 16;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(MetaArray),
}

/// A metadata array: one vector of its element type, so that a 49,152-token vocabulary is one
/// `Vec<String>` to borrow.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    /// An array of arrays, each with its own element type.
    Array(Vec<MetaArray>),
}

/// The names of the GGUF value types, by id, as messages print them.
const TYPE_NAMES: [&str; 13] = ["u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"];

impl MetaValue {
    /// The GGUF value type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    /// The value's type as messages name it: `u32`, `string`, `array of string`.
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::Array(a) => a.type_name(),
            other => TYPE_NAMES[other.type_id() as usize].to_string(),
        }
    }

    /// An integer of any width, widened to i128 (which holds every u64 and i64 exactly).
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl MetaArray {
    /// The GGUF value type id of the elements.
    pub fn elem_type_id(&self) -> u32 {
        match self {
            MetaArray::U8(_) => 0,
            MetaArray::I8(_) => 1,
            MetaArray::U16(_) => 2,
            MetaArray::I16(_) => 3,
            MetaArray::U32(_) => 4,
            MetaArray::I32(_) => 5,
            MetaArray::F32(_) => 6,
            MetaArray::Bool(_) => 7,
            MetaArray::Str(_) => 8,
            MetaArray::Array(_) => 9,
            MetaArray::U64(_) => 10,
            MetaArray::I64(_) => 11,
            MetaArray::F64(_) => 12,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The array's type as messages name it: `array of string`, `array of array of u8`.
    pub fn type_name(&self) -> String {
        match self {
            // An empty array of arrays has no inner type to name.
            MetaArray::Array(inner) => format!("array of {}", inner.first().map_or_else(|| "array".to_string(), MetaArray::type_name)),
            other => format!("array of {}", TYPE_NAMES[other.elem_type_id() as usize]),
        }
    }
}

/// One tensor's entry in the file's tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions in GGUF order: `dims[0]` is the innermost (contiguous) one.
    pub dims: Vec<u64>,
    /// Where the tensor's bytes start, relative to the start of the data section.
    pub offset: u64,
    /// How many bytes the tensor takes.
    pub bytes: usize,
}

impl TensorInfo {
    /// Dimensions in PyTorch order, outermost first (`dims` reversed). Every dimension fits a
    /// `usize`: the parser checked that the product of all of them does.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// What the header of a GGUF file says: its metadata, its tensor table and where data starts.
#[derive(Debug)]
struct Header {
    version: u32,
    alignment: usize,
    /// Byte offset of the data section in the file.
    data_start: usize,
    /// Metadata in file order.
    metadata: Vec<(String, MetaValue)>,
    /// Key -> index into `metadata`.
    keys: HashMap<String, usize>,
    /// Tensors in file order.
    tensors: Vec<TensorInfo>,
    /// Tensor name -> index into `tensors`.
    names: HashMap<String, usize>,
}

/// A GGUF file, memory-mapped, with its header parsed and checked.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    map: MappedFile,
    header: Header,
}

impl GgufFile {
    /// Maps `path` and parses its header. Tensor data is not read until asked for.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let map = MappedFile::open(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
        let header = parse(map.bytes()).map_err(|detail| ModelError::Gguf { path: path.to_path_buf(), detail })?;
        Ok(Self { path: path.to_path_buf(), map, header })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// The alignment of tensor data, in bytes.
    pub fn alignment(&self) -> usize {
        self.header.alignment
    }

    /// The metadata value stored under `key`.
    pub fn metadata(&self, key: &str) -> Option<&MetaValue> {
        self.header.keys.get(key).map(|&i| &self.header.metadata[i].1)
    }

    /// The metadata keys, in file order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.header.metadata.iter().map(|(k, _)| k.as_str())
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The table entry of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.names.get(name).map(|&i| &self.header.tensors[i])
    }

    /// Tensor `name` as its stored blocks, borrowed from the mapping, whatever its type.
    pub fn tensor(&self, name: &str) -> Result<QuantTensor<'_>, ModelError> {
        let info = self.tensor_info(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string(), path: self.path.clone() })?;
        // The parser checked that this range lies inside the file.
        let start = usize::try_from(info.offset).ok().and_then(|o| o.checked_add(self.header.data_start));
        let bytes = start.and_then(|s| self.map.bytes().get(s..s.checked_add(info.bytes)?));
        let bytes = bytes.ok_or_else(|| self.error(format!("tensor `{name}` lies past the end of the file")))?;
        QuantTensor::new(info.ty, info.shape(), bytes).map_err(|e| self.error(format!("tensor `{name}`: {e}")))
    }

    /// Tensor `name` decoded to f32, in PyTorch (row-major, [`TensorInfo::shape`]) order. A
    /// type loraplex cannot decode is an error naming it and the tensor.
    pub fn dequantize_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let tensor = self.tensor(name)?;
        if !tensor.ty.is_supported() {
            let supported = GgmlType::SUPPORTED.map(GgmlType::name).join(", ");
            return Err(self.error(format!("tensor `{name}` is {}, which loraplex cannot read (it reads {supported})", tensor.ty)));
        }
        tensor.to_f32().map_err(|e| self.error(format!("tensor `{name}`: {e}")))
    }

    /// `key` as a u32: any integer type whose value fits.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, ModelError> {
        self.get_integer(key, "u32")
    }

    /// `key` as a u64: any integer type whose value is not negative.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, ModelError> {
        self.get_integer(key, "u64")
    }

    /// `key` as an f32: an f32, or an f64 rounded to the nearest f32.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        self.get(key, "f32", |v| match *v {
            MetaValue::F32(x) => Some(x),
            MetaValue::F64(x) => Some(x as f32),
            _ => None,
        })
    }

    /// `key` as a bool.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        self.get(key, "bool", |v| match *v {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        })
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        self.get(key, "string", |v| match v {
            MetaValue::Str(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// `key` as an array of strings (a vocabulary, merges).
    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>, ModelError> {
        self.get(key, "array of string", |v| match v {
            MetaValue::Array(MetaArray::Str(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    /// `key` as an array of f32 (token scores).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<&[f32]>, ModelError> {
        self.get(key, "array of f32", |v| match v {
            MetaValue::Array(MetaArray::F32(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    /// `key` as an array of i32 (token types).
    pub fn get_i32_array(&self, key: &str) -> Result<Option<&[i32]>, ModelError> {
        self.get(key, "array of i32", |v| match v {
            MetaValue::Array(MetaArray::I32(a)) => Some(a.as_slice()),
            _ => None,
        })
    }

    /// The value of `key` through `convert`; `None` if absent, an error naming both types if
    /// `convert` refuses it.
    fn get<'a, T>(&'a self, key: &str, expected: &str, convert: impl FnOnce(&'a MetaValue) -> Option<T>) -> Result<Option<T>, ModelError> {
        let Some(value) = self.metadata(key) else { return Ok(None) };
        convert(value).map(Some).ok_or_else(|| self.error(format!("key `{key}` has type {}, expected {expected}", value.type_name())))
    }

    /// The integer value of `key` as `T`, from any integer type that holds it exactly.
    fn get_integer<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> Result<Option<T>, ModelError> {
        let Some(n) = self.get(key, expected, MetaValue::as_integer)? else { return Ok(None) };
        T::try_from(n).map(Some).map_err(|_| self.error(format!("key `{key}` is {n}, which does not fit in {expected}")))
    }

    fn error(&self, detail: String) -> ModelError {
        ModelError::Gguf { path: self.path.clone(), detail }
    }
}

/// A bounds-checked little-endian cursor over the file's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes; `what` names them if the file ends first.
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!("truncated: {} needs {n} bytes at offset {}, the file has {} left", what(), self.pos, self.remaining()));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length or count, which must fit in `usize`.
    fn count(&mut self, what: &dyn Fn() -> String) -> Result<usize, String> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| format!("{} is {n}, more than this machine can address", what()))
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, max: usize, what: &dyn Fn() -> String) -> Result<String, String> {
        let len = self.count(&|| format!("the length of {}", what()))?;
        if len > max {
            return Err(format!("{} is {len} bytes long, more than the {max} allowed", what()));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("{} is not valid UTF-8 ({e})", what()))
    }

    /// A value of type `ty` at array depth `depth` (0 for a top-level value).
    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<MetaValue, String> {
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => MetaValue::Bool(bool_byte(u8::from_le_bytes(self.array(what)?), what)?),
            8 => MetaValue::Str(self.string(MAX_STRING_LEN, what)?),
            9 => MetaValue::Array(self.array_value(depth + 1, what)?),
            10 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(format!("{} has unknown value type {other}", what())),
        })
    }

    /// An array (element type, count, elements) at nesting depth `depth` (1 for a top-level array).
    fn array_value(&mut self, depth: usize, what: &dyn Fn() -> String) -> Result<MetaArray, String> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(format!("{} nests arrays more than {MAX_ARRAY_DEPTH} deep", what()));
        }
        let ty = self.u32(&|| format!("the element type of {}", what()))?;
        let Some(&min) = MIN_VALUE_BYTES.get(ty as usize) else {
            return Err(format!("{} is an array of unknown value type {ty}", what()));
        };
        let n = self.count(&|| format!("the length of {}", what()))?;
        if n > self.remaining() / min {
            return Err(format!(
                "{} claims {n} elements of type {}, which need at least {} bytes; the file has {} left",
                what(),
                TYPE_NAMES[ty as usize],
                (n as u128) * (min as u128),
                self.remaining()
            ));
        }
        // `n * min` fits in what is left, so each fixed-size read below is one bounded `take`.
        Ok(match ty {
            0 => MetaArray::U8(self.take(n, what)?.to_vec()),
            1 => MetaArray::I8(self.take(n, what)?.iter().map(|&b| b as i8).collect()),
            2 => MetaArray::U16(self.fixed_array(n, what, u16::from_le_bytes)?),
            3 => MetaArray::I16(self.fixed_array(n, what, i16::from_le_bytes)?),
            4 => MetaArray::U32(self.fixed_array(n, what, u32::from_le_bytes)?),
            5 => MetaArray::I32(self.fixed_array(n, what, i32::from_le_bytes)?),
            6 => MetaArray::F32(self.fixed_array(n, what, f32::from_le_bytes)?),
            7 => MetaArray::Bool(self.take(n, what)?.iter().map(|&b| bool_byte(b, what)).collect::<Result<_, _>>()?),
            8 => {
                let mut out = Vec::with_capacity(n.min(PREALLOCATE));
                for i in 0..n {
                    out.push(self.string(MAX_STRING_LEN, &|| format!("element {i} of {}", what()))?);
                }
                MetaArray::Str(out)
            }
            9 => {
                let mut out = Vec::with_capacity(n.min(PREALLOCATE));
                for i in 0..n {
                    out.push(self.array_value(depth + 1, &|| format!("element {i} of {}", what()))?);
                }
                MetaArray::Array(out)
            }
            10 => MetaArray::U64(self.fixed_array(n, what, u64::from_le_bytes)?),
            11 => MetaArray::I64(self.fixed_array(n, what, i64::from_le_bytes)?),
            12 => MetaArray::F64(self.fixed_array(n, what, f64::from_le_bytes)?),
            other => return Err(format!("{} is an array of unknown value type {other}", what())),
        })
    }

    /// `n` values of `N` bytes each, decoded by `decode`.
    fn fixed_array<const N: usize, T>(&mut self, n: usize, what: &dyn Fn() -> String, decode: fn([u8; N]) -> T) -> Result<Vec<T>, String> {
        let len = n.checked_mul(N).ok_or_else(|| format!("{} is too long", what()))?;
        let (chunks, _) = self.take(len, what)?.as_chunks::<N>();
        Ok(chunks.iter().map(|&c| decode(c)).collect())
    }
}

/// A GGUF bool: one byte, 0 or 1.
fn bool_byte(b: u8, what: &dyn Fn() -> String) -> Result<bool, String> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(format!("{} is a bool stored as {other}, not 0 or 1", what())),
    }
}

/// Parses and checks the header of a whole GGUF file, `bytes`.
fn parse(bytes: &[u8]) -> Result<Header, String> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>(&|| "the magic number".into())?;
    if &magic != MAGIC {
        return Err(format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""));
    }
    let version = r.u32(&|| "the version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 (from 2023, with 32-bit lengths) is not supported; convert the model again with a current llama.cpp".into()),
        // A version whose low half is zero is a small version read in the wrong byte order.
        v if v != 0 && v & 0xFFFF == 0 => {
            return Err(format!("a big-endian GGUF file (version {}); only little-endian files are read", v.swap_bytes()));
        }
        v => return Err(format!("GGUF version {v} is not supported (versions 2 and 3 are)")),
    }
    let n_tensors = r.count(&|| "the tensor count".into())?;
    let n_kv = r.count(&|| "the metadata count".into())?;
    let least = (n_tensors as u128) * (MIN_TENSOR_INFO_BYTES as u128) + (n_kv as u128) * (MIN_KV_BYTES as u128);
    if least > r.remaining() as u128 {
        return Err(format!(
            "the header claims {n_tensors} tensors and {n_kv} metadata entries, which need at least {least} bytes; the file has {} left",
            r.remaining()
        ));
    }

    let mut metadata = Vec::with_capacity(n_kv.min(PREALLOCATE));
    let mut keys = HashMap::with_capacity(n_kv.min(PREALLOCATE));
    for i in 0..n_kv {
        let key = r.string(MAX_KEY_LEN, &|| format!("metadata key {i}"))?;
        let ty = r.u32(&|| format!("the type of key `{key}`"))?;
        let value = r.value(ty, 0, &|| format!("key `{key}`"))?;
        match keys.entry(key) {
            Entry::Occupied(e) => return Err(format!("key `{}` appears twice", e.key())),
            Entry::Vacant(e) => {
                metadata.push((e.key().clone(), value));
                e.insert(i);
            }
        }
    }

    let alignment = match keys.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(&MetaValue::U32(a)) if a.is_power_of_two() => a as usize,
        Some(MetaValue::U32(a)) => return Err(format!("{ALIGNMENT_KEY} is {a}, not a power of two")),
        Some(other) => return Err(format!("{ALIGNMENT_KEY} has type {}, expected u32", other.type_name())),
    };

    if n_tensors > r.remaining() / MIN_TENSOR_INFO_BYTES {
        return Err(format!(
            "the header claims {n_tensors} tensors, whose table needs at least {} bytes; the file has {} left",
            n_tensors as u128 * MIN_TENSOR_INFO_BYTES as u128,
            r.remaining()
        ));
    }
    let mut tensors = Vec::with_capacity(n_tensors.min(PREALLOCATE));
    let mut names = HashMap::with_capacity(n_tensors.min(PREALLOCATE));
    for i in 0..n_tensors {
        let info = tensor_info(&mut r, i, alignment)?;
        match names.entry(info.name.clone()) {
            Entry::Occupied(e) => return Err(format!("tensor `{}` appears twice", e.key())),
            Entry::Vacant(e) => {
                e.insert(i);
                tensors.push(info);
            }
        }
    }

    let data_start = r.pos.checked_next_multiple_of(alignment).ok_or("the data section starts past the addressable range")?;
    check_ranges(&tensors, data_start, bytes.len())?;
    Ok(Header { version, alignment, data_start, metadata, keys, tensors, names })
}

/// Reads and checks tensor info `index`.
fn tensor_info(r: &mut Reader<'_>, index: usize, alignment: usize) -> Result<TensorInfo, String> {
    let name = r.string(MAX_TENSOR_NAME_LEN, &|| format!("the name of tensor {index}"))?;
    let what = |part: &str| format!("the {part} of tensor `{name}`");
    let n_dims = r.u32(&|| what("dimension count"))?;
    if n_dims as usize > MAX_DIMS {
        return Err(format!("tensor `{name}` has {n_dims} dimensions, more than {MAX_DIMS}"));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(r.u64(&|| what(&format!("dimension {d}")))?);
    }
    let id = r.u32(&|| what("type"))?;
    let offset = r.u64(&|| what("offset"))?;

    let ty = GgmlType::from_id(id).ok_or_else(|| format!("tensor `{name}` has unknown GGML type id {id}"))?;
    if let Some(d) = dims.iter().position(|&d| d == 0) {
        return Err(format!("tensor `{name}` has dimensions {dims:?}: dimension {d} is zero"));
    }
    let elems = dims.iter().try_fold(1usize, |n, &d| usize::try_from(d).ok().and_then(|d| n.checked_mul(d)));
    let elems = elems.ok_or_else(|| format!("tensor `{name}` has dimensions {dims:?}, more elements than this machine can address"))?;
    let inner = dims.first().map_or(1, |&d| d as usize);
    if !inner.is_multiple_of(ty.block_elems()) {
        return Err(format!("tensor `{name}` is {ty} with rows of {inner} elements, not a multiple of its {}-element blocks", ty.block_elems()));
    }
    let bytes = ty.row_bytes(elems).ok_or_else(|| format!("tensor `{name}` ({ty}, dimensions {dims:?}) is larger than this machine can address"))?;
    if !offset.is_multiple_of(alignment as u64) {
        return Err(format!("tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}"));
    }
    Ok(TensorInfo { name, ty, dims, offset, bytes })
}

/// Checks that every tensor lies inside the file (of `file_len` bytes, data from `data_start`)
/// and that no two overlap.
fn check_ranges(tensors: &[TensorInfo], data_start: usize, file_len: usize) -> Result<(), String> {
    let mut ranges = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let start = usize::try_from(t.offset).ok().and_then(|o| o.checked_add(data_start));
        let end = start.and_then(|s| s.checked_add(t.bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => ranges.push((start, end, i)),
            _ => {
                return Err(format!(
                    "tensor `{}` ({} bytes at data offset {}) ends past the end of the file ({file_len} bytes, data from {data_start}): truncated?",
                    t.name, t.bytes, t.offset
                ));
            }
        }
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((_, end_a, a), (start_b, _, b)) = (pair[0], pair[1]);
        if start_b < end_a {
            return Err(format!("tensors `{}` and `{}` overlap", tensors[a].name, tensors[b].name));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
