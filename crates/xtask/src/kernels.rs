//! `cargo xtask build-kernels`: compiles `crates/tm-kernels/cuda/*.cu` with nvcc (or NVRTC, see
//! [`crate::nvrtc`]) into `{module}.sm_{NN}.cubin` per arch plus `{module}.compute_{NN}.ptx` for the
//! newest arch, and writes `manifest.txt` (the sources' digest and each file's sha256), which
//! tm-kernels' build script checks before embedding them.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::nvrtc::{self, Nvrtc};

/// The arches CI builds and `--arch` defaults to: A100, A10/3090, Orin, L4/4090, H100/H200.
pub const DEFAULT_ARCHES: [u32; 5] = [80, 86, 87, 89, 90];

/// The pip packages that provide nvcc (CUDA 13.0), pinned.
pub const PIP_PACKAGES: &str = "\"nvidia-cuda-nvcc==13.0.88\" \"nvidia-nvvm==13.0.88\" \"nvidia-cuda-crt==13.0.88\" \
                                \"nvidia-cuda-runtime==13.0.96\" \"nvidia-cuda-cccl==13.0.85\"";

/// The pip packages that provide NVRTC 12 and the CUDA 12 headers (for JetPack 6), pinned.
pub const PIP_PACKAGES_NVRTC12: &str = "\"nvidia-cuda-nvrtc-cu12==12.6.77\" \"nvidia-cuda-runtime-cu12==12.6.77\"";

const USAGE: &str = "usage: cargo xtask build-kernels [--arch sm_80,sm_86,sm_87,sm_89,sm_90] [--out DIR] [--jobs N] \
                     [--nvrtc LIBNVRTC|VENV|auto]";

/// Parsed `build-kernels` arguments.
#[derive(Debug, PartialEq, Eq)]
pub struct Options {
    /// Arch numbers, sorted and deduplicated (e.g. 87 for sm_87).
    pub arches: Vec<u32>,
    /// Output directory (`None`: `$TM_KERNELS_DIR`, else `<workspace>/target/kernels`).
    pub out: Option<PathBuf>,
    /// Parallel nvcc processes (`None`: the available cores).
    pub jobs: Option<usize>,
    /// Compile with NVRTC instead of nvcc: a `libnvrtc.so` path, a venv or site-packages holding
    /// the nvrtc-cu12 wheel, or `auto` (`None`: `$TM_NVRTC`, else nvcc, else a pip NVRTC 12).
    pub nvrtc: Option<String>,
}

/// Parses `sm_80,sm_86` (or `80,86`) into sorted, deduplicated arch numbers.
pub fn parse_arches(list: &str) -> Result<Vec<u32>> {
    let mut arches = Vec::new();
    for item in list.split(',').map(str::trim) {
        if item.is_empty() {
            continue;
        }
        let digits = item.strip_prefix("sm_").unwrap_or(item);
        let sm: u32 = match digits.parse() {
            Ok(sm) if digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit()) => sm,
            _ => bail!("bad arch `{item}`: expected sm_NN, e.g. sm_87"),
        };
        if !(50..=199).contains(&sm) {
            bail!("bad arch `{item}`: expected a compute capability like sm_80 or sm_90");
        }
        arches.push(sm);
    }
    if arches.is_empty() {
        bail!("no arch given: expected e.g. --arch sm_87 or --arch sm_80,sm_90");
    }
    arches.sort_unstable();
    arches.dedup();
    Ok(arches)
}

/// Parses the arguments after `build-kernels`.
pub fn parse_args(args: &[String]) -> Result<Options> {
    let mut opts = Options { arches: DEFAULT_ARCHES.to_vec(), out: None, jobs: None, nvrtc: None };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = || -> Result<String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => it.next().cloned().with_context(|| format!("{flag} needs a value\n{USAGE}")),
            }
        };
        match flag {
            "--arch" => opts.arches = parse_arches(&value()?)?,
            "--out" => opts.out = Some(PathBuf::from(value()?)),
            "--nvrtc" => opts.nvrtc = Some(value()?),
            "--jobs" | "-j" => {
                let v = value()?;
                opts.jobs = Some(v.parse().ok().filter(|&j| j > 0).with_context(|| format!("bad --jobs `{v}`"))?);
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    Ok(opts)
}

/// The digest tm-kernels' build script compares: sha256 over `name \n len \n bytes` of every
/// `.cu` and `.cuh` file in `dir`, sorted by name. Returns it with the module names (`.cu` stems).
pub fn source_digest(dir: &Path) -> Result<(String, Vec<String>)> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        if let Some(name) = entry.file_name().to_str() {
            if (name.ends_with(".cu") || name.ends_with(".cuh")) && entry.path().is_file() {
                names.push(name.to_string());
            }
        }
    }
    names.sort();
    let mut h = Sha256::new();
    for name in &names {
        let bytes = fs::read(dir.join(name)).with_context(|| format!("reading {name}"))?;
        h.update(format!("{name}\n{}\n", bytes.len()).as_bytes());
        h.update(&bytes);
    }
    let modules = names.iter().filter_map(|n| n.strip_suffix(".cu")).map(str::to_string).collect();
    Ok((hex(&h.finalize()), modules))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Whether `p` is an executable file.
fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `nvidia/cu13/bin/nvcc` (the CUDA 13 wheels) under a site-packages directory. (The CUDA 12
/// `nvidia-cuda-nvcc-cu12` wheel ships ptxas but no nvcc: CUDA 12 builds use NVRTC instead.)
fn pip_nvcc(site_packages: &Path) -> Option<PathBuf> {
    Some(site_packages.join("nvidia/cu13/bin/nvcc")).filter(|p| executable(p))
}

/// `lib/python3*/site-packages` directories of a virtual environment.
fn venv_site_packages(venv: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(venv.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("python3")))
        .map(|e| e.path().join("site-packages"))
        .collect();
    dirs.sort();
    dirs
}

/// python3's site-packages, then those of the repo's `.venv-nvcc` and `.venv-nvrtc12` and of the
/// `/opt/nvcc` venv: where the pip wheels of the CUDA compilers land.
fn pip_sites(root: &Path) -> Vec<PathBuf> {
    let mut sites: Vec<PathBuf> = Vec::new();
    let script =
        "import site, sys\nprint('\\n'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))";
    if let Ok(out) = Command::new("python3").args(["-c", script]).output() {
        sites.extend(String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.is_empty()).map(PathBuf::from));
    }
    for venv in [root.join(".venv-nvcc"), root.join(".venv-nvrtc12"), PathBuf::from("/opt/nvcc")] {
        sites.extend(venv_site_packages(&venv));
    }
    sites
}

/// The NVRTC library `arg` names: a `libnvrtc.so*` file; a venv or site-packages directory holding
/// the nvrtc-cu12 wheel ([`nvrtc::pip_nvrtc`]); or `auto`, the first such wheel in [`pip_sites`].
pub fn find_nvrtc(root: &Path, arg: &str) -> Result<PathBuf> {
    let path = PathBuf::from(arg);
    let sites = if arg == "auto" {
        pip_sites(root)
    } else if path.is_dir() {
        let mut sites = venv_site_packages(&path);
        sites.push(path.clone());
        sites
    } else if path.is_file() {
        return Ok(path);
    } else {
        bail!("--nvrtc / $TM_NVRTC = {arg}: no such file or directory");
    };
    let looked = match arg {
        "auto" => "in python3's site-packages, .venv-nvcc, .venv-nvrtc12 or /opt/nvcc".to_string(),
        _ => format!("under {arg}"),
    };
    sites.iter().find_map(|s| nvrtc::pip_nvrtc(s)).with_context(|| {
        format!(
            "no NVRTC 12 wheel (nvidia/cuda_nvrtc/lib/libnvrtc.so.12 next to nvidia/cuda_runtime/include) \
             {looked}; install it with e.g.\n\n    python3 -m venv .venv-nvrtc12\n    \
             .venv-nvrtc12/bin/pip install {PIP_PACKAGES_NVRTC12}\n"
        )
    })
}

/// The compiler `build-kernels` runs.
enum Compiler {
    Nvcc(PathBuf),
    Nvrtc(Box<Nvrtc>),
}

impl Compiler {
    /// `--nvrtc`, else `$TM_NVRTC`, else nvcc ([`find_nvcc`]), else a pip NVRTC 12 wheel.
    fn find(root: &Path, nvrtc_arg: Option<&str>) -> Result<Self> {
        let env = std::env::var("TM_NVRTC").ok().filter(|v| !v.is_empty());
        if let Some(arg) = nvrtc_arg.or(env.as_deref()) {
            return Ok(Compiler::Nvrtc(Box::new(Nvrtc::load(&find_nvrtc(root, arg)?)?)));
        }
        match find_nvcc(root) {
            Ok(nvcc) => Ok(Compiler::Nvcc(nvcc)),
            Err(e) => match find_nvrtc(root, "auto") {
                Ok(lib) => {
                    println!("nvcc not found; compiling with NVRTC from {}", lib.display());
                    Ok(Compiler::Nvrtc(Box::new(Nvrtc::load(&lib)?)))
                }
                Err(_) => bail!(
                    "{e:#}\nFor CUDA 12 (JetPack 6) cubins, NVRTC 12 does instead (then pass --nvrtc .venv-nvrtc12):\n\
                     \n    python3 -m venv .venv-nvrtc12\n    .venv-nvrtc12/bin/pip install {PIP_PACKAGES_NVRTC12}\n"
                ),
            },
        }
    }

    /// The manifest's compiler line, e.g. `nvcc Cuda compilation tools, release 13.0, V13.0.88`.
    fn describe(&self) -> Result<String> {
        match self {
            Compiler::Nvcc(nvcc) => Ok(format!("nvcc {}", nvcc_version(nvcc)?)),
            Compiler::Nvrtc(n) => Ok(format!("nvrtc {}.{}", n.version.0, n.version.1)),
        }
    }

    fn path(&self) -> &Path {
        match self {
            Compiler::Nvcc(nvcc) => nvcc,
            Compiler::Nvrtc(n) => &n.lib_path,
        }
    }
}

/// Finds nvcc: `$NVCC`, `PATH`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `/usr/local/cuda/bin`, then the
/// pip wheels in python3's site-packages, the repo's `.venv-nvcc` and the `/opt/nvcc` venv.
pub fn find_nvcc(root: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if executable(&p) {
            return Ok(p);
        }
        bail!("$NVCC = {} is not an executable file", p.display());
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            candidates.push(PathBuf::from(home).join("bin/nvcc"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Some(p) = candidates.into_iter().find(|p| executable(p)) {
        return Ok(p);
    }
    if let Some(p) = pip_sites(root).iter().find_map(|s| pip_nvcc(s)) {
        return Ok(p);
    }
    bail!(
        "nvcc not found (looked at $NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin and python3's site-packages).\n\
         Install it from pip (no GPU needed), e.g. into a venv:\n\
         \n    python3 -m venv .venv-nvcc\n    .venv-nvcc/bin/pip install {PIP_PACKAGES}\n\
         \nthen rerun this command (it finds .venv-nvcc), or point $NVCC at an nvcc binary."
    )
}

/// What an artefact is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Cubin,
    Ptx,
}

/// One compiler run: the cubin of `module` for `sm`, and with `ptx` also its PTX for `compute_<sm>`
/// (the compiler's intermediate, kept: the front end is most of the time, so this costs nothing extra).
struct Job {
    module: String,
    sm: u32,
    ptx: bool,
}

/// The artefact file name of `module` for `sm`.
fn file_name(module: &str, sm: u32, kind: Kind) -> String {
    match kind {
        Kind::Cubin => format!("{module}.sm_{sm}.cubin"),
        Kind::Ptx => format!("{module}.compute_{sm}.ptx"),
    }
}

/// One artefact written.
struct Done {
    file: String,
    sm: u32,
    kind: Kind,
    bytes: u64,
}

/// The artefacts of one job and how long nvcc took.
type Compiled = (Vec<Done>, Duration);

/// Whether `TM_KERNELS_LINEINFO=1` asks for line tables (they double the artefacts, which are
/// embedded in every binary: opt in for profiling).
fn lineinfo() -> bool {
    std::env::var_os("TM_KERNELS_LINEINFO").is_some_and(|v| v == "1")
}

/// Runs nvcc for one job: the cubin to `tmp`, with `job.ptx` the PTX into `keep_dir`.
fn run_nvcc(nvcc: &Path, src_dir: &Path, tmp: &Path, keep_dir: &Path, job: &Job) -> Result<()> {
    let source = src_dir.join(format!("{}.cu", job.module));
    let arch = nvrtc::cubin_arch(job.sm);
    let mut cmd = Command::new(nvcc);
    // `-gencode` for the arch-specific target: the `-arch=sm_90a` shorthand also runs a plain
    // sm_90 pass (nvcc 13.0), which rejects sm_90a's instructions.
    let target = format!("arch=compute_{},code={arch}", arch.trim_start_matches("sm_"));
    cmd.args(["-O3", "-std=c++17", "-cubin", "-gencode", &target]);
    if lineinfo() {
        cmd.arg("-lineinfo");
    }
    // The kept PTX is the cubin's own unless the cubin is arch-specific (sm_90a), whose PTX no
    // later GPU could compile: then a separate pass writes the portable compute_<sm> PTX.
    let separate_ptx = job.ptx && arch != format!("sm_{}", job.sm);
    if job.ptx && !separate_ptx {
        cmd.arg("--keep").arg("--keep-dir").arg(keep_dir);
    }
    cmd.arg("-I").arg(src_dir);
    cmd.arg("-o").arg(tmp).arg(&source);
    run_logged(cmd, &job.module, job.sm)?;
    if separate_ptx {
        let mut ptx = Command::new(nvcc);
        ptx.args(["-O3", "-std=c++17", "-ptx"]).arg(format!("-arch=compute_{}", job.sm));
        ptx.arg("-I").arg(src_dir);
        ptx.arg("-o").arg(keep_dir.join(format!("{}.ptx", job.module))).arg(&source);
        run_logged(ptx, &job.module, job.sm)?;
    }
    Ok(())
}

/// Runs one nvcc command for `module` and `sm`, failing with its output, printing any warnings.
fn run_logged(mut cmd: Command, module: &str, sm: u32) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {:?}", cmd.get_program()))?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("nvcc failed on {module}.cu for sm_{sm} ({}):\n{log}\ncommand: {cmd:?}", out.status);
    }
    if !log.trim().is_empty() {
        eprintln!("nvcc {module}.cu (sm_{sm}):\n{}", log.trim_end());
    }
    Ok(())
}

/// Compiles one job with NVRTC, writing the same files as [`run_nvcc`].
fn run_nvrtc(nvrtc: &Nvrtc, src_dir: &Path, tmp: &Path, keep_dir: &Path, job: &Job) -> Result<()> {
    let (source, headers) = nvrtc::read_sources(src_dir, &job.module)?;
    let name = format!("{}.cu", job.module);
    let options = nvrtc::options(job.sm, &nvrtc.include, lineinfo());
    // As with nvcc: an arch-specific (sm_90a) cubin's PTX would not serve later GPUs, so the PTX
    // then comes from a plain sm_<sm> compilation.
    let separate_ptx = job.ptx && nvrtc::cubin_arch(job.sm) != format!("sm_{}", job.sm);
    let out = nvrtc.compile(&name, &source, &headers, &options, job.ptx && !separate_ptx)?;
    if !out.log.is_empty() {
        eprintln!("nvrtc {}.cu (sm_{}):\n{}", job.module, job.sm, out.log);
    }
    fs::write(tmp, &out.cubin).with_context(|| format!("writing {}", tmp.display()))?;
    let ptx = if separate_ptx {
        let plain = nvrtc::options_for(&format!("sm_{}", job.sm), &nvrtc.include, lineinfo());
        nvrtc.compile(&name, &source, &headers, &plain, true)?.ptx
    } else {
        out.ptx
    };
    if let Some(ptx) = ptx {
        let path = keep_dir.join(format!("{}.ptx", job.module));
        fs::write(&path, ptx).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Compiles one job, writing the files through temporary names. Returns them and the time.
fn compile(compiler: &Compiler, src_dir: &Path, out_dir: &Path, job: &Job) -> Result<Compiled> {
    let cubin = file_name(&job.module, job.sm, Kind::Cubin);
    let tmp = out_dir.join(format!(".{cubin}.tmp"));
    let keep_dir = out_dir.join(format!(".{cubin}.keep"));
    if job.ptx {
        let _ = fs::remove_dir_all(&keep_dir);
        fs::create_dir_all(&keep_dir).with_context(|| format!("creating {}", keep_dir.display()))?;
    }
    let start = Instant::now();
    let ran = match compiler {
        Compiler::Nvcc(nvcc) => run_nvcc(nvcc, src_dir, &tmp, &keep_dir, job),
        Compiler::Nvrtc(nvrtc) => run_nvrtc(nvrtc, src_dir, &tmp, &keep_dir, job),
    };
    let time = start.elapsed();
    let result = (|| -> Result<Vec<Done>> {
        ran?;
        let mut done = Vec::new();
        let mut put = |from: &Path, kind: Kind| -> Result<()> {
            let file = file_name(&job.module, job.sm, kind);
            let path = out_dir.join(&file);
            fs::rename(from, &path).with_context(|| format!("writing {}", path.display()))?;
            let bytes = fs::metadata(&path)?.len();
            done.push(Done { file, sm: job.sm, kind, bytes });
            Ok(())
        };
        put(&tmp, Kind::Cubin)?;
        if job.ptx {
            put(&keep_dir.join(format!("{}.ptx", job.module)), Kind::Ptx)?;
        }
        Ok(done)
    })();
    let _ = fs::remove_file(&tmp);
    if job.ptx {
        let _ = fs::remove_dir_all(&keep_dir);
    }
    Ok((result?, time))
}

/// The first line of `nvcc --version` naming the release.
fn nvcc_version(nvcc: &Path) -> Result<String> {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", nvcc.display()))?;
    if !out.status.success() {
        bail!("{} --version failed: {}", nvcc.display(), String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Ok(text.lines().find(|l| l.contains("release")).unwrap_or("unknown").trim().to_string())
}

/// Removes the artefacts and manifest a previous build left in `dir`, so none outlive their sources.
fn clear_old(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let artefact = name.ends_with(".cubin") || name.ends_with(".ptx") || name.ends_with(".tmp");
        if (artefact || name == "manifest.txt") && path.is_file() {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        } else if name.ends_with(".keep") && path.is_dir() {
            fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Runs `build-kernels` with `args` (the arguments after the task name).
pub fn build_kernels(root: &Path, args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "{USAGE}\n(default: all of {DEFAULT_ARCHES:?}; out: $TM_KERNELS_DIR, else target/kernels; \
             compiler: --nvrtc, else $TM_NVRTC, else nvcc, else NVRTC 12 from pip)"
        );
        return Ok(());
    }
    let opts = parse_args(args)?;
    let src_dir = root.join("crates/tm-kernels/cuda");
    let out_dir = match (&opts.out, std::env::var_os("TM_KERNELS_DIR").filter(|d| !d.is_empty())) {
        (Some(out), _) => out.clone(),
        (None, Some(env)) => PathBuf::from(env),
        (None, None) => root.join("target/kernels"),
    };
    let out_dir = if out_dir.is_relative() { std::env::current_dir()?.join(out_dir) } else { out_dir };
    let compiler = Compiler::find(root, opts.nvrtc.as_deref())?;
    let version = compiler.describe()?;
    let (digest, modules) = source_digest(&src_dir)?;
    if modules.is_empty() {
        bail!("no .cu files in {}", src_dir.display());
    }
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    clear_old(&out_dir)?;

    let newest = *opts.arches.last().context("no arch")?;
    // Biggest sources first, newest arch first: the longest jobs start early.
    let mut by_size: Vec<(u64, &String)> =
        modules.iter().map(|m| (fs::metadata(src_dir.join(format!("{m}.cu"))).map_or(0, |md| md.len()), m)).collect();
    by_size.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let mut jobs = Vec::new();
    for (_, module) in by_size {
        for &sm in opts.arches.iter().rev() {
            jobs.push(Job { module: module.clone(), sm, ptx: sm == newest });
        }
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = opts.jobs.unwrap_or(cores).clamp(1, jobs.len());
    println!(
        "building {} module(s) for {} with {} ({version}), {workers} in parallel, into {}",
        modules.len(),
        opts.arches.iter().map(|s| format!("sm_{s}")).collect::<Vec<_>>().join(","),
        compiler.path().display(),
        out_dir.display()
    );
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Result<Compiled>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = compile(&compiler, &src_dir, &out_dir, job);
                let failed = r.is_err();
                if let Ok(mut v) = results.lock() {
                    v.push(r);
                }
                if failed {
                    // Let the other workers stop early too.
                    next.store(jobs.len(), Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| anyhow::anyhow!("a compile thread panicked"))?;
    let (mut done, mut times) = (Vec::new(), Vec::new());
    for r in results {
        let (files, time) = r?;
        if let Some(f) = files.first() {
            times.push((f.sm, time));
        }
        done.extend(files);
    }
    if times.len() != jobs.len() {
        bail!("only {} of {} compile jobs finished", times.len(), jobs.len());
    }
    done.sort_by(|a, b| a.file.cmp(&b.file));
    if source_digest(&src_dir)?.0 != digest {
        bail!("the sources in {} changed during the build; run it again", src_dir.display());
    }

    for &sm in &opts.arches {
        let mine: Vec<&Done> = done.iter().filter(|d| d.sm == sm).collect();
        let cubin: u64 = mine.iter().filter(|d| d.kind == Kind::Cubin).map(|d| d.bytes).sum();
        let ptx: u64 = mine.iter().filter(|d| d.kind == Kind::Ptx).map(|d| d.bytes).sum();
        let secs: f64 = times.iter().filter(|t| t.0 == sm).map(|t| t.1.as_secs_f64()).sum();
        let ptx = if ptx > 0 { format!(" + {} KiB PTX", ptx.div_ceil(1024)) } else { String::new() };
        println!(
            "sm_{sm}: {} module(s), {} KiB cubin{ptx}, {secs:.1} s compiling",
            modules.len(),
            cubin.div_ceil(1024)
        );
    }

    let mut manifest = String::from(
        "# Written by `cargo xtask build-kernels`. tm-kernels/build.rs embeds the files below only while\n\
         # `sources` matches the sha256 of crates/tm-kernels/cuda/*.cu and *.cuh.\n",
    );
    let _ = writeln!(manifest, "sources {digest}");
    let _ = writeln!(manifest, "{version}");
    let _ =
        writeln!(manifest, "arches {}", opts.arches.iter().map(|s| format!("sm_{s}")).collect::<Vec<_>>().join(","));
    for d in &done {
        let bytes = fs::read(out_dir.join(&d.file))?;
        let _ = writeln!(manifest, "file {} {}", d.file, hex(&Sha256::digest(&bytes)));
    }
    let path = out_dir.join("manifest.txt");
    fs::write(&path, manifest).with_context(|| format!("writing {}", path.display()))?;
    println!(
        "done in {:.1} s: {} files and manifest.txt; the next cargo build of tm-kernels embeds them",
        start.elapsed().as_secs_f64(),
        done.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arch_lists() {
        assert_eq!(parse_arches("sm_87").unwrap(), vec![87]);
        assert_eq!(parse_arches("sm_90,sm_80, sm_86,sm_90").unwrap(), vec![80, 86, 90]);
        assert_eq!(parse_arches("89").unwrap(), vec![89]);
        for bad in ["", ",", "sm_", "sm_8", "sm_x7", "compute_90", "sm_87a", "sm_+87", "sm_1000"] {
            assert!(parse_arches(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn arguments() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(o, Options { arches: DEFAULT_ARCHES.to_vec(), out: None, jobs: None, nvrtc: None });
        let o = parse_args(&args(&["--arch", "sm_87", "--out", "k", "-j", "3", "--nvrtc", "auto"])).unwrap();
        let nvrtc = Some("auto".to_string());
        assert_eq!(o, Options { arches: vec![87], out: Some(PathBuf::from("k")), jobs: Some(3), nvrtc });
        let o = parse_args(&args(&["--arch=sm_80,sm_90", "--out=/x"])).unwrap();
        assert_eq!(o.arches, vec![80, 90]);
        assert_eq!(o.out, Some(PathBuf::from("/x")));
        assert!(parse_args(&args(&["--arch"])).is_err());
        assert!(parse_args(&args(&["--jobs", "0"])).is_err());
        assert!(parse_args(&args(&["--frob"])).is_err());
    }

    #[test]
    fn digest_matches_tm_kernels_build_script() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tm-kernels/cuda");
        let (digest, modules) = source_digest(&dir).unwrap();
        assert_eq!(digest, tm_kernels::cuda::source_digest());
        let embedded: Vec<&str> = tm_kernels::cuda::modules().iter().map(|s| s.name.trim_end_matches(".cu")).collect();
        assert_eq!(modules, embedded);
    }

    #[test]
    fn nvrtc_locations() {
        let venv = std::env::temp_dir().join(format!("tm-xtask-venv-{}", std::process::id()));
        let site = venv.join("lib/python3.11/site-packages");
        let lib = site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        fs::create_dir_all(lib.parent().unwrap()).unwrap();
        fs::write(&lib, "").unwrap();
        let root = Path::new("/nonexistent-root");
        let venv_arg = venv.to_str().unwrap();
        assert!(find_nvrtc(root, venv_arg).is_err(), "no runtime headers yet");
        fs::create_dir_all(site.join("nvidia/cuda_runtime/include")).unwrap();
        for h in ["cuda_fp16.h", "cuda_bf16.h"] {
            fs::write(site.join("nvidia/cuda_runtime/include").join(h), "").unwrap();
        }
        assert_eq!(find_nvrtc(root, venv_arg).unwrap(), lib, "a venv");
        assert_eq!(find_nvrtc(root, site.to_str().unwrap()).unwrap(), lib, "a site-packages");
        assert_eq!(find_nvrtc(root, lib.to_str().unwrap()).unwrap(), lib, "the library itself");
        assert!(find_nvrtc(root, "/nonexistent/libnvrtc.so.12").is_err());
        let _ = fs::remove_dir_all(&venv);
    }

    #[test]
    fn artefact_names() {
        assert_eq!(file_name("elementwise", 87, Kind::Cubin), "elementwise.sm_87.cubin");
        assert_eq!(file_name("elementwise", 90, Kind::Ptx), "elementwise.compute_90.ptx");
    }
}
