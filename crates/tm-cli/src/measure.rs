//! `tm-cli plan --measure`: plans, then loads the model on this machine's backend, starts the
//! serving engine with the plan's KV blocks and workspace, serves a few requests, and prints the
//! memory really used next to the plan:
//!
//! - **device memory**: the peak of the backend allocator's bytes in use (weights, KV cache,
//!   workspace, scratch); on the CUDA unified variant plus the weights read in place from pinned
//!   file pages and the pinned staging buffer, which the plan counts there too; on the CPU backend
//!   the peak anonymous resident memory (`RssAnon`), which holds all of that and the scratch;
//! - **host memory**: the process's peak anonymous resident memory (`RssAnon`, sampled) while
//!   loading and while serving, and `VmHWM`; while loading, the anonymous growth must stay under
//!   the plan's host share plus its load staging (no second copy of the weights).
//!
//! It fails when the device peak differs from the plan's peak by more than `--tolerance`, or the
//! load's host growth exceeds its bound.

use crate::common::{backend, cuda_options, load_model, BackendChoice, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::sync::Arc;
use std::time::Duration;
use tm_core::sampling::{Rng, SamplingParams};
use tm_core::{DeviceKind, Ops};
use tm_model::engine::{Engine, EngineConfig, Event, FinishReason, Request};
use tm_model::loader::Checkpoint;
use tm_model::plan::rss::{RssPeaks, RssSampler};
use tm_model::plan::{human, plan, MemoryPlan, PlanRequest, PlanTarget};

/// Flags of `plan --measure`.
#[derive(Args, Debug, Clone)]
pub struct MeasureArgs {
    /// Load the model and serve a few requests on this machine's backend, then print measured
    /// device memory and peak RSS next to the plan.
    #[arg(long)]
    pub measure: bool,
    /// Largest accepted |measured − planned| / planned device peak for --measure.
    #[arg(long, default_value_t = 0.05)]
    pub tolerance: f64,
    /// Requests --measure serves, all at once.
    #[arg(long, default_value_t = 4)]
    pub measure_requests: usize,
    /// Prompt tokens of each --measure request.
    #[arg(long, default_value_t = 128)]
    pub measure_input_len: usize,
    /// Generated tokens of each --measure request.
    #[arg(long, default_value_t = 16)]
    pub measure_output_len: usize,
}

/// The most requests `--measure` serves (each from its own thread, all at once).
const MAX_MEASURE_REQUESTS: usize = 1024;

/// Memory figures at one point, in bytes.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct Snapshot {
    /// Backend allocator: bytes in use now.
    in_use: u64,
    /// Backend allocator: the most in use so far.
    alloc_peak: u64,
    /// CUDA unified: weights read in place from pinned file pages (peak).
    zero_copy: u64,
    /// Host buffers the plan counts on the device (CUDA unified: the pinned staging buffer).
    host_buffers: u64,
    /// `alloc_peak + zero_copy + host_buffers`: the figure set against the plan's peak.
    device_peak: u64,
    /// Peak anonymous resident memory of the process over the phase.
    rss_anon_peak: u64,
    /// Growth of the anonymous resident memory over the phase, at its peak.
    rss_anon_growth: u64,
    /// Peak resident memory (VmHWM) over the phase.
    rss_peak: u64,
}

/// What the backend can tell beyond tm-core's `Ops`.
struct Backend {
    ops: Arc<dyn Ops>,
    cuda: Option<Arc<tm_cuda::CudaBackend>>,
}

impl Backend {
    fn open(args: &ModelArgs) -> Result<Backend> {
        if args.backend == BackendChoice::Cuda {
            let b = Arc::new(tm_cuda::CudaBackend::open(cuda_options(args)).context("opening the CUDA backend")?);
            let ops: Arc<dyn Ops> = b.clone();
            return Ok(Backend { ops, cuda: Some(b) });
        }
        Ok(Backend { ops: Arc::from(backend(args)?), cuda: None })
    }

    fn snapshot(&self, plan: &MemoryPlan, rss: Option<RssPeaks>) -> Snapshot {
        let stats = self.ops.allocator().stats();
        let (zero_copy, host_buffers) = match &self.cuda {
            Some(c) if c.cuda_allocator().is_unified() => {
                (c.cuda_allocator().zero_copy_bytes().1, if plan.host_buffers_counted { plan.host_buffers } else { 0 })
            }
            _ => (0, 0),
        };
        let rss = rss.unwrap_or_default();
        Snapshot {
            in_use: stats.in_use,
            alloc_peak: stats.peak,
            zero_copy,
            host_buffers,
            // On the CPU backend the "device" is the process's anonymous memory: the
            // allocator's buffers plus the backend's scratch, the tokenizer and thread stacks,
            // which the plan's scratch allowance covers.
            device_peak: if self.ops.device().kind() == DeviceKind::Cpu {
                stats.peak.max(rss.anon)
            } else {
                stats.peak + zero_copy + host_buffers
            },
            rss_anon_peak: rss.anon,
            rss_anon_growth: rss.anon_growth(),
            rss_peak: rss.rss,
        }
    }
}

/// The plan's peak less what is not resident on a live device (the runtime reserve of a profile
/// is zero here; load staging is transient and not alive with the workspace).
fn planned_device_peak(p: &MemoryPlan) -> u64 {
    p.peak - p.runtime_reserve
}

/// Runs `plan --measure`.
pub fn run(model: &ModelArgs, args: &MeasureArgs, ckpt: Checkpoint, request: &PlanRequest, json: bool) -> Result<()> {
    if args.measure_requests == 0 || args.measure_input_len == 0 || args.measure_output_len == 0 {
        bail!("--measure-requests, --measure-input-len and --measure-output-len must be at least 1");
    }
    if args.measure_requests > MAX_MEASURE_REQUESTS {
        bail!("--measure-requests {} is more than {MAX_MEASURE_REQUESTS} (one thread each)", args.measure_requests);
    }
    if !(args.tolerance > 0.0 && args.tolerance < 1.0) {
        bail!("--tolerance must be in (0, 1), got {}", args.tolerance);
    }
    model.single_rank_only("plan --measure")?;
    let backend = Backend::open(model)?;
    let ops = &backend.ops;
    let target = PlanTarget::for_backend(ops.as_ref())?;
    let p = plan(&ckpt, &target, request).context("planning")?;
    drop(ckpt);
    if !json {
        print!("{}", p.table());
    }
    match args.measure_input_len.checked_add(args.measure_output_len) {
        Some(seq) if seq <= p.max_len => {}
        _ => bail!(
            "--measure-input-len {} + --measure-output-len {} is more than the planned max_len {} tokens",
            args.measure_input_len,
            args.measure_output_len,
            p.max_len
        ),
    }

    let sampler = RssSampler::start(Duration::from_millis(2));
    let loaded = Arc::new(load_model(model, ops.as_ref())?);
    let load = backend.snapshot(&p, sampler.map(RssSampler::finish));

    let sampler = RssSampler::start(Duration::from_millis(2));
    let config = EngineConfig {
        block_size: p.block_size,
        num_blocks: p.num_blocks,
        max_batched_tokens: request.max_batched_tokens,
        max_batch_size: request.max_batch_size,
        max_queue: args.measure_requests,
        max_model_len: Some(p.max_len),
        enable_prefix_caching: false,
        kv_cache_dtype: request.kv_cache_dtype,
    };
    let engine = Engine::start(Arc::clone(&loaded), Arc::clone(ops), config).context("starting the engine")?;
    let mut rng = Rng::new(7);
    let vocab = loaded.model.config.vocab_size as u64;
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..args.measure_requests)
            .map(|_| {
                let prompt: Vec<u32> = (0..args.measure_input_len).map(|_| (rng.next_u64() % vocab) as u32).collect();
                let engine = &engine;
                s.spawn(move || -> Result<()> {
                    let mut req = Request::tokens(prompt)
                        .with_max_tokens(args.measure_output_len)
                        .with_sampling(SamplingParams::greedy());
                    req.ignore_eos = true;
                    for event in engine.submit(req)? {
                        if let Event::Finished(f) = event {
                            if f.reason == FinishReason::Error {
                                bail!("a request failed: {}", f.error.unwrap_or_default());
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        }
        Ok(())
    })?;
    let serve = backend.snapshot(&p, sampler.map(RssSampler::finish));
    engine.shutdown(Duration::from_secs(10))?;

    let planned = planned_device_peak(&p);
    let deviation = serve.device_peak as f64 / planned.max(1) as f64 - 1.0;
    // While loading, the host holds the staging of one tensor (on top of the weights the plan
    // charges to a host-sharing device) and the pinned buffer; nothing like a second copy.
    let host_weights = if p.shared_with_host { p.weights_total - p.weights_in_place } else { 0 };
    let load_bound = host_weights + p.load_staging + p.host_buffers + (64 << 20) + host_weights / 50;
    let kind = target.kind;
    let model_label = &loaded.name;
    if json {
        let v = serde_json::json!({
            "model": model_label,
            "device": target.name,
            "plan": p,
            "planned_device_peak": planned,
            "after_load": load,
            "after_serving": serve,
            "deviation": deviation,
            "tolerance": args.tolerance,
            "load_host_bound": load_bound,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        println!("measured on {} ({kind:?}) with {model_label}:", target.name);
        let line = |what: &str, s: &Snapshot| {
            let mut extra = String::new();
            if s.zero_copy > 0 {
                extra += &format!(" + {} read in place", human(s.zero_copy));
            }
            if s.host_buffers > 0 {
                extra += &format!(" + {} pinned staging", human(s.host_buffers));
            }
            println!(
                "  {what:<14} device peak {} (allocator peak {}{extra}; {} in use now); host: RssAnon peak {} (+{}), \
                 VmHWM {}",
                human(s.device_peak),
                human(s.alloc_peak),
                human(s.in_use),
                human(s.rss_anon_peak),
                human(s.rss_anon_growth),
                human(s.rss_peak)
            );
        };
        line("after load:", &load);
        line("after serving:", &serve);
        println!(
            "  planned device peak {} (weights {}, workspace {}, scratch {}, KV {}{}): measured {:+.2}% (tolerance \
             ±{:.1}%)",
            human(planned),
            human(p.weights_total),
            human(p.workspace),
            human(p.kernel_scratch.total),
            human(p.kv_bytes),
            if p.host_buffers_counted && p.host_buffers > 0 {
                format!(", host buffers {}", human(p.host_buffers))
            } else {
                String::new()
            },
            deviation * 100.0,
            args.tolerance * 100.0
        );
        println!(
            "  load: host anonymous growth {} (bound: {}weights' staging {} + pinned {} + slack = {})",
            human(load.rss_anon_growth),
            if host_weights > 0 {
                format!("weights held in host memory {} + ", human(host_weights))
            } else {
                String::new()
            },
            human(p.load_staging),
            human(p.host_buffers),
            human(load_bound)
        );
    }
    let mut failures = Vec::new();
    if deviation.abs() > args.tolerance {
        failures.push(format!(
            "the device peak {} is {:+.2}% off the planned {} (tolerance ±{:.1}%)",
            human(serve.device_peak),
            deviation * 100.0,
            human(planned),
            args.tolerance * 100.0
        ));
    }
    if kind != DeviceKind::Cpu && load.device_peak > planned {
        failures
            .push(format!("loading alone took {} of the device, more than the planned peak", human(load.device_peak)));
    }
    if load.rss_anon_growth > load_bound {
        failures.push(format!(
            "loading grew the process's anonymous memory by {}, more than the bound {}: a second copy of the weights?",
            human(load.rss_anon_growth),
            human(load_bound)
        ));
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    if !json {
        println!("measured within the plan");
    }
    Ok(())
}
