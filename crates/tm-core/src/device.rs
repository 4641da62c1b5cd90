//! The `Device` trait: what a compute device is and how much memory it really has.

use crate::Result;
use std::fmt::Debug;

/// Which family of backend drives a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
    /// Any GPU through wgpu.
    Wgpu,
}

/// Memory facts of a device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Total physical memory of the device.
    pub total: u64,
    /// What tm may really use now (after the OS, other processes and reserves).
    pub usable: u64,
    /// Whether the device shares its memory with the host (CPU, integrated GPUs).
    pub shared_with_host: bool,
}

/// A compute device.
pub trait Device: Send + Sync + Debug {
    /// Human-readable name, e.g. `cpu (2 threads, AVX-512 VNNI)` or `NVIDIA H200`.
    fn name(&self) -> String;
    /// The backend family.
    fn kind(&self) -> DeviceKind;
    /// Index among devices of the same kind.
    fn ordinal(&self) -> usize {
        0
    }
    /// Current memory facts.
    fn memory_info(&self) -> Result<MemoryInfo>;
}
