//! Random weights and a streaming safetensors writer.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use rayon::prelude::*;

use super::{ModelDims, SynthError, io_err};
use crate::sampling::{Xoshiro256, splitmix64};

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Init {
    Normal { std: f64 },
    Uniform { lo: f64, hi: f64 },
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Values per independently seeded block. Fixed, so the output does not depend on threads.
const BLOCK: usize = 1 << 16;

/// Norm weights are drawn from this range, so an engine that ignores them is caught.
const NORM_RANGE: (f64, f64) = (0.5, 1.5);

/// The tensors of a HuggingFace Llama checkpoint, sorted by name (the order of the data in the
/// file, matching the header's key order). Linear weights are `[out, in]` with standard
/// deviation `1/sqrt(in)`, so activations stay of order one through the layers.
pub(crate) fn tensor_specs(d: &ModelDims) -> Vec<TensorSpec> {
    let h = d.hidden_size;
    let q = d.num_attention_heads * d.head_dim;
    let kv = d.num_key_value_heads * d.head_dim;
    let inter = d.intermediate_size;
    let linear = |name: String, out: usize, inp: usize| TensorSpec { name, shape: vec![out, inp], init: Init::Normal { std: 1.0 / (inp as f64).sqrt() } };
    let norm = |name: String| TensorSpec { name, shape: vec![h], init: Init::Uniform { lo: NORM_RANGE.0, hi: NORM_RANGE.1 } };
    let mut specs = vec![
        TensorSpec { name: "model.embed_tokens.weight".into(), shape: vec![d.vocab_size, h], init: Init::Normal { std: 1.0 } },
        norm("model.norm.weight".into()),
        linear("lm_head.weight".into(), d.vocab_size, h),
    ];
    for i in 0..d.num_hidden_layers {
        let p = format!("model.layers.{i}");
        specs.extend([
            norm(format!("{p}.input_layernorm.weight")),
            linear(format!("{p}.self_attn.q_proj.weight"), q, h),
            linear(format!("{p}.self_attn.k_proj.weight"), kv, h),
            linear(format!("{p}.self_attn.v_proj.weight"), kv, h),
            linear(format!("{p}.self_attn.o_proj.weight"), h, q),
            norm(format!("{p}.post_attention_layernorm.weight")),
            linear(format!("{p}.mlp.gate_proj.weight"), inter, h),
            linear(format!("{p}.mlp.up_proj.weight"), inter, h),
            linear(format!("{p}.mlp.down_proj.weight"), h, inter),
        ]);
    }
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    specs
}

/// FNV-1a, to give each tensor its own random streams independent of its position in the file.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

/// The seed of block `block` of tensor `name`.
fn block_seed(seed: u64, name: &str, block: u64) -> u64 {
    let mut s = seed;
    let mut t = splitmix64(&mut s) ^ fnv1a(name);
    let mut u = splitmix64(&mut t) ^ block;
    splitmix64(&mut u)
}

/// Fills `out` with the values of one block. Normals use Marsaglia's polar method with the
/// portable `libm` logarithm, so the bits are the same on every platform.
fn fill_block(out: &mut [f32], init: Init, seed: u64) {
    let mut rng = Xoshiro256::seed_from_u64(seed);
    match init {
        Init::Uniform { lo, hi } => {
            for x in out.iter_mut() {
                *x = (lo + (hi - lo) * rng.next_f64()) as f32;
            }
        }
        Init::Normal { std } => {
            for pair in out.chunks_mut(2) {
                let (a, b) = loop {
                    let u = 2.0 * rng.next_f64() - 1.0;
                    let v = 2.0 * rng.next_f64() - 1.0;
                    let s = u * u + v * v;
                    if s > 0.0 && s < 1.0 {
                        let f = (-2.0 * libm::log(s) / s).sqrt();
                        break (u * f, v * f);
                    }
                };
                pair[0] = (a * std) as f32;
                if let Some(y) = pair.get_mut(1) {
                    *y = (b * std) as f32;
                }
            }
        }
    }
}

/// Generates a whole tensor into `buf` (resized to fit), blocks in parallel.
pub(crate) fn generate(spec: &TensorSpec, seed: u64, buf: &mut Vec<f32>) {
    buf.clear();
    buf.resize(spec.numel(), 0.0);
    buf.par_chunks_mut(BLOCK).enumerate().for_each(|(i, block)| fill_block(block, spec.init, block_seed(seed, &spec.name, i as u64)));
}

/// The element type tensors are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileDType {
    F32,
    /// bfloat16, rounded to nearest even from the generated f32 values.
    Bf16,
}

impl FileDType {
    fn name(self) -> &'static str {
        match self {
            FileDType::F32 => "F32",
            FileDType::Bf16 => "BF16",
        }
    }

    fn size(self) -> usize {
        match self {
            FileDType::F32 => 4,
            FileDType::Bf16 => 2,
        }
    }
}

/// The safetensors header: JSON with each tensor's dtype, shape and byte range, padded with
/// spaces to a multiple of 8 bytes.
fn header(specs: &[TensorSpec], dtype: FileDType) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for spec in specs {
        let end = offset + spec.numel() * dtype.size();
        map.insert(spec.name.clone(), serde_json::json!({ "dtype": dtype.name(), "shape": spec.shape, "data_offsets": [offset, end] }));
        offset = end;
    }
    let mut json = serde_json::to_vec(&map).expect("a JSON map always serializes");
    json.resize(json.len().next_multiple_of(8), b' ');
    json
}

/// Writes `model.safetensors` for `dims` to `path`; see [`write_tensors`].
/// Returns (parameter count, file size).
pub(crate) fn write_safetensors(path: &Path, dims: &ModelDims, seed: u64, dtype: FileDType) -> Result<(u64, u64), SynthError> {
    write_tensors(path, &tensor_specs(dims), seed, dtype)
}

/// Writes the tensors `specs` (sorted by name) in `dtype` to the safetensors file `path`, streaming:
/// header first, then each tensor as soon as it is generated from `seed`. The file appears
/// under its name only once complete. Returns (value count, file size).
pub(crate) fn write_tensors(path: &Path, specs: &[TensorSpec], seed: u64, dtype: FileDType) -> Result<(u64, u64), SynthError> {
    debug_assert!(specs.is_sorted_by(|a, b| a.name < b.name));
    let partial = path.with_extension("safetensors.partial");
    let file = File::create(&partial).map_err(io_err(&partial))?;
    let mut w = BufWriter::with_capacity(4 << 20, file);
    let header = header(specs, dtype);
    let mut size = 8 + header.len() as u64;
    w.write_all(&(header.len() as u64).to_le_bytes()).and_then(|()| w.write_all(&header)).map_err(io_err(&partial))?;

    let mut buf = Vec::new();
    let mut params = 0u64;
    for spec in specs {
        generate(spec, seed, &mut buf);
        match dtype {
            FileDType::F32 => write_f32_le(&mut w, &buf),
            FileDType::Bf16 => {
                let bytes: Vec<u8> = buf.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect();
                w.write_all(&bytes)
            }
        }
        .map_err(io_err(&partial))?;
        params += buf.len() as u64;
        size += (dtype.size() * buf.len()) as u64;
    }
    w.flush().map_err(io_err(&partial))?;
    drop(w);
    std::fs::rename(&partial, path).map_err(io_err(path))?;
    Ok((params, size))
}

fn write_f32_le(w: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    if cfg!(target_endian = "little") {
        w.write_all(bytemuck::cast_slice(values))
    } else {
        for v in values {
            w.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    }
}
