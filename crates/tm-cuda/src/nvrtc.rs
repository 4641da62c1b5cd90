//! Run-time compilation of the embedded kernel sources with NVRTC, cached on disk.
//!
//! Used when no embedded cubin or PTX fits the device. The module's source and every embedded
//! header are handed to NVRTC in memory; `cuda_fp16.h` / `cuda_bf16.h` come from a CUDA include
//! directory ([`cuda_include_dirs`]). The result is a cubin for `sm_XX` when this NVRTC supports the
//! arch, else PTX for the highest `compute_XX` it supports below it (the driver JIT-compiles it).
//! Results are cached under [`cache_dir`] by a SHA-256 of everything that affects them, so a second
//! run loads from disk.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys, Ptx};
use sha2::{Digest, Sha256};

/// What NVRTC is asked to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Machine code for `sm_XX`.
    Cubin(u32),
    /// PTX for `compute_XX`.
    Ptx(u32),
}

impl Output {
    /// The `--gpu-architecture` option. An sm_90 cubin is built for `sm_90a` (Hopper's
    /// arch-specific wgmma, which `q4_gemm.cu` uses), as `cargo xtask build-kernels` builds it.
    pub fn arch_option(self) -> String {
        match self {
            Output::Cubin(90) => "--gpu-architecture=sm_90a".to_string(),
            Output::Cubin(sm) => format!("--gpu-architecture=sm_{sm}"),
            Output::Ptx(sm) => format!("--gpu-architecture=compute_{sm}"),
        }
    }

    fn extension(self) -> &'static str {
        match self {
            Output::Cubin(_) => "cubin",
            Output::Ptx(_) => "ptx",
        }
    }
}

/// Picks the output for device arch `sm` given the archs this NVRTC supports: a cubin when `sm` is
/// supported, else PTX for the highest supported arch below `sm`, else `None`.
pub fn choose_output(sm: u32, supported: &[u32]) -> Option<Output> {
    if supported.contains(&sm) {
        return Some(Output::Cubin(sm));
    }
    supported.iter().copied().filter(|&s| s <= sm).max().map(Output::Ptx)
}

/// The kernel cache directory: `$TM_HOME/kernels`, else `<platform cache>/tm/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("TM_HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(home).join("kernels"));
    }
    dirs::cache_dir().map(|d| d.join("tm").join("kernels"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 (hex) over everything that determines the compiled module: its source, every
/// header (name and text), the device arch, the NVRTC version and the options.
pub fn cache_key(
    source: &str,
    headers: &[(&str, &str)],
    sm: u32,
    nvrtc_version: (i32, i32),
    options: &[String],
) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(source.as_bytes());
    for (name, text) in headers {
        field(name.as_bytes());
        field(text.as_bytes());
    }
    field(format!("sm_{sm}").as_bytes());
    field(format!("nvrtc {}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    for o in options {
        field(o.as_bytes());
    }
    hex(&h.finalize())
}

/// The cache file for `module` with key `key`.
pub fn cache_path(dir: &Path, module: &str, sm: u32, key: &str, output: Output) -> PathBuf {
    let short = &key[..key.len().min(16)];
    dir.join(format!("{module}-sm{sm}-{short}.{}", output.extension()))
}

/// Candidate CUDA include directories, in order: each toolkit root's `include` and
/// `targets/*/include` (`$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`, `/usr/local/cuda`), then the pip
/// wheels' `site-packages/nvidia/cu13/include` (CUDA 13) or `nvidia/cuda_runtime/include` (CUDA 12).
/// Returns every candidate, existing or not; [`cuda_include_dir`] picks one.
pub fn cuda_include_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for root in crate::libs::cuda_roots() {
        dirs.push(root.join("include"));
        for target in ["x86_64-linux", "sbsa-linux", "aarch64-linux"] {
            dirs.push(root.join("targets").join(target).join("include"));
        }
    }
    if !dirs.iter().any(|d| d.starts_with("/usr/local/cuda")) {
        dirs.push(PathBuf::from("/usr/local/cuda/include"));
    }
    let pip: &[&str] = if crate::libs::CUDA_MAJOR == 12 {
        &["cuda_runtime/include", "cuda_nvrtc/include"]
    } else {
        &["cu13/include", "cuda_runtime/include"]
    };
    for site in crate::libs::python_site_dirs() {
        for sub in pip {
            dirs.push(site.join("nvidia").join(sub));
        }
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// The first of [`cuda_include_dirs`] holding `cuda_fp16.h` and `cuda_bf16.h`.
pub fn cuda_include_dir() -> Option<PathBuf> {
    cuda_include_dirs().into_iter().find(|d| d.join("cuda_fp16.h").is_file() && d.join("cuda_bf16.h").is_file())
}

/// Whether the NVRTC library can be loaded (loads nothing else, never panics).
pub fn available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: only dlopens cudarc's candidate names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// NVRTC's version (major, minor), or why it is unavailable.
pub fn version() -> Result<(i32, i32), String> {
    if !available() {
        return Err(missing());
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present; both are valid out pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| format!("nvrtcVersion: {:?}", e.0))?;
    Ok((major, minor))
}

/// The archs this NVRTC can compile for (e.g. `[75, 80, ..., 120]`).
pub fn supported_archs() -> Result<Vec<u32>, String> {
    if !available() {
        return Err(missing());
    }
    let mut n: c_int = 0;
    // SAFETY: the library is present; `n` is a valid out pointer.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| format!("nvrtcGetNumSupportedArchs: {:?}", e.0))?;
    let mut archs: Vec<c_int> = vec![0; n.max(0) as usize];
    if !archs.is_empty() {
        // SAFETY: `archs` has room for the `n` entries NVRTC writes.
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| format!("nvrtcGetSupportedArchs: {:?}", e.0))?;
    }
    Ok(archs.into_iter().filter(|&a| a > 0).map(|a| a as u32).collect())
}

fn missing() -> String {
    let names = crate::libs::cudarc_candidates("nvrtc");
    format!(
        "the NVRTC library ({}) is not installed or not on the loader's path (tried {})",
        crate::libs::NVRTC_SONAME,
        names.join(", ")
    )
}

/// Everything one compilation of a module needs, worked out before compiling.
struct Job {
    file: String,
    source: &'static str,
    headers: Vec<(&'static str, &'static str)>,
    nvrtc_version: (i32, i32),
    output: Output,
    include: Option<PathBuf>,
    options: Vec<String>,
    cached: Option<PathBuf>,
}

fn job(module: &str, sm: u32) -> Result<Job, String> {
    let file = format!("{module}.cu");
    let modules = tm_kernels::cuda::modules();
    let source = modules.iter().find(|s| s.name == file).ok_or_else(|| {
        let names: Vec<&str> = modules.iter().map(|s| s.name).collect();
        format!("no embedded kernel source {file} (embedded: {names:?})")
    })?;
    let nvrtc_version = version()?;
    let supported = supported_archs()?;
    let output = choose_output(sm, &supported).ok_or_else(|| {
        format!("NVRTC {}.{} supports archs {supported:?}, none <= sm_{sm}", nvrtc_version.0, nvrtc_version.1)
    })?;
    let include = cuda_include_dir();
    let mut options = vec![output.arch_option(), "-std=c++17".to_string(), "-default-device".to_string()];
    if let Some(dir) = &include {
        options.push(format!("-I{}", dir.display()));
    }
    let headers: Vec<(&str, &str)> = tm_kernels::cuda::headers().iter().map(|h| (h.name, h.text)).collect();
    let key = cache_key(source.text, &headers, sm, nvrtc_version, &options);
    let cached = cache_dir().map(|d| cache_path(&d, module, sm, &key, output));
    Ok(Job { file, source: source.text, headers, nvrtc_version, output, include, options, cached })
}

/// Where [`compile_module`] caches `module` for `sm` (`None` without a cache directory), or why it
/// cannot compile it (no such module, NVRTC missing, no supported arch).
pub fn cache_file(module: &str, sm: u32) -> Result<Option<PathBuf>, String> {
    job(module, sm).map(|j| j.cached)
}

/// Compiles module `module` (a `.cu` stem from `tm_kernels::cuda::modules()`) for arch `sm`,
/// or loads the result of an earlier compilation from the disk cache ([`cache_file`]).
///
/// Returns `Err` with the reason (no such module, NVRTC missing, the compile log, the include
/// directories tried) instead of panicking.
pub fn compile_module(module: &str, sm: u32) -> Result<Ptx, String> {
    let job = job(module, sm)?;
    if let Some(path) = &job.cached {
        if let Ok(bytes) = std::fs::read(path) {
            if !bytes.is_empty() {
                tracing::debug!("kernel module {module} for sm_{sm} from the cache {}", path.display());
                return to_ptx(job.output, bytes);
            }
        }
    }
    let bytes = compile(module, job.source, &job.headers, &job.options, job.output).map_err(|e| {
        let inc = match &job.include {
            Some(d) => format!("CUDA headers from {}", d.display()),
            None => {
                let tried: Vec<String> = cuda_include_dirs().iter().map(|d| d.display().to_string()).collect();
                format!(
                    "no CUDA include directory with cuda_fp16.h and cuda_bf16.h found (tried {}; set CUDA_HOME)",
                    tried.join(", ")
                )
            }
        };
        let (major, minor) = job.nvrtc_version;
        format!("NVRTC {major}.{minor} compiling {} for sm_{sm}: {e}; {inc}", job.file)
    })?;
    if let Some(path) = &job.cached {
        if let Err(e) = write_atomically(path, &bytes) {
            tracing::warn!("could not cache the compiled kernels at {}: {e}", path.display());
        }
    }
    to_ptx(job.output, bytes)
}

fn to_ptx(output: Output, bytes: Vec<u8>) -> Result<Ptx, String> {
    match output {
        Output::Cubin(_) => Ok(Ptx::from_binary(bytes)),
        Output::Ptx(_) => {
            let text = String::from_utf8(bytes).map_err(|e| format!("NVRTC produced PTX that is not UTF-8: {e}"))?;
            Ok(Ptx::from_src(text.trim_end_matches('\0').to_string()))
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

/// Runs NVRTC; returns the cubin or the PTX bytes, or the error with NVRTC's log.
fn compile(
    module: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
    output: Output,
) -> Result<Vec<u8>, String> {
    let src = cstring(source, "the kernel source")?;
    let name = cstring(&format!("{module}.cu"), "the module name")?;
    let texts = headers.iter().map(|(n, t)| cstring(t, n)).collect::<Result<Vec<_>, _>>()?;
    let names = headers.iter().map(|(n, _)| cstring(n, n)).collect::<Result<Vec<_>, _>>()?;
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    let count = c_int::try_from(headers.len()).map_err(|_| "too many headers".to_string())?;
    // SAFETY: every pointer is a live NUL-terminated string for the duration of the program,
    // which is destroyed before they are dropped (Program is declared after them).
    unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            name.as_ptr(),
            count,
            if headers.is_empty() { std::ptr::null() } else { text_ptrs.as_ptr() },
            if headers.is_empty() { std::ptr::null() } else { name_ptrs.as_ptr() },
        )
    }
    .result()
    .map_err(|e| format!("nvrtcCreateProgram: {:?}", e.0))?;
    let prog = Program(raw);
    let opts = options.iter().map(|o| cstring(o, "an option")).collect::<Result<Vec<_>, _>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let n_opts = c_int::try_from(opt_ptrs.len()).map_err(|_| "too many options".to_string())?;
    // SAFETY: `prog` is live; the options are live NUL-terminated strings.
    let compiled = unsafe { sys::nvrtcCompileProgram(prog.0, n_opts, opt_ptrs.as_ptr()) }.result();
    if let Err(e) = compiled {
        // SAFETY: `prog` is live.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| {
                let bytes: Vec<u8> = l.into_iter().map(|c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).trim().to_string()
            })
            .unwrap_or_default();
        return Err(format!("{:?} with options {options:?}:\n{log}", e.0));
    }
    match output {
        Output::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: `prog` was compiled for a real arch; `size` is a valid out pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {:?}", e.0))?;
            let mut cubin = vec![0u8; size];
            if size > 0 {
                // SAFETY: `cubin` has the `size` bytes NVRTC writes.
                unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) }
                    .result()
                    .map_err(|e| format!("nvrtcGetCUBIN: {:?}", e.0))?;
            }
            if cubin.is_empty() {
                return Err("NVRTC produced an empty cubin".into());
            }
            Ok(cubin)
        }
        Output::Ptx(_) => {
            // SAFETY: `prog` is live and compiled.
            let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| format!("nvrtcGetPTX: {:?}", e.0))?;
            Ok(ptx.into_iter().map(|c| c as u8).take_while(|&b| b != 0).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_choice() {
        let supported = [75, 80, 86, 87, 89, 90, 100, 120];
        assert_eq!(choose_output(90, &supported), Some(Output::Cubin(90)));
        assert_eq!(choose_output(91, &supported), Some(Output::Ptx(90)));
        assert_eq!(choose_output(70, &supported), None);
        assert_eq!(Output::Cubin(90).arch_option(), "--gpu-architecture=sm_90a");
        assert_eq!(Output::Cubin(89).arch_option(), "--gpu-architecture=sm_89");
        assert_eq!(Output::Ptx(87).arch_option(), "--gpu-architecture=compute_87");
    }

    #[test]
    fn cache_key_depends_on_every_input() {
        let opts = vec!["-std=c++17".to_string()];
        let base = cache_key("src", &[("a.cuh", "x")], 90, (13, 0), &opts);
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key("src", &[("a.cuh", "x")], 90, (13, 0), &opts), "deterministic");
        for other in [
            cache_key("src2", &[("a.cuh", "x")], 90, (13, 0), &opts),
            cache_key("src", &[("a.cuh", "y")], 90, (13, 0), &opts),
            cache_key("src", &[("b.cuh", "x")], 90, (13, 0), &opts),
            cache_key("src", &[("a.cuh", "x")], 89, (13, 0), &opts),
            cache_key("src", &[("a.cuh", "x")], 90, (13, 1), &opts),
            cache_key("src", &[("a.cuh", "x")], 90, (13, 0), &[]),
            // Field boundaries matter: moving text between source and header changes the key.
            cache_key("srca.cuh", &[("", "x")], 90, (13, 0), &opts),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn cache_paths() {
        let key = "0123456789abcdef0123";
        let p = cache_path(Path::new("/c"), "elementwise", 90, key, Output::Cubin(90));
        assert_eq!(p, PathBuf::from("/c/elementwise-sm90-0123456789abcdef.cubin"));
        let p = cache_path(Path::new("/c"), "attention", 91, key, Output::Ptx(90));
        assert_eq!(p, PathBuf::from("/c/attention-sm91-0123456789abcdef.ptx"));
        // The default cache directory ends in kernels (TM_HOME or the platform cache).
        if let Some(d) = cache_dir() {
            assert!(d.ends_with("kernels"), "{}", d.display());
        }
    }

    #[test]
    fn include_dirs_are_listed() {
        let dirs = cuda_include_dirs();
        assert!(dirs.iter().any(|d| d == Path::new("/usr/local/cuda/include")), "{dirs:?}");
        if let Some(d) = cuda_include_dir() {
            assert!(d.join("cuda_fp16.h").is_file());
        }
    }

    #[test]
    fn missing_module_or_library_is_an_error_not_a_panic() {
        let err = compile_module("no_such_module", 90).expect_err("no such module");
        assert!(err.contains("no_such_module.cu"), "{err}");
        if !available() {
            assert!(version().is_err() && supported_archs().is_err());
        }
    }

    #[test]
    fn gpu_nvrtc_compiles_the_embedded_modules_and_caches_them() {
        if !available() {
            eprintln!("skipping NVRTC test: NVRTC not found");
            return;
        }
        for m in tm_kernels::cuda::modules() {
            let module = m.name.trim_end_matches(".cu");
            let first = std::time::Instant::now();
            let ptx = compile_module(module, 90);
            let first = first.elapsed();
            if let Err(e) = &ptx {
                panic!("{e}");
            }
            let path = cache_file(module, 90).expect("cache file");
            if let Some(path) = path {
                assert!(path.is_file(), "{} was not cached", path.display());
                let again = std::time::Instant::now();
                compile_module(module, 90).expect("from the cache");
                eprintln!("{module}: compiled in {first:?}, from the cache in {:?}", again.elapsed());
            }
        }
    }

    #[test]
    fn gpu_nvrtc_compiles_and_caches() {
        if !available() {
            eprintln!("skipping NVRTC test: NVRTC not found");
            return;
        }
        let src = "#include <cuda_fp16.h>\nextern \"C\" __global__ void k(__half* p) { p[threadIdx.x] = __float2half(1.0f); }\n";
        let (ver, archs) = match (version(), supported_archs()) {
            (Ok(v), Ok(a)) => (v, a),
            other => panic!("NVRTC present but unusable: {other:?}"),
        };
        let Some(output) = choose_output(90, &archs) else { return };
        let mut options = vec![output.arch_option(), "-std=c++17".to_string(), "-default-device".to_string()];
        if let Some(dir) = cuda_include_dir() {
            options.push(format!("-I{}", dir.display()));
        }
        let bytes = compile("test", src, &[], &options, output).expect("compile");
        assert!(!bytes.is_empty());
        let key = cache_key(src, &[], 90, ver, &options);
        assert_eq!(key.len(), 64);
    }
}
