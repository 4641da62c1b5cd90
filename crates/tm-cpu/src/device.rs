//! The host CPU as a tm `Device`.

use tm_core::host_memory::host_memory;
use tm_core::{Device, DeviceKind, MemoryInfo, Result};

/// The CPU. Usable memory is what the host really has free (MemAvailable, cgroup limit).
#[derive(Debug, Default)]
pub struct CpuDevice;

impl Device for CpuDevice {
    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        let m = host_memory();
        Ok(MemoryInfo { total: m.total, usable: m.available, shared_with_host: true })
    }
}
