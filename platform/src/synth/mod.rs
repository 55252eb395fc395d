//! Random Llama models in the HuggingFace layout, for tests and benchmarks without downloads.
//!
//! [`synthesize_model`] writes a directory that HuggingFace tooling and this engine load like a
//! real checkpoint: `config.json`, `generation_config.json`, `model.safetensors` (f32),
//! `tokenizer.json` (a working byte-level BPE), `tokenizer_config.json` (with a ChatML chat
//! template) and `special_tokens_map.json`.
//!
//! Weights depend only on the seed (the same seed writes byte-identical files on any machine);
//! the tokenizer depends only on the vocabulary size, so models of one preset share it.
//!
//! [`synthesize_adapters`] writes random LoRA adapters for such a model in the PEFT layout.

mod adapters;
#[cfg(test)]
mod tests;
pub(crate) mod tokenizer;
mod weights;

use std::io;
use std::path::{Path, PathBuf};

use serde_json::json;

pub(crate) use adapters::check_adapter_options;
pub use adapters::{AdapterSynthOptions, AdapterTargets, synthesize_adapters};
pub use tokenizer::SPECIAL_TOKENS;
pub use weights::FileDType;

/// Model sizes to synthesize.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// The size of the reference fixtures: vocab 512, hidden 128, 4 layers (about 0.8M parameters).
    Tiny,
    /// vocab 4096, hidden 512, 6 layers (about 21M parameters).
    Small,
    /// vocab 32000, hidden 1024, 8 layers (about 156M parameters, 620 MB in f32).
    Bench,
    /// TinyLlama's shapes: vocab 32000, hidden 2048, intermediate 5632, 22 layers, 32 heads over
    /// 4 KV heads (about 1.1B parameters, 2.2 GB in bf16).
    #[value(name = "1b")]
    OneB,
    /// Llama 2 7B's shapes: vocab 32000, hidden 4096, intermediate 11008, 32 layers, 32 heads and
    /// 32 KV heads (about 6.7B parameters, 13.5 GB in bf16).
    #[value(name = "7b")]
    SevenB,
}

/// The architecture hyper-parameters of a synthesized Llama model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelDims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
}

impl Preset {
    /// The dimensions this preset stands for.
    pub fn dims(self) -> ModelDims {
        let (vocab, hidden, inter, layers, heads, kv, max_pos) = match self {
            Preset::Tiny => (512, 128, 344, 4, 8, 2, 512),
            Preset::Small => (4096, 512, 1408, 6, 8, 2, 2048),
            Preset::Bench => (32000, 1024, 2816, 8, 16, 4, 4096),
            Preset::OneB => (32000, 2048, 5632, 22, 32, 4, 4096),
            Preset::SevenB => (32000, 4096, 11008, 32, 32, 32, 4096),
        };
        ModelDims {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: hidden / heads,
            max_position_embeddings: max_pos,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
        }
    }
}

impl ModelDims {
    /// These dimensions with `kv_heads` key/value heads (grouped-query attention) when given.
    pub fn with_kv_heads(mut self, kv_heads: Option<usize>) -> Result<Self, SynthError> {
        if let Some(n) = kv_heads {
            if n == 0 || !self.num_attention_heads.is_multiple_of(n) {
                return Err(SynthError::Options(format!("--kv-heads {n} must divide the {} attention heads", self.num_attention_heads)));
            }
            self.num_key_value_heads = n;
        }
        Ok(self)
    }

    /// Total number of weights, embeddings and `lm_head` included.
    pub fn parameter_count(&self) -> u64 {
        weights::tensor_specs(self).iter().map(|t| t.numel() as u64).sum()
    }
}

/// What to synthesize and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthOptions {
    /// Output directory, created if needed; existing files of the same names are replaced.
    pub out: PathBuf,
    pub preset: Preset,
    /// Seeds the weights.
    pub seed: u64,
    /// Element type of the weights (norms and embeddings included, as real checkpoints store
    /// them).
    pub dtype: FileDType,
    /// Key/value heads instead of the preset's (see [`ModelDims::with_kv_heads`]).
    pub kv_heads: Option<usize>,
}

/// What [`synthesize_model`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthSummary {
    /// Number of parameters in `model.safetensors`.
    pub parameters: u64,
    /// Every file written, in the order written.
    pub files: Vec<PathBuf>,
    /// Their total size in bytes.
    pub bytes: u64,
}

/// Why a model or its adapters could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("building the tokenizer: {0}")]
    Tokenizer(String),
    /// The options ask for something that cannot be built; the message says what.
    #[error("{0}")]
    Options(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

/// Writes a complete random model for `opts.preset` into `opts.out`.
///
/// The safetensors file is streamed tensor by tensor, so memory use stays around the size of
/// the largest tensor; weights are generated in parallel in fixed-size blocks, each with its own
/// random stream, so the bytes do not depend on the number of threads.
pub fn synthesize_model(opts: &SynthOptions) -> Result<SynthSummary, SynthError> {
    let dims = opts.preset.dims().with_kv_heads(opts.kv_heads)?;
    std::fs::create_dir_all(&opts.out).map_err(io_err(&opts.out))?;
    let mut files = Vec::new();
    let mut bytes = 0;
    let mut put = |name: &str, contents: &[u8]| -> Result<(), SynthError> {
        let path = opts.out.join(name);
        std::fs::write(&path, contents).map_err(io_err(&path))?;
        bytes += contents.len() as u64;
        files.push(path);
        Ok(())
    };

    put("config.json", &to_json(&config_json(&dims, opts.dtype)))?;
    put("generation_config.json", &to_json(&generation_config_json()))?;
    let tok = tokenizer::tokenizer_json(dims.vocab_size)?;
    put("tokenizer.json", tok.as_bytes())?;
    let tok_config = tokenizer_config_json(dims.max_position_embeddings);
    put("tokenizer_config.json", &to_json(&tok_config))?;
    put("special_tokens_map.json", &to_json(&special_tokens_map_json()))?;

    let path = opts.out.join("model.safetensors");
    let (parameters, size) = weights::write_safetensors(&path, &dims, opts.seed, opts.dtype)?;
    files.push(path);
    bytes += size;
    Ok(SynthSummary { parameters, files, bytes })
}

fn to_json(value: &serde_json::Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(value).expect("a JSON value always serializes");
    s.push('\n');
    s.into_bytes()
}

/// `config.json` in both the transformers 5 style (`rope_parameters`, `dtype`) and the older
/// one (top-level `rope_theta`, `torch_dtype`), as real checkpoints come in either.
fn config_json(d: &ModelDims, dtype: FileDType) -> serde_json::Value {
    let dtype = match dtype {
        FileDType::F32 => "float32",
        FileDType::Bf16 => "bfloat16",
    };
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": dtype,
        "eos_token_id": 2,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate_size,
        "max_position_embeddings": d.max_position_embeddings,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": d.num_attention_heads,
        "num_hidden_layers": d.num_hidden_layers,
        "num_key_value_heads": d.num_key_value_heads,
        "pad_token_id": null,
        "pretraining_tp": 1,
        "rms_norm_eps": d.rms_norm_eps,
        "rope_parameters": { "rope_theta": d.rope_theta, "rope_type": "default" },
        "rope_theta": d.rope_theta,
        "tie_word_embeddings": false,
        "torch_dtype": dtype,
        "use_cache": true,
        "vocab_size": d.vocab_size,
    })
}

fn generation_config_json() -> serde_json::Value {
    json!({
        "bos_token_id": 1,
        "do_sample": false,
        "eos_token_id": [2, 4],
        "pad_token_id": 2,
    })
}

/// ChatML, opened by the BOS token.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn tokenizer_config_json(max_len: usize) -> serde_json::Value {
    let added: serde_json::Map<String, serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            let entry = json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true,
            });
            (id.to_string(), entry)
        })
        .collect();
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": true,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    })
}

fn special_tokens_map_json() -> serde_json::Value {
    json!({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    })
}
