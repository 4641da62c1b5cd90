//! tm-cuda: the NVIDIA GPU backend (planned; see issue "CUDA backend").
//!
//! It will implement tm-core's `Device`, `Allocator`, `Comm` and `Ops` traits with cudarc
//! (dynamic loading, so one binary runs with or without a GPU), cuBLASLt for matrix products,
//! NCCL for tensor parallelism and the kernels of `tm-kernels`, with a discrete and an
//! integrated-memory (Jetson) variant. Nothing is implemented yet.
