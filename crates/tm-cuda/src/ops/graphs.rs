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
//!
//! # Early replay
//! Recording a batch-1 step of an 8B model takes 0.13-0.16 ms of host time (about 300 ops), all
//! of it on the critical path: the graph can only be launched once the signature is known. But a
//! decode step's per-step inputs are all uploaded by the end of its first layer (the later layers
//! upload the same bytes again, which [`super::meta`] skips), and the model says so
//! ([`tm_core::Ops::step_inputs_ready`]). So if the signature recorded up to that point equals
//! the one recorded there when the cache last replayed or captured a graph, that graph is
//! launched at once (an *early* replay) and the rest of the step is recorded while the GPU runs
//! it. At the end the full signature must equal the graph's and no upload may have happened since
//! the launch; otherwise the step runs again eagerly, which rewrites everything the graph wrote
//! (a step's writes are its workspace, its KV slots and its logits; the KV values are the same),
//! or, when the step had collectives (a rerun would enter them once more than the other ranks),
//! fails with an error. `TM_EARLY_REPLAY=0` turns early replays off.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

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
// or through the `Early` prediction lent out while that mutex is held by the step's thread, which
// is the only thread that launches it; so its driver objects are never used from two threads at
// once (the driver's rule for graphs).
unsafe impl Send for Graph {}
// SAFETY: as above: shared references only ever reach the thread that holds the cache's mutex.
unsafe impl Sync for Graph {}

/// Whether early replays are on (`TM_EARLY_REPLAY` is not `0`).
fn early_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_EARLY_REPLAY").map_or(true, |v| v.trim() != "0"))
}

/// The early-replay state of the step being recorded (see the module docs). It lives beside the
/// cache, not in it: [`inputs_ready`] runs inside the step, while [`run_step`] holds the cache.
#[derive(Default)]
pub(crate) struct Early {
    /// The graph predicted for this step: the signature recorded up to `step_inputs_ready` when
    /// it was last replayed or captured, its full signature, and the graph.
    predicted: Option<(u64, u64, Arc<Graph>)>,
    /// The signature recorded up to `step_inputs_ready` in this step.
    prefix: Option<u64>,
    /// Once the predicted graph is launched: its full signature and the staging upload count
    /// at the launch.
    launched: Option<(u64, u64)>,
    /// The cache's replay timing events, lent for the step.
    events: Option<(CudaEvent, CudaEvent)>,
}

impl std::fmt::Debug for Early {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Early")
            .field("predicted", &self.predicted.as_ref().map(|p| (p.0, p.1)))
            .field("prefix", &self.prefix)
            .field("launched", &self.launched)
            .finish_non_exhaustive()
    }
}

/// The step being recorded has uploaded its per-step inputs ([`tm_core::Ops::step_inputs_ready`]):
/// launches the predicted graph if the signature so far is the predicted one.
pub(crate) fn inputs_ready(gpu: &Gpu, staging: &Staging, early: &Mutex<Early>) -> Result<()> {
    if gpu.mode() != LaunchMode::Record {
        return Ok(());
    }
    let mut e = early.lock().map_err(|_| Error::invalid("cuda early replay state poisoned"))?;
    let prefix = gpu.signature();
    e.prefix = Some(prefix);
    let Some((want, full, graph)) = e.predicted.take() else { return Ok(()) };
    if want != prefix || gpu.uncapturable() {
        return Ok(());
    }
    launch_timed(gpu, &graph, &e.events, "cuGraphLaunch (early)")?;
    e.launched = Some((full, staging.upload_stats().0));
    Ok(())
}

/// Captured graphs by step signature.
#[derive(Default)]
pub(crate) struct GraphCache {
    graphs: HashMap<u64, Arc<Graph>>,
    /// The last graph replayed or captured: (signature up to `step_inputs_ready`, signature).
    last: Option<(u64, u64)>,
    /// Early replays that held, and that did not (the step then ran again).
    pub(crate) early: (u64, u64),
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
    /// Whether those events time a replay not yet counted in `replay_gpu`.
    replay_pending: bool,
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
            let (early, missed) = self.early;
            tracing::info!(
                "cuda graphs: {replayed} steps replayed ({early} early, {missed} early replays rerun), {eager} run eagerly, \
                 {captured} captured; recording took {:.1} us per step on the host ({:.1} uploads taking {:.1} us); \
                 a replay took {:.1} us on the GPU ({timed} timed)",
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
        self.graphs.insert(signature, Arc::new(Graph(graph)));
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

/// Runs one forward step through the graph cache (`early`: see the module docs on early replay).
pub(crate) fn run_step(
    gpu: &Gpu,
    staging: &Staging,
    cache: &mut GraphCache,
    early: &Mutex<Early>,
    step: &mut (dyn FnMut() -> Result<()> + Send),
) -> Result<()> {
    // The previous replay's GPU time (the step's results have been read since, so it is done).
    if let (Some((start, end)), true) = (cache.replay_events.as_ref(), cache.replay_pending) {
        if end.is_complete() {
            cache.replay_pending = false;
            if let Ok(ms) = start.elapsed_ms(end) {
                cache.replay_gpu.0 += ms as f64;
                cache.replay_gpu.1 += 1;
            }
        }
    }
    {
        let mut e = early.lock().map_err(|_| Error::invalid("cuda early replay state poisoned"))?;
        *e = Early::default();
        if let Some((prefix, full)) = cache.last.filter(|_| early_enabled()) {
            if let Some(graph) = cache.graphs.get(&full) {
                e.predicted = Some((prefix, full, Arc::clone(graph)));
                e.events = take_events(cache, gpu);
            }
        }
    }
    let start = std::time::Instant::now();
    let uploads = staging.upload_stats();
    gpu.set_mode(LaunchMode::Record);
    let recorded = step();
    let signature = gpu.signature();
    let uncapturable = gpu.uncapturable();
    let collectives = gpu.collectives();
    gpu.set_mode(LaunchMode::Eager);
    cache.record_time += start.elapsed();
    let after = staging.upload_stats();
    cache.record_uploads.0 += after.0 - uploads.0;
    cache.record_uploads.1 += after.1 - uploads.1;
    let Early { prefix, launched, events, .. } =
        std::mem::take(&mut *early.lock().map_err(|_| Error::invalid("cuda early replay state poisoned"))?);
    if events.is_some() {
        cache.replay_events = events;
        cache.replay_pending |= launched.is_some();
    }
    if let Some((full, uploads_at)) = launched {
        if recorded.is_ok() && signature == full && after.0 == uploads_at && !uncapturable {
            cache.counts[0] += 1;
            cache.early.0 += 1;
            cache.last = prefix.map(|p| (p, full));
            return Ok(());
        }
        // The graph launched early was not this step's (or missed an upload): its writes are
        // rewritten by running the step eagerly, unless the step has collectives.
        cache.early.1 += 1;
        cache.last = None;
        recorded?;
        if collectives || uncapturable {
            return Err(Error::Backend {
                backend: "cuda".into(),
                message: "a CUDA graph replayed early did not match its step, which has collectives and cannot \
                          be run again on this rank alone; set TM_EARLY_REPLAY=0 and report this"
                    .into(),
            });
        }
        tracing::warn!("a CUDA graph replayed early did not match its step; running the step again eagerly");
        step()?;
        cache.counts[1] += 1;
        return Ok(());
    }
    recorded?;
    if uncapturable {
        step()?;
        cache.counts[1] += 1;
        return Ok(());
    }
    if let Some(graph) = cache.graphs.get(&signature).cloned() {
        cache.counts[0] += 1;
        let events = take_events(cache, gpu);
        launch_timed(gpu, &graph, &events, "cuGraphLaunch")?;
        cache.replay_pending = events.is_some();
        cache.replay_events = events;
        cache.last = prefix.map(|p| (p, signature));
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
                cache.last = prefix.map(|p| (p, signature));
            }
            Err(e) => tracing::debug!("CUDA graph capture failed, the step ran eagerly: {e}"),
        }
    }
    Ok(())
}

/// The cache's timing events for the next replay (made on first use).
fn take_events(cache: &mut GraphCache, gpu: &Gpu) -> Option<(CudaEvent, CudaEvent)> {
    cache.replay_events.take().or_else(|| replay_events(gpu))
}

/// Launches `graph` on the stream between the two timing `events` (when there are any).
fn launch_timed(gpu: &Gpu, graph: &Graph, events: &Option<(CudaEvent, CudaEvent)>, what: &'static str) -> Result<()> {
    if let Some((start, _)) = events {
        let _ = start.record(gpu.stream());
    }
    graph.0.launch().map_err(driver_err(what))?;
    if let Some((_, end)) = events {
        let _ = end.record(gpu.stream());
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
