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
//! PDL is used when the device's compute capability major is at least 9, unless the environment
//! variable `TM_PDL` is `0` (also `off`, `false`), read once per process.
//!
//! Most kernels do not trigger their dependents early (`TM_PDL_EARLY_TRIGGER`, common.cuh, is 0):
//! a grid's successor is scheduled as its blocks exit, which hides the launch of each kernel
//! behind the end of the one before. Triggering at the top of every kernel was slower: the
//! successors' blocks, and theirs in turn, became resident early and sat in `griddepcontrol.wait`
//! on SM slots the running kernels needed. Measured on an H200 (same machine, batch-1 decode,
//! replay of a step on the GPU): bf16 4.61 ms without PDL, 4.75 ms with the early trigger,
//! 4.55 ms with the late one; AWQ 2.75 / 2.76 / 2.69 ms; tp=2 3.36 / 3.46 / 3.28 ms.
//!
//! The exceptions are kernels after which the next one has work that depends on nothing (the int4
//! GEMVs' first weight loads): the norms, RoPE with the KV write and decode attention trigger
//! first thing (their decode grids are small, so the GEMV's blocks take SMs they leave free), and
//! the int4 GEMVs once their main loop is done. AWQ batch-1 replay 2448 -> 2303 us, bf16 and
//! c256 unchanged (H200, same call; harness: scripts/gpu/q4_decode_chain.cu).

use std::sync::{Once, OnceLock};

use cudarc::driver::{sys, DriverError};

/// The environment variable that turns PDL off (`TM_PDL=0`).
pub const ENV: &str = "TM_PDL";

/// The first compute capability major with PDL.
const MIN_MAJOR: u32 = 9;

/// Whether `TM_PDL` allows PDL (unset or anything but `0`, `off`, `false`: yes); read once.
fn env_allows() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| crate::switches::env_on(ENV))
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
        return format!("off ({ENV}=0)");
    }
    let without = modules_without();
    let except = if without.is_empty() {
        String::new()
    } else {
        format!("; kernels of {} launched without it until they all wait", without.join(", "))
    };
    format!("on ({sm}; {ENV}=0 turns it off){except}")
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
        for off in ["0", "off", "OFF", "false", " 0 "] {
            assert!(!crate::switches::on(off), "{off:?}");
        }
        for on in ["1", "on", " ON ", "true", "", "yes"] {
            assert!(crate::switches::on(on), "{on:?}");
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
