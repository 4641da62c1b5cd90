//! tm-cpu: the CPU reference backend.
