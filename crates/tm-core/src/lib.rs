//! tm-core: the vocabulary every other tm crate speaks.
//!
//! - [`dtype`]: element types (f32, f16, bf16, i8, u8, i32, packed int4).
//! - [`fp8`]: the FP8 E4M3 encoding of the 8-bit KV cache.
//! - [`tensor`]: tensor descriptors and device tensors that own their memory.
//! - [`device`] and [`alloc`]: the `Device` and `Allocator` traits; memory is handed out as owning
//!   RAII [`alloc::Buffer`]s tied to their allocator.
//! - [`comm`]: the `Comm` trait for collectives with deadlines; the single-rank and in-process
//!   (CPU ranks) implementations.
//! - [`ops`]: the kernel-ops interface the model is written against (one kernel per call).
//! - [`quant`]: the group-wise int4/int8 weight layout shared by importers and kernels.
//! - [`q4_slab`]: the policy and arithmetic of large-batch int4 products by dequantized slabs.
//! - [`rope`]: rotary-embedding frequencies for every scaling type the models use.
//! - [`sampling`]: sampling parameters and the host reference sampler.
//! - [`host_memory`]: what the host really has free (MemAvailable, cgroup limits).
//! - [`error`]: the error type.

pub mod alloc;
pub mod checks;
pub mod comm;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod host_memory;
pub mod ops;
pub mod q4_slab;
pub mod quant;
pub mod rope;
pub mod sampling;
pub mod tensor;

pub use alloc::{Allocator, Buffer};
pub use comm::{Comm, LocalComm, SingleRank};
pub use device::{Device, DeviceKind, MemoryInfo};
pub use dtype::DType;
pub use error::{Error, Result};
pub use ops::Ops;
pub use tensor::{Tensor, TensorDesc};
