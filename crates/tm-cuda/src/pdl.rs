//! Programmatic dependent launch (PDL): whether tm launches its kernels with it, and the launch.
//!
//! On compute capability 9.0 and newer a kernel launched with the programmatic-stream-serialization
//! attribute may start its blocks while the kernel before it on the stream is still running (once
//! every block of that one has called `griddepcontrol.launch_dependents` or exited); it waits with
//! `griddepcontrol.wait` before touching that kernel's output. In a decode step of a few hundred
//! short kernels this hides most of the gap between kernels. Every tm kernel calls the wait (see
//! tm-kernels' ABI.md and [`tm_kernels::pdl`]); the kernels of a module that does not yet are
//! launched without the attribute, and so are cuBLASLt's and NCCL's (ordinary stream order).
//!
//! PDL is opt-in: it is used when the device's compute capability major is at least 9 and the
//! environment variable `TM_PDL` is `1` (also `on`, `true`), read once per process. Measured on an
//! H200 with every kernel waiting at its top, it made decode slower, not faster: batch-1 bf16
//! TPOT 5.00-5.03 ms against 4.82-4.89 ms without it, tp=2 3.93 against 3.78 ms; the int4 GEMV
//! variants that load their weights before the wait (`TM_Q4_GEMV_UNROLL=pf|pf8|pfw`) were slower
//! than the default ones too. Large batches did not move (c256 10.08k vs 10.07k tok/s).

use std::sync::{Once, OnceLock};

use cudarc::driver::{sys, DriverError};

/// The environment variable that turns PDL on (`TM_PDL=1`).
pub const ENV: &str = "TM_PDL";

/// The first compute capability major with PDL.
const MIN_MAJOR: u32 = 9;

/// Whether `TM_PDL` asks for PDL (`1`, `on`, `true`; unset or anything else: no); read once.
fn env_allows() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var(ENV).is_ok_and(|v| allows(&v)))
}

/// Whether the value of `TM_PDL` asks for PDL.
fn allows(value: &str) -> bool {
    matches!(value.trim().to_ascii_lowercase().as_str(), "1" | "on" | "true")
}

/// Whether tm launches kernels with PDL on a device of compute capability `cc` (major, minor).
pub fn enabled(cc: (u32, u32)) -> bool {
    cc.0 >= MIN_MAJOR && env_allows()
}

/// The tm kernel modules that are launched without PDL because some of their kernels do not
/// wait for their predecessors (see [`tm_kernels::pdl::module_waits`]).
pub fn modules_without() -> Vec<&'static str> {
    tm_kernels::cuda::modules()
        .iter()
        .map(|m| m.name.trim_end_matches(".cu"))
        .filter(|m| !tm_kernels::pdl::module_waits(m))
        .collect()
}

/// One line saying whether PDL is used on a device of compute capability `cc` and why.
pub fn describe(cc: (u32, u32)) -> String {
    let sm = format!("sm_{}{}", cc.0, cc.1);
    if cc.0 < MIN_MAJOR {
        return format!("off (needs sm_90 or newer; this is {sm})");
    }
    if !env_allows() {
        return format!("off ({ENV}=1 turns it on)");
    }
    let without = modules_without();
    let except = if without.is_empty() {
        String::new()
    } else {
        format!("; kernels of {} launched without it until they all wait", without.join(", "))
    };
    format!("on ({sm}; {ENV}=1){except}")
}

/// Logs the choice for a device, once per process (later devices log at debug level).
pub(crate) fn log_choice(ordinal: usize, cc: (u32, u32)) {
    static LOGGED: Once = Once::new();
    let mut first = false;
    LOGGED.call_once(|| first = true);
    let line = describe(cc);
    if first {
        tracing::info!("cuda device {ordinal}: programmatic dependent launch {line}");
    } else {
        tracing::debug!("cuda device {ordinal}: programmatic dependent launch {line}");
    }
}

/// Launches `f` with the programmatic-stream-serialization attribute.
///
/// # Safety
/// As `cuLaunchKernel`: `f` is a live function of the current context, `stream` a live stream of
/// it, and `params` points at one valid value per kernel parameter, in order.
pub(crate) unsafe fn launch(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem: u32,
    stream: sys::CUstream,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), DriverError> {
    // SAFETY: the attribute is plain data (an id and a union of C scalars); all-zero is valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: shared_mem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `config` and `attr` outlive the call; the rest is the caller's contract.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values() {
        for off in ["0", "off", "OFF", "false", " 0 ", "", "yes"] {
            assert!(!allows(off), "{off:?}");
        }
        for on in ["1", "on", " ON ", "true"] {
            assert!(allows(on), "{on:?}");
        }
    }

    #[test]
    fn only_sm90_and_newer() {
        assert!(!enabled((8, 9)));
        assert!(!enabled((8, 0)));
        assert!(describe((8, 7)).starts_with("off (needs sm_90"), "{}", describe((8, 7)));
        // On sm_90 it follows the environment of this test process.
        assert_eq!(enabled((9, 0)), env_allows());
        assert_eq!(describe((10, 0)).starts_with("on"), env_allows());
    }

    #[test]
    fn modules_without_pdl_are_known_modules() {
        let names: Vec<&str> = tm_kernels::cuda::modules().iter().map(|m| m.name.trim_end_matches(".cu")).collect();
        let without = modules_without();
        assert!(without.iter().all(|m| names.contains(m)), "{without:?}");
        // The simple modules always wait (they use the TM_KERNEL wrappers).
        assert!(!without.contains(&"elementwise"), "{without:?}");
    }
}
