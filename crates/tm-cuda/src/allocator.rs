//! The capped caching pool over `cuMemAlloc` that every piece of tm's device memory comes from.
//!
//! Requests are rounded up to a *size class* ([`size_class`]): powers of two from 512 bytes to
//! 1 MiB, then multiples of 2 MiB. A freed block goes onto the free list of its class and the next
//! request of that class reuses it instead of calling the driver. Memory always comes from plain
//! `cuMemAlloc` (never managed memory).
//!
//! # Why reusing a freed block is safe without waiting
//!
//! All of tm's device work (kernels, cuBLASLt, copies, the zero-fill of new blocks) runs in order
//! on the one stream [`Gpu::stream`]. When a [`tm_core::Buffer`] is dropped while kernels that use
//! it are still queued, its block goes onto a free list at once; whoever gets the block next can
//! only touch it through work queued *later* on the same stream (starting with the zero-fill done
//! by [`CudaAllocator`]'s `alloc_raw`), which the stream runs after the earlier kernels have
//! finished. Work on any other stream must not use memory from this allocator unless it is
//! synchronised with [`Gpu::stream`] first. Blocks are only handed back to the driver
//! (`cuMemFree`) after a stream synchronisation.
//!
//! # The cap
//!
//! Reserved bytes (in use plus cached) never exceed the cap given to [`CudaAllocator::new`]. When a
//! new block would cross it, or `cuMemAlloc` reports out-of-memory, the cached blocks are released
//! and the allocation is retried once; after that the caller gets [`Error::OutOfMemory`] naming the
//! device, the phase, the bytes asked for and what is free under the cap and on the device.
//!
//! # The unified variant
//!
//! [`CudaAllocator::new_unified`] makes the allocator of the unified memory model
//! ([`crate::memory_model`]): the cap also counts the weights read in place from file pages
//! ([`CudaAllocator::zero_copy_tensor`]), and at most a cache limit of freed blocks stays cached
//! (a new block from the driver first returns the excess), so freed memory goes back to the host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result, sys};
use tm_core::alloc::{AllocStats, AllocatorId, RawAllocation};
use tm_core::{Allocator, Device, Error, Result};

use crate::runtime::{driver_err, Gpu};
use crate::zero_copy::{self, ZeroCopyStats};

/// Smallest block handed out, in bytes.
pub const MIN_BLOCK: usize = 512;
/// Requests up to this size are rounded up to a power of two.
pub const SMALL_LIMIT: usize = 1 << 20;
/// Requests above [`SMALL_LIMIT`] are rounded up to a multiple of this.
pub const LARGE_GRANULE: usize = 2 << 20;

/// What to try when memory runs out.
pub const OOM_HINT: &str = "lower --memory-fraction / --max-model-len / --max-batch-size, or use a smaller model";

/// The block size a request of `bytes` gets: at least [`MIN_BLOCK`], the next power of two up to
/// [`SMALL_LIMIT`], and the next multiple of [`LARGE_GRANULE`] above. `None` when rounding
/// overflows `usize`. Zero bytes get a zero-sized class (no block at all).
pub fn size_class(bytes: usize) -> Option<usize> {
    if bytes == 0 {
        Some(0)
    } else if bytes <= SMALL_LIMIT {
        Some(bytes.max(MIN_BLOCK).next_power_of_two())
    } else {
        bytes.checked_next_multiple_of(LARGE_GRANULE)
    }
}

/// Formats a byte count for messages (`1.50 GiB`, `12.0 MiB`, `512 B`).
pub(crate) fn human(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b >= KIB * KIB * KIB {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    } else if b >= KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// The bookkeeping under the allocator's lock.
#[derive(Debug, Default)]
struct Pool {
    /// Cached blocks per size class.
    free: HashMap<usize, Vec<u64>>,
    /// Bytes in cached blocks.
    cached: u64,
    /// Bytes obtained from the driver and not yet returned (in use + cached + leaked).
    reserved: u64,
    /// Bytes in blocks held by live allocations (size-class bytes).
    in_use: u64,
    /// Highest `in_use` seen.
    peak: u64,
}

impl Pool {
    fn take_cached(&mut self, class: usize) -> Option<u64> {
        let addr = self.free.get_mut(&class)?.pop()?;
        self.cached = self.cached.saturating_sub(class as u64);
        Some(addr)
    }

    fn put_cached(&mut self, class: usize, addr: u64) {
        self.free.entry(class).or_default().push(addr);
        self.cached += class as u64;
    }
}

/// A capped caching allocator of device memory on one GPU. See the [module docs](self).
#[derive(Debug)]
pub struct CudaAllocator {
    id: AllocatorId,
    gpu: Arc<Gpu>,
    device: Arc<dyn Device>,
    label: String,
    cap: u64,
    pool: Mutex<Pool>,
    /// Unified variant: most bytes of freed blocks kept cached.
    cache_limit: Option<u64>,
    /// Unified variant: weights read in place (counted against the cap).
    zero_copy: Arc<ZeroCopyStats>,
    /// Why zero-copy weights are not used (`None` when they are).
    zero_copy_off: Option<String>,
}

impl CudaAllocator {
    /// A pool on `gpu` that never reserves more than `cap_bytes`. `device` is what
    /// [`Allocator::device`] returns and names the GPU in errors.
    pub fn new(gpu: Arc<Gpu>, device: Arc<dyn Device>, cap_bytes: u64) -> Arc<CudaAllocator> {
        let label = format!("cuda:{} ({})", device.ordinal(), device.name());
        Arc::new(CudaAllocator {
            id: AllocatorId::fresh(),
            gpu,
            device,
            label,
            cap: cap_bytes,
            pool: Mutex::new(Pool::default()),
            cache_limit: None,
            zero_copy: Arc::default(),
            zero_copy_off: Some("the discrete memory model copies every weight to the device".into()),
        })
    }

    /// The allocator of the unified memory model: `cap_bytes` covers device blocks *and* the
    /// weights read in place; at most `cache_limit` bytes of freed blocks stay cached. Zero-copy
    /// weights are used when the device supports them ([`zero_copy::unsupported_reason`]).
    pub fn new_unified(gpu: Arc<Gpu>, device: Arc<dyn Device>, cap_bytes: u64, cache_limit: u64) -> Arc<CudaAllocator> {
        let label = format!("cuda:{} ({}, unified memory)", device.ordinal(), device.name());
        let zero_copy_off = zero_copy::unsupported_reason(&gpu);
        match &zero_copy_off {
            None => tracing::info!("{label}: weights in their stored dtype are read in place (zero-copy)"),
            Some(why) => tracing::info!("{label}: zero-copy weights off ({why}); weights are copied"),
        }
        Arc::new(CudaAllocator {
            id: AllocatorId::fresh(),
            gpu,
            device,
            label,
            cap: cap_bytes,
            pool: Mutex::new(Pool::default()),
            cache_limit: Some(cache_limit),
            zero_copy: Arc::default(),
            zero_copy_off,
        })
    }

    /// Whether this is the unified variant's allocator.
    pub fn is_unified(&self) -> bool {
        self.cache_limit.is_some()
    }

    /// Bytes of weights read in place from file pages now, and the most at any time.
    pub fn zero_copy_bytes(&self) -> (u64, u64) {
        (self.zero_copy.bytes(), self.zero_copy.peak())
    }

    /// Why weights are not read in place, or `None` when they are.
    pub fn zero_copy_off(&self) -> Option<&str> {
        self.zero_copy_off.as_deref()
    }

    /// In the unified variant, a tensor of `desc` whose bytes `src` are already in the layout the
    /// kernels read, served straight from the file pages `src` lies in (see [`crate::zero_copy`]);
    /// `None` when that is not possible (the caller copies it), with the reason logged at debug
    /// level. The registered bytes count against the cap.
    pub fn zero_copy_tensor(&self, src: &[u8], desc: tm_core::TensorDesc) -> Result<Option<tm_core::Tensor>> {
        if self.zero_copy_off.is_some() || src.len() != desc.bytes() || src.len() < 4096 {
            return Ok(None);
        }
        {
            let pool = self.lock();
            if pool.reserved + self.zero_copy.bytes() + src.len() as u64 > self.cap {
                return Err(self.oom(&pool, src.len(), src.len(), "weights (zero-copy)"));
            }
        }
        match zero_copy::map_tensor(&self.gpu, &self.device, &self.zero_copy, src)? {
            Ok(buffer) => Ok(Some(tm_core::Tensor::from_buffer(buffer, desc)?)),
            Err(why) => {
                tracing::debug!("weight of {} bytes copied instead of read in place: {why}", src.len());
                Ok(None)
            }
        }
    }

    /// The cap on reserved bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes held in cached (freed, not yet released) blocks.
    pub fn cached_bytes(&self) -> u64 {
        self.lock().cached
    }

    /// Returns every cached block to the driver (`cuMemFree`), after waiting for the stream.
    pub fn trim(&self) -> Result<()> {
        let mut pool = self.lock();
        self.release_cached(&mut pool)
    }

    /// The lock, recovered when poisoned: the pool's counters stay consistent at every await-free
    /// step, and freeing must work even after a panic elsewhere.
    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Synchronises the stream (cached blocks may still be read by queued work) and frees every
    /// cached block. A block the driver refuses to free stays counted as reserved.
    fn release_cached(&self, pool: &mut Pool) -> Result<()> {
        if pool.cached == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        self.gpu.synchronize()?;
        let mut first_error = None;
        for (class, addrs) in pool.free.drain() {
            for addr in addrs {
                // SAFETY: `addr` came from cuMemAlloc in this context, is on no live allocation's
                // list (it was freed by its Buffer) and the stream is idle.
                match unsafe { result::free_sync(addr) } {
                    Ok(()) => pool.reserved = pool.reserved.saturating_sub(class as u64),
                    Err(e) => {
                        tracing::error!("cuMemFree of a cached {class}-byte block failed: {:?}", e.0);
                        first_error.get_or_insert_with(|| driver_err("cuMemFree")(e));
                    }
                }
            }
        }
        pool.cached = 0;
        first_error.map_or(Ok(()), Err)
    }

    /// The out-of-memory error for a request of `bytes` in `phase`.
    fn oom(&self, pool: &Pool, bytes: usize, class: usize, phase: &str) -> Error {
        let under_cap = self.cap.saturating_sub(pool.reserved + self.zero_copy.bytes());
        let device = result::mem_get_info().ok().map(|(free, total)| (free as u64, total as u64));
        let device_text = match device {
            Some((free, total)) => format!("{} free on the device of {}", human(free), human(total)),
            None => "device free memory unknown".to_string(),
        };
        let rounded = if class != bytes { format!(" (a {} block)", human(class as u64)) } else { String::new() };
        Error::OutOfMemory {
            device: self.label.clone(),
            phase: phase.to_string(),
            requested: bytes as u64,
            free: device.map_or(under_cap, |(free, _)| under_cap.min(free)),
            hint: format!(
                "{rounded}; {} free under the {} cap ({} reserved, {} in use{}), {device_text}; {OOM_HINT}{}",
                human(under_cap),
                human(self.cap),
                human(pool.reserved),
                human(pool.in_use),
                if self.zero_copy.bytes() > 0 {
                    format!(", {} of weights read in place", human(self.zero_copy.bytes()))
                } else {
                    String::new()
                },
                if self.is_unified() { ", or lower --host-reserve" } else { "" },
            ),
        }
    }

    /// Gets a new block of `class` bytes from the driver, within the cap.
    fn reserve(&self, pool: &mut Pool, bytes: usize, class: usize, phase: &str) -> Result<u64> {
        let external = self.zero_copy.bytes();
        if pool.reserved + external + class as u64 > self.cap {
            self.release_cached(pool)?;
            if pool.reserved + external + class as u64 > self.cap {
                return Err(self.oom(pool, bytes, class, phase));
            }
        }
        let is_oom = |e: &cudarc::driver::DriverError| e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        // SAFETY: the context is current; the block is zero-filled before anyone reads it.
        let addr = match unsafe { result::malloc_sync(class) } {
            Ok(addr) => addr,
            Err(e) if is_oom(&e) => {
                self.release_cached(pool)?;
                // SAFETY: as above.
                match unsafe { result::malloc_sync(class) } {
                    Ok(addr) => addr,
                    Err(e) if is_oom(&e) => return Err(self.oom(pool, bytes, class, phase)),
                    Err(e) => return Err(driver_err("cuMemAlloc")(e)),
                }
            }
            Err(e) => return Err(driver_err("cuMemAlloc")(e)),
        };
        pool.reserved += class as u64;
        Ok(addr)
    }

    fn check_owner(&self, raw: &RawAllocation, what: &str) -> Result<()> {
        if raw.owner() == self.id {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: a block of {} bytes made by another allocator was handed to the allocator of {}",
                raw.bytes(),
                self.label
            )))
        }
    }
}

impl Allocator for CudaAllocator {
    fn id(&self) -> AllocatorId {
        self.id
    }

    fn device(&self) -> Arc<dyn Device> {
        Arc::clone(&self.device)
    }

    fn host_accessible(&self) -> bool {
        false
    }

    /// Takes a cached block of the request's size class, or a new one from the driver, and
    /// zero-fills the requested bytes with `cuMemsetD8Async` on the stream.
    fn alloc_raw(&self, bytes: usize, phase: &str) -> Result<RawAllocation> {
        if bytes == 0 {
            return Ok(RawAllocation::new(0, 0, self.id));
        }
        let class = size_class(bytes)
            .ok_or_else(|| Error::invalid(format!("allocation of {bytes} bytes for {phase} is too large")))?;
        let mut pool = self.lock();
        self.gpu.bind()?;
        let addr = match pool.take_cached(class) {
            Some(addr) => addr,
            None => {
                // Unified variant: freed blocks beyond the limit go back to the host first.
                if self.cache_limit.is_some_and(|limit| pool.cached > limit) {
                    self.release_cached(&mut pool)?;
                }
                self.reserve(&mut pool, bytes, class, phase)?
            }
        };
        // SAFETY: `addr` is a live block of `class >= bytes` bytes owned by this allocator; the
        // memset is ordered on the stream after all earlier users of a reused block.
        if let Err(e) = unsafe { result::memset_d8_async(addr, 0, bytes, self.gpu.stream().cu_stream()) } {
            pool.put_cached(class, addr);
            return Err(driver_err("cuMemsetD8Async")(e));
        }
        pool.in_use += class as u64;
        pool.peak = pool.peak.max(pool.in_use);
        Ok(RawAllocation::new(addr, bytes, self.id))
    }

    /// Puts the block on its class's free list; no driver call, never panics.
    fn free_raw(&self, raw: RawAllocation) -> Result<()> {
        // A block that is not ours is leaked: that is the safe answer.
        self.check_owner(&raw, "free")?;
        if raw.bytes() == 0 {
            return Ok(());
        }
        let class = size_class(raw.bytes())
            .ok_or_else(|| Error::invalid(format!("free of an impossible {}-byte block", raw.bytes())))?;
        let mut pool = self.lock();
        pool.put_cached(class, raw.addr());
        pool.in_use = pool.in_use.saturating_sub(class as u64);
        Ok(())
    }

    /// Device-to-device copy of the first `bytes` bytes, queued on the stream.
    fn copy_raw(&self, src: &RawAllocation, dst: &RawAllocation, bytes: usize) -> Result<()> {
        self.check_owner(src, "copy source")?;
        self.check_owner(dst, "copy destination")?;
        if bytes > src.bytes() || bytes > dst.bytes() {
            return Err(Error::invalid(format!(
                "copy of {bytes} bytes between blocks of {} and {} bytes",
                src.bytes(),
                dst.bytes()
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: both blocks are live allocations of this allocator holding at least `bytes`.
        unsafe { result::memcpy_dtod_async(dst.addr(), src.addr(), bytes, self.gpu.stream().cu_stream()) }
            .map_err(driver_err("cuMemcpyDtoDAsync"))
    }

    /// `in_use` and `peak` count whole size-class blocks; `reserved` includes cached blocks.
    fn stats(&self) -> AllocStats {
        let pool = self.lock();
        AllocStats { in_use: pool.in_use, reserved: pool.reserved, peak: pool.peak }
    }
}

impl Drop for CudaAllocator {
    fn drop(&mut self) {
        // Every Buffer holds an Arc of its allocator, so only cached blocks are left here.
        let mut pool = std::mem::take(self.pool.get_mut().unwrap_or_else(|p| p.into_inner()));
        if let Err(e) = self.release_cached(&mut pool) {
            tracing::warn!("releasing cached device memory of {}: {e}", self.label);
        }
    }
}

/// GPU 0 for tests, or `None` (with a message) when CUDA is not available here. Once the driver
/// shows a device, failing to open it is a test failure, not a skip.
#[cfg(test)]
pub(crate) fn test_gpu() -> Option<(Arc<Gpu>, Arc<dyn Device>)> {
    if let Err(e) = crate::probe() {
        eprintln!("skipping GPU test: {e}");
        return None;
    }
    let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("the driver shows a GPU but opening it failed: {e}"));
    let device = crate::CudaDevice::new(0).unwrap_or_else(|e| panic!("CudaDevice::new(0): {e}"));
    Some((gpu, Arc::new(device)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        assert_eq!(size_class(0), Some(0));
        assert_eq!(size_class(1), Some(512));
        assert_eq!(size_class(512), Some(512));
        assert_eq!(size_class(513), Some(1024));
        assert_eq!(size_class(3000), Some(4096));
        assert_eq!(size_class(SMALL_LIMIT - 1), Some(SMALL_LIMIT));
        assert_eq!(size_class(SMALL_LIMIT), Some(SMALL_LIMIT));
        assert_eq!(size_class(SMALL_LIMIT + 1), Some(LARGE_GRANULE));
        assert_eq!(size_class(LARGE_GRANULE + 1), Some(2 * LARGE_GRANULE));
        assert_eq!(size_class(5 * LARGE_GRANULE), Some(5 * LARGE_GRANULE));
        assert_eq!(size_class(usize::MAX), None);
        for b in [1usize, 100, 4097, 700_000, 1 << 20, 3 << 20, 123_456_789] {
            let c = size_class(b).unwrap_or(0);
            assert!(c >= b && c.is_multiple_of(MIN_BLOCK), "{b} -> {c}");
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 20), "3.0 MiB");
        assert_eq!(human(3 << 30), "3.00 GiB");
    }

    /// Opens GPU 0 with an allocator capped at `cap`, or says why the test is skipped.
    fn open(cap: u64) -> Option<Arc<CudaAllocator>> {
        let (gpu, device) = test_gpu()?;
        Some(CudaAllocator::new(gpu, device, cap))
    }

    #[test]
    fn gpu_blocks_are_reused_zeroed_and_capped() {
        let Some(a) = open(64 << 20) else { return };
        let dyn_a: Arc<dyn Allocator> = a.clone();
        let first = tm_core::Buffer::new(&dyn_a, 1000, "workspace").expect("alloc");
        let addr = first.addr();
        assert_eq!(first.len(), 1000);
        assert_eq!(a.stats().in_use, 1024);
        drop(first);
        assert_eq!(a.stats().in_use, 0);
        assert_eq!(a.cached_bytes(), 1024);
        let again = tm_core::Buffer::new(&dyn_a, 900, "workspace").expect("alloc");
        assert_eq!(again.addr(), addr, "a freed block of the same class is reused");
        drop(again);
        // Over the cap: an out-of-memory error with the numbers.
        let err = tm_core::Buffer::new(&dyn_a, 100 << 20, "kv cache").expect_err("over the cap");
        let msg = err.to_string();
        assert!(msg.contains("kv cache") && msg.contains("--memory-fraction"), "{msg}");
        let _big = tm_core::Buffer::new(&dyn_a, 60 << 20, "weights").expect("within the cap");
        assert_eq!(a.cached_bytes(), 0, "the cache was released to make room");
        assert!(a.stats().reserved <= a.cap());
        a.trim().expect("trim");
    }

    #[test]
    fn gpu_device_out_of_memory_is_an_error_with_numbers() {
        let Some(a) = open(u64::MAX / 2) else { return };
        let dyn_a: Arc<dyn Allocator> = a.clone();
        let _small = tm_core::Buffer::new(&dyn_a, 4096, "workspace").expect("alloc");
        let err = tm_core::Buffer::new(&dyn_a, 1 << 42, "weights").expect_err("4 TiB cannot fit");
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("weights") && msg.contains("free on the device"), "{msg}");
        eprintln!("{msg}");
        assert_eq!(a.stats().in_use, 4096);
    }

    #[test]
    fn gpu_refuses_foreign_blocks() {
        let Some(a) = open(16 << 20) else { return };
        let foreign = RawAllocation::new(0x1000, 512, AllocatorId::fresh());
        assert!(a.free_raw(foreign).is_err());
    }
}
