//! NCCL: tm-core's [`Comm`] for GPU ranks, one thread per GPU in one process and one
//! communicator per rank ([`NcclComm::group`]).
//!
//! NCCL is loaded at run time through tm's own bindings ([`Api`]: the dozen functions tm calls,
//! opened by the path [`crate::libs`] finds, so a missing or old library is an error that says
//! so, never a panic). The communicators are *blocking* ones: NCCL's non-blocking mode hands
//! every collective to a new thread of its own and answers `ncclInProgress` (about 130 µs per
//! collective, measured: 14 ms per decode step of an 8B model instead of 3), so instead every
//! NCCL call that could block runs where tm can give up on it:
//! - initialisation runs on a thread of its own, waited for with a deadline;
//! - a collective that stays inside NCCL past its deadline (connecting to a peer that never
//!   comes) is seen by the watchdog, which aborts the communicator from its own thread
//!   (`ncclCommAbort` is what unblocks such a call).
//!
//! # Never hanging
//! NCCL queues a collective on the rank's stream and returns; the exchange happens later on the
//! GPU. So the deadline of a collective is kept by a *watchdog* thread per group:
//! - After queueing a collective, the rank records a CUDA event behind it on its stream. The
//!   watchdog polls the oldest pending event of every rank (every [`WATCHDOG_PERIOD`]); one that
//!   is still pending when its deadline passes fails the group with [`Error::Timeout`] naming
//!   the rank, the collective (`all_reduce #37 (layer 5 o_proj)`: the rank's 38th collective and
//!   the caller's step), and which ranks never queued it (a host-side hang) or, when all did,
//!   that the GPUs did not complete the exchange (a transport hang).
//! - It also fails the group when a rank has been inside one NCCL call past the call's deadline,
//!   and polls `ncclCommGetAsyncError` of every communicator: an asynchronous NCCL error fails
//!   the group the same way.
//! - A failed group is *aborted*: `ncclCommAbort` on every communicator (on the watchdog thread,
//!   or a thread of its own, never the caller's), which makes NCCL's kernels in flight return, so
//!   every rank blocked on its stream comes back. Every later call on any rank fails at once.
//! - [`Comm::synchronize`] (called by every rank at the end of every step) waits for the rank's
//!   stream with the same deadline, polling, so the caller learns of the failure in that step.
//! - Initialisation (`ncclCommInitRankConfig` for every rank, in one group, on its own thread)
//!   and the start-up self-test ([`self_test`]) have deadlines too; on expiry the error says what
//!   was tried and what to try ([`INIT_HINT`]).
//!
//! # Small messages: one-shot kernels over peer access
//! When every pair of GPUs has peer access ([`crate::peer::plan`]), all-reduces and all-gathers
//! of up to [`PeerGroup::max_bytes`] per rank (every decode step's) do not go through NCCL but
//! through tm's one-shot kernels ([`crate::peer`]): one launch on the rank's stream, about the
//! latency of one peer round trip (all-reduces of up to [`PeerGroup::ll_bytes`]: the
//! low-latency protocol, whose flags travel with the data; see [`crate::peer`]). They are
//! launched through [`Gpu::launch`], so the backend's
//! CUDA graphs sign and capture them like any kernel. Their deadline is kept on the device: a
//! kernel that waits longer for a peer gives up and leaves a report (the peer, the step), which
//! the watchdog and [`Comm::synchronize`] turn into the same [`Error::Timeout`] as an NCCL
//! deadline, aborting the group. Larger messages, other dtypes, broadcasts and barriers go
//! through NCCL, which is kept out of graphs: a step that queues an NCCL collective while it is
//! recorded is marked uncapturable ([`Gpu::mark_uncapturable`]) and runs eagerly.
//!
//! [`Comm::all_reduce_add_rms_norm`] (a row-parallel projection's output joining the residual
//! stream) is one fused one-shot kernel on the peer path (unless `TM_FUSED_ALLREDUCE_NORM=0`), the
//! all-reduce then the backend's `add_rms_norm` otherwise; it counts as one collective either way.
//!
//! Collectives are numbered per rank in the order the rank's host issues them: a step recorded
//! for a graph issues them once while recording and, when it is not replayed, once more while
//! running eagerly (a capture issues nothing), the same on every rank.
//!
//! # Fault injection
//! [`NcclComm::stall_after`] makes a rank stop queueing at a chosen collective (as a hung host
//! thread would), so the paths above can be tested on real GPUs.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tm_core::{Comm, DType, Error, Ops, Result, Tensor};

use crate::libs;
use crate::peer::{self, PeerGroup, PeerTimeout, Protocol};
use crate::runtime::{Gpu, LaunchMode};

/// How often the watchdog looks at pending collectives and asynchronous errors.
pub const WATCHDOG_PERIOD: Duration = Duration::from_millis(2);

/// What to try when NCCL cannot start or its self-test fails.
pub const INIT_HINT: &str =
    "try NCCL_P2P_DISABLE=1 (GPUs exchange through host memory instead of peer-to-peer copies, \
     which hangs on some PCIe systems), fewer GPUs (--tp), or NCCL_DEBUG=INFO to see which transport NCCL chose";

/// What to try when a collective misses its deadline.
pub const TIMEOUT_HINT: &str = "the communicator was aborted (ncclCommAbort). If a rank did not arrive, check that \
     rank (a hang or a crash); if every rank arrived, the exchange between the GPUs hung: try NCCL_P2P_DISABLE=1, \
     fewer GPUs (--tp) or NCCL_DEBUG=INFO. Raise --comm-timeout if the step is only slow";

type RawComm = *mut c_void;
type NcclResult = c_int;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;
const NCCL_SUM: c_int = 0;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// `ncclConfig_t` as NCCL 2.17 defined it. Later versions append fields and read only `size`
/// bytes of a config whose `version` is older than theirs, so this layout works with every NCCL
/// from 2.17 on.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const CONFIG_MAGIC: u32 = 0xcafe_beef;
const CONFIG_VERSION: u32 = 21700;
const CONFIG_UNDEF: c_int = c_int::MIN;
/// The oldest NCCL tm accepts (the `ncclConfig_t` layout above).
pub const MIN_VERSION: i32 = 21700;

/// The NCCL functions tm calls, loaded once per process.
pub struct Api {
    _lib: libloading::Library,
    path: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    init_rank_config: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> NcclResult,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, sys::CUstream) -> NcclResult,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, sys::CUstream) -> NcclResult,
    broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, sys::CUstream) -> NcclResult,
    abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

fn nccl_err(message: impl Into<String>) -> Error {
    Error::Backend { backend: "nccl".into(), message: message.into() }
}

impl Api {
    /// Loads NCCL (once per process): the library [`libs`] finds (`libnccl.so.2` on the loader's
    /// path, in the CUDA toolkit or in the `nvidia-nccl` pip wheel), at least version 2.17.
    pub fn get() -> Result<&'static Api> {
        static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
        API.get_or_init(Api::load).as_ref().map_err(|e| nccl_err(e.clone()))
    }

    fn load() -> std::result::Result<Api, String> {
        let status = libs::find(libs::NCCL);
        let Some(found) = status.found.clone() else {
            return Err(format!(
                "NCCL (libnccl.so.2) was not found (tried {}); install it (the `nvidia-nccl-cu{}` pip wheel or \
                 NVIDIA's libnccl2 package) or put its directory on LD_LIBRARY_PATH",
                status.tried.join(", "),
                libs::CUDA_MAJOR
            ));
        };
        // SAFETY: loading NCCL runs its initialisers, as linking against it would.
        let lib = unsafe { libloading::Library::new(&found) }.map_err(|e| format!("loading NCCL from {found}: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's function of that name; the type is its C signature
                // (nccl.h), and the library stays loaded for as long as the pointer is kept.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("NCCL at {found} has no {}: {e}", $name))?
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!("ncclGetVersion");
        let mut version: c_int = 0;
        // SAFETY: a valid out pointer.
        let rc = unsafe { get_version(&mut version) };
        if rc != NCCL_SUCCESS {
            return Err(format!("ncclGetVersion failed with code {rc}"));
        }
        if version < MIN_VERSION {
            return Err(format!(
                "NCCL at {found} is version {}, older than 2.17, which tm needs",
                version_string(version)
            ));
        }
        let path = status.path.clone().unwrap_or_else(|| found.clone());
        Ok(Api {
            get_unique_id: sym!("ncclGetUniqueId"),
            init_rank_config: sym!("ncclCommInitRankConfig"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            broadcast: sym!("ncclBroadcast"),
            abort: sym!("ncclCommAbort"),
            destroy: sym!("ncclCommDestroy"),
            get_async_error: sym!("ncclCommGetAsyncError"),
            error_string: sym!("ncclGetErrorString"),
            last_error: sym!("ncclGetLastError"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            _lib: lib,
            path,
            version,
        })
    }

    /// The file NCCL was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The version, e.g. `2.27.7`.
    pub fn version(&self) -> String {
        version_string(self.version)
    }

    /// `ncclGetErrorString(rc)` plus the communicator's last error, when there is one.
    fn describe(&self, rc: NcclResult, comm: RawComm) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string (or null) for any code.
        let what = unsafe { cstr((self.error_string)(rc)) }.unwrap_or_else(|| "unknown error".into());
        // SAFETY: `comm` is null or a live communicator; ncclGetLastError accepts both and returns
        // a NUL-terminated string owned by NCCL (or null).
        let last = unsafe { cstr((self.last_error)(comm)) }.filter(|s| !s.is_empty());
        match last {
            Some(l) => format!("{what} (code {rc}): {l}"),
            None => format!("{what} (code {rc})"),
        }
    }
}

/// # Safety
/// `p` is null or points at a NUL-terminated string that stays valid during the call.
unsafe fn cstr(p: *const c_char) -> Option<String> {
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `22703` → `2.27.3` (NCCL ≥ 2.9 encodes major·10000 + minor·100 + patch).
pub fn version_string(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// NCCL's code for a dtype.
fn nccl_dtype(dtype: DType) -> Result<c_int> {
    Ok(match dtype {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::BF16 => 9,
        other => return Err(Error::Unsupported(format!("NCCL collectives of {other} tensors"))),
    })
}

/// A CUDA event handle.
#[derive(Clone, Copy)]
struct Event(sys::CUevent);
// SAFETY: CUDA events may be recorded and queried from any thread.
unsafe impl Send for Event {}

/// A collective queued on a rank's stream and not yet seen complete.
struct Inflight {
    seq: u64,
    label: String,
    event: Event,
    at: Instant,
    deadline: Duration,
}

/// One rank's state, shared by its [`NcclComm`] and the watchdog.
struct Slot {
    gpu: Arc<Gpu>,
    /// The communicator; null once aborted or destroyed (swapped out by whoever closes it).
    comm: AtomicPtr<c_void>,
    /// Held across every NCCL call on the communicator (the rank's calls, the watchdog's polls,
    /// the abort when it can get it).
    busy: Mutex<()>,
    /// While the rank is inside an NCCL call: since when, which collective, its deadline.
    in_call: Mutex<Option<(Instant, String, Duration)>>,
    inflight: Mutex<VecDeque<Inflight>>,
    events: Mutex<Vec<Event>>,
    /// Collectives this rank has entered (numbering its collectives).
    seq: AtomicU64,
    /// Collectives this rank has queued.
    queued: AtomicU64,
    last: Mutex<Option<String>>,
    /// The number and label of the last one-shot (peer) collective this rank launched eagerly.
    last_peer: Mutex<Option<(u64, String)>>,
    /// 256 bytes of device memory for barriers.
    scratch: u64,
}

/// Why the group was aborted.
#[derive(Clone, Debug)]
enum Cause {
    Expired { rank: usize, label: String, missing: String, waited: Duration },
    Failed(String),
}

struct Shared {
    api: &'static Api,
    slots: Vec<Slot>,
    cause: Mutex<Option<Cause>>,
    aborted: AtomicBool,
    /// Whether `ncclCommAbort` has been started (by the watchdog or an abort thread).
    abort_started: AtomicBool,
    /// The one-shot kernels for small messages, or why they are not used.
    peer: std::result::Result<PeerGroup, String>,
    /// Step names by tag and tags by step name (the one-shot kernels report the tag of the call
    /// that gave up). Every rank looks its step up here at every collective, while recording
    /// too, so lookups take the shared read lock and only a new name the write lock.
    tags: RwLock<(Vec<String>, std::collections::HashMap<String, u32>)>,
    /// Whether the transport of the peer path and of the NCCL path has been logged.
    logged: [AtomicBool; 2],
    /// Whether [`Comm::all_reduce_add_rms_norm`] may use the fused one-shot kernel (on unless
    /// `TM_FUSED_ALLREDUCE_NORM=0`; it needs the peer path too).
    fuse_norm: bool,
}

/// Tags beyond this many step names are all `u32::MAX` ("unknown"): the names are a fixed set
/// (layers × call sites), so this is only a bound.
const MAX_TAGS: usize = 4096;

/// Makes `gpu`'s context current without touching cudarc's per-context error state (which
/// belongs to the rank's own thread).
fn set_current(gpu: &Gpu) {
    // SAFETY: the context is alive (the Gpu holds it).
    unsafe {
        let _ = sys::cuCtxSetCurrent(gpu.context().cu_ctx());
    }
}

/// `m`'s lock if it can be had within `wait`.
fn lock_within<T>(m: &Mutex<T>, wait: Duration) -> Option<MutexGuard<'_, T>> {
    let until = Instant::now() + wait;
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_micros(200))
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks, so a poisoned state is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Records the first cause of failure and starts aborting every communicator on a thread of
    /// its own (`ncclCommAbort` can take a while and must not block the caller).
    fn fail(self: &Arc<Self>, cause: Cause) {
        {
            let mut c = lock(&self.cause);
            if c.is_none() {
                match &cause {
                    Cause::Expired { rank, label, missing, waited } => {
                        tracing::error!("NCCL rank {rank} timed out after {waited:?} in {label}: {missing}; aborting")
                    }
                    Cause::Failed(msg) => tracing::error!("NCCL group failed: {msg}; aborting"),
                }
                *c = Some(cause);
            }
        }
        self.aborted.store(true, Ordering::Release);
        if let Ok(p) = &self.peer {
            p.request_abort();
        }
        if !self.abort_started.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            let spawned = std::thread::Builder::new().name("tm-nccl-abort".into()).spawn(move || me.abort_all());
            if spawned.is_err() {
                tracing::error!("could not start the NCCL abort thread; aborting on this thread");
                self.abort_all();
            }
        }
    }

    /// `ncclCommAbort` on every communicator that is still open. A call in progress on it gets
    /// 200 ms to return first (so the communicator is not freed under it); one that does not is
    /// blocked inside NCCL, which is what the abort unblocks.
    fn abort_all(&self) {
        for (r, slot) in self.slots.iter().enumerate() {
            if slot.comm.load(Ordering::Acquire).is_null() {
                continue;
            }
            let guard = lock_within(&slot.busy, Duration::from_millis(200));
            let c = slot.comm.swap(std::ptr::null_mut(), Ordering::AcqRel);
            if c.is_null() {
                continue;
            }
            if guard.is_none() {
                tracing::warn!("rank {r} is blocked inside an NCCL call; aborting its communicator under it");
            }
            set_current(&slot.gpu);
            // SAFETY: a live communicator, swapped out so nobody starts another call on it.
            let rc = unsafe { (self.api.abort)(c) };
            drop(guard);
            if rc != NCCL_SUCCESS {
                tracing::warn!("ncclCommAbort on rank {r} returned {}", self.api.describe(rc, std::ptr::null_mut()));
            }
        }
        tracing::info!("NCCL communicators aborted");
    }

    /// The tag of step name `step` (the same on every rank: the table is the group's).
    fn tag(&self, step: &str) -> u32 {
        {
            let t = self.tags.read().unwrap_or_else(|e| e.into_inner());
            if let Some(&i) = t.1.get(step) {
                return i;
            }
        }
        let mut t = self.tags.write().unwrap_or_else(|e| e.into_inner());
        if let Some(&i) = t.1.get(step) {
            return i;
        }
        if t.0.len() >= MAX_TAGS {
            return u32::MAX;
        }
        let tag = t.0.len() as u32;
        t.0.push(step.to_string());
        t.1.insert(step.to_string(), tag);
        tag
    }

    /// Fails the group if a one-shot kernel of any rank gave up waiting; returns whether one did.
    fn check_peer(self: &Arc<Self>) -> bool {
        let Some(t) = self.peer.as_ref().ok().and_then(PeerGroup::any_timeout) else {
            return false;
        };
        if self.cause().is_none() {
            let cause = self.peer_cause(&t);
            self.fail(cause);
        }
        true
    }

    /// The failure a one-shot kernel's report describes.
    fn peer_cause(&self, t: &PeerTimeout) -> Cause {
        let tags = self.tags.read().unwrap_or_else(|e| e.into_inner());
        let step = tags.0.get(t.tag as usize).cloned().unwrap_or_else(|| "unknown step".into());
        drop(tags);
        let label = format!("one-shot collective ({step}; epoch {}, block {})", t.epoch, t.block);
        let mut missing = format!(
            "rank {} did not arrive (the GPU of rank {} waited for its data on the device in tm's one-shot \
             peer-to-peer collective; TM_CUSTOM_ALLREDUCE=0 sends every collective through NCCL instead)",
            t.peer, t.rank
        );
        match lock(&self.slots[t.peer].last).as_deref() {
            Some(l) => {
                let _ = write!(missing, "; rank {} was last in {l}", t.peer);
            }
            None => {
                let _ = write!(missing, "; rank {} has not entered any collective", t.peer);
            }
        }
        Cause::Expired { rank: t.rank, label, missing, waited: t.waited }
    }

    fn cause(&self) -> Option<Cause> {
        lock(&self.cause).clone()
    }

    /// The error rank `rank` gets for `label` once the group is aborted.
    fn aborted_error(&self, rank: usize, label: &str, start: Instant) -> Error {
        match self.cause() {
            Some(Cause::Expired { rank: r, label: theirs, missing, waited }) if r == rank => Error::Timeout {
                rank,
                step: theirs,
                waited,
                hint: format!("{missing}; {TIMEOUT_HINT}"),
            },
            Some(Cause::Expired { rank: r, label: theirs, missing, waited }) => Error::Timeout {
                rank,
                step: label.to_string(),
                waited: start.elapsed(),
                hint: format!("the group was aborted: rank {r} timed out after {waited:?} in {theirs} ({missing}); {TIMEOUT_HINT}"),
            },
            Some(Cause::Failed(msg)) => {
                Error::Aborted { rank, step: format!("{label} (after {:?})", start.elapsed()), reason: msg }
            }
            None => Error::Aborted { rank, step: label.to_string(), reason: "the communicator was closed".into() },
        }
    }

    /// Which ranks have not queued collective `seq`, and where they were last seen.
    fn missing(&self, seq: u64) -> String {
        let absent: Vec<usize> =
            (0..self.slots.len()).filter(|&r| self.slots[r].queued.load(Ordering::Acquire) <= seq).collect();
        if absent.is_empty() {
            return "every rank queued it, but the GPUs did not complete the exchange".into();
        }
        let list: Vec<String> = absent.iter().map(usize::to_string).collect();
        let mut s = format!("rank{} {} did not arrive", if absent.len() == 1 { "" } else { "s" }, list.join(", "));
        for r in absent {
            match lock(&self.slots[r].last).as_deref() {
                Some(l) => {
                    let _ = write!(s, "; rank {r} was last in {l}");
                }
                None => {
                    let _ = write!(s, "; rank {r} has not entered any collective");
                }
            }
        }
        s
    }

    /// One look at every rank: asynchronous NCCL errors, completed and expired collectives.
    fn poll(self: &Arc<Self>) {
        if self.check_peer() {
            return;
        }
        let now = Instant::now();
        for (r, slot) in self.slots.iter().enumerate() {
            let in_call = lock(&slot.in_call).clone();
            if let Some((since, label, deadline)) = in_call {
                let waited = now.saturating_duration_since(since);
                if waited > deadline {
                    let seq = slot.seq.load(Ordering::Acquire).saturating_sub(1);
                    let missing = format!(
                        "rank {r} is blocked inside NCCL in it (connecting to a peer that does not answer?); {}",
                        self.missing(seq)
                    );
                    self.fail(Cause::Expired { rank: r, label, missing, waited });
                    return;
                }
            }
            // The rank's own calls come first: no asynchronous-error poll while it is in one.
            if let Ok(busy) = slot.busy.try_lock() {
                let c = slot.comm.load(Ordering::Acquire);
                if !c.is_null() {
                    let mut state: NcclResult = NCCL_SUCCESS;
                    // SAFETY: a live communicator (closing it takes `busy` first); a valid out
                    // pointer.
                    let rc = unsafe { (self.api.get_async_error)(c, &mut state) };
                    let bad = if rc != NCCL_SUCCESS {
                        Some(rc)
                    } else if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                        Some(state)
                    } else {
                        None
                    };
                    if let Some(code) = bad {
                        let msg =
                            format!("rank {r}: NCCL reported an asynchronous error: {}", self.api.describe(code, c));
                        drop(busy);
                        self.fail(Cause::Failed(msg));
                        return;
                    }
                }
            }
            let mut q = lock(&slot.inflight);
            if q.is_empty() {
                continue;
            }
            set_current(&slot.gpu);
            while let Some(front) = q.front() {
                // SAFETY: an event this rank created and recorded; it is destroyed only when the
                // group is dropped.
                let rc = unsafe { sys::cuEventQuery(front.event.0) };
                match rc {
                    sys::CUresult::CUDA_SUCCESS => {
                        if let Some(done) = q.pop_front() {
                            lock(&slot.events).push(done.event);
                        }
                    }
                    sys::CUresult::CUDA_ERROR_NOT_READY => {
                        let waited = now.saturating_duration_since(front.at);
                        if waited > front.deadline {
                            let cause = Cause::Expired {
                                rank: r,
                                label: front.label.clone(),
                                missing: self.missing(front.seq),
                                waited,
                            };
                            drop(q);
                            self.fail(cause);
                            return;
                        }
                        break;
                    }
                    e => {
                        let msg = format!("rank {r}: the GPU failed after {} was queued: {e:?}", front.label);
                        drop(q);
                        self.fail(Cause::Failed(msg));
                        return;
                    }
                }
            }
        }
    }
}

impl Drop for Shared {
    /// Closes the communicators (`ncclCommDestroy`, or `ncclCommAbort` after a failure), one
    /// thread each, waited for at most 10 s; then frees the events and the scratch memory (left
    /// alone if the communicators did not close).
    fn drop(&mut self) {
        let api = self.api;
        let aborted = self.aborted.load(Ordering::Acquire);
        let comms: Vec<(Arc<Gpu>, usize)> = self
            .slots
            .iter()
            .map(|s| (Arc::clone(&s.gpu), s.comm.swap(std::ptr::null_mut(), Ordering::AcqRel) as usize))
            .filter(|(_, c)| *c != 0)
            .collect();
        // One thread per communicator, concurrently: closing one can wait for the other ranks to
        // close theirs (NCCL's teardown is collective among the ranks of a node).
        let (tx, rx) = mpsc::channel();
        let to_close = comms.len();
        let mut started = 0;
        for (gpu, c) in comms {
            let tx = tx.clone();
            let spawned = std::thread::Builder::new().name("tm-nccl-close".into()).spawn(move || {
                set_current(&gpu);
                // SAFETY: a communicator swapped out of its slot: nobody else holds it.
                let rc = unsafe {
                    if aborted {
                        (api.abort)(c as RawComm)
                    } else {
                        (api.destroy)(c as RawComm)
                    }
                };
                if rc != NCCL_SUCCESS {
                    tracing::warn!("closing an NCCL communicator: {}", api.describe(rc, std::ptr::null_mut()));
                }
                let _ = tx.send(());
            });
            started += usize::from(spawned.is_ok());
        }
        drop(tx);
        let until = Instant::now() + Duration::from_secs(10);
        let mut done = 0;
        while done < started {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(()) => done += 1,
                Err(_) => break,
            }
        }
        let closed = done == to_close;
        if !closed {
            tracing::error!("the NCCL communicators did not close within 10 s; leaving them");
        }
        for slot in &self.slots {
            set_current(&slot.gpu);
            let pending: Vec<Event> = lock(&slot.inflight).drain(..).map(|i| i.event).collect();
            for e in pending.into_iter().chain(lock(&slot.events).drain(..)) {
                // SAFETY: an event this group created, destroyed once (it left every list).
                unsafe {
                    let _ = sys::cuEventDestroy_v2(e.0);
                }
            }
            if closed && slot.scratch != 0 {
                // SAFETY: allocated by `group` with cuMemAlloc, freed once; the communicators
                // that could use it are closed.
                unsafe {
                    let _ = sys::cuMemFree_v2(slot.scratch);
                }
            }
        }
    }
}

/// The watchdog: polls the group until it is dropped or aborted.
fn watchdog(group: Weak<Shared>) {
    loop {
        let Some(shared) = group.upgrade() else { return };
        if shared.aborted.load(Ordering::Acquire) {
            return;
        }
        shared.poll();
        drop(shared);
        std::thread::sleep(WATCHDOG_PERIOD);
    }
}

/// One rank of an NCCL group (see the module docs). Its collectives run on the stream of its
/// [`Gpu`], in order with the backend's kernels.
pub struct NcclComm {
    rank: usize,
    shared: Arc<Shared>,
    stall_after: Option<u64>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.shared.slots.len())
            .field("aborted", &self.shared.aborted.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// One communicator per GPU of `gpus` (rank `r` on `gpus[r]`), created in one NCCL group on
    /// a thread of its own; waits at most `timeout` for NCCL to finish, else fails with what to
    /// try. Starts the group's watchdog.
    pub fn group(gpus: &[Arc<Gpu>], timeout: Duration) -> Result<Vec<NcclComm>> {
        Self::group_with(gpus, timeout, true)
    }

    /// [`NcclComm::group`]; `peer_path: false` keeps every collective on NCCL (tests compare the
    /// two paths). With `true`, the one-shot kernels are set up when [`peer::plan`] allows; when
    /// setting them up fails, NCCL is used for everything and [`NcclComm::peer_path`] says why.
    pub fn group_with(gpus: &[Arc<Gpu>], timeout: Duration, peer_path: bool) -> Result<Vec<NcclComm>> {
        let api = Api::get()?;
        let world = gpus.len();
        if world == 0 {
            return Ok(Vec::new());
        }
        let mut seen = Vec::new();
        for g in gpus {
            if seen.contains(&g.info().ordinal) {
                return Err(Error::invalid(format!(
                    "NCCL needs one GPU per rank, but device {} appears twice",
                    g.info().ordinal
                )));
            }
            seen.push(g.info().ordinal);
        }
        let start = Instant::now();
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: a valid out pointer.
        let rc = unsafe { (api.get_unique_id)(&mut id) };
        if rc != NCCL_SUCCESS {
            return Err(nccl_err(format!("ncclGetUniqueId: {}", api.describe(rc, std::ptr::null_mut()))));
        }
        let mut scratch = Vec::with_capacity(world);
        for g in gpus {
            g.bind()?;
            // SAFETY: the GPU's context is current; 256 bytes.
            match unsafe { cudarc::driver::result::malloc_sync(256) } {
                Ok(p) => scratch.push(p),
                Err(e) => {
                    free_scratch(gpus, &scratch);
                    return Err(crate::runtime::driver_err("cuMemAlloc (NCCL scratch)")(e));
                }
            }
        }
        // Blocking initialisation on a thread of its own: if it never finishes (a transport that
        // hangs), this call still returns, with the error, at the deadline.
        let (tx, rx) = mpsc::channel();
        let owned: Vec<Arc<Gpu>> = gpus.to_vec();
        let spawned = std::thread::Builder::new().name("tm-nccl-init".into()).spawn(move || {
            let result = init_blocking(api, &owned, id);
            if let Err(mpsc::SendError(Ok(comms))) = tx.send(result) {
                // Nobody waits any more (the deadline passed): close what was made.
                let raw: Vec<RawComm> = comms.iter().map(|&c| c as RawComm).collect();
                abort_raw(api, &owned, &raw);
                tracing::warn!("NCCL initialisation finished after its deadline; the communicators were aborted");
            }
        });
        if let Err(e) = spawned {
            free_scratch(gpus, &scratch);
            return Err(nccl_err(format!("could not start the NCCL initialisation thread: {e}")));
        }
        let comms: Vec<RawComm> = match rx.recv_timeout(timeout) {
            Ok(Ok(comms)) => comms.into_iter().map(|c| c as RawComm).collect(),
            Ok(Err(e)) => {
                free_scratch(gpus, &scratch);
                return Err(nccl_err(format!("starting NCCL on GPUs {seen:?} failed: {e}. {INIT_HINT}")));
            }
            Err(_) => {
                // The scratch memory is left to the process: the init thread may still use the GPUs.
                return Err(Error::Timeout {
                    rank: 0,
                    step: format!("NCCL initialisation of {world} ranks on GPUs {seen:?} (ncclCommInitRankConfig)"),
                    waited: start.elapsed(),
                    hint: format!(
                        "NCCL did not finish starting the communicators; its thread is left behind (exit the \
                         process). {INIT_HINT}"
                    ),
                });
            }
        };
        tracing::info!(
            "NCCL {} ({}): {world} ranks on GPUs {seen:?} in {:?}",
            api.version(),
            api.path(),
            start.elapsed()
        );
        let slots = gpus
            .iter()
            .zip(comms)
            .zip(scratch)
            .map(|((g, c), s)| Slot {
                gpu: Arc::clone(g),
                comm: AtomicPtr::new(c),
                busy: Mutex::new(()),
                in_call: Mutex::new(None),
                inflight: Mutex::new(VecDeque::new()),
                events: Mutex::new(Vec::new()),
                seq: AtomicU64::new(0),
                queued: AtomicU64::new(0),
                last: Mutex::new(None),
                last_peer: Mutex::new(None),
                scratch: s,
            })
            .collect();
        let peer = if peer_path {
            peer_links(&seen)
                .map_err(|e| format!("reading the peer links: {e}"))
                .and_then(|links| peer::plan(&links))
                .and_then(|max| PeerGroup::new(gpus, max))
        } else {
            Err("turned off by the caller".to_string())
        };
        match &peer {
            Ok(p) => tracing::info!(
                "one-shot collectives over peer access for messages up to {} KiB per rank (decode steps; all-reduces \
                 up to {} KiB with the low-latency protocol{}); NCCL above",
                p.max_bytes() >> 10,
                p.ll_bytes() >> 10,
                if p.ll_bytes() == 0 { ", turned off by TM_PEER_LL=0" } else { "" }
            ),
            Err(why) => tracing::info!("every collective goes through NCCL (one-shot peer collectives: {why})"),
        }
        let shared = Arc::new(Shared {
            api,
            slots,
            cause: Mutex::new(None),
            aborted: AtomicBool::new(false),
            abort_started: AtomicBool::new(false),
            peer,
            tags: RwLock::new((Vec::new(), std::collections::HashMap::new())),
            logged: [AtomicBool::new(false), AtomicBool::new(false)],
            fuse_norm: fused_norm_enabled(),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("tm-nccl-watchdog".into())
            .spawn(move || watchdog(weak))
            .map_err(|e| nccl_err(format!("could not start the NCCL watchdog thread: {e}")))?;
        Ok((0..world).map(|rank| NcclComm { rank, shared: Arc::clone(&shared), stall_after: None }).collect())
    }

    /// Test hook: this rank queues collectives `#0..#n` normally, then stops at collective `#n`
    /// (queues nothing, does not return) until the group is aborted, as a hung rank would; the
    /// others then miss their deadlines. The stalled rank gives up after four deadlines.
    pub fn stall_after(mut self, n: u64) -> Self {
        self.stall_after = Some(n);
        self
    }

    /// Whether small collectives take the one-shot peer path: `Ok(largest message per rank in
    /// bytes)`, or why not.
    pub fn peer_path(&self) -> std::result::Result<usize, String> {
        self.shared.peer.as_ref().map(PeerGroup::max_bytes).map_err(Clone::clone)
    }

    /// The largest all-reduce per rank (bytes) that takes the peer path's low-latency protocol;
    /// 0 without the peer path or with `TM_PEER_LL=0`.
    pub fn peer_ll_bytes(&self) -> usize {
        self.shared.peer.as_ref().map_or(0, PeerGroup::ll_bytes)
    }

    /// The GPU this rank runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.shared.slots[self.rank].gpu
    }

    /// Whether the group has been aborted, and why.
    pub fn abort_reason(&self) -> Option<String> {
        self.shared.cause().map(|c| match c {
            Cause::Expired { rank, label, missing, waited } => {
                format!("rank {rank} timed out after {waited:?} in {label} ({missing})")
            }
            Cause::Failed(msg) => msg,
        })
    }

    /// How many collectives this rank has entered.
    pub fn collectives_started(&self) -> u64 {
        self.slot().seq.load(Ordering::Relaxed)
    }

    fn slot(&self) -> &Slot {
        &self.shared.slots[self.rank]
    }

    fn check(&self, label: &str, start: Instant) -> Result<()> {
        if self.shared.aborted.load(Ordering::Acquire) {
            return Err(self.shared.aborted_error(self.rank, label, start));
        }
        Ok(())
    }

    /// The test hook's stall: wait for the abort (at most four deadlines), then fail.
    fn stall(&self, label: &str, start: Instant, deadline: Duration) -> Error {
        tracing::warn!("rank {} stalls in {label} (NcclComm::stall_after test hook)", self.rank);
        let until = start.checked_add(deadline.saturating_mul(4));
        loop {
            if self.shared.aborted.load(Ordering::Acquire) {
                break;
            }
            if until.is_some_and(|t| Instant::now() >= t) {
                self.shared.fail(Cause::Failed(format!("rank {} stalled in {label} (test hook)", self.rank)));
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let reason = self.abort_reason().unwrap_or_default();
        Error::Aborted {
            rank: self.rank,
            step: format!("{label} (stalled by the test hook for {:?})", start.elapsed()),
            reason,
        }
    }

    /// An event from the rank's pool (created when the pool is empty). The rank's context must
    /// be current.
    fn take_event(&self) -> Result<Event> {
        if let Some(e) = lock(&self.slot().events).pop() {
            return Ok(e);
        }
        cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(crate::runtime::driver_err("cuEventCreate"))
    }

    /// Fails the group because this rank's NCCL or CUDA call failed, and returns the error.
    fn fail_local(&self, label: &str, message: String) -> Error {
        let msg = format!("rank {} failed in {label}: {message}", self.rank);
        self.shared.fail(Cause::Failed(msg.clone()));
        nccl_err(msg)
    }

    /// Queues one collective: `call(comm, stream)` issues it. Then records the event the
    /// watchdog follows.
    fn enqueue(
        &self,
        kind: &str,
        step: &str,
        deadline: Duration,
        call: impl Fn(&Api, RawComm, sys::CUstream) -> NcclResult,
    ) -> Result<()> {
        let start = Instant::now();
        let slot = self.slot();
        let mode = slot.gpu.mode();
        if mode == LaunchMode::Capture {
            return Err(nccl_err(format!("{kind} ({step}): NCCL collectives are not captured into CUDA graphs")));
        }
        let seq = slot.seq.fetch_add(1, Ordering::AcqRel);
        let label = format!("{kind} #{seq} ({step})");
        *lock(&slot.last) = Some(label.clone());
        self.check(&label, start)?;
        if self.stall_after.is_some_and(|n| seq >= n) {
            return Err(self.stall(&label, start, deadline));
        }
        if mode == LaunchMode::Record {
            // The step is being recorded for a graph: it will run eagerly (NCCL stays out of
            // graphs), and queue this collective then.
            slot.gpu.mark_uncapturable();
            slot.queued.store(seq + 1, Ordering::Release);
            return Ok(());
        }
        self.log_transport(1, || format!("{kind} ({step}) through NCCL"));
        slot.gpu.bind()?;
        let stream = slot.gpu.stream().cu_stream();
        let api = self.shared.api;
        {
            let busy = lock(&slot.busy);
            let c = slot.comm.load(Ordering::Acquire);
            if c.is_null() {
                drop(busy);
                return Err(self.shared.aborted_error(self.rank, &label, start));
            }
            // The watchdog fails the group if this call stays inside NCCL past the deadline.
            *lock(&slot.in_call) = Some((start, label.clone(), deadline));
            let rc = call(api, c, stream);
            *lock(&slot.in_call) = None;
            if rc != NCCL_SUCCESS {
                // An abort may have closed the communicator under a blocked call.
                let still = slot.comm.load(Ordering::Acquire);
                let msg = api.describe(rc, if still.is_null() { std::ptr::null_mut() } else { c });
                drop(busy);
                if self.shared.aborted.load(Ordering::Acquire) {
                    return Err(self.shared.aborted_error(self.rank, &label, start));
                }
                return Err(self.fail_local(&label, msg));
            }
        }
        let event = self.take_event().map_err(|e| self.fail_local(&label, e.to_string()))?;
        // SAFETY: an event of this context and the rank's stream.
        if let Err(e) = unsafe { cudarc::driver::result::event::record(event.0, stream) } {
            lock(&slot.events).push(event);
            return Err(self.fail_local(&label, format!("cuEventRecord: {:?}", e.0)));
        }
        lock(&slot.inflight).push_back(Inflight { seq, label, event, at: start, deadline });
        slot.queued.store(seq + 1, Ordering::Release);
        Ok(())
    }

    /// Logs (once per group, on rank 0) the transport collectives take: `which` 0 is the peer
    /// path, 1 NCCL.
    fn log_transport(&self, which: usize, what: impl FnOnce() -> String) {
        if self.rank == 0 && !self.shared.logged[which].swap(true, Ordering::Relaxed) {
            tracing::info!("first collective on this path: {}", what());
        }
    }

    /// Whether a collective of `count` elements of `dtype` per rank takes the peer path.
    fn takes_peer_path(&self, count: usize, dtype: DType) -> bool {
        self.shared.peer.as_ref().is_ok_and(|p| p.fits(count, dtype))
    }

    /// One one-shot collective (see the module docs): numbered and checked like an NCCL one
    /// (the stall hook included) unless the stream is being captured, then launched by `launch`
    /// (given the group and the step's tag) through [`Gpu::launch`], which records, captures or
    /// runs it as the backend's mode says. `what` names it in errors, `bytes` (per rank) in the log.
    #[allow(clippy::too_many_arguments)]
    fn peer_collective(
        &self,
        kind: peer::Kind,
        src: u64,
        dst: u64,
        count: usize,
        dtype: DType,
        protocol: Protocol,
        step: &str,
        deadline: Duration,
    ) -> Result<()> {
        let what = match kind {
            peer::Kind::AllReduce => "all_reduce",
            peer::Kind::AllGather => "all_gather",
        };
        let bytes = count * dtype.bits() / 8;
        self.peer_numbered(what, bytes, step, deadline, |p, tag| {
            p.launch(kind, self.rank, src, dst, count, dtype, protocol, tag, deadline)
        })
    }

    /// The numbering, checks and logging of [`NcclComm::peer_collective`] around `launch`.
    fn peer_numbered(
        &self,
        what: &str,
        bytes: usize,
        step: &str,
        deadline: Duration,
        launch: impl FnOnce(&PeerGroup, u32) -> Result<()>,
    ) -> Result<()> {
        let p = self.shared.peer.as_ref().map_err(|why| nccl_err(format!("no peer path: {why}")))?;
        let slot = self.slot();
        let mode = slot.gpu.mode();
        let mut numbered = None;
        // The label is only formatted when something needs it: every step of a replayed graph
        // still records its collectives on the host, and this runs 2 · layers + 1 times per step.
        let label = |seq: u64| format!("{what} #{seq} ({step}; peer-to-peer)");
        if mode != LaunchMode::Capture {
            let start = Instant::now();
            let seq = slot.seq.fetch_add(1, Ordering::AcqRel);
            {
                // Reuses the last label's allocation.
                let mut last = lock(&slot.last);
                let s = last.get_or_insert_with(String::new);
                s.clear();
                let _ = write!(s, "{what} #{seq} ({step}; peer-to-peer)");
            }
            if self.shared.aborted.load(Ordering::Acquire) {
                return Err(self.shared.aborted_error(self.rank, &label(seq), start));
            }
            if self.stall_after.is_some_and(|n| seq >= n) {
                return Err(self.stall(&label(seq), start, deadline));
            }
            numbered = Some(seq);
        }
        let tag = self.shared.tag(step);
        let launched = launch(p, tag);
        if let Some(seq) = numbered {
            if let Err(e) = launched {
                return Err(self.fail_local(&label(seq), e.to_string()));
            }
            if mode == LaunchMode::Eager {
                *lock(&slot.last_peer) = Some((seq, label(seq)));
                self.log_transport(0, || {
                    format!("{what} of {bytes} bytes per rank ({step}) as a one-shot kernel over peer access")
                });
            }
            slot.queued.store(seq + 1, Ordering::Release);
        }
        launched
    }

    /// The rows and columns of an [`Comm::all_reduce_add_rms_norm`] that the fused one-shot
    /// kernel takes: the group has the peer path (and `TM_FUSED_ALLREDUCE_NORM` is not `0`), the
    /// message fits it, and the four tensors are distinct GPU tensors of one dtype with
    /// consistent sizes. `None` sends it through the separate all-reduce and `add_rms_norm`
    /// (which also report any inconsistency).
    pub fn fused_norm_shape(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        out: &Tensor,
    ) -> Option<(usize, usize)> {
        if !self.shared.fuse_norm {
            return None;
        }
        let dtype = x.dtype();
        let (count, cols) = (x.numel(), weight.numel());
        let tensors = [x, residual, weight, out];
        let consistent = tensors.iter().all(|t| t.dtype() == dtype && !t.buffer().allocator().host_accessible())
            && residual.numel() == count
            && out.numel() == count
            && cols > 0
            && count.is_multiple_of(cols);
        let addrs = [x.buffer().addr(), residual.buffer().addr(), weight.buffer().addr(), out.buffer().addr()];
        let distinct = (0..4).all(|i| (i + 1..4).all(|j| addrs[i] != addrs[j]));
        (consistent && distinct && self.takes_peer_path(count, dtype)).then_some((count / cols, cols))
    }

    /// Sums `count` elements of `dtype` at device address `ptr` over all ranks, in place: through
    /// the one-shot peer path when the message fits it, else NCCL.
    pub fn all_reduce_raw(&self, ptr: u64, count: usize, dtype: DType, step: &str, deadline: Duration) -> Result<()> {
        if self.takes_peer_path(count, dtype) {
            return self.peer_collective(peer::Kind::AllReduce, ptr, ptr, count, dtype, Protocol::Auto, step, deadline);
        }
        self.all_reduce_nccl(ptr, count, dtype, step, deadline)
    }

    /// [`NcclComm::all_reduce_raw`] through the one-shot peer path (an error when the group has
    /// none or the message does not fit it), with the low-latency protocol when it fits.
    pub fn all_reduce_peer(&self, ptr: u64, count: usize, dtype: DType, step: &str, deadline: Duration) -> Result<()> {
        self.all_reduce_peer_with(ptr, count, dtype, Protocol::Auto, step, deadline)
    }

    /// [`NcclComm::all_reduce_peer`] through `protocol` (every rank must pass the same; tests and
    /// benchmarks compare the two): an error when the message does not fit it (the group stays
    /// usable).
    pub fn all_reduce_peer_with(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        protocol: Protocol,
        step: &str,
        deadline: Duration,
    ) -> Result<()> {
        if !self.takes_peer_path(count, dtype) {
            return Err(nccl_err(format!(
                "{step}: an all-reduce of {count} {dtype} elements does not take the peer path ({})",
                self.peer_path().map_or_else(|why| why, |max| format!("at most {max} bytes of f32, f16 or bf16"))
            )));
        }
        if protocol == Protocol::LowLatency && !self.shared.peer.as_ref().is_ok_and(|p| p.fits_ll(count, dtype)) {
            return Err(nccl_err(format!(
                "{step}: an all-reduce of {count} {dtype} elements does not fit the low-latency peer protocol (at \
                 most {} bytes per rank)",
                self.peer_ll_bytes()
            )));
        }
        self.peer_collective(peer::Kind::AllReduce, ptr, ptr, count, dtype, protocol, step, deadline)
    }

    /// [`Comm::all_reduce_add_rms_norm`] through the fused one-shot kernel with `protocol`
    /// (every rank must pass the same): an error when [`NcclComm::fused_norm_shape`] does not
    /// take the tensors or the message does not fit `protocol` (the group stays usable).
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm_with(
        &self,
        protocol: Protocol,
        x: &mut Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
        step: &str,
        deadline: Duration,
    ) -> Result<()> {
        let Some((rows, cols)) = self.fused_norm_shape(x, residual, weight, out) else {
            return Err(nccl_err(format!(
                "{step}: the fused peer all-reduce + add_rms_norm does not take these tensors (no peer path, \
                 TM_FUSED_ALLREDUCE_NORM=0, or inconsistent shapes)"
            )));
        };
        let dtype = x.dtype();
        if protocol == Protocol::LowLatency
            && !self.shared.peer.as_ref().is_ok_and(|p| p.fits_ll_rows(rows, cols, dtype))
        {
            return Err(nccl_err(format!(
                "{step}: an all-reduce + add_rms_norm of {rows} x {cols} {dtype} elements does not fit the \
                 low-latency peer protocol (at most {} bytes per rank, rows in whole 8-byte packs)",
                self.peer_ll_bytes()
            )));
        }
        let tensors = peer::NormTensors {
            x: x.buffer().addr(),
            residual: residual.buffer().addr(),
            out: out.buffer().addr(),
            weight: weight.buffer().addr(),
        };
        let bytes = x.desc().bytes();
        self.peer_numbered("all_reduce_add_rms_norm", bytes, step, deadline, |p, tag| {
            p.launch_add_rms_norm(self.rank, tensors, eps, rows, cols, dtype, protocol, tag, deadline)
        })
    }

    /// [`NcclComm::all_reduce_raw`] through NCCL, whatever the size.
    pub fn all_reduce_nccl(&self, ptr: u64, count: usize, dtype: DType, step: &str, deadline: Duration) -> Result<()> {
        let dt = nccl_dtype(dtype)?;
        self.enqueue("all_reduce", step, deadline, |api, comm, stream| {
            // SAFETY: `ptr` holds `count` elements of `dtype` on this rank's GPU (the caller's
            // contract); in place is allowed.
            unsafe { (api.all_reduce)(ptr as *const c_void, ptr as *mut c_void, count, dt, NCCL_SUM, comm, stream) }
        })
    }

    fn world(&self) -> usize {
        self.shared.slots.len()
    }
}

/// The device address of `t`, which must be GPU memory.
fn device_ptr(t: &Tensor, what: &str) -> Result<u64> {
    if t.buffer().allocator().host_accessible() {
        return Err(Error::Unsupported(format!("{what}: NCCL needs GPU tensors, not host memory")));
    }
    Ok(t.buffer().addr())
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world()
    }

    fn all_reduce_sum(&self, tensor: &mut Tensor, step: &str, deadline: Duration) -> Result<()> {
        let ptr = device_ptr(tensor, "all_reduce")?;
        self.all_reduce_raw(ptr, tensor.numel(), tensor.dtype(), step, deadline)
    }

    /// One fused kernel (`peer_all_reduce_add_rms_norm`) when the one-shot peer path takes the
    /// message ([`NcclComm::fused_norm_shape`]); else the all-reduce, then `ops.add_rms_norm`.
    fn all_reduce_add_rms_norm(
        &self,
        ops: &dyn Ops,
        x: &mut Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
        step: &str,
        deadline: Duration,
    ) -> Result<()> {
        if self.fused_norm_shape(x, residual, weight, out).is_none() {
            self.all_reduce_sum(x, step, deadline)?;
            return ops.add_rms_norm(x, residual, weight, eps, out);
        }
        self.all_reduce_add_rms_norm_with(Protocol::Auto, x, residual, weight, eps, out, step, deadline)
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor, step: &str, deadline: Duration) -> Result<()> {
        let n = input.numel();
        if output.dtype() != input.dtype() || output.numel() != n * self.world() {
            return Err(Error::shape(
                format!("all_gather in {step}"),
                format!("{} x {:?} of {}", self.world(), input.shape(), input.dtype()),
                format!("{:?} of {}", output.shape(), output.dtype()),
            ));
        }
        let (src, dst) = (device_ptr(input, "all_gather")?, device_ptr(output, "all_gather")?);
        if self.takes_peer_path(n, input.dtype()) {
            return self.peer_collective(
                peer::Kind::AllGather,
                src,
                dst,
                n,
                input.dtype(),
                Protocol::Flags,
                step,
                deadline,
            );
        }
        let dt = nccl_dtype(input.dtype())?;
        self.enqueue("all_gather", step, deadline, |api, comm, stream| {
            // SAFETY: `src` holds n elements and `dst` world·n, both on this rank's GPU.
            unsafe { (api.all_gather)(src as *const c_void, dst as *mut c_void, n, dt, comm, stream) }
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize, step: &str, deadline: Duration) -> Result<()> {
        if root >= self.world() {
            return Err(Error::invalid(format!("broadcast in {step}: root {root} of a world of {}", self.world())));
        }
        let dt = nccl_dtype(tensor.dtype())?;
        let (ptr, n) = (device_ptr(tensor, "broadcast")?, tensor.numel());
        self.enqueue("broadcast", step, deadline, |api, comm, stream| {
            // SAFETY: `ptr` holds n elements on this rank's GPU; in place is allowed.
            unsafe { (api.broadcast)(ptr as *const c_void, ptr as *mut c_void, n, dt, root as c_int, comm, stream) }
        })
    }

    /// An all-reduce of one element of the rank's scratch memory (through NCCL), then
    /// [`Comm::synchronize`].
    fn barrier(&self, step: &str, deadline: Duration) -> Result<()> {
        let start = Instant::now();
        self.all_reduce_nccl(self.slot().scratch, 1, DType::F32, step, deadline)?;
        self.synchronize(step, deadline.saturating_sub(start.elapsed()))
    }

    /// Waits for everything queued on the rank's stream so far, polling, until `deadline` (then
    /// fails the group naming the collective still pending) or the group is aborted.
    fn synchronize(&self, step: &str, deadline: Duration) -> Result<()> {
        let start = Instant::now();
        let label = format!("synchronize ({step})");
        self.check(&label, start)?;
        let slot = self.slot();
        slot.gpu.bind()?;
        let event = self.take_event()?;
        let stream = slot.gpu.stream().cu_stream();
        // SAFETY: an event of this context and the rank's stream.
        if let Err(e) = unsafe { cudarc::driver::result::event::record(event.0, stream) } {
            lock(&slot.events).push(event);
            return Err(self.fail_local(&label, format!("cuEventRecord: {:?}", e.0)));
        }
        let mut polls = 0u32;
        loop {
            // SAFETY: the event recorded above.
            match unsafe { sys::cuEventQuery(event.0) } {
                sys::CUresult::CUDA_SUCCESS => {
                    lock(&slot.events).push(event);
                    // A one-shot kernel that gave up has returned, so its stream drained: its
                    // report is read here, not left to the watchdog's next look.
                    self.shared.check_peer();
                    return self.check(&label, start);
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    lock(&slot.events).push(event);
                    return Err(self.fail_local(&label, format!("the GPU failed: {e:?}")));
                }
            }
            if polls % 64 == 63 {
                self.shared.check_peer();
            }
            if self.shared.aborted.load(Ordering::Acquire) {
                // The event may still be pending: it is not reused (destroying it is allowed).
                // SAFETY: our event, in no list.
                unsafe {
                    let _ = sys::cuEventDestroy_v2(event.0);
                }
                return Err(self.shared.aborted_error(self.rank, &label, start));
            }
            if start.elapsed() > deadline {
                let pending = lock(&slot.inflight).front().map(|i| (i.seq, i.label.clone()));
                let last_peer = lock(&slot.last_peer).clone();
                let (what, missing) = match (pending, last_peer) {
                    (Some((seq, l)), _) => (l, self.shared.missing(seq)),
                    // The one-shot kernels keep their own deadline; this is the host's view.
                    (None, Some((seq, l))) => (l, self.shared.missing(seq)),
                    (None, None) => {
                        (label.clone(), "the GPU did not finish the step's kernels (no collective pending)".into())
                    }
                };
                self.shared.fail(Cause::Expired { rank: self.rank, label: what, missing, waited: start.elapsed() });
                // SAFETY: our event, in no list.
                unsafe {
                    let _ = sys::cuEventDestroy_v2(event.0);
                }
                return Err(self.shared.aborted_error(self.rank, &label, start));
            }
            polls += 1;
            if polls < 64 {
                std::hint::spin_loop();
            } else if polls < 4096 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn abort(&self, reason: &str) {
        self.shared.fail(Cause::Failed(format!("rank {} aborted the group: {reason}", self.rank)));
    }
}

/// Whether the fused all-reduce + residual add + RMSNorm kernel may be used:
/// `TM_FUSED_ALLREDUCE_NORM=0` turns it off (the separate kernels run instead, for comparison).
fn fused_norm_enabled() -> bool {
    std::env::var("TM_FUSED_ALLREDUCE_NORM").map_or(true, |v| v.trim() != "0")
}

/// Creates one blocking communicator per GPU in one NCCL group (returns their addresses).
fn init_blocking(api: &Api, gpus: &[Arc<Gpu>], id: UniqueId) -> std::result::Result<Vec<usize>, String> {
    let world = gpus.len();
    let mut comms: Vec<RawComm> = vec![std::ptr::null_mut(); world];
    let mut first_error: Option<String> = None;
    // SAFETY: group calls bracket the init calls below.
    unsafe { (api.group_start)() };
    for (r, g) in gpus.iter().enumerate() {
        if let Err(e) = g.bind() {
            first_error.get_or_insert(format!("rank {r}: {e}"));
            continue;
        }
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 1,
            cga_cluster_size: CONFIG_UNDEF,
            min_ctas: CONFIG_UNDEF,
            max_ctas: CONFIG_UNDEF,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF,
        };
        // SAFETY: valid out pointer, the id from ncclGetUniqueId, a config NCCL reads `size`
        // bytes of; the rank's context is current (NCCL takes the device from it).
        let rc = unsafe { (api.init_rank_config)(&mut comms[r], world as c_int, id, r as c_int, &mut config) };
        if rc != NCCL_SUCCESS {
            first_error.get_or_insert(format!("rank {r}: ncclCommInitRankConfig: {}", api.describe(rc, comms[r])));
        }
    }
    // SAFETY: closes the group opened above; runs the initialisation.
    let rc = unsafe { (api.group_end)() };
    if rc != NCCL_SUCCESS {
        first_error.get_or_insert(format!("ncclGroupEnd: {}", api.describe(rc, std::ptr::null_mut())));
    }
    if first_error.is_none() {
        if let Some(r) = comms.iter().position(|c| c.is_null()) {
            first_error = Some(format!("rank {r}: NCCL returned no communicator"));
        }
    }
    match first_error {
        Some(e) => {
            abort_raw(api, gpus, &comms);
            Err(e)
        }
        None => Ok(comms.into_iter().map(|c| c as usize).collect()),
    }
}

fn abort_raw(api: &Api, gpus: &[Arc<Gpu>], comms: &[RawComm]) {
    for (g, &c) in gpus.iter().zip(comms) {
        if !c.is_null() {
            set_current(g);
            // SAFETY: a communicator from ncclCommInitRankConfig, not used again.
            unsafe {
                let _ = (api.abort)(c);
            }
        }
    }
}

fn free_scratch(gpus: &[Arc<Gpu>], scratch: &[u64]) {
    for (g, &p) in gpus.iter().zip(scratch) {
        set_current(g);
        // SAFETY: allocated above with cuMemAlloc, unused.
        unsafe {
            let _ = sys::cuMemFree_v2(p);
        }
    }
}

/// What the start-up self-test measured.
#[derive(Clone, Debug)]
pub struct SelfTest {
    /// Ranks.
    pub world: usize,
    /// Time of one small (one f32 per rank) all-reduce on rank 0, including the wait for it.
    pub small: Duration,
    /// Bytes of the bandwidth test (0 when skipped).
    pub big_bytes: usize,
    /// Median time of one all-reduce of `big_bytes` on rank 0.
    pub big: Option<Duration>,
    /// The one-shot peer path: the time of one small all-reduce on rank 0 (the fastest of
    /// three, including the wait for it), or why the group has no such path.
    pub peer: std::result::Result<Duration, String>,
}

impl SelfTest {
    /// NCCL's "bus bandwidth" of the large all-reduce in GB/s: `2(n-1)/n · bytes / time`.
    pub fn bus_bandwidth_gb_s(&self) -> Option<f64> {
        let t = self.big?.as_secs_f64();
        let n = self.world as f64;
        (t > 0.0).then(|| 2.0 * (n - 1.0) / n * self.big_bytes as f64 / t / 1e9)
    }

    /// One line for logs and `check-env`.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "all-reduce over {} ranks passed ({:.0} µs for a small one",
            self.world,
            self.small.as_secs_f64() * 1e6
        );
        if let (Some(t), Some(bw)) = (self.big, self.bus_bandwidth_gb_s()) {
            let _ = write!(
                s,
                "; {} MiB in {:.2} ms, bus bandwidth {bw:.0} GB/s",
                self.big_bytes >> 20,
                t.as_secs_f64() * 1e3
            );
        }
        s.push(')');
        match &self.peer {
            Ok(t) => {
                let _ =
                    write!(s, "; one-shot peer all-reduce passed ({:.0} µs for a small one)", t.as_secs_f64() * 1e6);
            }
            Err(why) => {
                let _ = write!(s, "; no one-shot peer path ({why})");
            }
        }
        s
    }
}

/// The start-up self-test on the real communicators: every rank sums a small vector (rank `r`
/// puts `r + 1` in slot `r`; everyone must get `1..=world`) through NCCL and, when the group has
/// it, through the one-shot peer path (whose kernels keep `deadline` on the device); then, when
/// `big_bytes > 0`, times an NCCL all-reduce of that size. One thread per rank; everything has `deadline` (the group is aborted
/// and the error says what to try when it passes). The rank threads allocate their own buffers
/// and free them before returning, so run this before the model is loaded.
pub fn self_test(comms: &[NcclComm], deadline: Duration, big_bytes: usize) -> Result<SelfTest> {
    let world = comms.len();
    if world == 0 {
        return Err(Error::invalid("the NCCL self-test needs at least one rank"));
    }
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    for c in comms {
        let comm = NcclComm { rank: c.rank, shared: Arc::clone(&c.shared), stall_after: c.stall_after };
        let tx = tx.clone();
        let spawned = std::thread::Builder::new().name(format!("tm-nccl-selftest-{}", c.rank)).spawn(move || {
            let r = rank_self_test(&comm, deadline, big_bytes);
            let _ = tx.send((comm.rank, r));
        });
        if let Err(e) = spawned {
            comms[0].abort("the self-test could not start");
            return Err(nccl_err(format!("could not start a self-test thread: {e}")));
        }
    }
    drop(tx);
    let mut results: Vec<Option<RankTimes>> = vec![None; world];
    let mut first_err: Option<Error> = None;
    let limit = deadline.saturating_mul(2) + Duration::from_secs(1);
    while results.iter().any(Option::is_none) {
        let left = limit.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok((r, Ok(t))) => results[r] = Some(t),
            Ok((r, Err(e))) => {
                results[r] = Some((Duration::ZERO, None, None));
                // Prefer a rank's own failure or timeout over the aborts it caused.
                let better = matches!(
                    (&first_err, &e),
                    (None, _) | (Some(Error::Aborted { .. }), Error::Timeout { .. } | Error::Backend { .. })
                );
                if better {
                    first_err = Some(e);
                }
            }
            Err(_) => {
                let pending: Vec<usize> = (0..world).filter(|&r| results[r].is_none()).collect();
                comms[0].abort("the start-up self-test did not finish");
                return Err(Error::Timeout {
                    rank: pending.first().copied().unwrap_or(0),
                    step: format!("the NCCL start-up self-test (all-reduce over {world} ranks)"),
                    waited: start.elapsed(),
                    hint: format!("ranks {pending:?} did not finish; the communicators were aborted. {INIT_HINT}"),
                });
            }
        }
    }
    if let Some(e) = first_err {
        return Err(nccl_err(format!("the NCCL start-up self-test failed: {e}. {INIT_HINT}")));
    }
    let (small, big, peer) = results[0].unwrap_or_default();
    let peer = match (peer, comms[0].peer_path()) {
        (Some(t), _) => Ok(t),
        (None, Err(why)) => Err(why),
        (None, Ok(_)) => Err("not tested".into()),
    };
    Ok(SelfTest { world, small, big_bytes: if big.is_some() { big_bytes } else { 0 }, big, peer })
}

/// One rank's self-test times: small NCCL all-reduce, median big one, fastest small peer one.
type RankTimes = (Duration, Option<Duration>, Option<Duration>);

/// One rank's part of [`self_test`].
fn rank_self_test(comm: &NcclComm, deadline: Duration, big_bytes: usize) -> Result<RankTimes> {
    let world = comm.world();
    let gpu = comm.gpu();
    gpu.bind()?;
    let small_bytes = world * 4;
    let alloc = |bytes: usize| -> Result<DeviceBuf> {
        // SAFETY: the context is current.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map(|ptr| DeviceBuf { ptr, gpu: Arc::clone(gpu) })
            .map_err(crate::runtime::driver_err("cuMemAlloc (NCCL self-test)"))
    };
    let buf = alloc(small_bytes)?;
    let mut mine = vec![0f32; world];
    mine[comm.rank] = (comm.rank + 1) as f32;
    // On the rank's stream, so the all-reduce (queued behind it) reads the copied values; `mine`
    // outlives the copy (the stream is waited for below).
    // SAFETY: `buf` holds `world` f32s; nothing else uses it yet.
    unsafe { cudarc::driver::result::memcpy_htod_async(buf.ptr, &mine, gpu.stream().cu_stream()) }
        .map_err(crate::runtime::driver_err("cuMemcpyHtoDAsync (NCCL self-test)"))?;
    let t0 = Instant::now();
    comm.all_reduce_nccl(buf.ptr, world, DType::F32, "start-up self-test", deadline)?;
    comm.synchronize("start-up self-test", deadline)?;
    let small = t0.elapsed();
    let want: Vec<f32> = (1..=world).map(|v| v as f32).collect();
    let verify = |path: &str| -> Result<()> {
        let mut got = vec![0f32; world];
        // SAFETY: the all-reduce finished (synchronize); `got` holds `world` f32s.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut got, buf.ptr) }
            .map_err(crate::runtime::driver_err("cuMemcpyDtoH (NCCL self-test)"))?;
        if got != want {
            let msg = format!(
                "the {path} all-reduce self-test summed to {got:?} instead of {want:?}: the transport corrupts data"
            );
            comm.abort(&msg);
            return Err(nccl_err(msg));
        }
        Ok(())
    };
    verify("NCCL")?;
    let mut peer = None;
    if comm.takes_peer_path(world, DType::F32) {
        // Both exchanges of the peer path (every rank takes the same turns).
        let ll = comm.peer_ll_bytes() > 0;
        for protocol in [Protocol::Flags, Protocol::LowLatency, Protocol::Flags, Protocol::LowLatency] {
            if protocol == Protocol::LowLatency && !ll {
                continue;
            }
            // SAFETY: as above.
            unsafe { cudarc::driver::result::memcpy_htod_async(buf.ptr, &mine, gpu.stream().cu_stream()) }
                .map_err(crate::runtime::driver_err("cuMemcpyHtoDAsync (NCCL self-test)"))?;
            let t = Instant::now();
            let step = "start-up self-test (peer path)";
            comm.all_reduce_peer_with(buf.ptr, world, DType::F32, protocol, step, deadline)?;
            comm.synchronize(step, deadline)?;
            let took = t.elapsed();
            verify(if protocol == Protocol::Flags { "one-shot peer" } else { "one-shot peer (low-latency)" })?;
            peer = Some(peer.map_or(took, |p: Duration| p.min(took)));
        }
    }
    if big_bytes == 0 {
        return Ok((small, None, peer));
    }
    let count = big_bytes / 2;
    let big = alloc(count * 2)?;
    let mut times = Vec::new();
    for i in 0..4 {
        let t = Instant::now();
        comm.all_reduce_nccl(big.ptr, count, DType::BF16, "start-up bandwidth test", deadline)?;
        comm.synchronize("start-up bandwidth test", deadline)?;
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    times.sort();
    Ok((small, times.get(times.len() / 2).copied(), peer))
}

/// Device memory freed on drop (self-test buffers).
struct DeviceBuf {
    ptr: u64,
    gpu: Arc<Gpu>,
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        set_current(&self.gpu);
        // SAFETY: allocated with cuMemAlloc by `rank_self_test`, freed once. The work that used
        // it was waited for, or the communicator was aborted (its kernels returned).
        unsafe {
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// How a pair of GPUs is linked, as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerLink {
    /// `cuDeviceCanAccessPeer`.
    pub access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: true over NVLink, false over PCIe on
    /// the systems NVIDIA documents (a hint at the link, not a guarantee).
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is faster).
    pub performance_rank: i32,
}

/// The links between every pair of `ordinals` (`m[i][j]` for `ordinals[i]` → `ordinals[j]`;
/// the diagonal is `None`).
pub fn peer_links(ordinals: &[usize]) -> Result<Vec<Vec<Option<PeerLink>>>> {
    crate::probe::init_driver().map_err(|e| Error::Backend { backend: "cuda".into(), message: e.to_string() })?;
    let devs = ordinals
        .iter()
        .map(|&o| crate::probe::device_handle(o))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Backend { backend: "cuda".into(), message: e.to_string() })?;
    let attr = |a: sys::CUdevice_P2PAttribute, i: usize, j: usize| -> Result<c_int> {
        let mut v: c_int = 0;
        // SAFETY: both handles from cuDeviceGet; a valid out pointer.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, a, devs[i], devs[j]) }
            .result()
            .map_err(crate::runtime::driver_err("cuDeviceGetP2PAttribute"))?;
        Ok(v)
    };
    let n = devs.len();
    let mut m = vec![vec![None; n]; n];
    for i in 0..n {
        for j in 0..n {
            if i == j {
                continue;
            }
            let mut can: c_int = 0;
            // SAFETY: both handles from cuDeviceGet; a valid out pointer.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, devs[i], devs[j]) }
                .result()
                .map_err(crate::runtime::driver_err("cuDeviceCanAccessPeer"))?;
            let access = can != 0;
            let (native_atomics, performance_rank) = if access {
                (
                    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, i, j)? != 0,
                    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, i, j)?,
                )
            } else {
                (false, 0)
            };
            m[i][j] = Some(PeerLink { access, native_atomics, performance_rank });
        }
    }
    Ok(m)
}

/// The transport NCCL is expected to pick between `ordinals`, from the peer links and the
/// `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE` / `NCCL_P2P_LEVEL` settings (NCCL_DEBUG=INFO shows the
/// one it really chose, and the self-test's bandwidth tells them apart).
pub fn expected_transport(links: &[Vec<Option<PeerLink>>]) -> String {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let p2p_off = env("NCCL_P2P_DISABLE").is_some_and(|v| v != "0");
    let shm_off = env("NCCL_SHM_DISABLE").is_some_and(|v| v != "0");
    let pairs: Vec<&PeerLink> = links.iter().flatten().flatten().collect();
    if pairs.is_empty() {
        return "none (one rank)".into();
    }
    let all_access = pairs.iter().all(|l| l.access);
    let all_nvlink = pairs.iter().all(|l| l.native_atomics);
    let mut s = if p2p_off || !all_access {
        let why = if p2p_off { "NCCL_P2P_DISABLE is set" } else { "not every pair of GPUs has peer access" };
        if shm_off {
            format!("network/sockets ({why} and NCCL_SHM_DISABLE is set)")
        } else {
            format!("SHM, through host memory ({why})")
        }
    } else if all_nvlink {
        "P2P over NVLink (peer access with native atomics between every pair)".to_string()
    } else {
        "P2P over PCIe (peer access without native atomics)".to_string()
    };
    if let Some(level) = env("NCCL_P2P_LEVEL") {
        let _ = write!(s, "; NCCL_P2P_LEVEL={level}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_layout_is_nccl_2_17s() {
        // size_t, 2 unsigned, 4 int, a pointer, an int (padded): 48 bytes on 64-bit targets.
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

    #[test]
    fn versions_read_like_nccls() {
        assert_eq!(version_string(22703), "2.27.3");
        assert_eq!(version_string(21700), "2.17.0");
    }

    #[test]
    fn dtypes_map_to_ncclss_codes() {
        assert_eq!(nccl_dtype(DType::F32).unwrap(), 7);
        assert_eq!(nccl_dtype(DType::BF16).unwrap(), 9);
        assert_eq!(nccl_dtype(DType::F16).unwrap(), 6);
        assert!(nccl_dtype(DType::I4).is_err());
    }

    #[test]
    fn transport_follows_links_and_settings() {
        let nv = PeerLink { access: true, native_atomics: true, performance_rank: 0 };
        let pcie = PeerLink { access: true, native_atomics: false, performance_rank: 0 };
        let none = PeerLink { access: false, native_atomics: false, performance_rank: 0 };
        let m = |l: &PeerLink| vec![vec![None, Some(l.clone())], vec![Some(l.clone()), None]];
        // The tests of this module never set NCCL_* variables; skip if the environment does.
        if std::env::var_os("NCCL_P2P_DISABLE").is_some() || std::env::var_os("NCCL_SHM_DISABLE").is_some() {
            return;
        }
        assert!(expected_transport(&m(&nv)).starts_with("P2P over NVLink"));
        assert!(expected_transport(&m(&pcie)).starts_with("P2P over PCIe"));
        assert!(expected_transport(&m(&none)).starts_with("SHM"));
        assert_eq!(expected_transport(&[vec![None]]), "none (one rank)");
    }

    #[test]
    fn without_a_gpu_or_nccl_the_errors_say_what_is_missing() {
        match Api::get() {
            Ok(api) => assert!(api.version >= MIN_VERSION),
            Err(e) => assert!(e.to_string().contains("NCCL"), "{e}"),
        }
        // An empty group is empty (when NCCL loads at all).
        if Api::get().is_ok() {
            assert!(NcclComm::group(&[], Duration::from_secs(1)).unwrap().is_empty());
        }
    }
}
