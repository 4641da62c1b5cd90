//! Errors of model loading and generation.

use std::path::PathBuf;

/// Result alias for tm-model.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// What can go wrong between a checkpoint on disk and generated text. Every variant names the
/// file, tensor or field involved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file is not what it should be (bad JSON, bad header, truncated, ...).
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The architecture is not one tm supports.
    #[error("unsupported architecture `{arch}` in {path}; supported: {supported}")]
    UnknownArchitecture {
        /// The architecture string found.
        arch: String,
        /// The config file.
        path: PathBuf,
        /// The supported list.
        supported: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from {path}")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// The checkpoint (directory or file).
        path: PathBuf,
    },
    /// A tensor has the wrong shape or dtype.
    #[error("tensor `{name}` in {path} has shape {got:?} ({dtype}), expected {expected:?}")]
    TensorShape {
        /// Tensor name.
        name: String,
        /// The file holding it.
        path: PathBuf,
        /// Expected shape.
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
        /// Dtype found.
        dtype: String,
    },
    /// A config value is missing or invalid.
    #[error("{path}: config field `{field}`: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// Tokenizer or chat-template failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Chat template failure.
    #[error("chat template: {0}")]
    Template(String),
    /// Bad request input (prompt too long, bad sampling parameters, ...).
    #[error("{0}")]
    InvalidInput(String),
    /// The engine's queue is full; try again later.
    #[error("{0}")]
    Overloaded(String),
    /// The engine is stopping or has stopped and takes no new requests.
    #[error("{0}")]
    Unavailable(String),
    /// The prompt does not fit in the context.
    #[error("{0}")]
    ContextLength(String),
    /// A backend error.
    #[error(transparent)]
    Core(#[from] tm_core::Error),
    /// A tensor-parallel rank failed (deadline expiries are [`ModelError::Core`] timeouts, which
    /// already name the rank and the collective).
    #[error("tensor-parallel rank {rank} failed in {step}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What the rank was doing (`loading`, `forward step 12`, ...).
        step: String,
        /// What went wrong.
        #[source]
        source: Box<ModelError>,
    },
}

impl ModelError {
    /// A [`ModelError::Format`] error.
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ModelError::Format { path: path.into(), message: message.into() }
    }
    /// A [`ModelError::Io`] error.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}
