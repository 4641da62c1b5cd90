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
//! - a new signature (prefill chunks, a new batch size): the step runs eagerly.
//!
//! A failed capture is logged and dropped; the step has already run eagerly.

use std::collections::{HashMap, VecDeque};

use cudarc::driver::{sys, CudaGraph};
use tm_core::{Error, Result};

use crate::runtime::{driver_err, Gpu, LaunchMode};

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
pub(crate) fn run_step(gpu: &Gpu, cache: &mut GraphCache, step: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
    gpu.set_mode(LaunchMode::Record);
    let recorded = step();
    let signature = gpu.signature();
    gpu.set_mode(LaunchMode::Eager);
    recorded?;
    if let Some(graph) = cache.graphs.get(&signature) {
        cache.counts[0] += 1;
        return graph.0.launch().map_err(driver_err("cuGraphLaunch"));
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
