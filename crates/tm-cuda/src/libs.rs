//! Finding the NVIDIA libraries tm loads at run time, without calling any of them.
//!
//! cudarc (with `dynamic-loading`) opens each library by *name* through the system loader, trying
//! its own list of candidate names in order ([`cudarc_candidates`]), and panics if none loads.
//! [`libraries`] reports, for the driver, cuBLASLt, NVRTC and NCCL: the name or path that loads
//! (names first, then known directories such as the CUDA toolkit and the pip wheels'
//! `site-packages/nvidia/...`), the file it resolves to, and what cudarc itself would load.
//!
//! A library found only by path (not on the loader's search path) is invisible to cudarc;
//! [`preload`] opens it by path and keeps it open, after which the loader answers cudarc's
//! by-name lookup of the same soname with the already loaded copy (glibc matches loaded objects
//! by `DT_SONAME`).

use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Display name of the CUDA driver.
pub const DRIVER: &str = "CUDA driver";
/// Display name of cuBLASLt.
pub const CUBLASLT: &str = "cuBLASLt";
/// Display name of NVRTC.
pub const NVRTC: &str = "NVRTC";
/// Display name of NCCL.
pub const NCCL: &str = "NCCL";

/// The CUDA major version tm's bindings were built for (the `cuda-12` / `cuda-13` feature).
pub const CUDA_MAJOR: u32 = if cfg!(feature = "cuda-12") { 12 } else { 13 };

/// The driver's soname.
pub const DRIVER_SONAME: &str = "libcuda.so.1";
/// cuBLASLt's soname for [`CUDA_MAJOR`].
pub const CUBLASLT_SONAME: &str = if cfg!(feature = "cuda-12") { "libcublasLt.so.12" } else { "libcublasLt.so.13" };
/// NVRTC's soname for [`CUDA_MAJOR`].
pub const NVRTC_SONAME: &str = if cfg!(feature = "cuda-12") { "libnvrtc.so.12" } else { "libnvrtc.so.13" };
/// NCCL's soname.
pub const NCCL_SONAME: &str = "libnccl.so.2";

/// What was found for one library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryStatus {
    /// Which library: [`DRIVER`], [`CUBLASLT`], [`NVRTC`] or [`NCCL`].
    pub name: &'static str,
    /// The soname or path that loaded, or `None` when nothing did.
    pub found: Option<String>,
    /// The file the loaded library resolves to (from `dladdr`), where known.
    pub path: Option<String>,
    /// The name cudarc's own loader would open (the first of [`cudarc_candidates`] that loads);
    /// `None` means cudarc would not find the library (and would panic if asked to use it) unless
    /// it is [`preload`]ed first.
    pub cudarc_loads: Option<String>,
    /// Something the user should know, e.g. cudarc would load a library of another CUDA major.
    pub warning: Option<String>,
    /// Everything tried, in order (names, then paths).
    pub tried: Vec<String>,
}

/// The candidate names cudarc tries for library stem `stem` (e.g. `cublasLt`), in order.
pub fn cudarc_candidates(stem: &str) -> Vec<String> {
    cudarc::get_lib_name_candidates(stem)
}

/// Tries to open `name` (a soname or a path); on success returns the handle.
fn open(name: &str) -> Option<libloading::Library> {
    // SAFETY: loading runs the library's initialisers, which is what using it would do anyway;
    // NVIDIA's libraries have no initialisers with side effects beyond their own state.
    unsafe { libloading::Library::new(name) }.ok()
}

/// The file `lib` was loaded from, found through the address of `symbol` and `dladdr`.
fn resolved_path(lib: &libloading::Library, symbol: &str) -> Option<String> {
    // SAFETY: the symbol is only used as an address, never called or read.
    let sym = unsafe { lib.get::<*mut c_void>(symbol.as_bytes()) }.ok()?;
    let addr: *mut c_void = *sym;
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `addr` is inside a loaded object; `info` is a valid out pointer.
    let ok = unsafe { libc::dladdr(addr as *const c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader, alive while `lib` is.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let path = std::fs::canonicalize(&path).map(|p| p.display().to_string()).unwrap_or(path);
    Some(path)
}

/// Directories from a `PATH`-like variable.
fn env_dirs(var: &str) -> Vec<PathBuf> {
    std::env::var_os(var)
        .map(|v| std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).collect())
        .unwrap_or_default()
}

/// The CUDA toolkit roots: `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`, `/usr/local/cuda`,
/// `/usr/local/cuda-<major>`, in that order, deduplicated, existing ones only.
pub fn cuda_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from))
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots.push(PathBuf::from(format!("/usr/local/cuda-{CUDA_MAJOR}")));
    dedup_existing(roots)
}

fn dedup_existing(dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Python's `site-packages` directories: those `python3` reports in `sys.path` (asked once per
/// process), then `$VIRTUAL_ENV` and `$CONDA_PREFIX`'s. Existing directories only.
pub fn python_site_dirs() -> Vec<PathBuf> {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let mut dirs = Vec::new();
        if let Ok(out) = std::process::Command::new("python3")
            .args(["-c", "import sys; print('\\n'.join(p for p in sys.path if p))"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
        {
            if out.status.success() {
                let text = String::from_utf8_lossy(&out.stdout);
                dirs.extend(
                    text.lines()
                        .map(str::trim)
                        .filter(|l| l.ends_with("site-packages") || l.ends_with("dist-packages"))
                        .map(PathBuf::from),
                );
            }
        }
        for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            let Some(prefix) = std::env::var_os(var).filter(|s| !s.is_empty()) else { continue };
            let lib = Path::new(&prefix).join("lib");
            if let Ok(entries) = std::fs::read_dir(&lib) {
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().starts_with("python3") {
                        dirs.push(e.path().join("site-packages"));
                    }
                }
            }
        }
        dedup_existing(dirs)
    })
    .clone()
}

/// The `lib` directories of NVIDIA's pip wheels under `sub` (e.g. `cu13/lib`, `nccl/lib`) in every
/// site-packages directory.
fn pip_dirs(subs: &[&str]) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for site in python_site_dirs() {
        for sub in subs {
            dirs.push(site.join("nvidia").join(sub));
        }
    }
    dedup_existing(dirs)
}

/// Where to look for library files beyond the loader's own search: `LD_LIBRARY_PATH`, the toolkit's
/// `lib64` and `targets/*/lib`, and the pip wheels' directories `pip_subs`.
fn search_dirs(pip_subs: &[&str]) -> Vec<PathBuf> {
    let mut dirs = env_dirs("LD_LIBRARY_PATH");
    for root in cuda_roots() {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("lib"));
        for target in ["x86_64-linux", "sbsa-linux", "aarch64-linux"] {
            dirs.push(root.join("targets").join(target).join("lib"));
        }
    }
    dirs.extend(pip_dirs(pip_subs));
    dedup_existing(dirs)
}

/// How to look for one library.
struct Spec {
    name: &'static str,
    /// Names to try first (our preferred sonames).
    names: Vec<String>,
    /// cudarc's library stems (e.g. `["cuda", "nvcuda"]`).
    cudarc_stems: &'static [&'static str],
    /// A symbol every version exports, for `dladdr`.
    symbol: &'static str,
    /// Pip wheel subdirectories of `site-packages/nvidia`.
    pip: &'static [&'static str],
    /// The soname prefix a library of the right major starts with (for the mismatch warning).
    expected_prefix: Option<&'static str>,
}

fn specs() -> Vec<Spec> {
    let cu12 = CUDA_MAJOR == 12;
    vec![
        Spec {
            name: DRIVER,
            names: vec![DRIVER_SONAME.into(), "libcuda.so".into()],
            cudarc_stems: &["cuda", "nvcuda"],
            symbol: "cuInit",
            pip: &[],
            expected_prefix: None,
        },
        Spec {
            name: CUBLASLT,
            names: vec![CUBLASLT_SONAME.into()],
            cudarc_stems: &["cublasLt"],
            symbol: "cublasLtCreate",
            pip: if cu12 { &["cublas/lib"] } else { &["cu13/lib", "cublas/lib"] },
            expected_prefix: Some(CUBLASLT_SONAME),
        },
        Spec {
            name: NVRTC,
            names: vec![NVRTC_SONAME.into()],
            cudarc_stems: &["nvrtc"],
            symbol: "nvrtcVersion",
            pip: if cu12 { &["cuda_nvrtc/lib"] } else { &["cu13/lib", "cuda_nvrtc/lib"] },
            expected_prefix: Some(NVRTC_SONAME),
        },
        Spec {
            name: NCCL,
            names: vec![NCCL_SONAME.into(), "libnccl.so".into()],
            cudarc_stems: &["nccl"],
            symbol: "ncclGetVersion",
            pip: if cu12 { &["nccl/lib"] } else { &["nccl/lib", "cu13/lib"] },
            expected_prefix: Some(NCCL_SONAME),
        },
    ]
}

/// Opens `candidate` if not tried yet; returns the file it resolves to when it loads.
fn try_candidate(candidate: String, symbol: &str, tried: &mut Vec<String>) -> Option<(String, String)> {
    if tried.contains(&candidate) {
        return None;
    }
    tried.push(candidate.clone());
    let lib = open(&candidate)?;
    let path = resolved_path(&lib, symbol).unwrap_or_else(|| candidate.clone());
    Some((candidate, path))
}

fn find_spec(spec: &Spec) -> LibraryStatus {
    let mut tried: Vec<String> = Vec::new();
    // Our preferred names through the loader's search, then as files in known directories.
    let mut hit = spec.names.iter().find_map(|n| try_candidate(n.clone(), spec.symbol, &mut tried));
    if hit.is_none() {
        'dirs: for dir in search_dirs(spec.pip) {
            for n in &spec.names {
                let p = dir.join(n);
                if p.is_file() {
                    hit = try_candidate(p.display().to_string(), spec.symbol, &mut tried);
                    if hit.is_some() {
                        break 'dirs;
                    }
                }
            }
        }
    }
    // What cudarc would load: the first of its candidates that opens by name.
    let mut cudarc_loads = None;
    for c in spec.cudarc_stems.iter().flat_map(|s| cudarc_candidates(s)) {
        if !tried.contains(&c) {
            tried.push(c.clone());
        }
        if let Some(lib) = open(&c) {
            let path = resolved_path(&lib, spec.symbol).unwrap_or_else(|| c.clone());
            cudarc_loads = Some((c, path));
            break;
        }
    }
    if hit.is_none() {
        hit = cudarc_loads.clone();
    }
    let warning = match (&cudarc_loads, &hit) {
        (Some((name, path)), _) => spec.expected_prefix.and_then(|want| {
            let file = Path::new(path).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            (!file.starts_with(want))
                .then(|| format!("cudarc would load {name} ({path}), not {want}: tm is built for CUDA {CUDA_MAJOR}"))
        }),
        (None, Some((found, _))) if spec.name == NCCL => Some(format!(
            "found at {found}, but cudarc's loader only tries unversioned or CUDA-numbered names ({}), not \
             {NCCL_SONAME}: put a libnccl.so symlink on LD_LIBRARY_PATH or load NCCL through tm",
            cudarc_candidates("nccl").join(", ")
        )),
        (None, Some((found, _))) => Some(format!(
            "found at {found} but not on the loader's search path, so cudarc will not find it; add its directory \
             to LD_LIBRARY_PATH"
        )),
        (None, None) => None,
    };
    let (found, path) = hit.map_or((None, None), |(f, p)| (Some(f), Some(p)));
    LibraryStatus { name: spec.name, found, path, cudarc_loads: cudarc_loads.map(|(c, _)| c), warning, tried }
}

/// The status of the CUDA driver, cuBLASLt, NVRTC and NCCL, in that order. Loads each library to
/// test it (and closes it again); calls nothing in it; never panics.
pub fn libraries() -> Vec<LibraryStatus> {
    specs().iter().map(find_spec).collect()
}

/// The status of one library ([`DRIVER`], [`CUBLASLT`], [`NVRTC`] or [`NCCL`]), as in
/// [`libraries`]; an unknown name is reported as not found.
pub fn find(name: &str) -> LibraryStatus {
    match specs().iter().find(|s| s.name == name) {
        Some(spec) => find_spec(spec),
        None => LibraryStatus {
            name: "unknown",
            found: None,
            path: None,
            cudarc_loads: None,
            warning: Some(format!("tm does not look for a library called {name}")),
            tried: Vec::new(),
        },
    }
}

/// Libraries opened by [`preload`], kept open for the life of the process.
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Makes a library that was found only by path visible to cudarc's by-name loading: opens
/// `status.found` by path and keeps it open. Returns whether cudarc can now load it.
pub fn preload(status: &LibraryStatus) -> bool {
    if status.cudarc_loads.is_some() {
        return true;
    }
    let Some(found) = status.found.as_deref() else { return false };
    let Some(lib) = open(found) else { return false };
    if let Ok(mut keep) = PRELOADED.lock() {
        keep.push(lib);
    } else {
        return false;
    }
    let stems: &[&str] = match status.name {
        DRIVER => &["cuda"],
        CUBLASLT => &["cublasLt"],
        NVRTC => &["nvrtc"],
        NCCL => &["nccl"],
        _ => &[],
    };
    stems.iter().flat_map(|s| cudarc_candidates(s)).any(|c| open(&c).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_status_without_a_gpu_does_not_panic() {
        let libs = libraries();
        let names: Vec<&str> = libs.iter().map(|l| l.name).collect();
        assert_eq!(names, [DRIVER, CUBLASLT, NVRTC, NCCL]);
        for l in &libs {
            assert!(!l.tried.is_empty(), "{l:?}");
            if l.found.is_none() {
                assert!(l.path.is_none() && l.cudarc_loads.is_none(), "{l:?}");
            }
        }
        // The driver status agrees with cudarc's own presence check.
        // SAFETY: only dlopens candidate names.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        assert_eq!(libs[0].cudarc_loads.is_some(), present, "{:?}", libs[0]);
    }

    #[test]
    fn cudarc_candidates_include_our_sonames() {
        assert!(cudarc_candidates("cuda").iter().any(|c| c == DRIVER_SONAME));
        assert!(cudarc_candidates("cublasLt").iter().any(|c| c == CUBLASLT_SONAME));
        assert!(cudarc_candidates("nvrtc").iter().any(|c| c == NVRTC_SONAME));
        // cudarc 0.19's list has no `.so.2`: it finds NCCL only through an unversioned
        // `libnccl.so` (see the NCCL warning in `find_spec`).
        assert!(!cudarc_candidates("nccl").iter().any(|c| c == NCCL_SONAME));
        assert!(cudarc_candidates("nccl").iter().any(|c| c == "libnccl.so"));
    }

    #[test]
    fn preload_of_nothing_is_false() {
        let s = LibraryStatus { name: NCCL, found: None, path: None, cudarc_loads: None, warning: None, tried: vec![] };
        assert!(!preload(&s));
    }
}
