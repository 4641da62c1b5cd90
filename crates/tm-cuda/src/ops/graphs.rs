//! CUDA graphs for repeated steps.
//!
//! A step is first run in [`LaunchMode::Record`]: every op validates its inputs and uploads its
//! small per-step inputs (token ids, positions, slots, block tables) into their device buffers as
//! usual, but kernels and products are only folded into a signature (kernel, grid, arguments —
//! device addresses and sizes, not the contents of the input buffers). Decoding steps of the same
//! batch shape have the same signature: they launch the same kernels on the same memory, with only
//! the buffer contents changed. So:
//! - a signature with a graph: the graph is launched (its kernels read the inputs just uploaded);
//! - a signature seen once before: the step runs eagerly, then is captured into a graph (the
//!   capture records without running; the input buffers already hold this step's inputs, and the
//!   ops refuse to upload or grow a buffer while capturing, so a capture cannot bake in stale or
//!   freed memory);
//! - a new signature (prefill chunks, a new batch size): the step runs eagerly;
//! - a step marked uncapturable while it was recorded ([`Gpu::mark_uncapturable`]: it queues an
//!   NCCL collective, which tm keeps out of graphs) runs eagerly and is not remembered.
//!
//! Under tensor parallelism every rank runs this on its own GPU. The one-shot collectives of
//! [`crate::peer`] are launched like kernels, so they are signed and captured; they keep their
//! epoch on the device, so ranks that decide differently for a step (one replays, one runs
//! eagerly) still run each collective exactly once and meet. A failed capture on one rank leaves
//! nobody waiting: the step already ran eagerly on that rank.
//!
//! A failed capture is logged and dropped; the step has already run eagerly.

use std::collections::{HashMap, VecDeque};

use cudarc::driver::{sys, CudaEvent, CudaGraph};
use tm_core::{Error, Result};

use crate::runtime::{driver_err, Gpu, LaunchMode};
use crate::staging::Staging;

/// Graphs kept at most (one per decode batch shape and attention plan in use).
const MAX_GRAPHS: usize = 64;
/// Signatures remembered as "seen once".
const MAX_SEEN: usize = 256;

/// A captured graph. cudarc's handle holds raw driver pointers, so it is not `Send`.
struct Graph(CudaGraph);

// SAFETY: a graph is only touched through `GraphCache`, which lives behind the backend's mutex,
// so its driver objects are never used from two threads at once (the driver's rule for graphs).
unsafe impl Send for Graph {}

/// Captured graphs by step signature.
#[derive(Default)]
pub(crate) struct GraphCache {
    graphs: HashMap<u64, Graph>,
    order: VecDeque<u64>,
    seen: VecDeque<u64>,
    /// Steps replayed from a graph, run eagerly, and captured.
    pub(crate) counts: [u64; 3],
    /// Host time spent recording steps (validating, uploading inputs, signing launches).
    record_time: std::time::Duration,
    /// Of which: uploads of step inputs (count, ns).
    record_uploads: (u64, u64),
    /// Events around the last graph replay, read at the next step (when they have completed).
    replay_events: Option<(CudaEvent, CudaEvent)>,
    /// GPU time of the replays measured so far, and how many.
    replay_gpu: (f64, u64),
}

impl Drop for GraphCache {
    /// Logs how the steps ran and what recording cost on the host.
    fn drop(&mut self) {
        let [replayed, eager, captured] = self.counts;
        let steps = replayed + eager;
        if steps > 0 {
            let (gpu_ms, timed) = self.replay_gpu;
            tracing::info!(
                "cuda graphs: {replayed} steps replayed, {eager} run eagerly, {captured} captured; recording took {:.1} us \
                 per step on the host ({:.1} uploads taking {:.1} us); a replay took {:.1} us on the GPU ({timed} timed)",
                self.record_time.as_secs_f64() * 1e6 / steps as f64,
                self.record_uploads.0 as f64 / steps as f64,
                self.record_uploads.1 as f64 / 1e3 / steps as f64,
                if timed > 0 { gpu_ms * 1e3 / timed as f64 } else { 0.0 }
            );
        }
    }
}

impl std::fmt::Debug for GraphCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphCache").field("graphs", &self.graphs.len()).field("counts", &self.counts).finish()
    }
}

impl GraphCache {
    fn insert(&mut self, signature: u64, graph: CudaGraph) {
        if self.graphs.len() >= MAX_GRAPHS {
            if let Some(old) = self.order.pop_front() {
                self.graphs.remove(&old);
            }
        }
        self.order.push_back(signature);
        self.graphs.insert(signature, Graph(graph));
    }

    /// Whether `signature` was seen before; remembers it.
    fn seen_before(&mut self, signature: u64) -> bool {
        if self.seen.contains(&signature) {
            return true;
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.pop_front();
        }
        self.seen.push_back(signature);
        false
    }
}

/// Runs one forward step through the graph cache.
pub(crate) fn run_step(
    gpu: &Gpu,
    staging: &Staging,
    cache: &mut GraphCache,
    step: &mut (dyn FnMut() -> Result<()> + Send),
) -> Result<()> {
    let start = std::time::Instant::now();
    let uploads = staging.upload_stats();
    gpu.set_mode(LaunchMode::Record);
    let recorded = step();
    let signature = gpu.signature();
    let uncapturable = gpu.uncapturable();
    gpu.set_mode(LaunchMode::Eager);
    cache.record_time += start.elapsed();
    let after = staging.upload_stats();
    cache.record_uploads.0 += after.0 - uploads.0;
    cache.record_uploads.1 += after.1 - uploads.1;
    recorded?;
    if uncapturable {
        step()?;
        cache.counts[1] += 1;
        return Ok(());
    }
    if let Some((start, end)) = cache.replay_events.as_ref() {
        if end.is_complete() {
            if let Ok(ms) = start.elapsed_ms(end) {
                cache.replay_gpu.0 += ms as f64;
                cache.replay_gpu.1 += 1;
            }
        }
    }
    if let Some(graph) = cache.graphs.get(&signature) {
        cache.counts[0] += 1;
        let events = match cache.replay_events.take() {
            Some(e) => Some(e),
            None => replay_events(gpu),
        };
        if let Some((start, _)) = &events {
            let _ = start.record(gpu.stream());
        }
        graph.0.launch().map_err(driver_err("cuGraphLaunch"))?;
        if let Some((_, end)) = &events {
            let _ = end.record(gpu.stream());
        }
        cache.replay_events = events;
        return Ok(());
    }
    let capture = cache.seen_before(signature);
    step()?;
    cache.counts[1] += 1;
    if capture {
        match capture_step(gpu, step) {
            Ok(graph) => {
                cache.counts[2] += 1;
                cache.insert(signature, graph);
            }
            Err(e) => tracing::debug!("CUDA graph capture failed, the step ran eagerly: {e}"),
        }
    }
    Ok(())
}

/// Two timing events for measuring replays (none if the driver refuses: timing is optional).
fn replay_events(gpu: &Gpu) -> Option<(CudaEvent, CudaEvent)> {
    let ctx = gpu.stream().context();
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    Some((ctx.new_event(flags).ok()?, ctx.new_event(flags).ok()?))
}

/// Captures `step` into a graph without running it.
fn capture_step(gpu: &Gpu, step: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<CudaGraph> {
    let stream = gpu.stream();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver_err("cuStreamBeginCapture"))?;
    gpu.set_mode(LaunchMode::Capture);
    let ran = step();
    gpu.set_mode(LaunchMode::Eager);
    // The capture must be ended whatever happened, or the stream stays in capture mode.
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(driver_err("cuStreamEndCapture"));
    ran?;
    graph?.ok_or_else(|| Error::Backend { backend: "cuda".into(), message: "the captured graph is empty".into() })
}
