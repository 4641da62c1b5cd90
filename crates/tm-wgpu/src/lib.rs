//! tm-wgpu: the portable GPU backend over wgpu (Vulkan, Metal, DX12).
//!
//! [`WgpuBackend`] implements tm-core's `Device`, `Allocator` and `Ops` with WGSL compute
//! shaders (sources in `tm_kernels::wgsl`). Activations and the KV cache are f32; dense weights
//! f32, or f16 with [`WgpuOptions::f16_weights`]; int4/int8 weights stay packed and are
//! dequantized inside the embedding and matrix kernels. Every tensor is one wgpu buffer (up to
//! the adapter's `max_buffer_size`); weights, embedding tables and the KV cache larger than the
//! storage binding limit (128 MiB on lavapipe) are bound in windows of whole rows or blocks. A
//! forward step is recorded into one command encoder and submitted once, when its logits are
//! read; bind groups are cached. The matrix-vector kernels reduce with subgroup operations where
//! the adapter has them.
//!
//! - [`context`]: adapter listing and selection, the device, the command recorder.
//! - [`allocator`]: storage buffers behind tm-core's RAII `Buffer`s, with a cap and statistics.
//! - [`ops`]: the kernels.
//! - [`profile`]: GPU time per kernel (`TM_WGPU_PROFILE=1`).

pub mod allocator;
pub mod context;
mod launch;
pub mod ops;
pub mod profile;

pub use allocator::{WgpuAllocator, WgpuDevice};
pub use context::{list_adapters, AdapterSummary, Gpu, WgpuOptions};
pub use ops::WgpuBackend;
