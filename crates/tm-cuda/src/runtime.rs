//! One GPU's driver state: the context, the stream every kernel runs on, and the kernel modules.
//!
//! Kernels come from `tm-kernels`: the cubin embedded for this device's arch (or the nearest
//! lower minor of the same major), else the embedded PTX JIT-compiled by the driver, else the
//! sources compiled with NVRTC (cached on disk). Kernels are looked up by name across modules.
//! On sm_90+ they are launched with programmatic dependent launch ([`crate::pdl`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use tm_core::{Error, Result};
use tm_kernels::cuda::{self as kernels, Target};

use crate::probe::{device_info, init_driver, CudaDeviceInfo};
use crate::record_profile::{self, RecordProfile};

/// One argument of a kernel launch, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg {
    /// A device pointer (`T*` in the kernel).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `unsigned`.
    U32(u32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

/// Grid or block dimensions.
pub type Dim3 = (u32, u32, u32);

/// What [`Gpu::launch`] (and the cuBLASLt wrapper) do with a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchMode {
    /// Launch it.
    Eager,
    /// Do not launch; fold the launch (kernel, dimensions, arguments) into the step's signature.
    /// Two steps with the same signature launch the same kernels on the same memory, so a CUDA
    /// graph captured from one replays the other.
    Record,
    /// Launch into a stream capture (the stream records instead of running).
    Capture,
}

/// FNV-1a over 64-bit words.
fn fnv(hash: u64, word: u64) -> u64 {
    let mut h = hash;
    for b in word.to_le_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Turns a cudarc driver error into tm's error, naming the call.
pub fn driver_err(call: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Backend { backend: "cuda".into(), message: format!("{call}: {:?}", e.0) }
}

/// One loaded kernel module.
#[derive(Debug)]
struct Module {
    module: Arc<CudaModule>,
    /// Whether its kernel names are known (listed in [`Gpu`]'s `index`).
    listed: bool,
    /// Whether its kernels are launched with programmatic dependent launch.
    pdl: bool,
}

/// The driver state of one GPU.
#[derive(Debug)]
pub struct Gpu {
    info: CudaDeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The loaded kernel modules.
    modules: Vec<Module>,
    /// Kernel name → its module in `modules`, read from the images, so that a lookup asks the
    /// driver only for a function the module has (a failed `cuModuleGetFunction` is an API error
    /// that compute-sanitizer reports).
    index: HashMap<String, usize>,
    /// Kernels looked up so far, with whether they are launched with PDL.
    functions: Mutex<HashMap<String, (CudaFunction, bool)>>,
    /// Whether kernels that wait for their predecessors are launched with PDL on this device.
    pdl: bool,
    kernel_source: String,
    /// The launch mode and what the step being recorded did.
    recorder: Mutex<Recorder>,
    /// Host time per kernel name while steps are recorded (`TM_RECORD_PROFILE=1`).
    profile: Option<Mutex<RecordProfile>>,
}

/// The launch mode, and for the step recorded since the last switch to [`LaunchMode::Record`]: its
/// signature, whether it did work that cannot be captured into a graph
/// ([`Gpu::mark_uncapturable`]), and whether it launched a collective ([`Gpu::mark_collective`]).
#[derive(Debug)]
struct Recorder {
    mode: LaunchMode,
    signature: u64,
    uncapturable: bool,
    collectives: bool,
}

impl Drop for Gpu {
    /// Logs the record profile, if one was asked for.
    fn drop(&mut self) {
        if let Some(p) = self.profile.as_ref().and_then(|p| p.lock().ok()) {
            for line in p.report() {
                tracing::info!("{line}");
            }
        }
    }
}

impl Gpu {
    /// Opens device `ordinal`: creates its context and stream and loads every kernel module.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        init_driver().map_err(|e| Error::Backend { backend: "cuda".into(), message: e.to_string() })?;
        let info =
            device_info(ordinal).map_err(|e| Error::Backend { backend: "cuda".into(), message: e.to_string() })?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuCtxCreate"))?;
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let sm = info.compute_capability.0 * 10 + info.compute_capability.1;
        let pdl = crate::pdl::enabled(info.compute_capability);
        crate::pdl::log_choice(ordinal, info.compute_capability);
        let mut modules = Vec::new();
        let mut index = HashMap::new();
        let mut sources = Vec::new();
        for src in kernels::modules() {
            let module = src.name.trim_end_matches(".cu");
            let (image, how, entries, current) = pick_image(module, sm)?;
            let loaded = ctx.load_module(image).map_err(driver_err("cuModuleLoadData"))?;
            sources.push(source_label(module, &how, pdl, current));
            for name in &entries {
                index.insert(name.clone(), modules.len());
            }
            modules.push(Module {
                module: loaded,
                listed: !entries.is_empty(),
                // Kernels built from other sources may not wait for their predecessors.
                pdl: pdl && current && tm_kernels::pdl::module_waits(module),
            });
        }
        let kernel_source = if sources.is_empty() { "no kernel modules".to_string() } else { sources.join(", ") };
        tracing::debug!("cuda device {ordinal}: kernels from {kernel_source}");
        Ok(Arc::new(Gpu {
            info,
            ctx,
            stream,
            modules,
            index,
            functions: Mutex::new(HashMap::new()),
            kernel_source,
            pdl,
            recorder: Mutex::new(Recorder {
                mode: LaunchMode::Eager,
                signature: FNV_OFFSET,
                uncapturable: false,
                collectives: false,
            }),
            profile: record_profile::enabled().then(|| Mutex::new(RecordProfile::default())),
        }))
    }

    /// What the driver said about the device.
    pub fn info(&self) -> &CudaDeviceInfo {
        &self.info
    }

    /// The arch number, e.g. 90 for compute capability 9.0.
    pub fn sm(&self) -> u32 {
        self.info.compute_capability.0 * 10 + self.info.compute_capability.1
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of tm's work on this device runs on, in order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Where each kernel module came from (cubin, PTX or NVRTC), for `check-env` and logs.
    pub fn kernel_source(&self) -> &str {
        &self.kernel_source
    }

    /// Whether kernels are launched with programmatic dependent launch on this device (sm_90+,
    /// unless `TM_PDL=0`); the kernels of modules that do not wait for their predecessors never are
    /// (see [`crate::pdl`]).
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
    }

    /// Waits for all work queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("cuStreamSynchronize"))
    }

    /// The current launch mode.
    pub fn mode(&self) -> LaunchMode {
        self.recorder.lock().map_or(LaunchMode::Eager, |r| r.mode)
    }

    /// Switches the launch mode; entering [`LaunchMode::Record`] starts a new signature.
    pub fn set_mode(&self, mode: LaunchMode) {
        if let Ok(mut r) = self.recorder.lock() {
            if mode == LaunchMode::Record {
                r.signature = FNV_OFFSET;
                r.uncapturable = false;
                r.collectives = false;
            }
            if let Some(mut p) = self.profile.as_ref().and_then(|p| p.lock().ok()) {
                match (r.mode, mode) {
                    (LaunchMode::Record, LaunchMode::Record) => {}
                    (_, LaunchMode::Record) => p.start(),
                    (LaunchMode::Record, _) => p.end(),
                    _ => {}
                }
            }
            r.mode = mode;
        }
    }

    /// The signature recorded since the last switch to [`LaunchMode::Record`].
    pub fn signature(&self) -> u64 {
        self.recorder.lock().map_or(0, |r| r.signature)
    }

    /// Marks the step being recorded as one that must run eagerly (it does work a graph cannot
    /// hold, e.g. an NCCL collective): it is neither captured nor replayed.
    pub fn mark_uncapturable(&self) {
        if let Ok(mut r) = self.recorder.lock() {
            r.uncapturable = true;
        }
    }

    /// Marks the step being recorded as one that launches a collective kernel (a one-shot peer
    /// all-reduce): running it again on this rank alone would leave the other ranks behind.
    pub fn mark_collective(&self) {
        if let Ok(mut r) = self.recorder.lock() {
            if r.mode == LaunchMode::Record {
                r.collectives = true;
            }
        }
    }

    /// Whether the step recorded since the last switch to [`LaunchMode::Record`] was marked
    /// with [`Gpu::mark_collective`].
    pub fn collectives(&self) -> bool {
        self.recorder.lock().map_or(true, |r| r.collectives)
    }

    /// Whether the step recorded since the last switch to [`LaunchMode::Record`] was marked
    /// with [`Gpu::mark_uncapturable`].
    pub fn uncapturable(&self) -> bool {
        self.recorder.lock().map_or(true, |r| r.uncapturable)
    }

    /// Folds `words` into the signature (for work that is not a plain kernel launch, e.g. a
    /// cuBLASLt product).
    pub fn record(&self, words: &[u64]) {
        if let Ok(mut r) = self.recorder.lock() {
            r.signature = words.iter().fold(r.signature, |h, &w| fnv(h, w));
            if r.mode == LaunchMode::Record {
                self.profile_mark("(signed product: Gpu::record)");
            }
        }
    }

    /// Charges the host time since the previous launch of the step being recorded to `name`
    /// (with `TM_RECORD_PROFILE=1`).
    fn profile_mark(&self, name: &str) {
        if let Some(mut p) = self.profile.as_ref().and_then(|p| p.lock().ok()) {
            p.mark(name);
        }
    }

    /// Finds a kernel by name in any loaded module.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.lookup(name).map(|(f, _)| f)
    }

    /// Finds a kernel by name in any loaded module, with whether it is launched with PDL.
    fn lookup(&self, name: &str) -> Result<(CudaFunction, bool)> {
        let mut cache = self.functions.lock().map_err(|_| Error::invalid("cuda function cache poisoned"))?;
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        // The module that lists the kernel, else those whose names could not be read.
        let listed = self.index.get(name).map(|&i| &self.modules[i]);
        let unlisted = self.modules.iter().filter(|m| !m.listed);
        for m in listed.into_iter().chain(unlisted) {
            if let Ok(f) = m.module.load_function(name) {
                cache.insert(name.to_string(), (f.clone(), m.pdl));
                return Ok((f, m.pdl));
            }
        }
        Err(Error::Backend {
            backend: "cuda".into(),
            message: format!(
                "kernel `{name}` is not in the loaded modules ({}); rebuild the kernels with `{}`",
                self.kernel_source,
                kernels::BUILD_COMMAND
            ),
        })
    }

    /// Launches kernel `name` on the stream. Dynamic shared memory above 48 KiB is opted into.
    /// With [`Gpu::pdl`] (and a kernel whose module waits for its predecessors) the launch carries
    /// the programmatic-stream-serialization attribute; eager and captured launches alike.
    pub fn launch(&self, name: &str, grid: Dim3, block: Dim3, shared_mem: u32, args: &[KernelArg]) -> Result<()> {
        if self.mode() == LaunchMode::Record {
            let mut r = self.recorder.lock().map_err(|_| Error::invalid("cuda launch recorder poisoned"))?;
            let mut h = name.bytes().fold(r.signature, |h, b| fnv(h, b as u64));
            for w in [grid.0, grid.1, grid.2, block.0, block.1, block.2, shared_mem] {
                h = fnv(h, w as u64);
            }
            for a in args {
                h = fnv(
                    h,
                    match *a {
                        KernelArg::Ptr(p) => p,
                        KernelArg::I32(v) => v as u32 as u64,
                        KernelArg::U32(v) => v as u64,
                        KernelArg::I64(v) => v as u64,
                        KernelArg::F32(v) => v.to_bits() as u64,
                    },
                );
            }
            r.signature = h;
            self.profile_mark(name);
            return Ok(());
        }
        let (f, pdl) = self.lookup(name)?;
        if shared_mem > 48 * 1024 {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_mem as i32,
            )
            .map_err(driver_err("cuFuncSetAttribute"))?;
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // Each argument lives in `values` while the launch reads it (no allocation per launch).
        const MAX_ARGS: usize = 32;
        if args.len() > MAX_ARGS {
            return Err(Error::invalid(format!("{name}: {} kernel arguments (at most {MAX_ARGS})", args.len())));
        }
        let mut values = [0u64; MAX_ARGS];
        for (v, a) in values.iter_mut().zip(args) {
            *v = match *a {
                KernelArg::Ptr(p) => p,
                KernelArg::I32(v) => v as u32 as u64,
                KernelArg::U32(v) => v as u64,
                KernelArg::I64(v) => v as u64,
                KernelArg::F32(v) => v.to_bits() as u64,
            };
        }
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, v) in params.iter_mut().zip(values.iter_mut()) {
            *p = v as *mut u64 as *mut c_void;
        }
        let params = &mut params[..args.len()];
        self.bind()?;
        // SAFETY: every parameter points at a little-endian u64 holding the value in its low
        // bytes, which is how 4- and 8-byte kernel parameters are read; the kernel's signature is
        // the launcher's contract (see tm-kernels/cuda/ABI.md). A PDL launch needs the kernel to
        // wait for its predecessor, which `pdl` says it does.
        let (func, stream) = (f.cu_function(), self.stream.cu_stream());
        unsafe {
            if pdl {
                crate::pdl::launch(func, grid, block, shared_mem, stream, params)
            } else {
                result::launch_kernel(func, grid, block, shared_mem, stream, params)
            }
        }
        .map_err(|e| Error::Backend { backend: "cuda".into(), message: format!("launching {name}: {:?}", e.0) })
    }
}

/// Chooses the image for `module` on arch `sm`: an exact cubin, else a cubin of the same major and
/// a lower minor, else PTX of an arch `<= sm`, else NVRTC. Also says whether the image was built
/// from the embedded sources (what [`tm_kernels::pdl`] checked).
///
/// `TM_KERNELS_DIR` set at run time names a folder of `{module}.sm_{NN}.cubin` files (what
/// `cargo xtask build-kernels --out DIR` writes) that take precedence over the embedded ones: the
/// GPU test bundle carries its kernels once this way instead of inside every binary. They count
/// as built from the embedded sources when the folder's `manifest.txt` says so.
fn pick_image(module: &str, sm: u32) -> Result<(Ptx, String, Vec<String>, bool)> {
    if let Some(dir) = std::env::var_os("TM_KERNELS_DIR") {
        let dir = std::path::Path::new(&dir);
        let path = dir.join(format!("{module}.sm_{sm}.cubin"));
        if let Ok(bytes) = std::fs::read(&path) {
            let entries = kernels::entry_points(&bytes);
            let current = manifest_matches(dir);
            if !current {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "the cubins in {} were not built from this binary's kernel sources (their manifest.txt \
                         says other sources, or is missing): they are launched without programmatic dependent \
                         launch",
                        dir.display()
                    )
                });
            }
            return Ok((Ptx::from_binary(bytes), format!("cubin {}", path.display()), entries, current));
        }
    }
    let mine = || kernels::artefacts().iter().filter(move |a| a.module == module);
    let cubin = mine()
        .filter_map(|a| match a.target {
            Target::Cubin { sm: s } if s / 10 == sm / 10 && s <= sm => Some((s, a.bytes)),
            _ => None,
        })
        .max_by_key(|(s, _)| *s);
    if let Some((s, bytes)) = cubin {
        let entries = kernels::entry_points(bytes);
        return Ok((Ptx::from_binary(bytes.to_vec()), format!("cubin sm_{s}"), entries, true));
    }
    let ptx = mine()
        .filter_map(|a| match a.target {
            Target::Ptx { sm: s } if s <= sm => Some((s, a.bytes)),
            _ => None,
        })
        .max_by_key(|(s, _)| *s);
    if let Some((s, bytes)) = ptx {
        let text = String::from_utf8_lossy(bytes).into_owned();
        return Ok((Ptx::from_src(text), format!("ptx compute_{s}"), kernels::entry_points(bytes), true));
    }
    let image = crate::nvrtc::compile_module(module, sm).map_err(|e| Error::Backend {
        backend: "cuda".into(),
        message: format!(
            "no kernels for sm_{sm}: embedded cubins are for {:?}, and NVRTC could not compile `{module}` ({e}); \
             build them with `{}`",
            kernels::embedded_arches(),
            kernels::BUILD_COMMAND
        ),
    })?;
    Ok((image, "nvrtc".to_string(), Vec::new(), true))
}

/// How [`Gpu::kernel_source`] names one module's image: `module (how)`, and where the device
/// would launch with PDL but the image was not built from this binary's sources, says that its
/// kernels lose it (so that `q4_gemv_bench`'s header and the logs show why figures moved).
fn source_label(module: &str, how: &str, pdl: bool, current: bool) -> String {
    let stale = if pdl && !current { "; not built from this binary's sources: no PDL" } else { "" };
    format!("{module} ({how}{stale})")
}

/// Whether `dir/manifest.txt` (written by `cargo xtask build-kernels`) records the sources
/// embedded in this binary (its `sources <sha256>` line).
fn manifest_matches(dir: &std::path::Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join("manifest.txt")) else { return false };
    text.lines().filter_map(|l| l.strip_prefix("sources ")).any(|d| d.trim() == kernels::source_digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_label_says_when_pdl_is_lost() {
        let stale = source_label("q4_gemv", "cubin k/q4_gemv.sm_90.cubin", true, false);
        assert!(stale.starts_with("q4_gemv (cubin k/q4_gemv.sm_90.cubin; "), "{stale}");
        assert!(stale.ends_with("no PDL)"), "{stale}");
        // current sources, or a device without PDL: nothing to say
        assert_eq!(source_label("gemv", "embedded cubin sm_90", true, true), "gemv (embedded cubin sm_90)");
        assert_eq!(source_label("gemv", "nvrtc", false, false), "gemv (nvrtc)");
    }

    #[test]
    fn manifest_must_name_the_embedded_sources() {
        let dir = std::env::temp_dir().join(format!("tm-manifest-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        assert!(!manifest_matches(&dir), "no manifest");
        let write = |digest: &str| {
            std::fs::write(dir.join("manifest.txt"), format!("# comment\nsources {digest}\narches sm_90\n"))
                .expect("manifest")
        };
        write(&"0".repeat(64));
        assert!(!manifest_matches(&dir), "other sources");
        write(kernels::source_digest());
        assert!(manifest_matches(&dir));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
