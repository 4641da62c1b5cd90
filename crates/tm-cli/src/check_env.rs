//! `tm-cli check-env`: what this machine offers tm — CPU threads, host memory, CUDA driver and
//! devices (compute capability, memory, integrated or discrete) and the GPU peer-access matrix, or
//! why CUDA is not available.

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};
use tm_core::host_memory::host_memory;
use tm_cuda::{CudaDeviceInfo, ProbeError};
use tm_model::plan::human;

/// Arguments of `check-env`.
#[derive(Args, Debug)]
pub struct CheckEnvArgs {
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Everything `check-env` reports, gathered once.
struct Report {
    cpu_model: Option<String>,
    cpu_threads: usize,
    host_total: u64,
    host_available: u64,
    cuda: Result<Cuda, ProbeError>,
}

struct Cuda {
    driver_version: Option<(u32, u32)>,
    devices: Vec<CudaDeviceInfo>,
    peer_access: Result<Vec<Vec<bool>>, ProbeError>,
}

fn gather() -> Report {
    let mem = host_memory();
    let cuda = tm_cuda::probe().map(|devices| Cuda {
        driver_version: tm_cuda::driver_version().ok(),
        peer_access: tm_cuda::peer_access_matrix(devices.len()),
        devices,
    });
    Report {
        cpu_model: cpu_model(),
        cpu_threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        host_total: mem.total,
        host_available: mem.available,
        cuda,
    }
}

/// The CPU's model name from /proc/cpuinfo, where there is one.
fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == "model name")
        .map(|(_, v)| v.trim().to_string())
}

/// Runs `check-env`: prints the report; never fails for lack of a GPU.
pub fn run(args: CheckEnvArgs) -> Result<()> {
    let r = gather();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&r))?);
    } else {
        print!("{}", to_text(&r));
    }
    Ok(())
}

fn to_text(r: &Report) -> String {
    let mut s = String::new();
    let model = r.cpu_model.as_deref().map(|m| format!(" ({m})")).unwrap_or_default();
    s += &format!("CPU: {} threads{model}\n", r.cpu_threads);
    s += &format!("host memory: {} total, {} available\n", human(r.host_total), human(r.host_available));
    match &r.cuda {
        Err(e) => s += &format!("CUDA: not available ({e}); tm runs on the CPU\n"),
        Ok(c) => {
            let driver = c.driver_version.map(|(a, b)| format!(", driver CUDA {a}.{b}")).unwrap_or_default();
            s += &format!("CUDA: {} device(s){driver}\n", c.devices.len());
            for d in &c.devices {
                let (major, minor) = d.compute_capability;
                let kind = if d.integrated { "integrated (memory shared with the host)" } else { "discrete" };
                s += &format!(
                    "  GPU {}: {}, compute capability {major}.{minor}, {} SMs, {} total, {} free, {kind}\n",
                    d.ordinal,
                    d.name,
                    d.multiprocessors,
                    human(d.total_memory),
                    human(d.free_memory)
                );
            }
            match &c.peer_access {
                Err(e) => s += &format!("peer access: unknown ({e})\n"),
                Ok(m) if m.len() < 2 => s += "peer access: single GPU\n",
                Ok(m) => {
                    s += "peer access (row can access column):\n      ";
                    s += &(0..m.len()).map(|j| format!("{:>5}", format!("GPU{j}"))).collect::<String>();
                    s += "\n";
                    for (i, row) in m.iter().enumerate() {
                        s += &format!("  GPU{i}");
                        s += &row.iter().map(|&ok| format!("{:>5}", if ok { "yes" } else { "no" })).collect::<String>();
                        s += "\n";
                    }
                }
            }
        }
    }
    s
}

fn to_json(r: &Report) -> Value {
    let cuda = match &r.cuda {
        Err(e) => json!({ "available": false, "reason": e.to_string() }),
        Ok(c) => json!({
            "available": true,
            "driver_version": c.driver_version.map(|(a, b)| format!("{a}.{b}")),
            "devices": c.devices.iter().map(|d| json!({
                "ordinal": d.ordinal,
                "name": d.name,
                "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                "multiprocessors": d.multiprocessors,
                "total_memory": d.total_memory,
                "free_memory": d.free_memory,
                "integrated": d.integrated,
            })).collect::<Vec<_>>(),
            "peer_access": match &c.peer_access {
                Ok(m) => json!(m),
                Err(e) => json!({ "error": e.to_string() }),
            },
        }),
    };
    json!({
        "cpu": { "threads": r.cpu_threads, "model": r.cpu_model },
        "host_memory": { "total": r.host_total, "available": r.host_available },
        "cuda": cuda,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(cuda: Result<Cuda, ProbeError>) -> Report {
        Report { cpu_model: None, cpu_threads: 2, host_total: 8 << 30, host_available: 4 << 30, cuda }
    }

    #[test]
    fn text_without_cuda_says_why() {
        let t = to_text(&report(Err(ProbeError::LibraryNotFound)));
        assert!(t.contains("CPU: 2 threads"), "{t}");
        assert!(t.contains("CUDA: not available (libcuda.so not found); tm runs on the CPU"), "{t}");
        let j = to_json(&report(Err(ProbeError::NoDevices)));
        assert_eq!(j["cuda"]["available"], false);
        assert_eq!(j["cuda"]["reason"], "no CUDA devices");
    }

    #[test]
    fn text_with_two_gpus_shows_the_peer_matrix() {
        let dev = |ordinal| CudaDeviceInfo {
            ordinal,
            name: "NVIDIA H200".into(),
            total_memory: 140 << 30,
            free_memory: 139 << 30,
            compute_capability: (9, 0),
            integrated: false,
            multiprocessors: 132,
        };
        let cuda = Cuda {
            driver_version: Some((13, 0)),
            devices: vec![dev(0), dev(1)],
            peer_access: Ok(vec![vec![true, false], vec![false, true]]),
        };
        let r = report(Ok(cuda));
        let t = to_text(&r);
        assert!(t.contains("CUDA: 2 device(s), driver CUDA 13.0"), "{t}");
        assert!(t.contains("GPU 1: NVIDIA H200, compute capability 9.0, 132 SMs"), "{t}");
        assert!(t.contains("  GPU0  yes   no"), "{t}");
        let j = to_json(&r);
        assert_eq!(j["cuda"]["devices"][1]["compute_capability"], "9.0");
        assert_eq!(j["cuda"]["peer_access"][0][1], false);
    }
}
