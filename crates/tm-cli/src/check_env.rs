//! `tm-cli check-env`: what this machine offers tm — CPU threads, host memory, CUDA driver and
//! devices (compute capability, memory, integrated or discrete), the GPU peer-access matrix, the
//! kernel arches embedded in this build, the NVIDIA libraries found (driver, cuBLASLt, NVRTC, NCCL)
//! whether kernels use programmatic dependent launch, and which backend `--backend auto` picks — or
//! why CUDA is not available. With two GPUs or
//! more: the transport NCCL is expected to use and the result of an all-reduce self-test over
//! every GPU (with a deadline: it reports a hang instead of hanging).

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};
use std::io::Write;
use tm_core::host_memory::host_memory;
use tm_cuda::libs::LibraryStatus;
use tm_cuda::{CudaDeviceInfo, ProbeError};
use tm_kernels::cuda::Target;
use tm_model::plan::human;

/// Arguments of `check-env`.
#[derive(Args, Debug)]
pub struct CheckEnvArgs {
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Seconds the NCCL self-test (two GPUs or more) may take before it is reported as hung
    /// (0 skips it).
    #[arg(long, default_value_t = 20.0)]
    self_test_timeout: f64,
}

/// Everything `check-env` reports, gathered once.
struct Report {
    cpu_model: Option<String>,
    cpu_threads: usize,
    /// The instruction set of the CPU backend's matrix kernels (and why, when not the fastest).
    cpu_kernels: String,
    host_total: u64,
    host_available: u64,
    cuda: Result<Cuda, ProbeError>,
    /// The NVIDIA kernel module's version, from /proc/driver/nvidia/version.
    nvidia_driver: Option<String>,
    /// The CUDA major version tm's bindings were built for.
    built_for_cuda: u32,
    /// NVRTC's version, when the library loads.
    nvrtc_version: Option<(i32, i32)>,
    kernels: Kernels,
    libraries: Vec<LibraryStatus>,
    /// wgpu adapters: (description, is a software adapter).
    wgpu_adapters: Vec<(String, bool)>,
}

/// The kernels embedded in this build.
struct Kernels {
    cubin_arches: Vec<u32>,
    ptx_arches: Vec<u32>,
    modules: Vec<String>,
}

fn kernels() -> Kernels {
    let mut ptx_arches: Vec<u32> = tm_kernels::cuda::artefacts()
        .iter()
        .filter_map(|a| match a.target {
            Target::Ptx { sm } => Some(sm),
            Target::Cubin { .. } => None,
        })
        .collect();
    ptx_arches.sort_unstable();
    ptx_arches.dedup();
    Kernels {
        cubin_arches: tm_kernels::cuda::embedded_arches(),
        ptx_arches,
        modules: tm_kernels::cuda::modules().iter().map(|m| m.name.to_string()).collect(),
    }
}

/// The NVIDIA kernel module's version (e.g. `580.65.06`), where the driver is installed.
fn nvidia_driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = text.lines().find(|l| l.starts_with("NVRM version"))?;
    line.split_whitespace()
        .find(|w| w.split('.').count() >= 2 && w.split('.').all(|p| p.parse::<u32>().is_ok()))
        .map(str::to_string)
}

struct Cuda {
    driver_version: Option<(u32, u32)>,
    devices: Vec<CudaDeviceInfo>,
    peer_access: Result<Vec<Vec<bool>>, ProbeError>,
    /// With two GPUs or more: the transport NCCL is expected to pick.
    transport: Option<Result<String, String>>,
    /// With two GPUs or more: whether tm's one-shot all-reduce over peer access is available
    /// (`Ok`: what it covers), or why not.
    custom_all_reduce: Option<Result<String, String>>,
    /// With two GPUs or more: the NCCL all-reduce self-test over every GPU.
    self_test: Option<Result<String, String>>,
    /// Whether kernels are launched with programmatic dependent launch (`None` without devices).
    pdl: Option<String>,
}

/// Whether tm's kernels use programmatic dependent launch on `devices`: one description, or one
/// per device when they differ.
fn pdl_line(devices: &[CudaDeviceInfo]) -> Option<String> {
    let each: Vec<String> = devices.iter().map(|d| tm_cuda::pdl::describe(d.compute_capability)).collect();
    if each.iter().all(|e| Some(e) == each.first()) {
        return each.first().cloned();
    }
    Some(devices.iter().zip(&each).map(|(d, e)| format!("GPU {}: {e}", d.ordinal)).collect::<Vec<_>>().join("; "))
}

/// The NCCL self-test over GPUs `0..n`: initialisation and an all-reduce (plus a 64 MiB one for
/// the bandwidth), each with `timeout`.
fn nccl_self_test(n: usize, timeout: std::time::Duration) -> Result<String, String> {
    let api = tm_cuda::nccl::Api::get().map_err(|e| e.to_string())?;
    let gpus =
        (0..n).map(tm_cuda::runtime::Gpu::open).collect::<tm_core::Result<Vec<_>>>().map_err(|e| e.to_string())?;
    let comms = tm_cuda::nccl::NcclComm::group(&gpus, timeout).map_err(|e| e.to_string())?;
    let t = tm_cuda::nccl::self_test(&comms, timeout, 64 << 20).map_err(|e| e.to_string())?;
    Ok(format!("NCCL {} ({}): {}", api.version(), api.path(), t.summary()))
}

fn gather(self_test_timeout: Option<std::time::Duration>) -> Report {
    let mem = host_memory();
    let cuda = tm_cuda::probe().map(|devices| {
        let n = devices.len();
        let ordinals: Vec<usize> = (0..n).collect();
        let multi = n >= 2;
        Cuda {
            driver_version: tm_cuda::driver_version().ok(),
            peer_access: tm_cuda::peer_access_matrix(n),
            transport: multi.then(|| {
                tm_cuda::nccl::peer_links(&ordinals)
                    .map(|l| tm_cuda::nccl::expected_transport(&l))
                    .map_err(|e| e.to_string())
            }),
            custom_all_reduce: multi.then(|| {
                tm_cuda::nccl::peer_links(&ordinals).map_err(|e| e.to_string()).and_then(|l| {
                    tm_cuda::peer::plan(&l).map(|max| {
                        format!("one-shot kernels over peer access for messages up to {} KiB per rank", max >> 10)
                    })
                })
            }),
            self_test: match self_test_timeout {
                Some(t) if multi => Some(nccl_self_test(n, t)),
                _ => None,
            },
            pdl: pdl_line(&devices),
            devices,
        }
    });
    Report {
        cpu_model: cpu_model(),
        cpu_threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cpu_kernels: cpu_kernels(),
        host_total: mem.total,
        host_available: mem.available,
        cuda,
        nvidia_driver: nvidia_driver_version(),
        built_for_cuda: tm_cuda::libs::CUDA_MAJOR,
        nvrtc_version: tm_cuda::nvrtc::version().ok(),
        kernels: kernels(),
        libraries: tm_cuda::libs::libraries(),
        wgpu_adapters: tm_wgpu::list_adapters().into_iter().map(|a| (a.to_string(), a.is_cpu)).collect(),
    }
}

/// What `--backend auto` picks, and why: CUDA when the driver shows a usable GPU, else the CPU.
fn auto_backend(r: &Report) -> (&'static str, String) {
    match &r.cuda {
        Ok(c) if !c.devices.is_empty() => {
            let d = &c.devices[0];
            let mut why = format!("GPU {}: {}", d.ordinal, d.name);
            if let Some(l) = r.libraries.iter().find(|l| l.name == tm_cuda::libs::CUBLASLT && l.cudarc_loads.is_none())
            {
                why += &format!("; but {} is not loadable, so GPU matrix products will fail", l.name);
            }
            ("cuda", why)
        }
        Ok(_) => wgpu_or_cpu(r, "no CUDA devices".to_string()),
        Err(e) => wgpu_or_cpu(r, format!("CUDA not available: {e}")),
    }
}

/// Without CUDA, `auto` takes the first real (not software) wgpu adapter, else the CPU.
fn wgpu_or_cpu(r: &Report, no_cuda: String) -> (&'static str, String) {
    match r.wgpu_adapters.iter().find(|(_, cpu)| !cpu) {
        Some((a, _)) => ("wgpu", format!("{no_cuda}; wgpu adapter {a}")),
        None => ("cpu", no_cuda),
    }
}

fn arches(prefix: &str, list: &[u32]) -> String {
    list.iter().map(|a| format!("{prefix}_{a}")).collect::<Vec<_>>().join(", ")
}

/// One line per library for the text report.
fn library_lines(libs: &[LibraryStatus]) -> String {
    let mut s = String::new();
    for l in libs {
        match (&l.found, &l.path) {
            (Some(found), Some(path)) if path != found => s += &format!("  {}: {found} ({path})", l.name),
            (Some(found), _) => s += &format!("  {}: {found}", l.name),
            (None, _) => {
                let shown: Vec<&str> = l.tried.iter().take(3).map(String::as_str).collect();
                let more = l.tried.len().saturating_sub(shown.len());
                let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                s += &format!("  {}: not found (tried {}{more})", l.name, shown.join(", "));
            }
        }
        match (&l.found, &l.cudarc_loads) {
            (Some(_), Some(c)) if Some(c) != l.found.as_ref() => s += &format!("; cudarc loads {c}"),
            (Some(_), None) => s += "; cudarc will not find it",
            _ => {}
        }
        s += "\n";
        if let Some(w) = &l.warning {
            s += &format!("    warning: {w}\n");
        }
    }
    s
}

/// The CPU's model name from /proc/cpuinfo, where there is one.
/// The CPU backend's kernel instruction set, naming the override when one is in force.
fn cpu_kernels() -> String {
    use tm_cpu::quant_matmul::{Isa, ISA_ENV};
    let (used, detected) = (Isa::best(), Isa::detected());
    if used == detected {
        used.describe().to_string()
    } else {
        format!("{} (set by {ISA_ENV}; this CPU has {})", used.describe(), detected.describe())
    }
}

fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == "model name")
        .map(|(_, v)| v.trim().to_string())
}

/// Runs `check-env`: prints the report; never fails for lack of a GPU.
pub fn run(args: CheckEnvArgs) -> Result<()> {
    let timeout = std::time::Duration::try_from_secs_f64(args.self_test_timeout)
        .map_err(|_| anyhow::anyhow!("--self-test-timeout must be a number of seconds"))?;
    let r = gather((!timeout.is_zero()).then_some(timeout));
    let text = if args.json { serde_json::to_string_pretty(&to_json(&r))? + "\n" } else { to_text(&r) };
    // A closed pipe (`check-env | head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn to_text(r: &Report) -> String {
    let mut s = String::new();
    let model = r.cpu_model.as_deref().map(|m| format!(" ({m})")).unwrap_or_default();
    s += &format!("CPU: {} threads{model}; matrix kernels: {}\n", r.cpu_threads, r.cpu_kernels);
    s += &format!("host memory: {} total, {} available\n", human(r.host_total), human(r.host_available));
    match &r.cuda {
        Err(e) => s += &format!("CUDA: not available ({e}); tm runs on the CPU\n"),
        Ok(c) => {
            let driver = c.driver_version.map(|(a, b)| format!(", driver CUDA {a}.{b}")).unwrap_or_default();
            let nvidia = r.nvidia_driver.as_deref().map(|v| format!(" (NVIDIA driver {v})")).unwrap_or_default();
            s += &format!("CUDA: {} device(s){driver}{nvidia}\n", c.devices.len());
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
            match &c.transport {
                Some(Ok(t)) => s += &format!("NCCL transport (expected): {t}\n"),
                Some(Err(e)) => s += &format!("NCCL transport: unknown ({e})\n"),
                None => {}
            }
            match &c.custom_all_reduce {
                Some(Ok(t)) => s += &format!("custom all-reduce: available ({t})\n"),
                Some(Err(e)) => s += &format!("custom all-reduce: not used ({e}); collectives go through NCCL\n"),
                None => {}
            }
            match &c.self_test {
                Some(Ok(t)) => s += &format!("NCCL self-test: {t}\n"),
                Some(Err(e)) => s += &format!("NCCL self-test: FAILED: {e}\n"),
                None => {}
            }
            if let Some(p) = &c.pdl {
                s += &format!("programmatic dependent launch: {p}\n");
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
    let nvrtc = match r.nvrtc_version {
        Some((a, b)) => format!("NVRTC {a}.{b}"),
        None => "NVRTC not found".to_string(),
    };
    s += &format!("tm built for CUDA {}; {nvrtc}\n", r.built_for_cuda);
    let k = &r.kernels;
    let cubins = if k.cubin_arches.is_empty() {
        "no cubins".to_string()
    } else {
        format!("cubins for {}", arches("sm", &k.cubin_arches))
    };
    let ptx = if k.ptx_arches.is_empty() {
        "no PTX".to_string()
    } else {
        format!("PTX for {}", arches("compute", &k.ptx_arches))
    };
    let modules = if k.modules.is_empty() { "none".to_string() } else { k.modules.join(", ") };
    s += &format!("kernels: {cubins}, {ptx}; sources (NVRTC fallback): {modules}\n");
    s += "libraries:\n";
    s += &library_lines(&r.libraries);
    s += "wgpu adapters:";
    if r.wgpu_adapters.is_empty() {
        s += " none\n";
    } else {
        s += "\n";
        for (a, cpu) in &r.wgpu_adapters {
            s += &format!("  {a}{}\n", if *cpu { " (software; --backend wgpu only)" } else { "" });
        }
    }
    let (backend, why) = auto_backend(r);
    s += &format!("--backend auto: {backend} ({why})\n");
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
            "nccl_transport": match &c.transport {
                Some(Ok(t)) => json!(t),
                Some(Err(e)) => json!({ "error": e }),
                None => Value::Null,
            },
            "custom_all_reduce": match &c.custom_all_reduce {
                Some(Ok(t)) => json!({ "available": true, "result": t }),
                Some(Err(e)) => json!({ "available": false, "reason": e }),
                None => Value::Null,
            },
            "programmatic_dependent_launch": c.pdl,
            "nccl_self_test": match &c.self_test {
                Some(Ok(t)) => json!({ "passed": true, "result": t }),
                Some(Err(e)) => json!({ "passed": false, "error": e }),
                None => Value::Null,
            },
        }),
    };
    let (backend, why) = auto_backend(r);
    json!({
        "cpu": { "threads": r.cpu_threads, "model": r.cpu_model, "kernels": r.cpu_kernels },
        "host_memory": { "total": r.host_total, "available": r.host_available },
        "cuda": cuda,
        "nvidia_driver": r.nvidia_driver,
        "built_for_cuda": r.built_for_cuda,
        "nvrtc_version": r.nvrtc_version.map(|(a, b)| format!("{a}.{b}")),
        "kernels": {
            "cubin_arches": r.kernels.cubin_arches,
            "ptx_arches": r.kernels.ptx_arches,
            "modules": r.kernels.modules,
        },
        "libraries": r.libraries.iter().map(|l| json!({
            "name": l.name,
            "found": l.found,
            "path": l.path,
            "cudarc_loads": l.cudarc_loads,
            "warning": l.warning,
            "tried": l.tried,
        })).collect::<Vec<_>>(),
        "wgpu_adapters": r.wgpu_adapters.iter().map(|(a, cpu)| json!({ "adapter": a, "software": cpu })).collect::<Vec<_>>(),
        "backend_auto": { "backend": backend, "reason": why },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(cuda: Result<Cuda, ProbeError>) -> Report {
        Report {
            cpu_model: None,
            cpu_threads: 2,
            cpu_kernels: "AVX2".into(),
            host_total: 8 << 30,
            host_available: 4 << 30,
            cuda,
            nvidia_driver: None,
            built_for_cuda: 13,
            nvrtc_version: None,
            kernels: Kernels {
                cubin_arches: vec![80, 90],
                ptx_arches: vec![80],
                modules: vec!["elementwise.cu".into()],
            },
            wgpu_adapters: vec![],
            libraries: vec![
                LibraryStatus {
                    name: tm_cuda::libs::DRIVER,
                    found: Some("libcuda.so.1".into()),
                    path: Some("/usr/lib/libcuda.so.580.65.06".into()),
                    cudarc_loads: Some("libcuda.so.1".into()),
                    warning: None,
                    tried: vec!["libcuda.so.1".into()],
                },
                LibraryStatus {
                    name: tm_cuda::libs::NCCL,
                    found: None,
                    path: None,
                    cudarc_loads: None,
                    warning: None,
                    tried: vec!["a".into(), "b".into(), "c".into(), "d".into()],
                },
            ],
        }
    }

    #[test]
    fn text_without_cuda_says_why() {
        let t = to_text(&report(Err(ProbeError::LibraryNotFound)));
        assert!(t.contains("CPU: 2 threads; matrix kernels: AVX2\n"), "{t}");
        assert!(t.contains("CUDA: not available (libcuda.so not found); tm runs on the CPU"), "{t}");
        let j = to_json(&report(Err(ProbeError::NoDevices)));
        assert_eq!(j["cuda"]["available"], false);
        assert_eq!(j["cuda"]["reason"], "no CUDA devices");
        assert_eq!(j["backend_auto"]["backend"], "cpu");
        assert!(t.contains("--backend auto: cpu (CUDA not available: libcuda.so not found)"), "{t}");
        assert!(
            t.contains(
                "kernels: cubins for sm_80, sm_90, PTX for compute_80; sources (NVRTC fallback): elementwise.cu"
            ),
            "{t}"
        );
        assert!(t.contains("  CUDA driver: libcuda.so.1 (/usr/lib/libcuda.so.580.65.06)\n"), "{t}");
        assert!(t.contains("  NCCL: not found (tried a, b, c and 1 more)\n"), "{t}");
        assert!(t.contains("tm built for CUDA 13; NVRTC not found"), "{t}");
    }

    #[test]
    fn gather_never_panics() {
        let r = gather(None);
        let t = to_text(&r);
        assert!(t.contains("--backend auto: "), "{t}");
        assert_eq!(r.libraries.len(), 4);
        let j = to_json(&r);
        assert!(j["libraries"].as_array().is_some_and(|l| l.len() == 4));
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
        let devices = vec![dev(0), dev(1)];
        let cuda = Cuda {
            driver_version: Some((13, 0)),
            pdl: pdl_line(&devices),
            devices,
            peer_access: Ok(vec![vec![true, false], vec![false, true]]),
            transport: Some(Ok("SHM, through host memory (not every pair of GPUs has peer access)".into())),
            custom_all_reduce: Some(Err("rank 0 cannot access rank 1's memory (no peer access)".into())),
            self_test: Some(Err("rank 1 timed out".into())),
        };
        let r = report(Ok(cuda));
        let t = to_text(&r);
        assert!(t.contains("CUDA: 2 device(s), driver CUDA 13.0"), "{t}");
        assert!(t.contains("GPU 1: NVIDIA H200, compute capability 9.0, 132 SMs"), "{t}");
        assert!(t.contains("  GPU0  yes   no"), "{t}");
        assert!(t.contains("NCCL transport (expected): SHM, through host memory"), "{t}");
        assert!(t.contains("NCCL self-test: FAILED: rank 1 timed out"), "{t}");
        assert!(t.contains("custom all-reduce: not used (rank 0 cannot access rank 1's memory"), "{t}");
        let j = to_json(&r);
        assert_eq!(j["cuda"]["custom_all_reduce"]["available"], false);
        assert_eq!(j["cuda"]["devices"][1]["compute_capability"], "9.0");
        assert_eq!(j["cuda"]["peer_access"][0][1], false);
        assert_eq!(j["backend_auto"]["backend"], "cuda");
        assert!(t.contains("--backend auto: cuda (GPU 0: NVIDIA H200)"), "{t}");
        // sm_90: on unless TM_PDL=0 in this test's environment; one line for identical GPUs.
        let pdl = t.lines().filter(|l| l.starts_with("programmatic dependent launch: ")).collect::<Vec<_>>();
        assert_eq!(pdl.len(), 1, "{t}");
        assert!(pdl[0].contains(": on (sm_90") || pdl[0].contains(": off (TM_PDL=0)"), "{t}");
        assert_eq!(j["cuda"]["programmatic_dependent_launch"].as_str(), pdl[0].split_once(": ").map(|(_, v)| v));
    }

    #[test]
    fn pdl_line_per_device_when_they_differ() {
        let dev = |ordinal, cc| CudaDeviceInfo {
            ordinal,
            name: "GPU".into(),
            total_memory: 1 << 30,
            free_memory: 1 << 30,
            compute_capability: cc,
            integrated: false,
            multiprocessors: 1,
        };
        assert_eq!(pdl_line(&[]), None);
        let one = pdl_line(&[dev(0, (8, 0))]).unwrap_or_default();
        assert!(one.starts_with("off (needs sm_90"), "{one}");
        let mixed = pdl_line(&[dev(0, (8, 0)), dev(1, (9, 0))]).unwrap_or_default();
        assert!(mixed.starts_with("GPU 0: off (needs sm_90") && mixed.contains("; GPU 1: "), "{mixed}");
    }
}
