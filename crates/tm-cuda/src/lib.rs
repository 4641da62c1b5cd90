//! tm-cuda: the NVIDIA GPU backend (first slice: device discovery; see issue "CUDA backend").
//!
//! What exists:
//! - [`probe`]: finds the CUDA driver (`libcuda.so`, loaded at run time through cudarc's
//!   `dynamic-loading`, so one binary runs with or without a GPU), initialises it and describes
//!   every device ([`CudaDeviceInfo`]: name, compute capability, memory, integrated or discrete,
//!   multiprocessors). Without a driver or a device it returns a [`ProbeError`] that says why; it
//!   never panics.
//! - [`driver_version`] and [`peer_access_matrix`] (`cuDeviceCanAccessPeer`), for `tm-cli check-env`
//!   and the tensor-parallel start-up checks.
//! - [`CudaDevice`]: tm-core's `Device` for one GPU (memory facts only).
//!
//! Still planned: the `Allocator` (a capped caching pool over `cuMemAlloc`), streams and events,
//! pinned staging copies, `Ops` with cuBLASLt and the `tm-kernels` kernels, NCCL `Comm`, NVRTC
//! fallback, and the integrated-memory (Jetson) variant of all of these.
//!
//! Features: `cuda-13` (default) or `cuda-12` chooses the CUDA bindings cudarc uses; enable exactly
//! one (`--no-default-features --features cuda-12` for JetPack 6).

#[cfg(all(feature = "cuda-12", feature = "cuda-13"))]
compile_error!("tm-cuda: enable only one of the features `cuda-12` and `cuda-13`");

mod device;
mod probe;

pub use device::CudaDevice;
pub use probe::{driver_version, peer_access_matrix, probe, CudaDeviceInfo, ProbeError};
