//! A GGUF model read as the HuggingFace checkpoint it was converted from: its `config.json`
//! rebuilt from the metadata, its tensors under their HuggingFace names, and the Q/K row order
//! that llama.cpp's converter applied undone.
//!
//! llama.cpp's converter permutes the rows of the query and key projections of Llama and
//! Mistral models (so that its rotary kernel can rotate adjacent pairs): within each head of
//! `D` rows, HF row `j·D/2 + i` is stored as row `2i + j`. Reading a tensor gives the HF order
//! back, by whole rows, so the stored blocks of a quantized tensor keep their encoding
//! ([`GgufCheckpoint::blocks`]) and a backend that computes on them can be handed them as they are.

use std::borrow::Cow;

use loraplex_kernels::DType;
use loraplex_kernels::quant::{GgmlType, QuantTensor};
use serde_json::{Map, Value, json};

use super::GgufFile;
use crate::model::ModelError;
use crate::model::weights::TensorData;

/// GGUF architectures loraplex runs, with the HuggingFace class each stands for and whether the
/// converter permuted its Q/K rows.
const ARCHITECTURES: [(&str, &str, bool); 3] =
    [("llama", "LlamaForCausalLM", true), ("mistral", "MistralForCausalLM", true), ("qwen2", "Qwen2ForCausalLM", false)];

/// The GGUF name of HuggingFace tensor `hf` (`model.layers.3.self_attn.q_proj.weight` ->
/// `blk.3.attn_q.weight`), or `None` for a name with no GGUF counterpart.
pub fn gguf_name(hf: &str) -> Option<String> {
    let (stem, kind) = hf.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let fixed = match stem {
        "model.embed_tokens" => Some("token_embd"),
        "model.norm" => Some("output_norm"),
        "lm_head" => Some("output"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(format!("{f}.{kind}"));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, module) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// The tensors of a GGUF file under their HuggingFace names.
pub struct GgufCheckpoint {
    file: GgufFile,
    /// Heads and KV heads, when the Q/K rows are permuted.
    permuted: Option<(usize, usize)>,
    /// What quantized weights are decoded to by [`Self::tensor_data`] (f32 or bf16).
    decode_to: DType,
}

impl GgufCheckpoint {
    pub fn new(file: GgufFile) -> Result<Self, ModelError> {
        let arch = architecture(&file)?;
        let permuted = if arch.2 {
            let heads = required(&file, &format!("{}.attention.head_count", arch.0))?;
            let kv = file.get_u64(&format!("{}.attention.head_count_kv", arch.0))?.map_or(Ok(heads), |v| to_usize(&file, v))?;
            Some((heads, kv))
        } else {
            None
        };
        Ok(Self { file, permuted, decode_to: DType::F32 })
    }

    /// Decodes quantized weights to `dtype` in [`Self::tensor_data`]: bf16 for a backend that
    /// multiplies in bf16 (half the memory of f32, and the same products), f32 otherwise.
    pub fn decoding_to(mut self, dtype: DType) -> Self {
        self.decode_to = if dtype == DType::Bf16 { DType::Bf16 } else { DType::F32 };
        self
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn contains(&self, hf: &str) -> bool {
        gguf_name(hf).is_some_and(|g| self.file.tensor_info(&g).is_some())
    }

    /// Bytes per stored value of `hf`, rounded up (a 4-bit type counts as one).
    pub fn element_bytes(&self, hf: &str) -> Option<usize> {
        let info = self.file.tensor_info(&gguf_name(hf)?)?;
        Some(info.ty.block_bytes().div_ceil(info.ty.block_elems()).max(1))
    }

    /// The stored blocks of `hf`, its shape checked against `shape` (PyTorch order) and its
    /// rows in HuggingFace order: borrowed from the mapping unless rows had to be reordered.
    pub fn blocks(&self, hf: &str, shape: &[usize]) -> Result<(GgmlType, Cow<'_, [u8]>), ModelError> {
        let missing = || ModelError::MissingTensor { name: hf.to_string(), path: self.file.path().to_path_buf() };
        let name = gguf_name(hf).ok_or_else(missing)?;
        let info = self.file.tensor_info(&name).ok_or_else(missing)?;
        let actual = info.shape();
        if actual != shape {
            return Err(ModelError::TensorShape { name: format!("{name} ({hf})"), path: self.file.path().to_path_buf(), expected: shape.to_vec(), actual });
        }
        let tensor = self.file.tensor(&name)?;
        let Some(heads) = self.permuted_heads(hf) else { return Ok((tensor.ty, Cow::Borrowed(tensor.bytes))) };
        // A 1-D bias is one row of single elements; only unblocked types can be split so.
        let (rows, row_bytes) = match shape {
            [rows, inner] => (*rows, info.ty.row_bytes(*inner)),
            [rows] => (*rows, Some(info.ty.block_bytes()).filter(|_| info.ty.block_elems() == 1)),
            _ => (0, None),
        };
        let row_bytes = row_bytes.ok_or_else(|| self.error(format!("tensor `{name}` ({}, shape {shape:?}) cannot have its rows reordered", info.ty)))?;
        let bytes = unpermute_rows(tensor.bytes, rows, row_bytes, heads).map_err(|e| self.error(format!("tensor `{name}`: {e}")))?;
        Ok((tensor.ty, Cow::Owned(bytes)))
    }

    /// `hf` in the element type it is stored in when that is f32, f16 or bf16, otherwise
    /// dequantized to the type [`Self::decoding_to`] chose.
    pub fn tensor_data(&self, hf: &str, shape: &[usize]) -> Result<TensorData, ModelError> {
        self.decode(hf, shape, self.decode_to)
    }

    /// `hf` as f32, whatever it is stored as.
    pub fn tensor_f32(&self, hf: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.decode(hf, shape, DType::F32)?.into_f32())
    }

    fn decode(&self, hf: &str, shape: &[usize], to: DType) -> Result<TensorData, ModelError> {
        let (ty, bytes) = self.blocks(hf, shape)?;
        let halves = || bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<u16>>();
        Ok(match ty {
            GgmlType::F32 => TensorData::F32(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
            GgmlType::F16 => TensorData::F16(halves().into_iter().map(half::f16::from_bits).collect()),
            GgmlType::BF16 => TensorData::Bf16(halves()),
            ty if ty.is_supported() => {
                let name = gguf_name(hf).unwrap_or_default();
                let t = QuantTensor::new(ty, shape.to_vec(), &bytes).map_err(|e| self.error(format!("tensor `{name}`: {e}")))?;
                let values = t.to_f32().map_err(|e| self.error(format!("tensor `{name}`: {e}")))?;
                match to {
                    DType::Bf16 => TensorData::Bf16(values.into_iter().map(|v| half::bf16::from_f32(v).to_bits()).collect()),
                    _ => TensorData::F32(values),
                }
            }
            ty => {
                let supported = GgmlType::SUPPORTED.map(GgmlType::name).join(", ");
                return Err(ModelError::TensorDType {
                    name: format!("{} ({hf})", gguf_name(hf).unwrap_or_default()),
                    path: self.file.path().to_path_buf(),
                    dtype: format!("{ty}, which loraplex cannot read (it reads {supported})"),
                });
            }
        })
    }

    /// The heads over which `hf`'s rows are permuted, if they are.
    fn permuted_heads(&self, hf: &str) -> Option<usize> {
        let (heads, kv) = self.permuted?;
        if hf.contains(".self_attn.q_proj.") {
            Some(heads)
        } else if hf.contains(".self_attn.k_proj.") {
            Some(kv)
        } else {
            None
        }
    }

    fn error(&self, detail: String) -> ModelError {
        ModelError::Gguf { path: self.file.path().to_path_buf(), detail }
    }
}

/// Puts the rows of a llama-converted Q or K projection (`rows` rows of `row_bytes` bytes,
/// `heads` heads) back in HuggingFace order: within each head of `D` rows, stored row `2i + j`
/// becomes row `j·D/2 + i`.
pub fn unpermute_rows(bytes: &[u8], rows: usize, row_bytes: usize, heads: usize) -> Result<Vec<u8>, String> {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!("{rows} rows do not split into {heads} heads of an even size"));
    }
    if rows.checked_mul(row_bytes) != Some(bytes.len()) {
        return Err(format!("{} bytes are not {rows} rows of {row_bytes} bytes", bytes.len()));
    }
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let (src, dst) = (h * d + 2 * i + j, h * d + j * half + i);
                out[dst * row_bytes..(dst + 1) * row_bytes].copy_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}

fn architecture(file: &GgufFile) -> Result<(&'static str, &'static str, bool), ModelError> {
    let err = |detail: String| ModelError::Gguf { path: file.path().to_path_buf(), detail };
    let arch = file.get_str("general.architecture")?.ok_or_else(|| err("no `general.architecture` in the metadata".into()))?;
    ARCHITECTURES.iter().copied().find(|a| a.0 == arch).ok_or_else(|| {
        let known: Vec<_> = ARCHITECTURES.iter().map(|a| a.0).collect();
        err(format!("architecture `{arch}` is not supported; supported: {}", known.join(", ")))
    })
}

fn to_usize(file: &GgufFile, v: u64) -> Result<usize, ModelError> {
    usize::try_from(v).map_err(|_| ModelError::Gguf { path: file.path().to_path_buf(), detail: format!("{v} does not fit in memory") })
}

fn required(file: &GgufFile, key: &str) -> Result<usize, ModelError> {
    let v = file.get_u64(key)?.ok_or_else(|| ModelError::Gguf { path: file.path().to_path_buf(), detail: format!("missing `{key}`") })?;
    to_usize(file, v)
}

/// The `config.json` the model's HuggingFace checkpoint would have, rebuilt from the GGUF
/// metadata (and the tensor table, for tied embeddings and biases); [`crate::model::ModelConfig`]
/// then checks it as it checks any config.
pub fn config_json(file: &GgufFile) -> Result<Value, ModelError> {
    let (arch, class, _) = architecture(file)?;
    let err = |detail: String| ModelError::Gguf { path: file.path().to_path_buf(), detail };
    let key = |k: &str| format!("{arch}.{k}");
    if file.tensor_info("rope_freqs.weight").is_some() {
        return Err(err("the model scales its rotary frequencies by a `rope_freqs` tensor (Llama 3.1-style long context), which loraplex does not read from GGUF yet; serve its safetensors checkpoint instead".into()));
    }
    let heads = required(file, &key("attention.head_count"))?;
    let hidden = required(file, &key("embedding_length"))?;
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("intermediate_size".into(), json!(required(file, &key("feed_forward_length"))?));
    c.insert("num_hidden_layers".into(), json!(required(file, &key("block_count"))?));
    c.insert("num_attention_heads".into(), json!(heads));
    if let Some(kv) = file.get_u64(&key("attention.head_count_kv"))? {
        c.insert("num_key_value_heads".into(), json!(kv));
    }
    if let Some(d) = file.get_u64(&key("attention.key_length"))? {
        if let Some(v) = file.get_u64(&key("attention.value_length"))?.filter(|&v| v != d) {
            return Err(err(format!("key length {d} and value length {v} differ, which loraplex does not run")));
        }
        c.insert("head_dim".into(), json!(d));
    }
    let head_dim = c.get("head_dim").and_then(Value::as_u64).map_or(Ok(hidden / heads.max(1)), |d| to_usize(file, d))?;
    if let Some(rot) = file.get_u64(&key("rope.dimension_count"))?.filter(|&r| to_usize(file, r).ok() != Some(head_dim)) {
        return Err(err(format!("rotary embeddings over {rot} of {head_dim} head dimensions (partial rotary) are not supported")));
    }
    c.insert("max_position_embeddings".into(), json!(required(file, &key("context_length"))?));
    let eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| err(format!("missing `{}`", key("attention.layer_norm_rms_epsilon"))))?;
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert("rope_theta".into(), json!(file.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0)));
    match file.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => {}
        Some("linear") => {
            let factor =
                file.get_f32(&key("rope.scaling.factor"))?.ok_or_else(|| err(format!("linear rope scaling without `{}`", key("rope.scaling.factor"))))?;
            c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": factor}));
        }
        Some(other) => return Err(err(format!("rope scaling `{other}` is not supported (only linear)"))),
    }
    if let Some(w) = file.get_u64(&key("attention.sliding_window"))? {
        c.insert("sliding_window".into(), json!(w));
    }
    let vocab = match file.get_u64(&key("vocab_size"))? {
        Some(v) => to_usize(file, v)?,
        None => file
            .get_str_array("tokenizer.ggml.tokens")?
            .map(<[String]>::len)
            .ok_or_else(|| err("no `tokenizer.ggml.tokens` to size the vocabulary by".into()))?,
    };
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(file.tensor_info("output.weight").is_none()));
    if arch == "llama" {
        c.insert("attention_bias".into(), json!(file.tensor_info("blk.0.attn_q.bias").is_some()));
        c.insert("mlp_bias".into(), json!(file.tensor_info("blk.0.ffn_up.bias").is_some()));
    }
    if let Some(b) = file.get_u32("tokenizer.ggml.bos_token_id")? {
        c.insert("bos_token_id".into(), json!(b));
    }
    if let Some(e) = file.get_u32("tokenizer.ggml.eos_token_id")? {
        c.insert("eos_token_id".into(), json!(e));
    }
    Ok(Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_they_exist() {
        assert_eq!(gguf_name("model.embed_tokens.weight").as_deref(), Some("token_embd.weight"));
        assert_eq!(gguf_name("lm_head.weight").as_deref(), Some("output.weight"));
        assert_eq!(gguf_name("model.norm.weight").as_deref(), Some("output_norm.weight"));
        assert_eq!(gguf_name("model.layers.12.self_attn.k_proj.bias").as_deref(), Some("blk.12.attn_k.bias"));
        assert_eq!(gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(), Some("blk.0.ffn_down.weight"));
        assert_eq!(gguf_name("model.layers.0.post_attention_layernorm.weight").as_deref(), Some("blk.0.ffn_norm.weight"));
        for bad in ["model.layers.x.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.scale", "model.layers.0.mlp.weird.weight", "weight", ""] {
            assert_eq!(gguf_name(bad), None, "{bad}");
        }
    }

    /// The inverse of llama.cpp's `permute`, applied to rows numbered by their HF index.
    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        let (heads, d, rb) = (3usize, 8usize, 2usize);
        let rows = heads * d;
        // The converter's permute: `w.reshape(heads, 2, d/2, ..).swapaxes(1, 2)` — stored row
        // h·d + 2i + j holds HF row h·d + j·d/2 + i.
        let mut stored = vec![0u8; rows * rb];
        for h in 0..heads {
            for i in 0..d / 2 {
                for j in 0..2 {
                    let hf = h * d + j * (d / 2) + i;
                    let at = (h * d + 2 * i + j) * rb;
                    stored[at..at + rb].copy_from_slice(&[hf as u8, 0xAA]);
                }
            }
        }
        let back = unpermute_rows(&stored, rows, rb, heads).unwrap();
        let order: Vec<u8> = back.chunks_exact(rb).map(|r| r[0]).collect();
        assert_eq!(order, (0..rows as u8).collect::<Vec<_>>());
        assert!(unpermute_rows(&stored, rows, rb, 5).is_err());
        assert!(unpermute_rows(&stored[1..], rows, rb, heads).is_err());
        assert!(unpermute_rows(&stored, rows, rb, 0).is_err());
    }
}
