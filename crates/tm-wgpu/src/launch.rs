//! Kernel launches: pipelines with explicit layouts, cached bind groups, and windows over
//! tensors larger than one storage binding.
//!
//! Every kernel's layout is read from its WGSL source ([`tm_kernels::wgsl::bindings`]): binding
//! 0 is the parameter block and binding 1, when named `inputs`, the launch's host inputs; both
//! are bound with dynamic offsets into the recorder's staging buffers, so a launch's bind group
//! depends only on the tensors it touches and is cached across steps.

use crate::context::{Staged, INPUT_WINDOW, PARAM_BYTES};
use crate::ops::WgpuBackend;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;
use tm_core::{Error, Result, Tensor};
use tm_kernels::wgsl::BindingKind;

/// Buffer id of the parameter staging buffer in bind-group cache keys.
const PARAMS_ID: u64 = u64::MAX;
/// Buffer id of the host-input staging buffer in bind-group cache keys.
const INPUTS_ID: u64 = u64::MAX - 1;
/// Buffer id of the placeholder bound where a kernel's binding is unused.
pub(crate) const DUMMY_ID: u64 = u64::MAX - 2;

/// One storage binding: `size` bytes of `buffer` from `offset`.
#[derive(Clone, Debug)]
pub(crate) struct Bind {
    pub buffer: wgpu::Buffer,
    /// Identity for the bind-group cache (the allocator's address for tensors).
    pub id: u64,
    pub offset: u64,
    pub size: u64,
}

/// A compiled kernel and its layout.
#[derive(Debug)]
pub(crate) struct Compiled {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    kinds: Vec<BindingKind>,
    index: u64,
}

/// Compiled kernels by name and fixed token count (0: none; see [`WgpuBackend::dispatch_fixed`]).
pub(crate) type PipelineCache = HashMap<(&'static str, u32), Arc<Compiled>>;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Splits `units` units (matrix rows, KV blocks, tokens) into windows `(first, count)` so that
/// each bound tensor, holding `unit_bytes[i]` bytes per unit, is bound in at most `max` bytes
/// from an offset that is a multiple of `align`. One window when everything fits.
pub(crate) fn windows(
    units: usize,
    unit_bytes: &[u64],
    max: u64,
    align: u64,
    what: &str,
) -> Result<Vec<(usize, usize)>> {
    let widest = unit_bytes.iter().copied().max().unwrap_or(0);
    if units == 0 || widest == 0 || (units as u64).saturating_mul(widest).div_ceil(4) * 4 <= max {
        return Ok(vec![(0, units)]);
    }
    // Units per window must be a multiple of `step` for every window start to be aligned.
    let step = unit_bytes.iter().filter(|&&b| b > 0).fold(1u64, |step, &b| {
        let need = align / gcd(b, align);
        step / gcd(step, need) * need
    });
    let per = (max.saturating_sub(4) / widest) / step * step;
    if per == 0 {
        return Err(Error::Unsupported(format!(
            "{what}: {step} unit(s) of {widest} bytes (the least that keeps bindings aligned to {align} bytes) \
             exceed the storage binding limit of {max} bytes"
        )));
    }
    let per = per as usize;
    Ok((0..units).step_by(per).map(|first| (first, per.min(units - first))).collect())
}

/// A 2-D grid of `count` workgroups: `(x, y)` with `x <= 65535`.
pub(crate) fn grid(count: u64) -> (u32, u32) {
    let x = count.clamp(1, 65535);
    (x as u32, count.div_ceil(x).max(1) as u32)
}

impl WgpuBackend {
    /// The compiled kernel `name` with its `TOKENS` override set to `tokens` (0: left at its
    /// default), compiling it on first use.
    pub(crate) fn compiled(&self, name: &'static str, tokens: u32) -> Result<Arc<Compiled>> {
        let mut cache = self.pipelines.lock().map_err(|_| Error::invalid("wgpu pipeline cache poisoned"))?;
        if let Some(p) = cache.get(&(name, tokens)) {
            return Ok(Arc::clone(p));
        }
        let kernel = tm_kernels::wgsl::kernel(name)
            .ok_or_else(|| Error::Unsupported(format!("wgpu kernel {name} does not exist")))?;
        if kernel.subgroups && !self.gpu.subgroups {
            return Err(Error::Unsupported(format!("wgpu kernel {name} needs subgroups, which this device lacks")));
        }
        let source = kernel.source();
        if tokens != 0 && !source.contains("override TOKENS") {
            return Err(Error::invalid(format!("wgpu kernel {name} has no token count to fix")));
        }
        let mut constants = Vec::new();
        if tokens != 0 {
            constants.push(("TOKENS", f64::from(tokens)));
        }
        if source.contains("override ROWS") {
            constants.push(("ROWS", f64::from(self.gemv_shape.0)));
            constants.push(("WG", f64::from(self.gemv_shape.1)));
        }
        let bindings = tm_kernels::wgsl::bindings(&source);
        let kinds: Vec<BindingKind> = bindings.iter().map(|b| b.1).collect();
        let device = &self.gpu.device;
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .map(|&(binding, kind)| {
                let ty = match kind {
                    BindingKind::Uniform => wgpu::BufferBindingType::Uniform,
                    BindingKind::ReadOnly | BindingKind::Inputs => wgpu::BufferBindingType::Storage { read_only: true },
                    BindingKind::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                };
                let dynamic = matches!(kind, BindingKind::Uniform | BindingKind::Inputs);
                wgpu::BindGroupLayoutEntry {
                    binding,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: dynamic, min_binding_size: None },
                    count: None,
                }
            })
            .collect();
        let (pipeline, layout) =
            self.gpu.scoped(wgpu::ErrorFilter::Validation, &format!("compiling kernel {name}"), || {
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(name),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
                let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(name),
                    entries: &entries,
                });
                let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(name),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(name),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some(kernel.entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &constants,
                        ..Default::default()
                    },
                    cache: None,
                });
                (pipeline, layout)
            })?;
        let compiled = Arc::new(Compiled { pipeline, layout, kinds, index: cache.len() as u64 });
        cache.insert((name, tokens), Arc::clone(&compiled));
        Ok(compiled)
    }

    /// The whole of tensor `t` as one binding; an error naming `what` when it exceeds the
    /// binding limit (only weights and the KV cache are bound in windows).
    pub(crate) fn whole(&self, t: &Tensor, what: &str) -> Result<Bind> {
        let b = self.window(t, 0, t.desc().bytes() as u64)?;
        let max = self.gpu.max_binding();
        if b.size > max {
            return Err(Error::Unsupported(format!(
                "{what}: a tensor of {} bytes exceeds the wgpu storage binding limit of {max} bytes \
                 (lower the batch or --max-batched-tokens)",
                b.size
            )));
        }
        Ok(b)
    }

    /// `bytes` bytes of tensor `t` from byte `offset` (a multiple of the storage alignment), as
    /// one binding (rounded up to whole words, within the buffer).
    pub(crate) fn window(&self, t: &Tensor, offset: u64, bytes: u64) -> Result<Bind> {
        let buffer = self.buf(t)?;
        let size = (bytes.max(4).div_ceil(4) * 4).min(buffer.size().saturating_sub(offset));
        if size == 0 || !offset.is_multiple_of(self.gpu.storage_align()) {
            return Err(Error::invalid(format!(
                "binding {bytes} bytes at {offset} of a buffer of {} bytes",
                buffer.size()
            )));
        }
        Ok(Bind { buffer, id: t.buffer().addr(), offset, size })
    }

    /// Records kernel `name` over `groups` workgroups: `params` at binding 0, `inputs` (host
    /// data, a whole number of u32 words) at binding 1 when the kernel has one, and `binds` at
    /// the following bindings (the placeholder buffer for any left over).
    pub(crate) fn dispatch(
        &self,
        name: &'static str,
        params: &[u32],
        inputs: &[u8],
        binds: &[Bind],
        groups: (u32, u32),
    ) -> Result<()> {
        self.dispatch_fixed(name, 0, params, inputs, binds, groups)
    }

    /// [`WgpuBackend::dispatch`] of a pipeline whose `TOKENS` override is `tokens` (a kernel
    /// that declares it, such as the matrix-vector ones; one pipeline per value, so loops over
    /// tokens unroll), or left at its default when `tokens` is 0.
    pub(crate) fn dispatch_fixed(
        &self,
        name: &'static str,
        tokens: u32,
        params: &[u32],
        inputs: &[u8],
        binds: &[Bind],
        groups: (u32, u32),
    ) -> Result<()> {
        let max = self.gpu.limits.max_compute_workgroups_per_dimension;
        if groups.0 > max || groups.1 > max {
            return Err(Error::Unsupported(format!(
                "kernel {name} needs {groups:?} workgroups; the adapter allows {max} per dimension"
            )));
        }
        if params.len() > 16 {
            return Err(Error::invalid(format!("kernel {name} got {} parameters; at most 16 fit", params.len())));
        }
        let k = self.compiled(name, tokens)?;
        let mut words = [0u32; 16];
        words[..params.len()].copy_from_slice(params);
        let has_inputs = k.kinds.get(1) == Some(&BindingKind::Inputs);
        // Inputs beyond the staging window go up in a buffer of their own (not cached).
        let own_inputs = (has_inputs && inputs.len() as u64 > INPUT_WINDOW).then(|| {
            use wgpu::util::DeviceExt;
            self.gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("inputs"),
                contents: inputs,
                usage: wgpu::BufferUsages::STORAGE,
            })
        });
        let mut all: Vec<Bind> = Vec::with_capacity(k.kinds.len());
        all.push(Bind { buffer: self.gpu.params.clone(), id: PARAMS_ID, offset: 0, size: PARAM_BYTES });
        if has_inputs {
            all.push(match &own_inputs {
                Some(b) => Bind { buffer: b.clone(), id: 0, offset: 0, size: b.size() },
                None => Bind { buffer: self.gpu.inputs.clone(), id: INPUTS_ID, offset: 0, size: INPUT_WINDOW },
            });
        }
        let first = all.len();
        if binds.len() > k.kinds.len() - first {
            return Err(Error::invalid(format!(
                "kernel {name} got {} buffers for {} bindings",
                binds.len(),
                k.kinds.len() - first
            )));
        }
        all.extend_from_slice(binds);
        while all.len() < k.kinds.len() {
            all.push(Bind { buffer: self.dummy.clone(), id: DUMMY_ID, offset: 0, size: self.dummy.size() });
        }
        let make = || {
            let entries: Vec<wgpu::BindGroupEntry> = all
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &b.buffer,
                        offset: b.offset,
                        size: NonZeroU64::new(b.size),
                    }),
                })
                .collect();
            self.gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(name),
                layout: &k.layout,
                entries: &entries,
            })
        };
        let group = if own_inputs.is_some() {
            make()
        } else {
            let mut key = Vec::with_capacity(1 + 3 * all.len());
            key.push(k.index);
            for b in &all {
                key.extend_from_slice(&[b.id, b.offset, b.size]);
            }
            self.gpu.bind_group(key, make)?
        };
        let staged_inputs = if has_inputs && own_inputs.is_none() { inputs } else { &[] };
        self.gpu.record_launch(name, &words, staged_inputs, |pass, staged: Staged| {
            pass.set_pipeline(&k.pipeline);
            let offsets = [staged.params, if own_inputs.is_some() { 0 } else { staged.inputs }];
            pass.set_bind_group(0, &group, &offsets[..if has_inputs { 2 } else { 1 }]);
            pass.dispatch_workgroups(groups.0, groups.1, 1);
        })?;
        self.gpu.take_error()
    }

    /// Records a 1-D kernel over `n` invocations (workgroups of 256).
    pub(crate) fn dispatch_1d(
        &self,
        name: &'static str,
        params: &[u32],
        inputs: &[u8],
        binds: &[Bind],
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.dispatch(name, params, inputs, binds, grid((n as u64).div_ceil(256)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_fit_and_stay_aligned() {
        assert_eq!(windows(10, &[100], 1 << 20, 256, "t").unwrap(), vec![(0, 10)]);
        // 1000 rows of 300 and 20 bytes under a 64 KiB limit, offsets aligned to 256.
        let w = windows(1000, &[300, 20], 65536, 256, "t").unwrap();
        assert!(w.len() > 1);
        let mut next = 0;
        for &(first, count) in &w {
            assert_eq!(first, next);
            assert!((first as u64 * 300).is_multiple_of(256) && (first as u64 * 20).is_multiple_of(256));
            assert!(count as u64 * 300 <= 65536);
            next = first + count;
        }
        assert_eq!(next, 1000);
        assert!(windows(4, &[1 << 20], 65536, 256, "huge row").is_err());
    }
}
