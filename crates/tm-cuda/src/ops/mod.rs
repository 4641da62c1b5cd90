//! tm-core's `Ops` on one CUDA GPU (placeholder).

/// tm-core's `Ops` on one CUDA GPU.
#[derive(Debug)]
pub struct CudaBackend;
