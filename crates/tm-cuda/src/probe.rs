//! Finding the CUDA driver and describing the devices, without ever panicking.

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use cudarc::driver::{result, sys, DriverError};

/// Why CUDA cannot be used on this machine, or which driver call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No CUDA driver library (`libcuda.so*`) could be loaded.
    #[error("libcuda.so not found")]
    LibraryNotFound,
    /// The library loaded but `cuInit` failed.
    #[error("cuInit failed with {name} (code {code})")]
    InitFailed {
        /// The raw `CUresult`.
        code: u32,
        /// Its symbolic name, e.g. `CUDA_ERROR_INSUFFICIENT_DRIVER`.
        name: String,
    },
    /// The driver works but shows no device (none installed, or `CUDA_VISIBLE_DEVICES` hides them).
    #[error("no CUDA devices")]
    NoDevices,
    /// A driver call after `cuInit` failed.
    #[error("{call} failed{} with {name} (code {code})", device_suffix(*.ordinal))]
    Driver {
        /// The driver function, e.g. `cuMemGetInfo`.
        call: &'static str,
        /// The device ordinal, when the call was about one device.
        ordinal: Option<usize>,
        /// The raw `CUresult`.
        code: u32,
        /// Its symbolic name.
        name: String,
    },
}

fn device_suffix(ordinal: Option<usize>) -> String {
    ordinal.map(|o| format!(" on device {o}")).unwrap_or_default()
}

impl ProbeError {
    fn driver(call: &'static str, ordinal: Option<usize>, e: DriverError) -> Self {
        ProbeError::Driver { call, ordinal, code: e.0 as u32, name: format!("{:?}", e.0) }
    }
}

/// One CUDA device as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Driver ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total memory in bytes (`cuDeviceTotalMem`).
    pub total_memory: u64,
    /// Free memory in bytes from `cuMemGetInfo`. On integrated devices this is not what can be
    /// allocated (the memory is shared with the host); [`crate::CudaDevice`] uses host
    /// `MemAvailable` there instead.
    pub free_memory: u64,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    /// Whether the GPU shares its memory with the host (`CU_DEVICE_ATTRIBUTE_INTEGRATED`; Jetson).
    pub integrated: bool,
    /// Number of streaming multiprocessors.
    pub multiprocessors: u32,
}

/// Loads the driver library and runs `cuInit` once per process; later calls return the same answer.
///
/// cudarc panics when a driver function is called and the library is missing, so every entry point
/// of this crate goes through here first.
pub(crate) fn init_driver() -> Result<(), ProbeError> {
    static INIT: OnceLock<Result<(), ProbeError>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the candidate library names; calls no driver function.
        if !unsafe { sys::is_culib_present() } {
            return Err(ProbeError::LibraryNotFound);
        }
        match result::init() {
            Ok(()) => Ok(()),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(ProbeError::NoDevices),
            Err(e) => Err(ProbeError::InitFailed { code: e.0 as u32, name: format!("{:?}", e.0) }),
        }
    })
    .clone()
}

/// The CUDA driver version as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(u32, u32), ProbeError> {
    init_driver()?;
    let mut v: c_int = 0;
    // SAFETY: the library is loaded and initialised; `v` is a valid out pointer.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(|e| ProbeError::driver("cuDriverGetVersion", None, e))?;
    let v = v.max(0) as u32;
    Ok((v / 1000, (v % 1000) / 10))
}

/// Number of visible devices; [`ProbeError::NoDevices`] when zero.
pub(crate) fn device_count() -> Result<usize, ProbeError> {
    init_driver()?;
    let n = result::device::get_count().map_err(|e| ProbeError::driver("cuDeviceGetCount", None, e))?;
    if n <= 0 {
        return Err(ProbeError::NoDevices);
    }
    Ok(n as usize)
}

/// The driver handle of device `ordinal`.
pub(crate) fn device_handle(ordinal: usize) -> Result<sys::CUdevice, ProbeError> {
    let o = c_int::try_from(ordinal).map_err(|_| ProbeError::Driver {
        call: "cuDeviceGet",
        ordinal: Some(ordinal),
        code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as u32,
        name: "CUDA_ERROR_INVALID_DEVICE".into(),
    })?;
    result::device::get(o).map_err(|e| ProbeError::driver("cuDeviceGet", Some(ordinal), e))
}

/// Finds the driver and describes every visible device.
///
/// Returns an error (never panics) when the driver library is missing, `cuInit` fails, or there is
/// no device. Retains each device's primary context briefly to read free memory.
pub fn probe() -> Result<Vec<CudaDeviceInfo>, ProbeError> {
    let n = device_count()?;
    (0..n).map(device_info).collect()
}

/// Describes device `ordinal`.
pub(crate) fn device_info(ordinal: usize) -> Result<CudaDeviceInfo, ProbeError> {
    init_driver()?;
    let dev = device_handle(ordinal)?;
    let attr = |a: sys::CUdevice_attribute, call: &'static str| -> Result<i32, ProbeError> {
        // SAFETY: `dev` came from cuDeviceGet.
        unsafe { result::device::get_attribute(dev, a) }.map_err(|e| ProbeError::driver(call, Some(ordinal), e))
    };
    use sys::CUdevice_attribute as A;
    let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute(cc major)")?;
    let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute(cc minor)")?;
    let integrated = attr(A::CU_DEVICE_ATTRIBUTE_INTEGRATED, "cuDeviceGetAttribute(integrated)")?;
    let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "cuDeviceGetAttribute(multiprocessors)")?;
    // SAFETY: `dev` came from cuDeviceGet.
    let total = unsafe { result::device::total_mem(dev) }
        .map_err(|e| ProbeError::driver("cuDeviceTotalMem", Some(ordinal), e))?;
    let (free, _) = mem_get_info(ordinal)?;
    Ok(CudaDeviceInfo {
        ordinal,
        name: device_name(dev, ordinal)?,
        total_memory: total as u64,
        free_memory: free,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        integrated: integrated != 0,
        multiprocessors: sms.max(0) as u32,
    })
}

fn device_name(dev: sys::CUdevice, ordinal: usize) -> Result<String, ProbeError> {
    let mut buf = [0u8; 256];
    // SAFETY: `dev` came from cuDeviceGet; the driver writes at most `len` bytes including the NUL.
    unsafe { sys::cuDeviceGetName(buf.as_mut_ptr() as *mut c_char, buf.len() as c_int, dev) }
        .result()
        .map_err(|e| ProbeError::driver("cuDeviceGetName", Some(ordinal), e))?;
    Ok(CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned()))
}

/// (free, total) bytes of device `ordinal` from `cuMemGetInfo`, through its primary context.
///
/// The calling thread's current context is restored afterwards.
pub(crate) fn mem_get_info(ordinal: usize) -> Result<(u64, u64), ProbeError> {
    init_driver()?;
    let dev = device_handle(ordinal)?;
    let err = |call: &'static str| move |e: DriverError| ProbeError::driver(call, Some(ordinal), e);
    let previous = result::ctx::get_current().map_err(err("cuCtxGetCurrent"))?;
    // SAFETY: `dev` came from cuDeviceGet; the retained context is released below on every path.
    let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(err("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: `ctx` is a live primary context.
    let info = unsafe { result::ctx::set_current(ctx) }
        .map_err(err("cuCtxSetCurrent"))
        .and_then(|()| result::mem_get_info().map_err(err("cuMemGetInfo")));
    // SAFETY: restores the caller's context (or none) and drops our reference on the primary context.
    unsafe {
        let _ = result::ctx::set_current(previous.unwrap_or(std::ptr::null_mut()));
        let _ = result::primary_ctx::release(dev);
    }
    info.map(|(free, total)| (free as u64, total as u64))
}

/// Which devices can read and write each other's memory directly: `m[i][j]` is
/// `cuDeviceCanAccessPeer(i, j)`, and `m[i][i]` is true.
///
/// `n` is the number of devices to check (usually `probe()?.len()`); an `n` larger than the number
/// of visible devices is an error.
pub fn peer_access_matrix(n: usize) -> Result<Vec<Vec<bool>>, ProbeError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let count = device_count()?;
    if n > count {
        return Err(ProbeError::Driver {
            call: "cuDeviceGet",
            ordinal: Some(n - 1),
            code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as u32,
            name: "CUDA_ERROR_INVALID_DEVICE".into(),
        });
    }
    let devs = (0..n).map(device_handle).collect::<Result<Vec<_>, _>>()?;
    let mut m = vec![vec![false; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i == j {
                m[i][j] = true;
                continue;
            }
            let mut can: c_int = 0;
            // SAFETY: both handles came from cuDeviceGet; `can` is a valid out pointer.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, devs[i], devs[j]) }
                .result()
                .map_err(|e| ProbeError::driver("cuDeviceCanAccessPeer", Some(i), e))?;
            m[i][j] = can != 0;
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_explains() {
        match probe() {
            Ok(devices) => {
                assert!(!devices.is_empty());
                for d in &devices {
                    assert!(d.total_memory > 0 && d.compute_capability.0 > 0, "{d:?}");
                }
                let m = peer_access_matrix(devices.len()).expect("peer matrix");
                assert_eq!(m.len(), devices.len());
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.is_empty());
                // Without a GPU every entry point fails the same way, without panicking.
                if e == ProbeError::LibraryNotFound {
                    assert_eq!(driver_version(), Err(ProbeError::LibraryNotFound));
                }
                assert!(peer_access_matrix(2).is_err());
                assert_eq!(peer_access_matrix(0), Ok(Vec::new()));
            }
        }
    }

    #[test]
    fn no_driver_here_means_library_not_found() {
        // The build machine has no NVIDIA driver; skip where one is installed.
        // SAFETY: only dlopens candidate names.
        if unsafe { sys::is_culib_present() } {
            return;
        }
        assert_eq!(probe(), Err(ProbeError::LibraryNotFound));
        assert_eq!(ProbeError::LibraryNotFound.to_string(), "libcuda.so not found");
    }

    #[test]
    fn driver_error_names_the_call_and_device() {
        let e = ProbeError::Driver {
            call: "cuMemGetInfo",
            ordinal: Some(1),
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        };
        assert_eq!(e.to_string(), "cuMemGetInfo failed on device 1 with CUDA_ERROR_OUT_OF_MEMORY (code 2)");
    }
}
