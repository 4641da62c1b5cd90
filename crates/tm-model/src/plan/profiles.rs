//! Devices that need not be present: `tm-cli plan --device-profile NAME` plans for them.
//!
//! A profile holds the nominal facts of a device (total memory, whether the GPU shares DRAM with
//! the CPU, compute capability). The memory it leaves to tm is estimated, not measured: on
//! integrated boards (Jetson) the OS and other processes keep [`DEFAULT_HOST_RESERVE`]; on every
//! CUDA device the context, module images and library workspaces take
//! [`CUDA_RUNTIME_RESERVE`]. These are estimates until measured on each board (`tm-cli plan
//! --measure` on the device prints measured against planned).

use super::{PlanTarget, WeightPolicy};
use tm_core::{DType, DeviceKind, MemoryInfo};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// Host memory an integrated board keeps for the OS and other processes (issue 10's
/// `--host-reserve` default): 1.5 GiB.
pub const DEFAULT_HOST_RESERVE: u64 = 3 * GIB / 2;

/// Allowance for what the CUDA runtime itself holds (context, loaded kernels, cuBLAS workspace):
/// 512 MiB. An estimate until measured.
pub const CUDA_RUNTIME_RESERVE: u64 = 512 * MIB;

/// Host memory the CUDA backend keeps for its whole life: the pinned staging buffer of
/// host↔device copies (`tm_cuda::staging`, 32 MiB).
pub const CUDA_HOST_BUFFERS: u64 = 32 * MIB;

/// A device tm can plan for without having it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceProfile {
    /// The name given to `--device-profile`.
    pub name: &'static str,
    /// Marketing name.
    pub description: &'static str,
    /// Physical memory in bytes (nominal: the DRAM of the board, or the GPU's memory as
    /// `nvidia-smi` reports it).
    pub total: u64,
    /// Whether GPU and CPU share the same DRAM (Jetson).
    pub integrated: bool,
    /// CUDA compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
}

/// The known profiles.
pub const DEVICE_PROFILES: &[DeviceProfile] = &[
    DeviceProfile {
        name: "orin-nano-8gb",
        description: "Jetson Orin Nano 8GB",
        total: 8 * GIB,
        integrated: true,
        compute_capability: (8, 7),
    },
    DeviceProfile {
        name: "orin-nx-16gb",
        description: "Jetson Orin NX 16GB",
        total: 16 * GIB,
        integrated: true,
        compute_capability: (8, 7),
    },
    DeviceProfile {
        name: "agx-orin-64gb",
        description: "Jetson AGX Orin 64GB",
        total: 64 * GIB,
        integrated: true,
        compute_capability: (8, 7),
    },
    DeviceProfile {
        name: "rtx3060ti-8gb",
        description: "GeForce RTX 3060 Ti 8GB",
        total: 8192 * MIB,
        integrated: false,
        compute_capability: (8, 6),
    },
    DeviceProfile {
        name: "rtx4090-24gb",
        description: "GeForce RTX 4090 24GB",
        total: 24564 * MIB,
        integrated: false,
        compute_capability: (8, 9),
    },
    DeviceProfile {
        name: "h200-141gb",
        description: "H200 141GB",
        total: 143771 * MIB,
        integrated: false,
        compute_capability: (9, 0),
    },
];

impl DeviceProfile {
    /// The profile called `name`.
    pub fn find(name: &str) -> Option<&'static DeviceProfile> {
        DEVICE_PROFILES.iter().find(|p| p.name.eq_ignore_ascii_case(name))
    }

    /// Names of all profiles, comma-separated (for messages).
    pub fn names() -> String {
        DEVICE_PROFILES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
    }

    /// The memory tm may use on this device: on integrated boards the total less `host_reserve`
    /// (the OS and other processes share the DRAM), on discrete GPUs the total (the runtime's own
    /// share is [`CUDA_RUNTIME_RESERVE`] in the plan's target).
    pub fn memory_info(&self, host_reserve: u64) -> MemoryInfo {
        let usable = if self.integrated { self.total.saturating_sub(host_reserve) } else { self.total };
        MemoryInfo { total: self.total, usable, shared_with_host: self.integrated }
    }

    /// The plan target of a GPU backend on this device: weights kept in their stored dtype,
    /// f16 activations and KV cache, [`CUDA_RUNTIME_RESERVE`] for the runtime,
    /// [`CUDA_HOST_BUFFERS`] of pinned staging; on integrated boards the unified variant, which
    /// reads dense weights in place (zero-copy).
    pub fn target(&self, host_reserve: u64) -> PlanTarget {
        let (major, minor) = self.compute_capability;
        PlanTarget {
            name: format!(
                "{} (profile: {}, {}, sm_{major}{minor})",
                self.name,
                self.description,
                if self.integrated { "integrated, shares DRAM with the CPU" } else { "discrete" }
            ),
            kind: DeviceKind::Cuda,
            memory: self.memory_info(host_reserve),
            weights: WeightPolicy::Stored,
            vectors: WeightPolicy::Stored,
            activation_dtype: DType::F16,
            reserve_bytes: CUDA_RUNTIME_RESERVE,
            host_buffers: CUDA_HOST_BUFFERS,
            zero_copy: self.integrated,
        }
    }
}
