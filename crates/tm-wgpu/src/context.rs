//! Adapter listing and selection, and the opened device.

use std::sync::{Arc, Mutex};
use tm_core::{Error, Result};

/// How to choose and open a wgpu adapter.
#[derive(Clone, Debug, Default)]
pub struct WgpuOptions {
    /// Index into [`list_adapters`]; `None` picks the best GPU (discrete, then integrated, then
    /// virtual, then other).
    pub adapter: Option<usize>,
    /// Whether a software (CPU) adapter such as Mesa lavapipe may be used.
    pub allow_cpu_adapter: bool,
    /// Hard cap on the bytes tm may allocate on the device. `None`: the host's available
    /// memory for CPU and integrated adapters, 8 GiB otherwise (wgpu does not report VRAM).
    pub memory_cap: Option<u64>,
}

impl WgpuOptions {
    /// Options from the environment: `TM_WGPU_ADAPTER` (an index into [`list_adapters`]) and
    /// `TM_WGPU_ALLOW_CPU=1` (allow a software adapter).
    pub fn from_env() -> Self {
        let adapter = std::env::var("TM_WGPU_ADAPTER").ok().and_then(|v| v.trim().parse().ok());
        let allow_cpu_adapter = std::env::var("TM_WGPU_ALLOW_CPU").is_ok_and(|v| v.trim() == "1");
        WgpuOptions { adapter, allow_cpu_adapter, memory_cap: None }
    }
}

/// One adapter as `check-env` shows it.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    /// Index to pass as [`WgpuOptions::adapter`].
    pub index: usize,
    /// Adapter name.
    pub name: String,
    /// Graphics API (Vulkan, Metal, Dx12).
    pub backend: String,
    /// Discrete, integrated, virtual, CPU or other.
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// Whether this is a software adapter.
    pub is_cpu: bool,
    /// Largest storage buffer binding, in bytes (the largest tensor the backend can hold).
    pub max_storage_binding: u64,
}

impl std::fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{}] {} ({}, {}, driver {}; max storage binding {} MiB)",
            self.index,
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            self.max_storage_binding >> 20
        )
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::PRIMARY;
    wgpu::Instance::new(desc.with_env())
}

fn adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::PRIMARY))
}

fn summary(index: usize, adapter: &wgpu::Adapter) -> AdapterSummary {
    let info = adapter.get_info();
    let limits = adapter.limits();
    AdapterSummary {
        index,
        name: info.name.clone(),
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
        is_cpu: info.device_type == wgpu::DeviceType::Cpu,
        max_storage_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
    }
}

/// Every adapter wgpu finds (Vulkan, Metal, DX12), software ones included.
pub fn list_adapters() -> Vec<AdapterSummary> {
    adapters(&instance()).iter().enumerate().map(|(i, a)| summary(i, a)).collect()
}

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// An opened wgpu device and queue, with the adapter's facts and the errors wgpu reported.
#[derive(Debug)]
pub struct Gpu {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// What the adapter is.
    pub summary: AdapterSummary,
    /// The limits the device was opened with (the adapter's own).
    pub limits: wgpu::Limits,
    errors: Arc<Mutex<Vec<String>>>,
}

fn backend_err(message: impl Into<String>) -> Error {
    Error::Backend { backend: "wgpu".into(), message: message.into() }
}

impl Gpu {
    /// Chooses an adapter as `opts` says and opens it with the adapter's full limits.
    pub fn open(opts: &WgpuOptions) -> Result<Gpu> {
        let instance = instance();
        let all = adapters(&instance);
        if all.is_empty() {
            return Err(Error::Unsupported(
                "no wgpu adapter found (install a Vulkan driver, e.g. mesa-vulkan-drivers and libvulkan1)".into(),
            ));
        }
        let list: Vec<String> = all.iter().enumerate().map(|(i, a)| summary(i, a).to_string()).collect();
        let index = match opts.adapter {
            Some(i) => {
                let a = all.get(i).ok_or_else(|| {
                    Error::invalid(format!("wgpu adapter {i} does not exist; adapters: {}", list.join("; ")))
                })?;
                if a.get_info().device_type == wgpu::DeviceType::Cpu && !opts.allow_cpu_adapter {
                    return Err(Error::invalid(format!(
                        "wgpu adapter {i} is a software adapter; allow it (TM_WGPU_ALLOW_CPU=1) to use it"
                    )));
                }
                i
            }
            None => all
                .iter()
                .enumerate()
                .filter(|(_, a)| opts.allow_cpu_adapter || a.get_info().device_type != wgpu::DeviceType::Cpu)
                .min_by_key(|(i, a)| (rank(a.get_info().device_type), *i))
                .map(|(i, _)| i)
                .ok_or_else(|| {
                    Error::Unsupported(format!(
                        "no wgpu GPU adapter (software adapters are not allowed; TM_WGPU_ALLOW_CPU=1 allows them); \
                         adapters: {}",
                        list.join("; ")
                    ))
                })?,
        };
        let adapter = &all[index];
        let summary = summary(index, adapter);
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("tm"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| backend_err(format!("opening {}: {e}", summary.name)))?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&errors);
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            tracing::error!("wgpu: {e}");
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        Ok(Gpu { device, queue, summary, limits, errors })
    }

    /// Returns the first error wgpu reported since the last call, if any.
    pub fn take_error(&self) -> Result<()> {
        let mut v = self.errors.lock().map_err(|_| backend_err("error log poisoned"))?;
        if v.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *v);
        Err(backend_err(all.join("; ")))
    }

    /// Waits until the queue has finished all submitted work.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| backend_err(format!("waiting for the device: {e}")))?;
        self.take_error()
    }

    /// The largest buffer the backend may bind as one tensor.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Runs `f` inside an error scope of `filter` and returns wgpu's error, if any, as ours.
    pub fn scoped<T>(&self, filter: wgpu::ErrorFilter, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        let scope = self.device.push_error_scope(filter);
        let out = f();
        match pollster::block_on(scope.pop()) {
            Some(e) => Err(backend_err(format!("{what}: {e}"))),
            None => Ok(out),
        }
    }
}
