//! Host-memory allocator: 64-byte aligned, zero-filled blocks, with statistics and an optional
//! hard cap.

use crate::device::CpuDevice;
use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tm_core::alloc::{AllocStats, AllocatorId, RawAllocation};
use tm_core::{Allocator, Device, Error, Result};

const ALIGN: usize = 64;

/// Allocates host memory for the CPU backend.
#[derive(Debug)]
pub struct CpuAllocator {
    id: AllocatorId,
    device: Arc<CpuDevice>,
    cap: Option<u64>,
    in_use: AtomicU64,
    peak: AtomicU64,
}

impl CpuAllocator {
    /// An allocator without a cap.
    pub fn new() -> Self {
        Self::with_cap(None)
    }

    /// An allocator that refuses to hold more than `cap` bytes at once.
    pub fn with_cap(cap: Option<u64>) -> Self {
        CpuAllocator {
            id: AllocatorId::fresh(),
            device: Arc::new(CpuDevice),
            cap,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    fn layout(bytes: usize) -> Result<Layout> {
        Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| Error::invalid(format!("allocation of {bytes} bytes: {e}")))
    }
}

impl Default for CpuAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl Allocator for CpuAllocator {
    fn id(&self) -> AllocatorId {
        self.id
    }
    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
    fn host_accessible(&self) -> bool {
        true
    }
    fn alloc_raw(&self, bytes: usize, phase: &str) -> Result<RawAllocation> {
        let oom = |free: u64| Error::OutOfMemory {
            device: "cpu".into(),
            phase: phase.into(),
            requested: bytes as u64,
            free,
            hint: String::new(),
        };
        let in_use = self.in_use.load(Ordering::Relaxed);
        if let Some(cap) = self.cap {
            if in_use + bytes as u64 > cap {
                return Err(oom(cap.saturating_sub(in_use)));
            }
        }
        let layout = Self::layout(bytes)?;
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom(tm_core::host_memory::host_memory().available));
        }
        let now = self.in_use.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(RawAllocation::new(ptr as u64, bytes, self.id))
    }
    fn free_raw(&self, raw: RawAllocation) -> Result<()> {
        if raw.owner() != self.id {
            // Leaking is the safe answer to a block that is not ours.
            return Err(Error::invalid(format!(
                "block of {} bytes freed by an allocator that did not make it",
                raw.bytes()
            )));
        }
        let layout = Self::layout(raw.bytes())?;
        // SAFETY: the block was made by `alloc_zeroed` with this layout and is freed once
        // (RawAllocation is not Clone and only Buffer's drop hands it back).
        unsafe { std::alloc::dealloc(raw.addr() as *mut u8, layout) };
        self.in_use.fetch_sub(raw.bytes() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn copy_raw(&self, src: &RawAllocation, dst: &RawAllocation, bytes: usize) -> Result<()> {
        if bytes > src.bytes() || bytes > dst.bytes() {
            return Err(Error::invalid(format!(
                "copy of {bytes} bytes between blocks of {} and {}",
                src.bytes(),
                dst.bytes()
            )));
        }
        // SAFETY: both blocks are live host allocations of at least `bytes` bytes and distinct.
        unsafe { std::ptr::copy_nonoverlapping(src.addr() as *const u8, dst.addr() as *mut u8, bytes) };
        Ok(())
    }
    fn stats(&self) -> AllocStats {
        let in_use = self.in_use.load(Ordering::Relaxed);
        AllocStats { in_use, reserved: in_use, peak: self.peak.load(Ordering::Relaxed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tm_core::Buffer;

    #[test]
    fn buffers_free_on_drop_and_grow_keeps_contents() {
        let a: Arc<dyn Allocator> = Arc::new(CpuAllocator::new());
        {
            let mut b = Buffer::new(&a, 16, "test").unwrap();
            b.host_bytes_mut().unwrap().copy_from_slice(&[7u8; 16]);
            b.grow(64, "test").unwrap();
            let bytes = b.host_bytes().unwrap();
            assert_eq!(&bytes[..16], &[7u8; 16]);
            assert_eq!(&bytes[16..], &[0u8; 48]);
            assert_eq!(a.stats().in_use, 64);
            assert_eq!(a.stats().peak, 80, "new block allocated before the old was freed");
        }
        assert_eq!(a.stats().in_use, 0);
    }

    #[test]
    fn cap_gives_out_of_memory_with_numbers() {
        let a: Arc<dyn Allocator> = Arc::new(CpuAllocator::with_cap(Some(100)));
        let _keep = Buffer::new(&a, 60, "weights").unwrap();
        let err = Buffer::new(&a, 50, "kv cache").unwrap_err().to_string();
        assert!(err.contains("kv cache") && err.contains("50") && err.contains("40"), "{err}");
        let mut b = Buffer::new(&a, 30, "workspace").unwrap();
        assert!(b.grow(80, "workspace").is_err());
        assert_eq!(b.len(), 30, "failed growth leaves the buffer as it was");
    }

    #[test]
    fn foreign_block_is_refused_not_freed() {
        let a = CpuAllocator::new();
        let b = CpuAllocator::new();
        let raw = a.alloc_raw(8, "test").unwrap();
        let addr = raw.addr();
        let bytes = raw.bytes();
        assert!(b.free_raw(raw).is_err());
        a.free_raw(RawAllocation::new(addr, bytes, a.id())).unwrap();
    }
}
