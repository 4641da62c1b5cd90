//! What the host really has: MemTotal/MemAvailable from `/proc/meminfo`, capped by cgroup limits.

/// Host memory facts in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// Physical memory (or the cgroup limit, if lower).
    pub total: u64,
    /// Memory that can be allocated now without swapping (MemAvailable, or the cgroup headroom).
    pub available: u64,
}

/// Reads host memory facts. Falls back to conservative values where the files are missing.
pub fn host_memory() -> HostMemory {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let (total, available) = parse_meminfo(&meminfo);
    let cgroup = cgroup_limit();
    apply_cgroup(total, available, cgroup)
}

/// Parses `MemTotal` and `MemAvailable` (kB) from /proc/meminfo text; 0 when absent.
pub fn parse_meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// Combines meminfo figures with a cgroup `(limit, usage)`.
pub fn apply_cgroup(total: u64, available: u64, cgroup: Option<(u64, u64)>) -> HostMemory {
    match cgroup {
        Some((limit, usage)) if limit < total => {
            let headroom = limit.saturating_sub(usage);
            HostMemory { total: limit, available: available.min(headroom) }
        }
        _ => HostMemory { total, available },
    }
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `(limit, usage)` of this process's memory cgroup (v2, then v1), if limited.
fn cgroup_limit() -> Option<(u64, u64)> {
    if let Some(limit) = read_u64("/sys/fs/cgroup/memory.max") {
        return Some((limit, read_u64("/sys/fs/cgroup/memory.current").unwrap_or(0)));
    }
    let limit = read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes")?;
    Some((limit, read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes").unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo() {
        let t = "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n";
        assert_eq!(parse_meminfo(t), (16_000_000 * 1024, 8_000_000 * 1024));
    }

    #[test]
    fn cgroup_caps_memory() {
        let m = apply_cgroup(100, 80, Some((50, 20)));
        assert_eq!(m, HostMemory { total: 50, available: 30 });
        let m = apply_cgroup(100, 80, Some((u64::MAX, 20)));
        assert_eq!(m, HostMemory { total: 100, available: 80 });
    }

    #[test]
    fn this_host_has_memory() {
        let m = host_memory();
        assert!(m.total > 0 && m.available > 0 && m.available <= m.total, "{m:?}");
    }
}
