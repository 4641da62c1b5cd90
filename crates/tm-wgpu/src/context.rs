//! Adapter listing and selection, the opened device, and the command recorder every kernel
//! launch and device copy goes through.
//!
//! Work is recorded into one pending command encoder and submitted only when something needs
//! its results on the host (a download), when host data is about to be written into a tensor
//! (an upload), or when the staging buffers for parameters and host inputs are full: a decode
//! step is one submission. The parameter blocks and host inputs of the recorded launches live at
//! distinct offsets of two staging buffers, gathered on the host and written with one
//! `Queue::write_buffer` each when the work is submitted (applied before the recorded work), so
//! no buffer is created and no queue write made per launch.

use crate::profile::{ProfileStats, Profiler};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
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
    /// Store dense float weights (matrices and embedding tables) as f16 instead of f32. They are
    /// read with WGSL's `unpack2x16float`, so this works on every adapter (`SHADER_F16` is not
    /// needed); activations and the KV cache stay f32.
    pub f16_weights: bool,
    /// Bind at most this many bytes of a tensor at once (never more than the adapter allows).
    /// Larger tensors are bound in windows; a small value exercises that path on any adapter.
    pub max_binding: Option<u64>,
    /// Do not use subgroup operations even where the adapter has them.
    pub no_subgroups: bool,
    /// Read the matrix-vector kernels' token count from their parameters instead of compiling
    /// a pipeline per count (1 ..= 8) with it fixed, which unrolls their loops over tokens.
    pub dynamic_gemv_tokens: bool,
    /// Weight rows per workgroup of the int4/int8 matrix-vector kernels (1 ..= 4; default 4).
    pub gemv_rows: Option<u32>,
    /// Invocations per workgroup of the int4/int8 matrix-vector kernels (32, 64, 128 or 256;
    /// default 64).
    pub gemv_workgroup: Option<u32>,
    /// Time every kernel launch on the GPU with timestamp queries and print the totals per
    /// kernel when the device is dropped (see [`crate::profile`]); ignored, with a warning,
    /// where the adapter has no timestamp queries. Serialises the host and the GPU.
    pub profile: bool,
}

impl WgpuOptions {
    /// Options from the environment: `TM_WGPU_ADAPTER` (an index into [`list_adapters`]),
    /// `TM_WGPU_ALLOW_CPU=1` (allow a software adapter), `TM_WGPU_MEMORY_CAP` (bytes, or with a
    /// `K`/`M`/`G` suffix, powers of 1024), `TM_WGPU_F16=1` (f16 weights),
    /// `TM_WGPU_MAX_BINDING` (bytes, as the cap), `TM_WGPU_NO_SUBGROUPS=1`, `TM_WGPU_PROFILE=1`
    /// (GPU time per kernel), `TM_WGPU_DYNAMIC_GEMV=1`, and `TM_WGPU_GEMV_ROWS` and
    /// `TM_WGPU_GEMV_WG` (the int4/int8 matrix-vector kernels' shape). Unparsable or out-of-range
    /// values are ignored with a warning.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let flag = |name: &str| var(name).is_some_and(|v| v == "1");
        let bytes = |name: &str| {
            let v = var(name)?;
            let parsed = parse_bytes(&v);
            if parsed.is_none() {
                tracing::warn!("ignoring {name}={v}: not a byte count");
            }
            parsed
        };
        let choice = |name: &str, allowed: &[u32]| {
            let v = var(name)?;
            let parsed = v.parse::<u32>().ok().filter(|n| allowed.contains(n));
            if parsed.is_none() {
                tracing::warn!("ignoring {name}={v}: not one of {allowed:?}");
            }
            parsed
        };
        let adapter = var("TM_WGPU_ADAPTER").and_then(|v| {
            let parsed = v.parse().ok();
            if parsed.is_none() {
                tracing::warn!("ignoring TM_WGPU_ADAPTER={v}: not an adapter index");
            }
            parsed
        });
        WgpuOptions {
            adapter,
            allow_cpu_adapter: flag("TM_WGPU_ALLOW_CPU"),
            memory_cap: bytes("TM_WGPU_MEMORY_CAP"),
            f16_weights: flag("TM_WGPU_F16"),
            max_binding: bytes("TM_WGPU_MAX_BINDING"),
            no_subgroups: flag("TM_WGPU_NO_SUBGROUPS"),
            profile: flag("TM_WGPU_PROFILE"),
            dynamic_gemv_tokens: flag("TM_WGPU_DYNAMIC_GEMV"),
            gemv_rows: choice("TM_WGPU_GEMV_ROWS", &[1, 2, 3, 4]),
            gemv_workgroup: choice("TM_WGPU_GEMV_WG", &[32, 64, 128, 256]),
        }
    }
}

/// `"123"`, `"64K"`, `"512M"`, `"100G"` (powers of 1024) as bytes.
pub fn parse_bytes(v: &str) -> Option<u64> {
    let v = v.trim();
    let (digits, shift) = match v.char_indices().last()? {
        (i, 'k' | 'K') => (&v[..i], 10),
        (i, 'm' | 'M') => (&v[..i], 20),
        (i, 'g' | 'G') => (&v[..i], 30),
        _ => (v, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
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

/// Bytes of the parameter staging buffer (one aligned slot per recorded launch).
const PARAMS_BYTES: u64 = 1 << 20;
/// Bytes of one launch's parameter block (16 u32 words).
pub const PARAM_BYTES: u64 = 64;
/// Bytes of the host-input staging buffer, not counting the binding window at its end.
const INPUTS_BYTES: u64 = 8 << 20;
/// Bytes of host inputs one launch may stage (its binding window); larger inputs go up in a
/// buffer of their own.
pub const INPUT_WINDOW: u64 = 1 << 20;

/// The pending command encoder and how much of the staging buffers it has used.
#[derive(Debug, Default)]
struct Recorder {
    /// The open compute pass the launches are recorded into (declared before the encoder, so it
    /// ends first when dropped); closed before any other command, and before submission.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    params_used: u64,
    inputs_used: u64,
    /// The recorded launches' parameter blocks and host inputs, written into the staging
    /// buffers in one `write_buffer` each at submission.
    params_host: Vec<u8>,
    inputs_host: Vec<u8>,
    profiler: Option<Profiler>,
}

/// Where one launch's parameter block and host inputs were staged.
#[derive(Clone, Copy, Debug)]
pub struct Staged {
    /// Offset of the parameter block in [`Gpu::params`].
    pub params: u32,
    /// Offset of the host inputs in [`Gpu::inputs`].
    pub inputs: u32,
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
    /// Whether kernels may use subgroup operations.
    pub subgroups: bool,
    /// The parameter staging buffer (uniform, bound with dynamic offsets).
    pub params: wgpu::Buffer,
    /// The host-input staging buffer (storage, bound with dynamic offsets).
    pub inputs: wgpu::Buffer,
    max_binding: u64,
    uniform_align: u64,
    storage_align: u64,
    recorder: Mutex<Recorder>,
    submissions: std::sync::atomic::AtomicU64,
    unsubmitted_writes: std::sync::atomic::AtomicU64,
    bind_groups: Mutex<HashMap<Vec<u64>, wgpu::BindGroup>>,
    errors: Arc<Mutex<Vec<String>>>,
}

/// Most bind groups kept; the cache starts over when it would grow past this.
const MAX_BIND_GROUPS: usize = 16384;

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
        let subgroups = !opts.no_subgroups && adapter.features().contains(wgpu::Features::SUBGROUP);
        let mut features = if subgroups { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
        let profile = opts.profile && adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        if profile {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        } else if opts.profile {
            tracing::warn!("TM_WGPU_PROFILE: {} has no timestamp queries; not profiling", summary.name);
        }
        let desc = wgpu::DeviceDescriptor {
            label: Some("tm"),
            required_features: features,
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
        let staging = |label, size, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: usage | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let params = staging("params", PARAMS_BYTES, wgpu::BufferUsages::UNIFORM);
        let inputs = staging("inputs", INPUTS_BYTES + INPUT_WINDOW, wgpu::BufferUsages::STORAGE);
        let adapter_max = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
        let storage_align = u64::from(limits.min_storage_buffer_offset_alignment).max(4);
        // At least a few aligned rows must fit a window.
        let max_binding = opts.max_binding.map_or(adapter_max, |m| m.min(adapter_max)).max(16 * storage_align);
        let profiler = profile.then(|| Profiler::new(&device, &queue));
        Ok(Gpu {
            device,
            queue,
            summary,
            uniform_align: u64::from(limits.min_uniform_buffer_offset_alignment).max(PARAM_BYTES),
            storage_align,
            limits,
            subgroups,
            params,
            inputs,
            max_binding,
            recorder: Mutex::new(Recorder { profiler, ..Default::default() }),
            submissions: Default::default(),
            unsubmitted_writes: Default::default(),
            bind_groups: Mutex::new(HashMap::new()),
            errors,
        })
    }

    fn recorder(&self) -> Result<MutexGuard<'_, Recorder>> {
        self.recorder.lock().map_err(|_| backend_err("command recorder poisoned by an earlier panic"))
    }

    fn submit(&self, r: &mut Recorder) {
        r.pass = None;
        if let Some(mut enc) = r.encoder.take() {
            self.unsubmitted_writes.store(0, std::sync::atomic::Ordering::Relaxed);
            if !r.params_host.is_empty() {
                self.queue.write_buffer(&self.params, 0, &r.params_host);
            }
            if !r.inputs_host.is_empty() {
                self.queue.write_buffer(&self.inputs, 0, &r.inputs_host);
            }
            if let Some(p) = r.profiler.as_mut() {
                p.resolve(&mut enc);
            }
            self.queue.submit([enc.finish()]);
            self.submissions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(p) = r.profiler.as_mut() {
                p.collect(&self.device);
            }
        }
        r.params_used = 0;
        r.inputs_used = 0;
        r.params_host.clear();
        r.inputs_host.clear();
    }

    /// The cached bind group under `key` (a kernel id, then `(buffer id, offset, size)` per
    /// binding), made by `make` on first use.
    pub fn bind_group(&self, key: Vec<u64>, make: impl FnOnce() -> wgpu::BindGroup) -> Result<wgpu::BindGroup> {
        let mut cache = self.bind_groups.lock().map_err(|_| backend_err("bind group cache poisoned"))?;
        if let Some(g) = cache.get(&key) {
            return Ok(g.clone());
        }
        if cache.len() >= MAX_BIND_GROUPS {
            cache.clear();
        }
        let g = make();
        cache.insert(key, g.clone());
        Ok(g)
    }

    /// Writes `data` (a whole number of words) into `buffer` at `offset` through the queue, in
    /// pieces of at most 64 MiB (the caller has flushed any recorded work that touches it). Past
    /// 256 MiB of writes not yet submitted (loading a model), submits them and waits, so their
    /// staging memory is given back.
    pub fn write(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        const PIECE: usize = 64 << 20;
        for (i, piece) in data.chunks(PIECE).enumerate() {
            self.queue.write_buffer(buffer, offset + (i * PIECE) as u64, piece);
            let pending = self.unsubmitted_writes.fetch_add(piece.len() as u64, Relaxed) + piece.len() as u64;
            if pending > 256 << 20 {
                self.unsubmitted_writes.store(0, Relaxed);
                self.queue.submit(std::iter::empty());
                self.wait()?;
            }
        }
        self.take_error()
    }

    /// Command buffers submitted so far (a decode step should cost one).
    pub fn submissions(&self) -> u64 {
        self.submissions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drops the cached bind groups that use buffer `id` (it is being freed).
    pub fn forget_buffer(&self, id: u64) {
        if let Ok(mut cache) = self.bind_groups.lock() {
            cache.retain(|k, _| !k[1..].chunks(3).any(|c| c[0] == id));
        }
    }

    /// Submits the recorded work (if any) and reports wgpu's errors.
    pub fn flush(&self) -> Result<()> {
        let mut r = self.recorder()?;
        self.submit(&mut r);
        drop(r);
        self.take_error()
    }

    /// Records `f`'s commands into the pending encoder.
    pub fn record<T>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> T) -> Result<T> {
        let mut r = self.recorder()?;
        r.pass = None;
        let device = &self.device;
        let enc = r.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("tm step") })
        });
        Ok(f(enc))
    }

    /// Stages launch `name`'s parameter block and host inputs (at most [`INPUT_WINDOW`] bytes,
    /// a multiple of 4), then records `f` into the open compute pass (one pass holds all the
    /// launches between other commands; when profiling, each launch has a pass of its own with
    /// its timestamps). Submits the pending work first when the staging buffers (or the
    /// profiler's queries) are full.
    pub fn record_launch<T>(
        &self,
        name: &'static str,
        params: &[u32; 16],
        inputs: &[u8],
        f: impl FnOnce(&mut wgpu::ComputePass<'_>, Staged) -> T,
    ) -> Result<T> {
        let mut guard = self.recorder()?;
        let r = &mut *guard;
        let input_bytes = (inputs.len() as u64).div_ceil(self.storage_align) * self.storage_align;
        if r.params_used + self.uniform_align > PARAMS_BYTES
            || r.inputs_used + input_bytes > INPUTS_BYTES
            || r.profiler.as_ref().is_some_and(Profiler::full)
        {
            self.submit(r);
        }
        let staged = Staged { params: r.params_used as u32, inputs: r.inputs_used as u32 };
        r.params_host.resize(r.params_used as usize, 0);
        r.params_host.extend_from_slice(bytemuck::cast_slice(params));
        if !inputs.is_empty() {
            r.inputs_host.resize(r.inputs_used as usize, 0);
            r.inputs_host.extend_from_slice(inputs);
        }
        r.params_used += self.uniform_align;
        r.inputs_used += input_bytes;
        let device = &self.device;
        let enc = r.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("tm step") })
        });
        if let Some(p) = r.profiler.as_mut() {
            p.recording();
            let (set, i) = p.next(name);
            let timestamp_writes = Some(wgpu::ComputePassTimestampWrites {
                query_set: &set,
                beginning_of_pass_write_index: Some(i),
                end_of_pass_write_index: Some(i + 1),
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(name), timestamp_writes });
            return Ok(f(&mut pass, staged));
        }
        let pass = r.pass.get_or_insert_with(|| {
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("tm launches"), timestamp_writes: None })
                .forget_lifetime()
        });
        Ok(f(pass, staged))
    }

    /// GPU time per kernel so far, when profiling ([`WgpuOptions::profile`]); work still being
    /// recorded is counted once it is submitted.
    pub fn profile(&self) -> Option<ProfileStats> {
        self.recorder.lock().ok()?.profiler.as_ref().map(|p| p.stats().clone())
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

    /// Submits the recorded work and waits until the queue has finished it.
    pub fn wait(&self) -> Result<()> {
        self.flush()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| backend_err(format!("waiting for the device: {e}")))?;
        self.take_error()
    }

    /// The most bytes of a tensor the backend binds at once ([`WgpuOptions::max_binding`],
    /// at most the adapter's `max_storage_buffer_binding_size`); larger tensors are bound in
    /// windows.
    pub fn max_binding(&self) -> u64 {
        self.max_binding
    }

    /// The largest tensor the backend can hold: the adapter's `max_buffer_size`.
    pub fn max_tensor(&self) -> u64 {
        self.limits.max_buffer_size
    }

    /// The alignment of a storage binding's offset, in bytes.
    pub fn storage_align(&self) -> u64 {
        self.storage_align
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

impl Drop for Gpu {
    /// Prints the profile (when profiling) to stderr; a write error is ignored.
    fn drop(&mut self) {
        if let Some(stats) = self.profile().filter(|s| s.submissions > 0) {
            use std::io::Write;
            let _ = std::io::stderr().write_all(stats.report().as_bytes());
        }
    }
}
