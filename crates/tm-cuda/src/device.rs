//! tm-core's [`Device`] for one CUDA GPU.

use tm_core::host_memory::host_memory;
use tm_core::{Device, DeviceKind, Error, MemoryInfo, Result};

use crate::probe::{device_info, mem_get_info, CudaDeviceInfo, ProbeError};

/// One CUDA GPU. Holds no driver resources (no context, no memory) yet.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    info: CudaDeviceInfo,
}

impl CudaDevice {
    /// Opens device `ordinal`; fails with the [`ProbeError`] when CUDA or the device is unavailable.
    pub fn new(ordinal: usize) -> std::result::Result<Self, ProbeError> {
        Ok(CudaDevice { info: device_info(ordinal)? })
    }

    /// What the driver said about the device when it was opened.
    pub fn info(&self) -> &CudaDeviceInfo {
        &self.info
    }
}

fn backend_error(e: ProbeError) -> Error {
    Error::Backend { backend: "cuda".into(), message: e.to_string() }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.info.name.clone()
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// Discrete GPUs: total and usable (= free) from `cuMemGetInfo`.
    ///
    /// Integrated GPUs (Jetson) share the host's memory, and `cuMemGetInfo` there reports
    /// roughly `MemFree`, which ignores reclaimable page cache and so understates what can really
    /// be allocated (NVIDIA's Jetson memory notes). Usable memory comes from the host's
    /// `MemAvailable` (capped by cgroup limits) instead, as for the CPU backend.
    fn memory_info(&self) -> Result<MemoryInfo> {
        let (free, total) = mem_get_info(self.info.ordinal).map_err(backend_error)?;
        if self.info.integrated {
            let host = host_memory();
            Ok(MemoryInfo { total, usable: host.available.min(total), shared_with_host: true })
        } else {
            Ok(MemoryInfo { total, usable: free, shared_with_host: false })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_without_cuda_is_an_error_not_a_panic() {
        match CudaDevice::new(0) {
            Ok(d) => {
                assert_eq!(d.kind(), DeviceKind::Cuda);
                let m = d.memory_info().expect("memory info");
                assert!(m.usable <= m.total || m.shared_with_host, "{m:?}");
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
