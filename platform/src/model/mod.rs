//! Llama-family decoder models (Llama, Mistral, Qwen2) over a [`Backend`].
//!
//! The model is immutable once loaded; the KV cache lives outside it and is passed to each
//! forward. A forward runs one batch of sequences of different lengths, flattened without
//! padding, over their block tables.

pub mod config;
pub mod gguf;
pub mod hub;
mod linear;
mod llama;
pub mod lora;
pub mod rope;
pub mod source;
pub mod weights;

use std::path::PathBuf;

use loraplex_kernels::{Backend, KernelError};

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use linear::{FusedLinear, Linear};
pub use llama::{ForwardBatch, Model};
pub use lora::{LoraBatch, LoraContext};

/// Why a model could not be loaded or run. Each names the file or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {detail}", path.display())]
    Config { path: PathBuf, detail: String },
    #[error("{}: {detail}", path.display())]
    Checkpoint { path: PathBuf, detail: String },
    /// A GGUF file that is malformed, or holds what loraplex cannot read.
    #[error("{}: {detail}", path.display())]
    Gguf { path: PathBuf, detail: String },
    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor { name: String, path: PathBuf },
    #[error("{}: tensor `{name}` has shape {actual:?}, expected {expected:?}", path.display())]
    TensorShape { name: String, path: PathBuf, expected: Vec<usize>, actual: Vec<usize> },
    #[error("{}: tensor `{name}` has dtype {dtype}; only F32, F16 and BF16 are supported", path.display())]
    TensorDType { name: String, path: PathBuf, dtype: String },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// The device a model lives on, shared by everything that runs on it.
pub type SharedBackend<B> = std::sync::Arc<B>;

/// Loads the model at `path` onto `backend`: a directory (config.json and safetensors) or a
/// GGUF file (its weights dequantized at load).
pub fn load<B: Backend>(backend: SharedBackend<B>, path: &std::path::Path) -> Result<Model<B>, ModelError> {
    if path.is_dir() {
        let config = ModelConfig::from_dir(path)?;
        let checkpoint = weights::Checkpoint::open(path)?;
        return Model::load(backend, config, &checkpoint);
    }
    let file = gguf::GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&file)?;
    let decode_to = backend.weight_dtype();
    Model::load(backend, config, &weights::Checkpoint::gguf(file, decode_to)?)
}
