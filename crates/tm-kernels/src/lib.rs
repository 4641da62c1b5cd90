//! tm-kernels: GPU kernel sources and compiled artefacts (planned).
//!
//! CUDA C++ sources will live in `cuda/` and WGSL sources in `wgsl/`; `cargo xtask
//! build-kernels --arch sm_87` will compile the CUDA ones into cubins that this crate embeds.
//! No kernels exist yet.
