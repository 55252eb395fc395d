//! Checkpoints: safetensors (one file or sharded behind `model.safetensors.index.json`) or a
//! GGUF file, memory-mapped, their tensors read under their HuggingFace names; f32, f16 and
//! bf16 kept or converted to f32 on read, GGML quantized types dequantized to f32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use loraplex_kernels::mmap::MappedFile;
use loraplex_kernels::{DType, WeightData};
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors, tensor::Metadata};
use serde::Deserialize;

use super::ModelError;
use super::gguf::GgufFile;
use super::gguf::convert::GgufCheckpoint;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped safetensors file with its parsed header.
/// A tensor's values in the element type its checkpoint stores them in.
#[derive(Debug, Clone)]
pub enum TensorData {
    F32(Vec<f32>),
    /// bfloat16 bits.
    Bf16(Vec<u16>),
    F16(Vec<half::f16>),
}

impl TensorData {
    /// The values widened to f32 (exact).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            TensorData::F32(d) => d,
            TensorData::Bf16(d) => d.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect(),
            TensorData::F16(d) => d.into_iter().map(half::f16::to_f32).collect(),
        }
    }

    pub fn as_weight(&self) -> WeightData<'_> {
        match self {
            TensorData::F32(d) => WeightData::F32(d),
            TensorData::Bf16(d) => WeightData::Bf16(d),
            TensorData::F16(d) => WeightData::F16(d),
        }
    }
}

struct Shard {
    path: PathBuf,
    map: MappedFile,
    /// Where the tensor data starts in the file (after the length prefix and the header).
    data_start: usize,
    metadata: Metadata,
}

/// The tensors of a checkpoint, read lazily from memory-mapped files.
pub enum Checkpoint {
    Safetensors(Safetensors),
    Gguf(GgufCheckpoint),
}

/// A safetensors checkpoint directory.
pub struct Safetensors {
    shards: Vec<Shard>,
    /// Tensor name -> index into `shards`.
    index: HashMap<String, usize>,
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a directory of safetensors, or a GGUF file.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        if path.is_dir() { Safetensors::open(path).map(Self::Safetensors) } else { Self::gguf(GgufFile::open(path)?, DType::F32) }
    }

    /// The tensors of an opened GGUF file, its quantized weights decoded to `decode_to` (f32
    /// or bf16).
    pub fn gguf(file: GgufFile, decode_to: DType) -> Result<Self, ModelError> {
        Ok(Self::Gguf(GgufCheckpoint::new(file)?.decoding_to(decode_to)))
    }

    pub fn contains(&self, name: &str) -> bool {
        match self {
            Self::Safetensors(s) => s.contains(name),
            Self::Gguf(g) => g.contains(name),
        }
    }

    /// Bytes per stored value of tensor `name` (rounded up), if the checkpoint has it.
    pub fn element_bytes(&self, name: &str) -> Option<usize> {
        match self {
            Self::Safetensors(s) => s.element_bytes(name),
            Self::Gguf(g) => g.element_bytes(name),
        }
    }

    /// Reads tensor `name`, checks its shape, and converts it to f32.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        match self {
            Self::Safetensors(s) => s.tensor_f32(name, shape),
            Self::Gguf(g) => g.tensor_f32(name, shape),
        }
    }

    /// Reads tensor `name` and checks its shape, keeping the element type it is stored in when
    /// that is f32, bf16 or f16; GGML quantized types are dequantized to f32.
    pub fn tensor_data(&self, name: &str, shape: &[usize]) -> Result<TensorData, ModelError> {
        match self {
            Self::Safetensors(s) => s.tensor_data(name, shape),
            Self::Gguf(g) => g.tensor_data(name, shape),
        }
    }
}

impl Safetensors {
    /// Opens `dir/model.safetensors`, or the shards listed by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| ModelError::Io { path: index_path.clone(), source })?;
            let idx: IndexFile =
                serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint { path: index_path.clone(), detail: format!("invalid index: {e}") })?;
            let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            let mut shards = Vec::with_capacity(files.len());
            for f in &files {
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(ModelError::Checkpoint { path: index_path.clone(), detail: format!("shard name `{f}` is not a plain file name") });
                }
                shards.push(Shard::open(dir.join(f))?);
            }
            let mut index = HashMap::new();
            for (name, file) in idx.weight_map {
                let i = files.binary_search(&file).unwrap_or_default();
                if shards[i].metadata.info(&name).is_none() {
                    return Err(ModelError::Checkpoint {
                        path: shards[i].path.clone(),
                        detail: format!("tensor `{name}` is listed in {INDEX_FILE} but missing from this shard"),
                    });
                }
                index.insert(name, i);
            }
            Ok(Self { shards, index })
        } else if single.is_file() {
            let shard = Shard::open(single)?;
            let index = shard.metadata.tensors().into_keys().map(|k| (k, 0)).collect();
            Ok(Self { shards: vec![shard], index })
        } else {
            Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                detail: format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory (only safetensors checkpoints are read)"),
            })
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Bytes per stored value of tensor `name` (rounded up), if the checkpoint has it.
    pub fn element_bytes(&self, name: &str) -> Option<usize> {
        let shard = &self.shards[*self.index.get(name)?];
        Some(shard.metadata.info(name)?.dtype.bitsize().div_ceil(8))
    }

    /// The shard, element type and bytes of tensor `name`, its shape checked.
    fn tensor_bytes(&self, name: &str, shape: &[usize]) -> Result<(&Shard, Dtype, &[u8]), ModelError> {
        let shard =
            self.index.get(name).map(|&i| &self.shards[i]).ok_or_else(|| ModelError::MissingTensor { name: name.to_string(), path: self.describe() })?;
        let info = shard.metadata.info(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string(), path: shard.path.clone() })?;
        if info.shape != shape {
            return Err(ModelError::TensorShape { name: name.to_string(), path: shard.path.clone(), expected: shape.to_vec(), actual: info.shape.clone() });
        }
        let (start, end) = info.data_offsets;
        Ok((shard, info.dtype, &shard.map.bytes()[shard.data_start + start..shard.data_start + end]))
    }

    /// Reads tensor `name`, checks its shape, and converts it to f32.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (shard, dtype, bytes) = self.tensor_bytes(name, shape)?;
        let convert = |width: usize, f: fn(&[u8]) -> f32| -> Vec<f32> { bytes.par_chunks_exact(width).with_min_len(1 << 16).map(f).collect() };
        Ok(match dtype {
            Dtype::F32 => convert(4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Dtype::F16 => convert(2, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
            Dtype::BF16 => convert(2, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            other => {
                return Err(ModelError::TensorDType { name: name.to_string(), path: shard.path.clone(), dtype: format!("{other:?}") });
            }
        })
    }

    /// Reads tensor `name` and checks its shape, keeping the element type it is stored in
    /// (f32, bf16 or f16; others are refused).
    pub fn tensor_data(&self, name: &str, shape: &[usize]) -> Result<TensorData, ModelError> {
        let (shard, dtype, bytes) = self.tensor_bytes(name, shape)?;
        let halves = || -> Vec<u16> { bytes.par_chunks_exact(2).with_min_len(1 << 16).map(|b| u16::from_le_bytes([b[0], b[1]])).collect() };
        Ok(match dtype {
            Dtype::F32 => TensorData::F32(bytes.par_chunks_exact(4).with_min_len(1 << 16).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
            Dtype::BF16 => TensorData::Bf16(halves()),
            Dtype::F16 => TensorData::F16(halves().into_iter().map(half::f16::from_bits).collect()),
            other => return Err(ModelError::TensorDType { name: name.to_string(), path: shard.path.clone(), dtype: format!("{other:?}") }),
        })
    }

    fn describe(&self) -> PathBuf {
        match self.shards.as_slice() {
            [one] => one.path.clone(),
            many => many.first().and_then(|s| s.path.parent()).map(|d| d.join(INDEX_FILE)).unwrap_or_default(),
        }
    }
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self, ModelError> {
        let map = MappedFile::open(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let (header_len, metadata) = SafeTensors::read_metadata(map.bytes())
            .map_err(|e| ModelError::Checkpoint { path: path.clone(), detail: format!("not a valid safetensors file (truncated or corrupt?): {e}") })?;
        Ok(Self { path, map, data_start: 8 + header_len, metadata })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_tensors(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<_> = tensors.iter().map(|(n, d, s, b)| (n.to_string(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn reads_every_dtype_and_shards() {
        let dir = tempfile::tempdir().unwrap();
        let vals = [1.5f32, -2.0, 0.25];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let bf16b: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        write_tensors(&dir.path().join("a.safetensors"), &[("x", Dtype::F32, vec![3], f32b), ("y", Dtype::F16, vec![1, 3], f16b)]);
        write_tensors(&dir.path().join("b.safetensors"), &[("z", Dtype::BF16, vec![3], bf16b), ("i", Dtype::I64, vec![1], vec![0; 8])]);
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors", "i": "b.safetensors"}}"#,
        )
        .unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.tensor_f32("x", &[3]).unwrap(), vals);
        assert_eq!(ck.tensor_f32("y", &[1, 3]).unwrap(), vals);
        assert_eq!(ck.tensor_f32("z", &[3]).unwrap(), vals);
        let e = ck.tensor_f32("y", &[3]).unwrap_err().to_string();
        assert!(e.contains("`y`") && e.contains("a.safetensors") && e.contains("[3]") && e.contains("[1, 3]"), "{e}");
        let e = ck.tensor_f32("i", &[1]).unwrap_err().to_string();
        assert!(e.contains("`i`") && e.contains("I64"), "{e}");
        let e = ck.tensor_f32("w", &[1]).unwrap_err().to_string();
        assert!(e.contains("`w`"), "{e}");
    }

    #[test]
    fn truncated_and_missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        let path = dir.path().join(SINGLE_FILE);
        write_tensors(&path, &[("x", Dtype::F32, vec![4], vec![0; 16])]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains(&path.display().to_string()) && e.contains("truncated"), "{e}");
        std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map": {"x": "gone.safetensors"}}"#).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("gone.safetensors"), "{e}");
    }
}
