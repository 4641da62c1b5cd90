//! Zero-copy weights for the unified memory variant: the GPU reads a tensor straight from the
//! checkpoint's file pages instead of from a copy.
//!
//! The loader hands `load_dense` a slice of its memory-mapped checkpoint, and drops that mapping
//! once loading ends, so the backend cannot keep using the loader's addresses. Instead
//! [`map_tensor`] finds which file and offset back the slice (`/proc/self/maps`), maps that range
//! of the same file again, read-only and shared (the *same* page-cache pages: nothing is copied),
//! pins it and maps it for the GPU (`cuMemHostRegister` with `READ_ONLY | DEVICEMAP`), and wraps
//! the device address in a [`Buffer`] whose allocator ([`MappedRegion`]) owns the mapping and the
//! registration until the weight is dropped. Each tensor gets its own mapping, so registrations
//! never overlap even where two tensors share a page.
//!
//! It is used only when the tensor's stored dtype is the one the kernels use (dense weights need
//! nothing beyond element alignment: `tm-kernels/cuda/ABI.md`; cuBLASLt is told each pointer's
//! alignment). Everything else, and every tensor for which this returns a reason instead, goes
//! through the bounded staging buffer into a device allocation. `TM_CUDA_ZERO_COPY=0` turns it off.

use std::ffi::c_void;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use tm_core::alloc::{AllocStats, AllocatorId, RawAllocation};
use tm_core::{Allocator, Buffer, Device, Error, Result};

use crate::runtime::Gpu;

/// Environment variable that turns zero-copy weights off (`0`) in the unified variant.
pub const ZERO_COPY_ENV: &str = "TM_CUDA_ZERO_COPY";

/// One line of `/proc/self/maps` that maps a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileMapping {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Offset in the file of `start`.
    pub offset: u64,
    /// Inode of the file.
    pub inode: u64,
    /// The file.
    pub path: PathBuf,
}

/// The file mapping of `/proc/self/maps` text `maps` that holds `addr..addr + len` whole; `None`
/// when it is anonymous memory, a deleted file, or spans several mappings.
pub fn find_mapping(maps: &str, addr: u64, len: u64) -> Option<FileMapping> {
    let end_addr = addr.checked_add(len)?;
    maps.lines().find_map(|line| {
        let mut f = line.split_ascii_whitespace();
        let (range, _perms, offset, _dev, inode) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let (s, e) = range.split_once('-')?;
        let (start, end) = (u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?);
        if !(start <= addr && end_addr <= end) {
            return None;
        }
        let inode: u64 = inode.parse().ok()?;
        // The path is the rest of the line (it may contain spaces).
        let path = line.split_once('/').map(|(_, p)| format!("/{p}"))?;
        if inode == 0 || path.ends_with(" (deleted)") {
            return None;
        }
        Some(FileMapping { start, end, offset: u64::from_str_radix(offset, 16).ok()?, inode, path: path.into() })
    })
}

/// Counts the bytes of registered file pages, shared by the backend's allocator (its cap covers
/// them) and every [`MappedRegion`].
#[derive(Debug, Default)]
pub struct ZeroCopyStats {
    bytes: AtomicU64,
    peak: AtomicU64,
    tensors: AtomicU64,
}

impl ZeroCopyStats {
    /// Bytes of tensors read in place now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
    /// Highest [`bytes`](Self::bytes) seen.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    /// Tensors read in place now.
    pub fn tensors(&self) -> u64 {
        self.tensors.load(Ordering::Relaxed)
    }
    fn add(&self, bytes: u64) {
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.tensors.fetch_add(1, Ordering::Relaxed);
    }
    fn sub(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.tensors.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why zero-copy cannot be used on this device at all, or `None` when it can: the driver must
/// support registering host memory, read-only registrations, and must not be turned off by
/// [`ZERO_COPY_ENV`].
pub fn unsupported_reason(gpu: &Gpu) -> Option<String> {
    if std::env::var(ZERO_COPY_ENV).is_ok_and(|v| v.trim() == "0") {
        return Some(format!("{ZERO_COPY_ENV}=0"));
    }
    let dev = match crate::probe::device_handle(gpu.info().ordinal) {
        Ok(d) => d,
        Err(e) => return Some(e.to_string()),
    };
    use sys::CUdevice_attribute as A;
    for (attr, what) in [
        (A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, "registering host memory (HOST_REGISTER_SUPPORTED)"),
        (A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, "read-only host registration"),
    ] {
        // SAFETY: `dev` came from cuDeviceGet.
        match unsafe { cudarc::driver::result::device::get_attribute(dev, attr) } {
            Ok(v) if v != 0 => {}
            Ok(_) => return Some(format!("the device does not support {what}")),
            Err(e) => return Some(format!("cuDeviceGetAttribute: {:?}", e.0)),
        }
    }
    None
}

/// A pinned, GPU-mapped range of a file: the allocator of exactly one zero-copy [`Buffer`].
#[derive(Debug)]
pub struct MappedRegion {
    id: AllocatorId,
    gpu: Arc<Gpu>,
    device: Arc<dyn Device>,
    stats: Arc<ZeroCopyStats>,
    /// Our own mapping (page-aligned) and its length.
    host: *mut c_void,
    map_len: usize,
    /// The tensor: device address and bytes; taken by the one `alloc_raw`.
    tensor: Mutex<Option<(u64, usize)>>,
    bytes: u64,
}

// SAFETY: `host` is a read-only mapping owned by this value, never written, released once in drop.
unsafe impl Send for MappedRegion {}
// SAFETY: as above; the mutable state is behind a mutex.
unsafe impl Sync for MappedRegion {}

impl Allocator for MappedRegion {
    fn id(&self) -> AllocatorId {
        self.id
    }
    fn device(&self) -> Arc<dyn Device> {
        Arc::clone(&self.device)
    }
    fn host_accessible(&self) -> bool {
        false
    }
    /// Hands out the registered tensor once; any other request is an error.
    fn alloc_raw(&self, bytes: usize, phase: &str) -> Result<RawAllocation> {
        let mut t = self.tensor.lock().map_err(|_| Error::invalid("zero-copy region lock poisoned"))?;
        match t.take() {
            Some((addr, len)) if len == bytes => Ok(RawAllocation::new(addr, len, self.id)),
            other => {
                *t = other;
                Err(Error::invalid(format!("a zero-copy weight region cannot allocate {bytes} bytes for {phase}")))
            }
        }
    }
    /// Nothing to do: the registration and mapping are released when the region is dropped,
    /// which happens with the buffer's last reference.
    fn free_raw(&self, raw: RawAllocation) -> Result<()> {
        if raw.owner() != self.id {
            return Err(Error::invalid("a block of another allocator was handed to a zero-copy region"));
        }
        Ok(())
    }
    fn copy_raw(&self, _src: &RawAllocation, _dst: &RawAllocation, bytes: usize) -> Result<()> {
        Err(Error::invalid(format!("zero-copy weights are read-only file pages; cannot copy {bytes} bytes into them")))
    }
    fn stats(&self) -> AllocStats {
        AllocStats { in_use: self.bytes, reserved: self.bytes, peak: self.bytes }
    }
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        self.stats.sub(self.bytes);
        // Kernels queued before the weight was dropped may still read it.
        if let Err(e) = self.gpu.bind().and_then(|()| self.gpu.synchronize()) {
            tracing::warn!("zero-copy weight released without a stream sync: {e}");
        }
        // SAFETY: `host` was registered by `map_tensor` and is unregistered once, after the
        // stream finished; then our own mapping is unmapped once.
        unsafe {
            if let Err(e) = sys::cuMemHostUnregister(self.host).result() {
                tracing::warn!("cuMemHostUnregister of a zero-copy weight failed: {:?}", e.0);
            }
            libc::munmap(self.host, self.map_len);
        }
    }
}

/// The system page size.
fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Maps `src` (a slice of a memory-mapped file) for the GPU in place: `Ok(Ok(buffer))` with the
/// tensor's device address, or `Ok(Err(reason))` when it cannot be (anonymous memory, a
/// changed file, a driver refusal), for the caller to copy it instead. `Err` only for a failure
/// that leaves the device unusable.
pub fn map_tensor(
    gpu: &Arc<Gpu>,
    device: &Arc<dyn Device>,
    stats: &Arc<ZeroCopyStats>,
    src: &[u8],
) -> Result<std::result::Result<Buffer, String>> {
    if src.is_empty() {
        return Ok(Err("empty tensor".into()));
    }
    let maps = match std::fs::read_to_string("/proc/self/maps") {
        Ok(m) => m,
        Err(e) => return Ok(Err(format!("reading /proc/self/maps: {e}"))),
    };
    let addr = src.as_ptr() as u64;
    let Some(m) = find_mapping(&maps, addr, src.len() as u64) else {
        return Ok(Err("not a slice of a memory-mapped file".into()));
    };
    let file = match std::fs::File::open(&m.path) {
        Ok(f) => f,
        Err(e) => return Ok(Err(format!("reopening {}: {e}", m.path.display()))),
    };
    match file.metadata() {
        Ok(md) if md.ino() == m.inode => {}
        _ => return Ok(Err(format!("{} was replaced since it was mapped", m.path.display()))),
    }
    let file_offset = m.offset + (addr - m.start);
    let page = page_size();
    let aligned = file_offset / page * page;
    let delta = (file_offset - aligned) as usize;
    let map_len = delta + src.len();
    let Ok(off) = libc::off_t::try_from(aligned) else {
        return Ok(Err(format!("file offset {aligned} too large")));
    };
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh read-only shared mapping of a file we hold open; checked for failure below.
    let host =
        unsafe { libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), off) };
    if host == libc::MAP_FAILED {
        return Ok(Err(format!(
            "mmap of {} bytes of {}: {}",
            map_len,
            m.path.display(),
            std::io::Error::last_os_error()
        )));
    }
    let unmap = |reason: String| {
        // SAFETY: `host` is the mapping made above, not registered (or already unregistered).
        unsafe { libc::munmap(host, map_len) };
        Ok(Err(reason))
    };
    // The same bytes? (Guards against a file rewritten in place; reads a few bytes of each end.)
    // SAFETY: `host..host + map_len` is mapped readable; the file is at least that long.
    let ours = unsafe { std::slice::from_raw_parts((host as *const u8).add(delta), src.len()) };
    let n = src.len().min(64);
    if ours[..n] != src[..n] || ours[src.len() - n..] != src[src.len() - n..] {
        return unmap(format!("{} changed since it was mapped", m.path.display()));
    }
    gpu.bind()?;
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_READ_ONLY;
    // SAFETY: `host..host + map_len` is a live mapping owned by us until the region drops.
    if let Err(e) = unsafe { sys::cuMemHostRegister_v2(host, map_len, flags) }.result() {
        return unmap(format!("cuMemHostRegister of {map_len} bytes: {:?}", e.0));
    }
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `host` was registered with DEVICEMAP just above.
    if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0) }.result() {
        // SAFETY: undoes the registration above.
        unsafe { sys::cuMemHostUnregister(host) };
        return unmap(format!("cuMemHostGetDevicePointer: {:?}", e.0));
    }
    stats.add(src.len() as u64);
    let region: Arc<dyn Allocator> = Arc::new(MappedRegion {
        id: AllocatorId::fresh(),
        gpu: Arc::clone(gpu),
        device: Arc::clone(device),
        stats: Arc::clone(stats),
        host,
        map_len,
        tensor: Mutex::new(Some((dptr + delta as u64, src.len()))),
        bytes: src.len() as u64,
    });
    Ok(Ok(Buffer::new(&region, src.len(), "weights (zero-copy)")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000400000 r--s 00001000 fd:01 1234567                    /models/My Model/model.safetensors
7f0000400000-7f0000500000 r--s 00000000 fd:01 99                         /tmp/gone.bin (deleted)
7f0000500000-7f0000600000 rw-p 00000000 00:00 0
";

    #[test]
    fn finds_the_file_behind_a_slice() {
        let m = find_mapping(MAPS, 0x7f0000001000, 0x1000).expect("file mapping");
        assert_eq!(m.start, 0x7f0000000000);
        assert_eq!(m.offset, 0x1000);
        assert_eq!(m.inode, 1234567);
        assert_eq!(m.path, PathBuf::from("/models/My Model/model.safetensors"));
        // The last byte of the mapping, but not one past it.
        assert!(find_mapping(MAPS, 0x7f00003fffff, 1).is_some());
        assert!(find_mapping(MAPS, 0x7f00003fffff, 2).is_none(), "spans two mappings");
        assert!(find_mapping(MAPS, 0x55d0c0a00010, 16).is_none(), "heap");
        assert!(find_mapping(MAPS, 0x7f0000400010, 16).is_none(), "deleted file");
        assert!(find_mapping(MAPS, 0x7f0000500010, 16).is_none(), "anonymous");
        assert!(find_mapping(MAPS, u64::MAX, 2).is_none());
    }

    #[test]
    fn finds_a_real_mapping_of_this_process() {
        // The test binary itself is mapped from a file.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let line = maps.lines().find(|l| l.ends_with(&*exe.to_string_lossy())).expect("the binary is mapped");
        let start = u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap();
        let m = find_mapping(&maps, start + 16, 32).expect("found");
        assert_eq!(m.path, exe);
    }

    #[test]
    fn gpu_zero_copy_reads_the_file_pages() {
        let Some((gpu, device)) = crate::allocator::test_gpu() else { return };
        let alloc = crate::allocator::CudaAllocator::new_unified(gpu.clone(), device, 1 << 30, 1 << 20);
        if let Some(why) = alloc.zero_copy_off() {
            eprintln!("skipped: zero-copy unsupported here ({why})");
            return;
        }
        // A file with a header of odd length, then the "tensor": an offset that is not page-aligned.
        let path = std::env::temp_dir().join(format!("tm-zero-copy-{}.bin", std::process::id()));
        let data: Vec<u8> = (0..3 * 4096 + 1000u32).map(|i| (i * 31 + 7) as u8).collect();
        let header = 1234usize;
        let mut file = vec![0u8; header];
        file.extend_from_slice(&data);
        std::fs::write(&path, &file).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a read-only mapping of the file just written, unmapped below.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), file.len(), libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0)
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the mapping is `file.len()` readable bytes.
        let src = unsafe { std::slice::from_raw_parts((base as *const u8).add(header), data.len()) };
        let desc = tm_core::TensorDesc::new(tm_core::DType::U8, &[data.len()]);
        let t = alloc.zero_copy_tensor(src, desc).expect("no driver error").expect("read in place");
        assert_eq!(alloc.zero_copy_bytes(), (data.len() as u64, data.len() as u64));
        // The loader's mapping may go away: the tensor keeps its own.
        // SAFETY: unmaps the mapping made above; `src` is not used after this.
        unsafe { libc::munmap(base, file.len()) };
        let staging = crate::staging::Staging::new(gpu.clone(), crate::staging::MIN_STAGING_BYTES).unwrap();
        let mut back = vec![0u8; data.len()];
        staging.download(t.buffer().addr(), &mut back).expect("download");
        assert!(back == data, "the GPU reads the file's bytes");
        assert_eq!(alloc.stats().in_use, 0, "no device allocation for it");
        drop(t);
        assert_eq!(alloc.zero_copy_bytes().0, 0, "released with the tensor");
        // Anonymous memory is copied instead.
        let anon = data.clone();
        let desc = tm_core::TensorDesc::new(tm_core::DType::U8, &[anon.len()]);
        assert!(alloc.zero_copy_tensor(&anon, desc).unwrap().is_none());
        let _ = std::fs::remove_file(&path);
    }
}
