//! tm-wgpu: the portable GPU backend over wgpu (Vulkan, Metal, DX12).
//!
//! [`WgpuBackend`] implements tm-core's `Device`, `Allocator` and `Ops` with WGSL compute
//! shaders (sources in `tm_kernels::wgsl`). Activations, dense weights and the KV cache are
//! f32; int4/int8 weights stay packed and are dequantized inside the embedding and matrix
//! kernels. Every tensor is one wgpu storage buffer, so a tensor may not exceed the adapter's
//! `max_storage_buffer_binding_size` (128 MiB on lavapipe); splitting larger weights is not
//! implemented yet.
//!
//! - [`context`]: adapter listing and selection, the device and its error capture.
//! - [`allocator`]: storage buffers behind tm-core's RAII `Buffer`s, with a cap and statistics.
//! - [`ops`]: the kernels.

pub mod allocator;
pub mod context;
pub mod ops;

pub use allocator::{WgpuAllocator, WgpuDevice};
pub use context::{list_adapters, AdapterSummary, Gpu, WgpuOptions};
pub use ops::WgpuBackend;
