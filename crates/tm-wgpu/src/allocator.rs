//! Device memory: one wgpu storage buffer per allocation, behind tm-core's RAII `Buffer`.
//!
//! A [`RawAllocation`]'s address is an id into the allocator's slab of `wgpu::Buffer`s (ids are
//! never reused). Sizes are rounded up to 4 bytes (wgpu's copy alignment); wgpu zero-fills new
//! buffers. A tensor may be as large as the adapter's `max_buffer_size`; the kernels bind tensors
//! larger than the storage binding limit in windows. Freeing drops the buffer handle, so recorded
//! but unsubmitted work that uses it keeps it alive until that work is done.

use crate::context::Gpu;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tm_core::alloc::{AllocStats, AllocatorId, RawAllocation};
use tm_core::{Allocator, Device, DeviceKind, Error, MemoryInfo, Result};

/// Bytes of an allocation of `bytes` (at least 4, a multiple of 4).
pub fn padded(bytes: usize) -> u64 {
    (bytes.max(4) as u64).div_ceil(4) * 4
}

/// Byte counters shared by the allocator and its device.
#[derive(Debug, Default)]
struct Usage {
    in_use: AtomicU64,
    peak: AtomicU64,
}

/// A wgpu adapter as a tm `Device`.
#[derive(Debug)]
pub struct WgpuDevice {
    name: String,
    ordinal: usize,
    cap: u64,
    shared_with_host: bool,
    usage: Arc<Usage>,
}

impl Device for WgpuDevice {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Wgpu
    }
    fn ordinal(&self) -> usize {
        self.ordinal
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        let in_use = self.usage.in_use.load(Ordering::Relaxed);
        Ok(MemoryInfo {
            total: self.cap,
            usable: self.cap.saturating_sub(in_use),
            shared_with_host: self.shared_with_host,
        })
    }
}

/// Hands out wgpu storage buffers, up to a cap.
#[derive(Debug)]
pub struct WgpuAllocator {
    id: AllocatorId,
    gpu: Arc<Gpu>,
    device: Arc<WgpuDevice>,
    cap: u64,
    buffers: Mutex<HashMap<u64, wgpu::Buffer>>,
    next: AtomicU64,
    usage: Arc<Usage>,
}

impl WgpuAllocator {
    /// An allocator on `gpu` that holds at most `cap` bytes at once.
    pub fn new(gpu: Arc<Gpu>, cap: u64) -> Arc<WgpuAllocator> {
        let usage = Arc::new(Usage::default());
        let s = &gpu.summary;
        let device = Arc::new(WgpuDevice {
            name: format!("{} ({}, {})", s.name, s.backend, s.device_type),
            ordinal: s.index,
            cap,
            shared_with_host: s.is_cpu || s.device_type == "IntegratedGpu",
            usage: Arc::clone(&usage),
        });
        Arc::new(WgpuAllocator {
            id: AllocatorId::fresh(),
            gpu,
            device,
            cap,
            buffers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            usage,
        })
    }

    /// The device and queue.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn slab(&self) -> Result<std::sync::MutexGuard<'_, HashMap<u64, wgpu::Buffer>>> {
        self.buffers.lock().map_err(|_| Error::invalid("wgpu buffer table poisoned by an earlier panic"))
    }

    /// The wgpu buffer behind block `addr` of this allocator.
    pub fn buffer(&self, addr: u64) -> Result<wgpu::Buffer> {
        self.slab()?
            .get(&addr)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("wgpu buffer {addr} is not a live block of this allocator")))
    }
}

impl Allocator for WgpuAllocator {
    fn id(&self) -> AllocatorId {
        self.id
    }
    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
    fn host_accessible(&self) -> bool {
        false
    }
    fn alloc_raw(&self, bytes: usize, phase: &str) -> Result<RawAllocation> {
        let size = padded(bytes);
        let max = self.gpu.max_tensor();
        if size > max {
            return Err(Error::Unsupported(format!(
                "{phase}: a tensor of {bytes} bytes exceeds the adapter's max_buffer_size of {max} bytes"
            )));
        }
        let in_use = self.usage.in_use.load(Ordering::Relaxed);
        if in_use + size > self.cap {
            return Err(Error::OutOfMemory {
                device: self.device.name.clone(),
                phase: phase.into(),
                requested: size,
                free: self.cap.saturating_sub(in_use),
                hint: "; raise the wgpu memory cap or lower the context length / batch".into(),
            });
        }
        let buffer = self.gpu.scoped(wgpu::ErrorFilter::OutOfMemory, phase, || {
            self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(phase),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        let addr = self.next.fetch_add(1, Ordering::Relaxed);
        self.slab()?.insert(addr, buffer);
        let now = self.usage.in_use.fetch_add(size, Ordering::Relaxed) + size;
        self.usage.peak.fetch_max(now, Ordering::Relaxed);
        Ok(RawAllocation::new(addr, bytes, self.id))
    }
    fn free_raw(&self, raw: RawAllocation) -> Result<()> {
        if raw.owner() != self.id {
            return Err(Error::invalid(format!(
                "block of {} bytes freed by a wgpu allocator that did not make it",
                raw.bytes()
            )));
        }
        let removed = self.slab()?.remove(&raw.addr());
        match removed {
            Some(buffer) => {
                self.gpu.forget_buffer(raw.addr());
                drop(buffer);
                self.usage.in_use.fetch_sub(padded(raw.bytes()), Ordering::Relaxed);
                Ok(())
            }
            None => Err(Error::invalid(format!("wgpu buffer {} freed twice", raw.addr()))),
        }
    }
    fn copy_raw(&self, src: &RawAllocation, dst: &RawAllocation, bytes: usize) -> Result<()> {
        if bytes > src.bytes() || bytes > dst.bytes() {
            return Err(Error::invalid(format!(
                "copy of {bytes} bytes between blocks of {} and {}",
                src.bytes(),
                dst.bytes()
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        let (s, d) = (self.buffer(src.addr())?, self.buffer(dst.addr())?);
        self.gpu.record(|enc| enc.copy_buffer_to_buffer(&s, 0, &d, 0, padded(bytes)))?;
        self.gpu.take_error()
    }
    fn stats(&self) -> AllocStats {
        let in_use = self.usage.in_use.load(Ordering::Relaxed);
        AllocStats { in_use, reserved: in_use, peak: self.usage.peak.load(Ordering::Relaxed) }
    }
}
