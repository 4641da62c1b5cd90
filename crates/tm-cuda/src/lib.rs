//! tm-cuda: the NVIDIA GPU backend.
//!
//! - [`probe`]: finds the CUDA driver (`libcuda.so`, loaded at run time through cudarc's
//!   `dynamic-loading`, so one binary runs with or without a GPU), initialises it and describes
//!   every device ([`CudaDeviceInfo`]). Without a driver or a device it returns a [`ProbeError`]
//!   that says why; it never panics.
//! - [`driver_version`] and [`peer_access_matrix`] (`cuDeviceCanAccessPeer`).
//! - [`CudaDevice`]: tm-core's `Device` for one GPU.
//! - [`runtime::Gpu`]: context, stream and kernel modules of one GPU; kernel launches.
//! - [`pdl`]: programmatic dependent launch on sm_90+ (on unless `TM_PDL=0`).
//! - [`allocator`]: the capped caching pool over `cuMemAlloc`.
//! - [`staging`]: bounded pinned host buffers for host↔device copies.
//! - [`memory_model`]: the discrete and unified (integrated GPU, Jetson) memory variants, and the
//!   system memory budget of the unified one.
//! - [`zero_copy`]: weights the GPU reads in place from the checkpoint's file pages (unified).
//! - [`blas`]: matrix products through cuBLASLt.
//! - [`nvrtc`]: compiling the embedded kernel sources when no cubin fits the device.
//! - [`kernels`]: typed launchers for the `tm-kernels` CUDA kernels.
//! - [`nccl`]: tm-core's `Comm` over NCCL for GPU ranks (non-blocking communicators, a watchdog
//!   with deadlines, `ncclCommAbort`), the start-up self-test and the peer links.
//! - [`peer`]: one-shot all-reduce and all-gather kernels over peer access for small messages
//!   (what `nccl` uses for decode steps, captured into CUDA graphs), with device-side deadlines.
//! - [`CudaBackend`]: tm-core's `Ops` on one GPU. Large-batch int4 products go by dequantized
//!   slabs through cuBLASLt ([`kernels::q4_slab`], `TM_Q4_SLAB`, `TM_Q4_SLAB_MIN_M`);
//!   [`set_slab_policy`] forces that path for tests and benchmarks, [`slab_products`] counts it.
//!
//! Features: `cuda-13` (default) or `cuda-12` chooses the CUDA bindings cudarc uses; enable exactly
//! one (`--no-default-features --features cuda-12` for JetPack 6).

#[cfg(all(feature = "cuda-12", feature = "cuda-13"))]
compile_error!("tm-cuda: enable only one of the features `cuda-12` and `cuda-13`");

pub mod allocator;
pub mod blas;
mod device;
pub mod kernels;
pub mod libs;
pub mod memory_model;
pub mod nccl;
pub mod nvrtc;
mod ops;
pub mod pdl;
pub mod peer;
mod probe;
mod record_profile;
pub mod runtime;
pub mod staging;
mod switches;
pub mod zero_copy;

pub use device::CudaDevice;
pub use memory_model::{MemoryConfig, MemoryModel};
pub use ops::{set_slab_policy, slab_products, CudaBackend, CudaOptions};
pub use probe::{driver_version, peer_access_matrix, probe, CudaDeviceInfo, ProbeError};
