//! tm-core's `Ops` on one CUDA GPU (being written).

use tm_core::{DType, Error, Result};

/// How to open a [`CudaBackend`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Device ordinal.
    pub ordinal: usize,
    /// Activation (and dense weight, KV cache) dtype: `BF16`, `F16` or `F32`.
    pub dtype: DType,
    /// Hard cap on device memory tm may take, in bytes (`None`: the device's usable memory).
    pub memory_cap: Option<u64>,
}

/// tm-core's `Ops` on one CUDA GPU.
#[derive(Debug)]
pub struct CudaBackend;

impl CudaBackend {
    /// Opens the GPU and loads the kernels.
    pub fn open(opts: CudaOptions) -> Result<CudaBackend> {
        Err(Error::Unsupported(format!("CUDA backend not built yet ({opts:?})")))
    }
}
