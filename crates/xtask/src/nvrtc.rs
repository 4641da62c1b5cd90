//! NVRTC as the second `build-kernels` compiler: `libnvrtc.so` loaded at run time from a path, so
//! that a CUDA 12 library from pip (`nvidia-cuda-nvrtc-cu12`, whose nvcc wheel has no nvcc driver)
//! builds the Jetson (JetPack 6, CUDA 12 driver) cubins on any machine. The options and the
//! in-memory headers are those tm-cuda's run-time NVRTC fallback (`tm-cuda/src/nvrtc.rs`) uses.

use std::ffi::{c_char, c_int, c_void, CString};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

type Prog = *mut c_void;
/// `nvrtcResult`: 0 is `NVRTC_SUCCESS`.
type Status = c_int;

/// The NVRTC entry points used, as declared in `nvrtc.h`.
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Status,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Prog) -> Status,
}

/// A loaded NVRTC library and the CUDA include directory (`cuda_fp16.h`, `cuda_bf16.h`) to use.
pub struct Nvrtc {
    api: Api,
    /// Keeps the functions in `api` mapped.
    _lib: libloading::Library,
    pub lib_path: PathBuf,
    pub include: PathBuf,
    /// (major, minor) from `nvrtcVersion`.
    pub version: (i32, i32),
}

/// What one compilation produced.
pub struct Output {
    pub cubin: Vec<u8>,
    /// The PTX (for `compute_<sm>`) NVRTC generated on the way, when asked for.
    pub ptx: Option<Vec<u8>>,
    /// NVRTC's log (warnings), trimmed.
    pub log: String,
}

/// Whether `dir` holds the fp16/bf16 headers the kernels include.
fn has_cuda_headers(dir: &Path) -> bool {
    dir.join("cuda_fp16.h").is_file() && dir.join("cuda_bf16.h").is_file()
}

/// The CUDA include directory for the NVRTC library `lib`: the CUDA 12 runtime wheel next to the
/// nvrtc wheel (`nvidia/cuda_nvrtc/lib/libnvrtc.so.12` → `nvidia/cuda_runtime/include`), the
/// library's own `../include` (a toolkit's `lib64`, `targets/*/lib`, the CUDA 13 `nvidia/cu13`
/// wheel), then `$CUDA_HOME/include` and `/usr/local/cuda/include`.
pub fn include_dir_for(lib: &Path) -> Option<PathBuf> {
    let lib_dir = lib.parent()?;
    let mut candidates = Vec::new();
    if let Some(nvidia) = lib_dir.parent().and_then(Path::parent) {
        candidates.push(nvidia.join("cuda_runtime/include"));
    }
    if let Some(up) = lib_dir.parent() {
        candidates.push(up.join("include"));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME").filter(|h| !h.is_empty()) {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|d| has_cuda_headers(d))
}

/// The CUDA 12 pip wheels under a site-packages directory: `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`
/// (nvidia-cuda-nvrtc-cu12) next to `nvidia/cuda_runtime/include` (nvidia-cuda-runtime-cu12).
pub fn pip_nvrtc(site_packages: &Path) -> Option<PathBuf> {
    let lib = site_packages.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
    (lib.is_file() && has_cuda_headers(&site_packages.join("nvidia/cuda_runtime/include"))).then_some(lib)
}

/// The machine target of the cubin for `sm`: `sm_90a` for sm_90 (Hopper's arch-specific
/// instructions, wgmma, which `q4_gemm.cu` uses; such a cubin runs on every sm_90 device), else
/// `sm_<sm>`. tm-cuda's run-time NVRTC (`Output::arch_option`) follows the same rule.
pub fn cubin_arch(sm: u32) -> String {
    if sm == 90 {
        "sm_90a".to_string()
    } else {
        format!("sm_{sm}")
    }
}

/// The options for `sm`'s cubin ([`cubin_arch`]), as tm-cuda's NVRTC fallback passes them (NVRTC
/// optimises at -O3 by default; the nvcc build uses no fast-math either).
pub fn options(sm: u32, include: &Path, lineinfo: bool) -> Vec<String> {
    options_for(&cubin_arch(sm), include, lineinfo)
}

/// [`options`] for the machine target `arch` (`sm_87`, `sm_90`, `sm_90a`, ...).
pub fn options_for(arch: &str, include: &Path, lineinfo: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "-default-device".to_string(),
        format!("-I{}", include.display()),
    ];
    if lineinfo {
        o.push("-lineinfo".to_string());
    }
    o
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).with_context(|| format!("{what} contains a NUL byte"))
}

/// Reads a size-then-bytes NVRTC result, without the trailing NUL of text results.
fn fetch(
    prog: Prog,
    what: &str,
    size_fn: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    get_fn: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; `size` is a valid out pointer.
    let rc = unsafe { size_fn(prog, &mut size) };
    if rc != 0 {
        bail!("nvrtcGet{what}Size failed ({rc})");
    }
    let mut buf = vec![0u8; size];
    if size > 0 {
        // SAFETY: `buf` holds the `size` bytes NVRTC writes.
        let rc = unsafe { get_fn(prog, buf.as_mut_ptr().cast()) };
        if rc != 0 {
            bail!("nvrtcGet{what} failed ({rc})");
        }
    }
    Ok(buf)
}

fn text(mut bytes: Vec<u8>) -> Vec<u8> {
    while bytes.last() == Some(&0) {
        bytes.pop();
    }
    bytes
}

impl Nvrtc {
    /// Loads the library at `lib_path` and finds its include directory.
    pub fn load(lib_path: &Path) -> Result<Self> {
        let include = include_dir_for(lib_path).with_context(|| {
            format!(
                "no CUDA include directory with cuda_fp16.h and cuda_bf16.h for {} (install the \
                 matching nvidia-cuda-runtime-cu12 wheel next to it, or set $CUDA_HOME)",
                lib_path.display()
            )
        })?;
        // SAFETY: loading NVRTC runs no initialisers beyond the C++ runtime's.
        let lib = unsafe { libloading::Library::new(lib_path) }
            .with_context(|| format!("loading NVRTC from {}", lib_path.display()))?;
        // SAFETY: each symbol is declared with its signature from nvrtc.h; `lib` is kept alive in
        // the returned value for as long as the pointers are used.
        let api = unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name).with_context(|| format!("{} in {}", $name, lib_path.display()))?
                };
            }
            Api {
                version: sym!("nvrtcVersion"),
                create: sym!("nvrtcCreateProgram"),
                compile: sym!("nvrtcCompileProgram"),
                log_size: sym!("nvrtcGetProgramLogSize"),
                log: sym!("nvrtcGetProgramLog"),
                cubin_size: sym!("nvrtcGetCUBINSize"),
                cubin: sym!("nvrtcGetCUBIN"),
                ptx_size: sym!("nvrtcGetPTXSize"),
                ptx: sym!("nvrtcGetPTX"),
                destroy: sym!("nvrtcDestroyProgram"),
            }
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out pointers.
        let rc = unsafe { (api.version)(&mut major, &mut minor) };
        if rc != 0 {
            bail!("nvrtcVersion failed ({rc}) in {}", lib_path.display());
        }
        Ok(Nvrtc { api, _lib: lib, lib_path: lib_path.to_path_buf(), include, version: (major, minor) })
    }

    /// Compiles `source` (named `name`, including `headers` given as (name, text)) with `options`;
    /// returns the cubin, and the PTX too with `want_ptx`. On failure the error holds NVRTC's log.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(String, String)],
        options: &[String],
        want_ptx: bool,
    ) -> Result<Output> {
        let src = cstring(source, name)?;
        let cname = cstring(name, "the module name")?;
        let texts = headers.iter().map(|(n, t)| cstring(t, n)).collect::<Result<Vec<_>>>()?;
        let names = headers.iter().map(|(n, _)| cstring(n, n)).collect::<Result<Vec<_>>>()?;
        let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
        let opts = options.iter().map(|o| cstring(o, "an option")).collect::<Result<Vec<_>>>()?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string until the program is destroyed
        // below; the counts match the arrays.
        let rc = unsafe {
            (self.api.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                headers.len() as c_int,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        if rc != 0 {
            bail!("nvrtcCreateProgram failed ({rc}) for {name}");
        }
        let result = (|| {
            // SAFETY: `prog` is live; the options are live NUL-terminated strings.
            let rc = unsafe { (self.api.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
            let log = fetch(prog, "ProgramLog", self.api.log_size, self.api.log).map(text).unwrap_or_default();
            let log = String::from_utf8_lossy(&log).trim().to_string();
            if rc != 0 {
                bail!("NVRTC failed ({rc}) on {name} with options {options:?}:\n{log}");
            }
            let cubin = fetch(prog, "CUBIN", self.api.cubin_size, self.api.cubin)?;
            if cubin.is_empty() {
                bail!("NVRTC produced an empty cubin for {name}");
            }
            let ptx = if want_ptx { Some(text(fetch(prog, "PTX", self.api.ptx_size, self.api.ptx)?)) } else { None };
            Ok(Output { cubin, ptx, log })
        })();
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { (self.api.destroy)(&mut prog) };
        result
    }
}

/// Reads the `.cu` module `module` and every `.cuh` header in `src_dir`, as tm-kernels embeds them.
pub fn read_sources(src_dir: &Path, module: &str) -> Result<(String, Vec<(String, String)>)> {
    let path = src_dir.join(format!("{module}.cu"));
    let source = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut headers = Vec::new();
    for entry in fs::read_dir(src_dir).with_context(|| format!("reading {}", src_dir.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if name.ends_with(".cuh") && path.is_file() {
            let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            headers.push((name.to_string(), text));
        }
    }
    headers.sort();
    Ok((source, headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_list() {
        let o = options(87, Path::new("/w/nvidia/cuda_runtime/include"), false);
        assert_eq!(
            o,
            ["--gpu-architecture=sm_87", "-std=c++17", "-default-device", "-I/w/nvidia/cuda_runtime/include"]
        );
        assert_eq!(options(90, Path::new("/i"), true).last().map(String::as_str), Some("-lineinfo"));
        // sm_90 cubins are built for sm_90a (wgmma); the portable PTX asks for plain sm_90.
        assert_eq!(options(90, Path::new("/i"), false)[0], "--gpu-architecture=sm_90a");
        assert_eq!(options_for("sm_90", Path::new("/i"), false)[0], "--gpu-architecture=sm_90");
        assert_eq!(cubin_arch(89), "sm_89");
    }

    #[test]
    fn wheel_layout_detection() {
        let site = std::env::temp_dir().join(format!("tm-xtask-nvrtc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&site);
        let lib = site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        fs::create_dir_all(lib.parent().unwrap()).unwrap();
        fs::write(&lib, "").unwrap();
        assert_eq!(pip_nvrtc(&site), None, "no runtime wheel yet");
        let include = site.join("nvidia/cuda_runtime/include");
        fs::create_dir_all(&include).unwrap();
        for h in ["cuda_fp16.h", "cuda_bf16.h"] {
            fs::write(include.join(h), "").unwrap();
        }
        assert_eq!(pip_nvrtc(&site), Some(lib.clone()));
        assert_eq!(include_dir_for(&lib), Some(include));
        // A toolkit layout: lib64/libnvrtc.so next to include/.
        let kit = site.join("cuda");
        fs::create_dir_all(kit.join("lib64")).unwrap();
        fs::create_dir_all(kit.join("include")).unwrap();
        for h in ["cuda_fp16.h", "cuda_bf16.h"] {
            fs::write(kit.join("include").join(h), "").unwrap();
        }
        assert_eq!(include_dir_for(&kit.join("lib64/libnvrtc.so")), Some(kit.join("include")));
        let _ = fs::remove_dir_all(&site);
    }

    #[test]
    fn reads_module_and_headers() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tm-kernels/cuda");
        let (src, headers) = read_sources(&dir, "elementwise").unwrap();
        assert!(src.contains("#include \"common.cuh\""));
        assert!(headers.iter().any(|(n, _)| n == "common.cuh"));
        assert!(read_sources(&dir, "no_such_module").is_err());
    }
}
