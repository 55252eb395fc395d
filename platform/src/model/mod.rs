//! Llama-family decoder models (Llama, Mistral, Qwen2) over a [`Backend`].
//!
//! The model is immutable once loaded; the KV cache lives outside it and is passed to each
//! forward. A forward runs one batch of sequences of different lengths, flattened without
//! padding, over their block tables.

pub mod config;
mod linear;
mod llama;
pub mod lora;
pub mod rope;
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

/// Loads the model in `dir` (config.json and safetensors) onto `backend`.
pub fn load<B: Backend>(backend: SharedBackend<B>, dir: &std::path::Path) -> Result<Model<B>, ModelError> {
    let config = ModelConfig::from_dir(dir)?;
    let checkpoint = weights::Checkpoint::open(dir)?;
    Model::load(backend, config, &checkpoint)
}
