//! Errors from reading and validating an adapter. Every message names the file and, where there
//! is one, the config key or tensor it is about.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{}: file not found ({what})", path.display())]
    MissingFile { path: PathBuf, what: &'static str },

    #[error(
        "{}: pickle checkpoints are not loaded (arbitrary code on unpickling); \
         provide adapter_model.safetensors instead",
        path.display()
    )]
    PickleCheckpoint { path: PathBuf },

    #[error("{}: invalid JSON: {reason}", path.display())]
    ConfigJson { path: PathBuf, reason: String },

    #[error("{}: key `{key}`: {reason}", path.display())]
    Config { path: PathBuf, key: String, reason: String },

    #[error("{}: invalid safetensors file: {reason}", path.display())]
    Safetensors { path: PathBuf, reason: String },

    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    Tensor { path: PathBuf, tensor: String, reason: String },
}

impl AdapterError {
    pub(crate) fn config(path: &std::path::Path, key: &str, reason: impl Into<String>) -> Self {
        AdapterError::Config { path: path.to_path_buf(), key: key.to_string(), reason: reason.into() }
    }

    pub(crate) fn tensor(path: &std::path::Path, tensor: &str, reason: impl Into<String>) -> Self {
        AdapterError::Tensor { path: path.to_path_buf(), tensor: tensor.to_string(), reason: reason.into() }
    }
}
