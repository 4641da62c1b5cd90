//! Bounded pinned host staging for host↔device copies.
//!
//! A copy from pageable host memory cannot be asynchronous, and pinning whole weight files would
//! take host memory the user did not offer. [`Staging`] owns one pinned buffer (32 MiB by default)
//! split into two halves, each with an event: while the GPU copies one half, the host fills (or
//! drains) the other. Copies run on [`Gpu::stream`], ordered with every other piece of tm's work.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};
use tm_core::{Error, Result};

use crate::runtime::{driver_err, Gpu};

/// Default size of the pinned buffer: 32 MiB (two halves of 16 MiB).
pub const DEFAULT_STAGING_BYTES: usize = 32 << 20;

/// Smallest accepted size (two halves of 4 KiB).
pub const MIN_STAGING_BYTES: usize = 8 << 10;

/// The pinned buffer and its events, under the lock.
#[derive(Debug)]
struct Inner {
    /// `cuMemHostAlloc` memory of `2 * half` bytes.
    host: *mut u8,
    /// Bytes per half.
    half: usize,
    /// `events[i]` completes when the last copy that used half `i` has finished.
    events: [sys::CUevent; 2],
    /// The half the next chunk uses.
    next: usize,
}

// SAFETY: the pointers are driver handles and pinned host memory owned by this value; they are
// used only under `Staging`'s mutex, with the context bound on the calling thread.
unsafe impl Send for Inner {}

impl Inner {
    /// The pinned half `i` as a mutable slice.
    ///
    /// # Safety
    /// The caller must have waited for `events[i]`, so that no copy is reading or writing it.
    unsafe fn half_mut(&mut self, i: usize) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.host.add(i * self.half), self.half)
    }

    /// Waits until the last copy through half `i` has finished.
    fn wait(&self, i: usize) -> Result<()> {
        // SAFETY: the event was created by `Staging::new` and is destroyed only in drop; an
        // event never recorded counts as complete.
        unsafe { result::event::synchronize(self.events[i]) }.map_err(driver_err("cuEventSynchronize"))
    }

    /// Records half `i`'s event on `stream`.
    fn record(&self, i: usize, stream: sys::CUstream) -> Result<()> {
        // SAFETY: as in `wait`; the stream belongs to the bound context.
        unsafe { result::event::record(self.events[i], stream) }.map_err(driver_err("cuEventRecord"))
    }
}

/// Bounded pinned host staging for host↔device copies. Thread-safe: copies through one
/// `Staging` are serialised by a mutex.
#[derive(Debug)]
pub struct Staging {
    gpu: Arc<Gpu>,
    inner: Mutex<Inner>,
    /// Uploads so far and the host time they took, in ns (for the graph cache's step report).
    uploads: (AtomicU64, AtomicU64),
}

impl Staging {
    /// Allocates `bytes` of pinned host memory (rounded down to an even size, at least
    /// [`MIN_STAGING_BYTES`]; pass [`DEFAULT_STAGING_BYTES`] unless there is a reason not to) and the
    /// two events.
    pub fn new(gpu: Arc<Gpu>, bytes: usize) -> Result<Staging> {
        let half = (bytes / 2).max(MIN_STAGING_BYTES / 2);
        let total = half
            .checked_mul(2)
            .ok_or_else(|| Error::invalid(format!("staging buffer of {bytes} bytes is too large")))?;
        gpu.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let e0 = result::event::create(flags).map_err(driver_err("cuEventCreate"))?;
        let e1 = match result::event::create(flags) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: `e0` was just created and is not used anywhere else.
                let _ = unsafe { result::event::destroy(e0) };
                return Err(driver_err("cuEventCreate")(e));
            }
        };
        // SAFETY: the context is current; flags 0 asks for plain page-locked memory.
        let host = match unsafe { result::malloc_host(total, 0) } {
            Ok(p) if !p.is_null() => p as *mut u8,
            other => {
                // SAFETY: both events were just created and are not used anywhere else.
                unsafe {
                    let _ = result::event::destroy(e0);
                    let _ = result::event::destroy(e1);
                }
                return Err(match other {
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                        device: "host (pinned)".into(),
                        phase: "staging".into(),
                        requested: total as u64,
                        free: tm_core::host_memory::host_memory().available,
                        hint: "; pinned memory may be limited (ulimit -l, container memlock)".into(),
                    },
                    Err(e) => driver_err("cuMemHostAlloc")(e),
                    Ok(_) => Error::Backend { backend: "cuda".into(), message: "cuMemHostAlloc returned null".into() },
                });
            }
        };
        Ok(Staging {
            gpu,
            inner: Mutex::new(Inner { host, half, events: [e0, e1], next: 0 }),
            uploads: (AtomicU64::new(0), AtomicU64::new(0)),
        })
    }

    /// Size of the pinned buffer in bytes (both halves).
    pub fn capacity(&self) -> usize {
        self.lock().map_or(0, |inner| inner.half * 2)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| Error::invalid("cuda staging buffer lock poisoned"))
    }

    /// Copies `src` to device address `dst`, chunk by chunk through the pinned halves.
    ///
    /// When this returns, `src` may be reused; the copies are queued on [`Gpu::stream`] and run
    /// in order with everything queued before and after. The caller guarantees that
    /// `dst..dst + src.len()` is live device memory of this GPU.
    pub fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let done = self.upload_chunks(dst, src);
        self.uploads.0.fetch_add(1, Ordering::Relaxed);
        self.uploads.1.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        done
    }

    /// Uploads so far and the host time they took (ns).
    pub(crate) fn upload_stats(&self) -> (u64, u64) {
        (self.uploads.0.load(Ordering::Relaxed), self.uploads.1.load(Ordering::Relaxed))
    }

    /// [`Staging::upload`]'s copies, through the pinned halves.
    fn upload_chunks(&self, dst: u64, src: &[u8]) -> Result<()> {
        let mut inner = self.lock()?;
        self.gpu.bind()?;
        let stream = self.gpu.stream().cu_stream();
        let half = inner.half;
        for (k, chunk) in src.chunks(half).enumerate() {
            let i = inner.next;
            inner.wait(i)?;
            // SAFETY: the last copy out of half `i` has finished (waited above).
            let pinned = unsafe { inner.half_mut(i) };
            pinned[..chunk.len()].copy_from_slice(chunk);
            let addr = dst + (k * half) as u64;
            // SAFETY: `pinned` is page-locked memory that stays untouched until the event below
            // completes; the caller vouches for the device range.
            unsafe { result::memcpy_htod_async(addr, &pinned[..chunk.len()], stream) }
                .map_err(driver_err("cuMemcpyHtoDAsync"))?;
            inner.record(i, stream)?;
            inner.next = 1 - i;
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst`; returns once the data is
    /// there. Waits for everything queued on [`Gpu::stream`] before the copy.
    pub fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let mut inner = self.lock()?;
        self.gpu.bind()?;
        let stream = self.gpu.stream().cu_stream();
        let half = inner.half;
        // The chunk whose copy is in flight and not yet drained: (half, chunk index, length).
        let mut pending: Option<(usize, usize, usize)> = None;
        let chunks = dst.len().div_ceil(half);
        for k in 0..chunks {
            let len = half.min(dst.len() - k * half);
            let i = inner.next;
            // Half `i` was last used by chunk k-2 (drained in the previous iteration) or by an
            // earlier upload still in flight.
            inner.wait(i)?;
            // SAFETY: nothing is copying into or out of half `i` (waited above).
            let pinned = unsafe { inner.half_mut(i) };
            // SAFETY: the pinned half stays untouched until its event completes; the caller
            // vouches for the device range.
            unsafe { result::memcpy_dtoh_async(&mut pinned[..len], src + (k * half) as u64, stream) }
                .map_err(driver_err("cuMemcpyDtoHAsync"))?;
            inner.record(i, stream)?;
            inner.next = 1 - i;
            if let Some(p) = pending.replace((i, k, len)) {
                drain(&mut inner, p, dst)?;
            }
        }
        if let Some(p) = pending {
            drain(&mut inner, p, dst)?;
        }
        Ok(())
    }
}

/// Waits for the copy of chunk `k` into half `i` and moves its `len` bytes into `dst`.
fn drain(inner: &mut Inner, (i, k, len): (usize, usize, usize), dst: &mut [u8]) -> Result<()> {
    inner.wait(i)?;
    let start = k * inner.half;
    // SAFETY: the copy into half `i` has finished (waited above).
    let pinned = unsafe { inner.half_mut(i) };
    dst[start..start + len].copy_from_slice(&pinned[..len]);
    Ok(())
}

impl Drop for Staging {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = self.gpu.bind() {
            tracing::warn!("staging buffer leaked: {e}");
            return;
        }
        // SAFETY: the events and the pinned memory were made by `new` and are released once, after
        // both halves' copies have finished.
        unsafe {
            for &event in &inner.events {
                let _ = result::event::synchronize(event);
            }
            if let Err(e) = result::free_host(inner.host as *mut c_void) {
                tracing::warn!("cuMemFreeHost of the staging buffer failed: {:?}", e.0);
            }
            for &event in &inner.events {
                let _ = result::event::destroy(event);
            }
        }
        inner.host = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::CudaAllocator;

    #[test]
    fn gpu_round_trip_through_small_halves() {
        let Some((gpu, device)) = crate::allocator::test_gpu() else { return };
        let alloc: Arc<dyn tm_core::Allocator> = CudaAllocator::new(gpu.clone(), device, 64 << 20);
        let staging = Staging::new(gpu, MIN_STAGING_BYTES).expect("staging");
        assert_eq!(staging.capacity(), MIN_STAGING_BYTES);
        // Several chunks, not a multiple of the half size.
        let data: Vec<u8> = (0..50_001u32).map(|i| (i * 7 + 3) as u8).collect();
        let buf = tm_core::Buffer::new(&alloc, data.len() + 16, "test").expect("alloc");
        staging.upload(buf.addr(), &data).expect("upload");
        let mut back = vec![0u8; data.len() + 16];
        staging.download(buf.addr(), &mut back).expect("download");
        assert_eq!(&back[..data.len()], &data[..]);
        assert!(back[data.len()..].iter().all(|&b| b == 0), "fresh memory is zero-filled");
    }

    #[test]
    fn gpu_default_staging_throughput() {
        let Some((gpu, device)) = crate::allocator::test_gpu() else { return };
        let alloc: Arc<dyn tm_core::Allocator> = CudaAllocator::new(gpu.clone(), device, 1 << 30);
        let staging = Staging::new(gpu.clone(), DEFAULT_STAGING_BYTES).expect("staging");
        let n = 256 << 20;
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let buf = tm_core::Buffer::new(&alloc, n, "test").expect("alloc");
        gpu.synchronize().expect("sync");
        let t = std::time::Instant::now();
        staging.upload(buf.addr(), &data).expect("upload");
        gpu.synchronize().expect("sync");
        let up = t.elapsed();
        // The first download also pays for faulting in `back`'s pages; the second does not.
        let mut back = vec![0u8; n];
        let t = std::time::Instant::now();
        staging.download(buf.addr(), &mut back).expect("download");
        let first = t.elapsed();
        let t = std::time::Instant::now();
        staging.download(buf.addr(), &mut back).expect("download");
        let down = t.elapsed();
        assert!(back == data, "round trip differs");
        let gbs = |d: std::time::Duration| n as f64 / d.as_secs_f64() / 1e9;
        eprintln!(
            "staging 256 MiB: upload {:.1} GB/s, download {:.1} GB/s (first, into fresh pages: {:.1} GB/s)",
            gbs(up),
            gbs(down),
            gbs(first)
        );
    }
}
