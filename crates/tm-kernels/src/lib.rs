//! tm-kernels: GPU kernel sources and their compiled artefacts.
//!
//! CUDA C++ sources live in `cuda/` (one module per `.cu` file, shared code in `.cuh` headers);
//! `cargo xtask build-kernels --arch sm_80,sm_86,sm_87,sm_89,sm_90` compiles them with nvcc into
//! cubins (plus PTX for the newest arch) that this crate embeds at build time (see [`cuda`]).
//! The sources themselves are embedded too, so a device with no matching cubin can compile them
//! with NVRTC at run time.

pub mod cuda;
pub mod pdl;
pub mod wgsl;
