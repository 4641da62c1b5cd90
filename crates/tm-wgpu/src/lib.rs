//! tm-wgpu: the portable GPU backend (planned; see issue "wgpu backend").
//!
//! It will implement tm-core's traits with wgpu compute shaders (WGSL sources in tm-kernels),
//! so tm runs on any Vulkan, Metal or DX12 GPU. Nothing is implemented yet.
