//! Which memory variant the CUDA backend runs in: *discrete* (the GPU has its own memory) or
//! *unified* (the GPU shares the host's DRAM: Jetson, or any GPU forced with
//! `--memory-model unified` / `TM_CUDA_MEMORY_MODEL=unified` so the variant is exercised on a
//! discrete card too).
//!
//! What changes in the unified variant:
//! - **usable memory** comes from the system, not from `cuMemGetInfo` (which on Jetson reports
//!   roughly `MemFree` and ignores reclaimable page cache): `min(MemAvailable, cgroup limit −
//!   cgroup usage) − host reserve` ([`SystemMemory::usable`]; the reserve is `--host-reserve`,
//!   default [`DEFAULT_HOST_RESERVE`], left to the OS and other processes);
//! - **weights are never held twice**: a tensor whose stored layout is what the kernels use is
//!   read in place from the checkpoint's file pages, registered with the driver
//!   ([`crate::zero_copy`]); the others are converted through the one bounded staging buffer into
//!   their final allocation;
//! - **one budget**: the KV cache, the workspace and the weights' device allocations all come out
//!   of the same cap, which also counts the registered file pages, and the allocator keeps at
//!   most [`UNIFIED_CACHE_LIMIT`] of freed blocks cached instead of holding freed memory forever.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// Environment variable that picks the memory model when the options say `auto` (so the CUDA
/// test suites run in the unified variant without code changes): `unified`, `discrete` or `auto`.
pub const MEMORY_MODEL_ENV: &str = "TM_CUDA_MEMORY_MODEL";

/// Host memory left to the OS and other processes on a unified device (`--host-reserve`): 1.5 GiB.
/// The same figure as `tm_model::plan::DEFAULT_HOST_RESERVE`.
pub const DEFAULT_HOST_RESERVE: u64 = 3 << 29;

/// Most bytes of freed device blocks the allocator keeps cached in the unified variant (the rest
/// goes back to the driver, and so to the host): 64 MiB.
pub const UNIFIED_CACHE_LIMIT: u64 = 64 << 20;

/// The memory variant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryModel {
    /// Unified when the device is integrated (`CU_DEVICE_ATTRIBUTE_INTEGRATED`), else discrete;
    /// [`MEMORY_MODEL_ENV`] overrides the detection.
    #[default]
    Auto,
    /// The GPU shares the host's memory (Jetson): budget from the system, zero-copy weights.
    Unified,
    /// The GPU has its own memory: budget from `cuMemGetInfo`, weights copied to the device.
    Discrete,
}

impl MemoryModel {
    /// The flag value: `auto`, `unified` or `discrete`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryModel::Auto => "auto",
            MemoryModel::Unified => "unified",
            MemoryModel::Discrete => "discrete",
        }
    }

    /// The model [`MEMORY_MODEL_ENV`] asks for, `None` when it is unset or empty, an error naming
    /// the variable when it holds something else.
    pub fn from_env() -> Result<Option<MemoryModel>, String> {
        match std::env::var(MEMORY_MODEL_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                v.parse().map(Some).map_err(|e: String| format!("{MEMORY_MODEL_ENV}={v}: {e}"))
            }
            _ => Ok(None),
        }
    }

    /// The concrete variant for a device (`integrated` from the driver): an explicit choice
    /// wins; `auto` takes `env` (the value of [`MEMORY_MODEL_ENV`]) and then the detection.
    pub fn resolve(self, integrated: bool, env: Option<MemoryModel>) -> MemoryModel {
        match (self, env) {
            (MemoryModel::Auto, Some(m)) if m != MemoryModel::Auto => m,
            (MemoryModel::Auto, _) if integrated => MemoryModel::Unified,
            (MemoryModel::Auto, _) => MemoryModel::Discrete,
            (m, _) => m,
        }
    }
}

impl fmt::Display for MemoryModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MemoryModel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(MemoryModel::Auto),
            "unified" | "integrated" => Ok(MemoryModel::Unified),
            "discrete" => Ok(MemoryModel::Discrete),
            other => Err(format!("unknown memory model `{other}` (use unified, discrete or auto)")),
        }
    }
}

/// The memory options of the CUDA backend: the variant and the unified variant's host reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryConfig {
    /// The variant asked for (`--memory-model`).
    pub model: MemoryModel,
    /// Host memory left to the OS and other processes in the unified variant (`--host-reserve`).
    pub host_reserve: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig { model: MemoryModel::Auto, host_reserve: DEFAULT_HOST_RESERVE }
    }
}

/// A memory cgroup's limit and usage in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupMemory {
    /// `memory.max` (v2) or `memory.limit_in_bytes` (v1).
    pub limit: u64,
    /// `memory.current` (v2) or `memory.usage_in_bytes` (v1).
    pub usage: u64,
}

/// What the system has for a unified device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SystemMemory {
    /// `MemTotal` from `/proc/meminfo`.
    pub mem_total: u64,
    /// `MemAvailable` from `/proc/meminfo` (free memory plus reclaimable page cache).
    pub mem_available: u64,
    /// The tightest memory cgroup limit on this process, if any.
    pub cgroup: Option<CgroupMemory>,
    /// Left to the OS and other processes.
    pub host_reserve: u64,
}

impl SystemMemory {
    /// Reads `/proc/meminfo` and this process's memory cgroup (v2, then v1).
    pub fn read(host_reserve: u64) -> SystemMemory {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let (mem_total, mem_available) = tm_core::host_memory::parse_meminfo(&meminfo);
        let proc_cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let cgroup = cgroup_memory(Path::new("/sys/fs/cgroup"), &proc_cgroup);
        SystemMemory { mem_total, mem_available, cgroup, host_reserve }
    }

    /// Memory the process could take now without swapping: `MemAvailable`, capped by the
    /// cgroup's `limit − usage`.
    pub fn available(&self) -> u64 {
        match self.cgroup {
            Some(c) => self.mem_available.min(c.limit.saturating_sub(c.usage)),
            None => self.mem_available,
        }
    }

    /// Total memory the process may ever use: `MemTotal`, capped by the cgroup limit.
    pub fn total(&self) -> u64 {
        self.cgroup.map_or(self.mem_total, |c| self.mem_total.min(c.limit))
    }

    /// What tm may use: [`available`](Self::available) less the host reserve.
    pub fn usable(&self) -> u64 {
        self.available().saturating_sub(self.host_reserve)
    }

    /// One line with every figure, for logs.
    pub fn describe(&self) -> String {
        let h = crate::allocator::human;
        let cgroup = match self.cgroup {
            Some(c) => format!(", cgroup limit {} with {} used", h(c.limit), h(c.usage)),
            None => String::new(),
        };
        format!(
            "usable {} = min(MemAvailable {}{cgroup}) − host reserve {} (--host-reserve)",
            h(self.usable()),
            h(self.mem_available),
            h(self.host_reserve)
        )
    }
}

/// The tightest memory limit among this process's cgroup and its ancestors, read under `root`
/// (normally `/sys/fs/cgroup`) for the `/proc/self/cgroup` text `proc_cgroup`: the v2 unified
/// hierarchy (`0::/path`: `memory.max`, `memory.current`) or the v1 `memory` controller
/// (`memory.limit_in_bytes`, `memory.usage_in_bytes`). `None` when no limit is set (`max`, or the
/// v1 "unlimited" value) or nothing can be read.
pub fn cgroup_memory(root: &Path, proc_cgroup: &str) -> Option<CgroupMemory> {
    let read = |p: &Path| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    // v1's "no limit" is a page-rounded i64::MAX; anything above 2^60 is treated as unlimited.
    let limited = |l: u64| l < (1 << 60);
    let mut best: Option<CgroupMemory> = None;
    let mut consider = |dir: &Path, limit_file: &str, usage_file: &str| {
        if let Some(limit) = read(&dir.join(limit_file)).filter(|&l| limited(l)) {
            let usage = read(&dir.join(usage_file)).unwrap_or(0);
            let c = CgroupMemory { limit, usage };
            let headroom = |c: &CgroupMemory| c.limit.saturating_sub(c.usage);
            if best.as_ref().is_none_or(|b| headroom(&c) < headroom(b)) {
                best = Some(c);
            }
        }
    };
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (base, limit_file, usage_file) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        // The process's own cgroup and every ancestor up to the root of the (namespaced) tree.
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            consider(&dir, limit_file, usage_file);
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_resolves() {
        assert_eq!("unified".parse(), Ok(MemoryModel::Unified));
        assert_eq!(" Discrete ".parse(), Ok(MemoryModel::Discrete));
        assert_eq!("auto".parse(), Ok(MemoryModel::Auto));
        let err = "shared".parse::<MemoryModel>().unwrap_err();
        assert!(err.contains("shared") && err.contains("unified"), "{err}");
        use MemoryModel::*;
        assert_eq!(Auto.resolve(true, None), Unified);
        assert_eq!(Auto.resolve(false, None), Discrete);
        assert_eq!(Auto.resolve(false, Some(Unified)), Unified, "the env overrides the detection");
        assert_eq!(Auto.resolve(true, Some(Auto)), Unified);
        assert_eq!(Discrete.resolve(true, Some(Unified)), Discrete, "an explicit choice wins over the env");
        assert_eq!(Unified.resolve(false, None), Unified);
        assert_eq!(MemoryConfig::default().host_reserve, 1536 << 20);
    }

    #[test]
    fn usable_is_the_tighter_of_meminfo_and_cgroup_less_the_reserve() {
        let gib = 1u64 << 30;
        let mut m = SystemMemory { mem_total: 16 * gib, mem_available: 12 * gib, cgroup: None, host_reserve: gib };
        assert_eq!(m.usable(), 11 * gib);
        assert_eq!(m.total(), 16 * gib);
        m.cgroup = Some(CgroupMemory { limit: 8 * gib, usage: 3 * gib });
        assert_eq!(m.available(), 5 * gib);
        assert_eq!(m.usable(), 4 * gib);
        assert_eq!(m.total(), 8 * gib);
        m.host_reserve = 6 * gib;
        assert_eq!(m.usable(), 0, "a reserve above what is available leaves nothing, not an underflow");
        assert!(m.describe().contains("--host-reserve"), "{}", m.describe());
    }

    #[test]
    fn reads_v2_and_v1_cgroups_with_ancestors() {
        let dir = std::env::temp_dir().join(format!("tm-cgroup-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let write = |rel: &str, text: &str| {
            let p = dir.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        // v2: the leaf is unlimited, its parent has 4 GiB with 1 GiB used.
        write("user.slice/memory.max", "4294967296\n");
        write("user.slice/memory.current", "1073741824\n");
        write("user.slice/app/memory.max", "max\n");
        write("user.slice/app/memory.current", "5\n");
        let c = cgroup_memory(&dir, "0::/user.slice/app\n");
        assert_eq!(c, Some(CgroupMemory { limit: 4 << 30, usage: 1 << 30 }));
        // Unlimited everywhere.
        assert_eq!(cgroup_memory(&dir, "0::/elsewhere\n"), None);
        // v1 memory controller, with the "unlimited" value at the root.
        write("memory/memory.limit_in_bytes", "9223372036854771712\n");
        write("memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
        write("memory/docker/abc/memory.usage_in_bytes", "1000\n");
        let v1 = "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n";
        assert_eq!(cgroup_memory(&dir, v1), Some(CgroupMemory { limit: 2 << 30, usage: 1000 }));
        assert_eq!(cgroup_memory(&dir, ""), None);
        assert_eq!(cgroup_memory(&dir, "garbage"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn this_system_reads() {
        let m = SystemMemory::read(DEFAULT_HOST_RESERVE);
        assert!(m.mem_total > 0 && m.available() <= m.mem_total, "{m:?}");
        assert!(m.usable() <= m.available());
    }
}
