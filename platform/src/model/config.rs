//! `config.json` of a HuggingFace Llama-family checkpoint, parsed into a checked [`ModelConfig`].
//!
//! Both styles are read: transformers 5 (`rope_parameters`, `dtype`) and the older one
//! (top-level `rope_theta`, `rope_scaling`, `torch_dtype`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ModelError;

/// The model families this engine runs. They share one forward pass and differ in biases and
/// attention windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

impl Architecture {
    const KNOWN: [(&'static str, Architecture); 3] =
        [("LlamaForCausalLM", Architecture::Llama), ("MistralForCausalLM", Architecture::Mistral), ("Qwen2ForCausalLM", Architecture::Qwen2)];

    pub fn hf_name(self) -> &'static str {
        Self::KNOWN.iter().find(|(_, a)| *a == self).map_or("", |(n, _)| n)
    }
}

/// How rotary frequencies are scaled for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Which linear layers carry a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Biases {
    pub qkv: bool,
    pub o: bool,
    pub mlp: bool,
}

/// A checked model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// The context length: no sequence may hold more tokens than this.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub biases: Biases,
    /// Per layer: the attention window, or `None` for full attention.
    pub sliding_windows: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RopeParams {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParams>,
    rope_scaling: Option<RopeParams>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

impl ModelConfig {
    /// FLOPs of attending to one cached token (scores and values, every layer and head) over
    /// the FLOPs of one token's projections and MLP: what a token deep in a long context costs
    /// on top of one at its start, per token of context.
    pub fn attention_flops_per_key(&self) -> f64 {
        let (h, q, kv) = (self.hidden_size as f64, (self.num_heads * self.head_dim) as f64, (self.num_kv_heads * self.head_dim) as f64);
        let linear = h * q + 2.0 * h * kv + q * h + 3.0 * h * self.intermediate_size as f64;
        let attention = 2.0 * q;
        if linear > 0.0 { attention / linear } else { 0.0 }
    }

    /// The config of the model at `path`: `config.json` of a directory, or a GGUF file's
    /// metadata.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        if path.is_dir() { Self::from_dir(path) } else { Self::from_gguf(&super::gguf::GgufFile::open(path)?) }
    }

    /// The config a GGUF file's metadata describes.
    pub fn from_gguf(file: &super::gguf::GgufFile) -> Result<Self, ModelError> {
        let json = super::gguf::convert::config_json(file)?;
        Self::from_json(&json.to_string(), file.path()).map_err(|e| match e {
            ModelError::Config { path, detail } => ModelError::Gguf { path, detail: format!("{detail} (in the config rebuilt from its metadata: {json})") },
            other => other,
        })
    }

    /// Reads and checks `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        Self::from_json(&text, &path)
    }

    /// Parses config text; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, ModelError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| ModelError::Config { path: path.to_path_buf(), detail: format!("not valid JSON: {e}") })?;
        Parser { path: path.to_path_buf() }.parse(raw)
    }
}

struct Parser {
    path: PathBuf,
}

impl Parser {
    fn err(&self, detail: impl Into<String>) -> ModelError {
        ModelError::Config { path: self.path.clone(), detail: detail.into() }
    }

    fn required(&self, v: Option<usize>, key: &str) -> Result<usize, ModelError> {
        match v {
            Some(0) => Err(self.err(format!("`{key}` must be positive"))),
            Some(v) => Ok(v),
            None => Err(self.err(format!("missing `{key}`"))),
        }
    }

    fn parse(&self, raw: RawConfig) -> Result<ModelConfig, ModelError> {
        let names = raw.architectures.clone().unwrap_or_default();
        let architecture = names.iter().find_map(|n| Architecture::KNOWN.iter().find(|(k, _)| k == n).map(|(_, a)| *a)).ok_or_else(|| {
            let known: Vec<_> = Architecture::KNOWN.iter().map(|(n, _)| *n).collect();
            self.err(format!("unsupported architecture {names:?}; supported: {}", known.join(", ")))
        })?;
        let hidden_size = self.required(raw.hidden_size, "hidden_size")?;
        let num_heads = self.required(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = self.required(raw.num_key_value_heads.or(Some(num_heads)), "num_key_value_heads")?;
        if num_heads % num_kv_heads != 0 {
            return Err(self.err(format!("num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})")));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => return Err(self.err(format!("hidden_size {hidden_size} is not divisible by {num_heads} heads"))),
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(self.err(format!("head_dim must be even and positive, got {head_dim}")));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(self.err(format!("unsupported hidden_act `{act}` (only silu)")));
        }
        let num_layers = self.required(raw.num_hidden_layers, "num_hidden_layers")?;
        let sliding_windows = self.sliding_windows(architecture, &raw, num_layers)?;
        let (rope_theta, rope_scaling) = self.rope(raw.rope_parameters, raw.rope_scaling, raw.rope_theta)?;
        let biases = match architecture {
            Architecture::Llama => {
                let attn = raw.attention_bias.unwrap_or(false);
                Biases { qkv: attn, o: attn, mlp: raw.mlp_bias.unwrap_or(false) }
            }
            Architecture::Mistral => Biases { qkv: false, o: false, mlp: false },
            Architecture::Qwen2 => Biases { qkv: true, o: false, mlp: false },
        };
        let eos_token_ids = match raw.eos_token_id {
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
            None => vec![],
        };
        let eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(self.err(format!("rms_norm_eps must be positive, got {eps}")));
        }
        Ok(ModelConfig {
            architecture,
            vocab_size: self.required(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: self.required(raw.intermediate_size, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: eps as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.required(raw.max_position_embeddings, "max_position_embeddings")?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            biases,
            sliding_windows,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
        })
    }

    fn rope(&self, params: Option<RopeParams>, scaling: Option<RopeParams>, theta: Option<f64>) -> Result<(f64, RopeScaling), ModelError> {
        // transformers 5 keeps everything in `rope_parameters`; older configs split it into
        // `rope_theta` and an optional `rope_scaling`.
        let p = params.or(scaling);
        let theta = p.as_ref().and_then(|p| p.rope_theta).or(theta).unwrap_or(10_000.0);
        if !(theta > 0.0 && theta.is_finite()) {
            return Err(self.err(format!("rope_theta must be positive, got {theta}")));
        }
        let Some(p) = p else { return Ok((theta, RopeScaling::Default)) };
        let kind = p.rope_type.as_deref().or(p.legacy_type.as_deref()).unwrap_or("default");
        let factor = |name: &str, v: Option<f64>| -> Result<f64, ModelError> {
            match v {
                Some(f) if f > 0.0 && f.is_finite() => Ok(f),
                Some(f) => Err(self.err(format!("rope `{name}` must be positive, got {f}"))),
                None => Err(self.err(format!("rope type `{kind}` needs `{name}`"))),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: factor("factor", p.factor)? },
            "llama3" => {
                let (low, high) = (factor("low_freq_factor", p.low_freq_factor)?, factor("high_freq_factor", p.high_freq_factor)?);
                if high <= low {
                    return Err(self.err(format!("rope high_freq_factor ({high}) must exceed low_freq_factor ({low})")));
                }
                RopeScaling::Llama3 {
                    factor: factor("factor", p.factor)?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: factor("original_max_position_embeddings", p.original_max_position_embeddings)?,
                }
            }
            other => return Err(self.err(format!("unsupported rope type `{other}` (supported: default, linear, llama3)"))),
        };
        Ok((theta, scaling))
    }

    fn sliding_windows(&self, arch: Architecture, raw: &RawConfig, layers: usize) -> Result<Vec<Option<usize>>, ModelError> {
        let window = match (arch, raw.sliding_window) {
            (_, Some(0)) => return Err(self.err("sliding_window must be positive")),
            (Architecture::Qwen2, w) if raw.use_sliding_window == Some(true) => w,
            (Architecture::Qwen2, _) => None,
            (_, w) => w,
        };
        if let Some(types) = &raw.layer_types {
            if types.len() != layers {
                return Err(self.err(format!("layer_types has {} entries for {layers} layers", types.len())));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(None),
                    "sliding_attention" => window.map(Some).ok_or_else(|| self.err("layer_types names sliding_attention but sliding_window is not set")),
                    other => Err(self.err(format!("unsupported layer type `{other}`"))),
                })
                .collect();
        }
        Ok(match (arch, window) {
            (_, None) => vec![None; layers],
            // Qwen2 keeps its first `max_window_layers` layers on full attention.
            (Architecture::Qwen2, Some(w)) => {
                let full = raw.max_window_layers.unwrap_or(layers);
                (0..layers).map(|i| (i >= full).then_some(w)).collect()
            }
            (_, Some(w)) => vec![Some(w); layers],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_json(json, Path::new("config.json"))
    }

    const BASE: &str = r#""vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256"#;

    #[test]
    fn reads_both_rope_styles() {
        let new =
            parse(&format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#))
                .unwrap();
        let old = parse(&format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_theta": 500000.0}}"#)).unwrap();
        assert_eq!(new, old);
        assert_eq!(new.rope_theta, 500000.0);
        assert_eq!(new.head_dim, 16);
        let llama3 = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_theta": 500000.0, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert!(matches!(llama3.rope_scaling, RopeScaling::Llama3 { factor: 8.0, .. }));
        let linear = parse(&format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#)).unwrap();
        assert_eq!(linear.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn architecture_specific_biases_and_windows() {
        let qwen = parse(&format!(r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}, "sliding_window": 32, "use_sliding_window": false}}"#)).unwrap();
        assert_eq!(qwen.biases, Biases { qkv: true, o: false, mlp: false });
        assert_eq!(qwen.sliding_windows, vec![None, None]);
        let mistral = parse(&format!(r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": 32}}"#)).unwrap();
        assert_eq!(mistral.sliding_windows, vec![Some(32), Some(32)]);
        let typed = parse(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}}"#
        ))
        .unwrap();
        assert_eq!(typed.sliding_windows, vec![Some(8), None]);
    }

    #[test]
    fn errors_name_the_problem_and_file() {
        let cases = [
            (format!(r#"{{"architectures": ["GPT2LMHeadModel"], {BASE}}}"#), "unsupported architecture"),
            (
                format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#),
                "unsupported rope type `yarn`",
            ),
            (format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "hidden_act": "gelu"}}"#), "hidden_act"),
            (r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 10}"#.to_string(), "missing `hidden_size`"),
            (r#"{"architectures": ["LlamaForCausalLM""#.to_string(), "not valid JSON"),
            (format!(r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"rope_type": "linear"}}}}"#), "needs `factor`"),
        ];
        for (json, want) in cases {
            let err = parse(&json).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains("config.json"), "{err}");
        }
    }
}
