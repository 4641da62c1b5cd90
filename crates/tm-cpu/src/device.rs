//! The host CPU as a tm `Device`.

use tm_core::host_memory::host_memory;
use tm_core::{Device, DeviceKind, MemoryInfo, Result};

/// The CPU. Usable memory is what the host really has free (MemAvailable, cgroup limit).
#[derive(Debug, Default)]
pub struct CpuDevice;

impl Device for CpuDevice {
    /// `cpu (T threads, ISA)`: the calling pool's threads and the kernels' instruction set
    /// ([`crate::quant_matmul::Isa::best`]), so that a benchmark's header says what ran.
    fn name(&self) -> String {
        format!("cpu ({} threads, {})", rayon::current_num_threads(), crate::quant_matmul::Isa::best().describe())
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        let m = host_memory();
        Ok(MemoryInfo { total: m.total, usable: m.available, shared_with_host: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_says_threads_and_kernels() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        let name = pool.install(|| CpuDevice.name());
        assert_eq!(name, format!("cpu (3 threads, {})", crate::quant_matmul::Isa::best().describe()));
    }
}
