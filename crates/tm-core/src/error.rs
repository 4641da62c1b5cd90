//! The error type shared by tm crates.

use std::time::Duration;

/// Result alias used across tm.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in tm-core and the backends, with the context a user needs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An allocation did not fit. Names the phase, the bytes asked for and what was free.
    #[error(
        "out of memory on {device} while allocating {phase}: asked for {requested} bytes, {free} bytes free{hint}"
    )]
    OutOfMemory {
        /// Device the allocation was for.
        device: String,
        /// What the memory was for (weights, KV cache, workspace, ...).
        phase: String,
        /// Bytes requested.
        requested: u64,
        /// Bytes that were free.
        free: u64,
        /// Advice on what to lower, starting with "; " or empty.
        hint: String,
    },
    /// A tensor had the wrong shape for an operation.
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    Shape {
        /// Operation or tensor name.
        op: String,
        /// What was expected.
        expected: String,
        /// What was found.
        got: String,
    },
    /// A tensor had a dtype the operation does not accept.
    #[error("dtype mismatch in {op}: expected {expected}, got {got}")]
    DType {
        /// Operation or tensor name.
        op: String,
        /// What was expected.
        expected: String,
        /// What was found.
        got: String,
    },
    /// The operation is not supported by this backend or for this input.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A caller passed an argument outside its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A collective or barrier missed its deadline.
    #[error("rank {rank} timed out after {waited:?} in {step}; {hint}")]
    Timeout {
        /// Rank that noticed the stall.
        rank: usize,
        /// The collective or barrier and the step it belonged to.
        step: String,
        /// How long it waited.
        waited: Duration,
        /// What to try.
        hint: String,
    },
    /// A collective or barrier was cut short because the communicator was aborted (another rank
    /// failed or timed out, or the group is shutting down).
    #[error("rank {rank}: {step} was aborted: {reason}")]
    Aborted {
        /// Rank whose collective was cut short.
        rank: usize,
        /// The collective and the step it belonged to.
        step: String,
        /// Why the communicator was aborted.
        reason: String,
    },
    /// A backend (driver, library) reported an error.
    #[error("{backend} error: {message}")]
    Backend {
        /// Backend name.
        backend: String,
        /// The message from the backend.
        message: String,
    },
    /// An I/O error, with what was being accessed.
    #[error("{context}: {source}")]
    Io {
        /// What was being read or written.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Shorthand for [`Error::Shape`].
    pub fn shape(op: impl Into<String>, expected: impl std::fmt::Debug, got: impl std::fmt::Debug) -> Self {
        Error::Shape { op: op.into(), expected: format!("{expected:?}"), got: format!("{got:?}") }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}
