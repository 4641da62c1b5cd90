//! Allocators and the owning buffers they hand out.
//!
//! Every piece of device memory in tm is a [`Buffer`]: it holds an `Arc` of the allocator that
//! made it, frees itself exactly once on drop, and never panics while doing so. There is no
//! global pointer→allocation map: the buffer *is* the record of its allocation.

use crate::{Device, Result};
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Identifies one allocator instance; a [`RawAllocation`] remembers which one made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocatorId(u64);

impl AllocatorId {
    /// A process-unique id for a new allocator.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        AllocatorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A block of memory as an allocator sees it. Not `Clone`: it moves from `alloc_raw` into a
/// [`Buffer`] and back into `free_raw`, so it is released once.
#[derive(Debug)]
pub struct RawAllocation {
    addr: u64,
    bytes: usize,
    owner: AllocatorId,
}

impl RawAllocation {
    /// Records a block made by allocator `owner`. Only allocators call this.
    pub fn new(addr: u64, bytes: usize, owner: AllocatorId) -> Self {
        RawAllocation { addr, bytes, owner }
    }
    /// Address (a host pointer or a device pointer, depending on the allocator).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The allocator that made this block.
    pub fn owner(&self) -> AllocatorId {
        self.owner
    }
}

/// Usage statistics of an allocator, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes held by live buffers.
    pub in_use: u64,
    /// Bytes reserved from the device (in use plus cached).
    pub reserved: u64,
    /// Highest `in_use` seen.
    pub peak: u64,
}

/// Hands out device memory. Implementations must be thread-safe and must not panic in
/// `free_raw`.
pub trait Allocator: Send + Sync + Debug {
    /// This allocator's identity.
    fn id(&self) -> AllocatorId;
    /// The device the memory lives on.
    fn device(&self) -> Arc<dyn Device>;
    /// Whether the host may read and write the memory directly through its address.
    fn host_accessible(&self) -> bool;
    /// Allocates `bytes` (zero-filled). `phase` names what the memory is for, for error messages.
    fn alloc_raw(&self, bytes: usize, phase: &str) -> Result<RawAllocation>;
    /// Releases a block. Called only by [`Buffer`]'s drop with a block this allocator made.
    /// Must not panic; failures are reported through the returned error and logged.
    fn free_raw(&self, raw: RawAllocation) -> Result<()>;
    /// Copies `bytes` from `src` to `dst`, both made by this allocator.
    fn copy_raw(&self, src: &RawAllocation, dst: &RawAllocation, bytes: usize) -> Result<()>;
    /// Current statistics.
    fn stats(&self) -> AllocStats;
}

/// Owning handle to memory from an [`Allocator`]. Frees on drop, exactly once, by its own
/// allocator.
#[derive(Debug)]
pub struct Buffer {
    allocator: Arc<dyn Allocator>,
    raw: Option<RawAllocation>,
}

impl Buffer {
    /// Allocates `bytes` from `allocator`. `phase` names what it is for.
    pub fn new(allocator: &Arc<dyn Allocator>, bytes: usize, phase: &str) -> Result<Buffer> {
        let raw = allocator.alloc_raw(bytes, phase)?;
        debug_assert_eq!(raw.owner(), allocator.id());
        Ok(Buffer { allocator: Arc::clone(allocator), raw: Some(raw) })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.raw.as_ref().map_or(0, RawAllocation::bytes)
    }

    /// Whether the buffer holds zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address of the memory (host or device pointer).
    pub fn addr(&self) -> u64 {
        self.raw.as_ref().map_or(0, RawAllocation::addr)
    }

    /// The allocator that owns this buffer.
    pub fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.allocator
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Arc<dyn Device> {
        self.allocator.device()
    }

    /// Grows the buffer to `new_bytes`, keeping its contents. The new block is allocated
    /// before the old one is released, so a failed growth leaves the buffer as it was.
    pub fn grow(&mut self, new_bytes: usize, phase: &str) -> Result<()> {
        if new_bytes <= self.len() {
            return Ok(());
        }
        let new = self.allocator.alloc_raw(new_bytes, phase)?;
        if let Some(old) = self.raw.as_ref() {
            if let Err(e) = self.allocator.copy_raw(old, &new, old.bytes()) {
                let _ = self.allocator.free_raw(new);
                return Err(e);
            }
        }
        if let Some(old) = self.raw.replace(new) {
            if let Err(e) = self.allocator.free_raw(old) {
                tracing::error!("freeing the old block after growth failed: {e}");
            }
        }
        Ok(())
    }

    /// Host view of the bytes, when the allocator's memory is host-accessible.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let raw = self.raw.as_ref()?;
        if !self.allocator.host_accessible() || raw.bytes() == 0 {
            return self.allocator.host_accessible().then_some(&[]);
        }
        // SAFETY: host-accessible allocators return addresses of `bytes` valid, initialised
        // (zero-filled) host memory that lives until `free_raw`, which only our drop calls.
        Some(unsafe { std::slice::from_raw_parts(raw.addr() as *const u8, raw.bytes()) })
    }

    /// Mutable host view of the bytes, when the allocator's memory is host-accessible.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let raw = self.raw.as_ref()?;
        if !self.allocator.host_accessible() || raw.bytes() == 0 {
            return self.allocator.host_accessible().then_some(&mut []);
        }
        // SAFETY: as in `host_bytes`; `&mut self` guarantees exclusive access.
        Some(unsafe { std::slice::from_raw_parts_mut(raw.addr() as *mut u8, raw.bytes()) })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            let allocator = &self.allocator;
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| allocator.free_raw(raw)));
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!("freeing a buffer failed: {e}"),
                Err(_) => tracing::error!("an allocator panicked while freeing a buffer"),
            }
        }
    }
}
