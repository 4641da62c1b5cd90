//! tm-core's [`Device`] for one CUDA GPU.

use tm_core::{Device, DeviceKind, Error, MemoryInfo, Result};

use crate::memory_model::{MemoryConfig, MemoryModel, SystemMemory};
use crate::probe::{device_info, mem_get_info, CudaDeviceInfo, ProbeError};

/// One CUDA GPU. Holds no driver resources (no context, no memory) yet.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    info: CudaDeviceInfo,
    /// The memory variant in use: [`MemoryModel::Unified`] or [`MemoryModel::Discrete`].
    model: MemoryModel,
    /// Host memory left to others in the unified variant.
    host_reserve: u64,
}

impl CudaDevice {
    /// Opens device `ordinal` in the memory variant `auto` picks ([`crate::memory_model`]: the
    /// `TM_CUDA_MEMORY_MODEL` environment variable, else unified exactly when the GPU is
    /// integrated); fails with the [`ProbeError`] when CUDA or the device is unavailable. An
    /// unreadable `TM_CUDA_MEMORY_MODEL` is logged and ignored here; [`CudaDevice::with_memory`]
    /// refuses it.
    pub fn new(ordinal: usize) -> std::result::Result<Self, ProbeError> {
        let info = device_info(ordinal)?;
        let env = MemoryModel::from_env().unwrap_or_else(|e| {
            tracing::warn!("{e}; ignored");
            None
        });
        let config = MemoryConfig::default();
        let model = config.model.resolve(info.integrated, env);
        Ok(CudaDevice { info, model, host_reserve: config.host_reserve })
    }

    /// Opens device `ordinal` in the memory variant `config` asks for (`auto`: the environment
    /// variable, else the detection).
    pub fn with_memory(ordinal: usize, config: MemoryConfig) -> Result<Self> {
        let info = device_info(ordinal).map_err(backend_error)?;
        let env = MemoryModel::from_env().map_err(Error::invalid)?;
        let model = config.model.resolve(info.integrated, env);
        Ok(CudaDevice { info, model, host_reserve: config.host_reserve })
    }

    /// What the driver said about the device when it was opened.
    pub fn info(&self) -> &CudaDeviceInfo {
        &self.info
    }

    /// The memory variant in use (never [`MemoryModel::Auto`]).
    pub fn memory_model(&self) -> MemoryModel {
        self.model
    }

    /// The host reserve of the unified variant, in bytes.
    pub fn host_reserve(&self) -> u64 {
        self.host_reserve
    }

    /// The system memory figures of the unified variant, read now.
    pub fn system_memory(&self) -> SystemMemory {
        SystemMemory::read(self.host_reserve)
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

    /// Discrete variant: total and usable (= free) from `cuMemGetInfo`.
    ///
    /// Unified variant (integrated GPUs such as Jetson, or forced): the GPU shares the host's
    /// memory, and `cuMemGetInfo` there reports roughly `MemFree`, which ignores reclaimable page
    /// cache and so understates what can really be allocated (NVIDIA's Jetson memory notes).
    /// Total is the host's (capped by the cgroup) and usable is [`SystemMemory::usable`]:
    /// `min(MemAvailable, cgroup limit − usage) − host reserve`.
    fn memory_info(&self) -> Result<MemoryInfo> {
        if self.model == MemoryModel::Unified {
            let m = self.system_memory();
            return Ok(MemoryInfo { total: m.total(), usable: m.usable(), shared_with_host: true });
        }
        let (free, total) = mem_get_info(self.info.ordinal).map_err(backend_error)?;
        Ok(MemoryInfo { total, usable: free, shared_with_host: false })
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
                assert!(m.usable <= m.total, "{m:?}");
                assert_eq!(m.shared_with_host, d.memory_model() == MemoryModel::Unified);
                let unified =
                    CudaDevice::with_memory(0, MemoryConfig { model: MemoryModel::Unified, host_reserve: 1 << 30 })
                        .expect("unified");
                let u = unified.memory_info().expect("memory info");
                assert!(u.shared_with_host && u.usable <= u.total, "{u:?}");
                assert!(u.total <= unified.system_memory().mem_total, "{u:?}");
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
