//! One-shot collectives between the GPUs of one process that have peer access: tm's own
//! all-reduce and all-gather for small messages (decode steps), used by [`crate::nccl::NcclComm`]
//! instead of NCCL up to [`PeerGroup::max_bytes`] per rank.
//!
//! Every rank is a thread of this process, so once peer access is enabled
//! (`cuCtxEnablePeerAccess`) a kernel on one GPU reads and writes another GPU's memory through
//! its ordinary device address: no IPC handles. Each rank owns one device buffer, allocated when
//! the group starts (never on the hot path), holding flag words and two slots per rank; the
//! kernels (`collectives.cu`, protocol in its header and in ABI.md) push their input into every
//! rank's slot, publish an epoch in every rank's flag word (system-scope release), wait for every
//! rank's flag (acquire) and sum (or gather) the slots locally. One launch, one exchange: about
//! the latency of one NVLink round trip instead of NCCL's ~12 µs per call.
//!
//! A third kernel fuses the all-reduce with the residual add and RMSNorm that follow every
//! row-parallel projection of a layer ([`PeerGroup::launch_add_rms_norm`], behind
//! `tm_core::Comm::all_reduce_add_rms_norm`): one launch instead of two per collective, with the
//! separate kernels' bits (it runs their row code, `norm.cuh`, at their block width).
//!
//! # The low-latency protocol
//! Messages of at most [`PeerGroup::ll_bytes`] per rank (default [`LL_MAX_BYTES`], every decode
//! step's hidden-state all-reduce at small batches) take the kernels' "LL" variant unless the
//! caller asks otherwise ([`Protocol`]): the flag travels with the data — every 8 bytes of payload
//! go out as two 8-byte words `{4 bytes of payload, epoch}`, each stored atomically — so the
//! system fence and the separate flag round trip disappear; the receiver polls its own words
//! until they carry the call's epoch. Same results (bits), epochs, deadline, reports and poison
//! as the flag protocol, which every larger message takes; the two may alternate freely. It needs
//! an LL region of `2 · world · 2 · ll_bytes` more per rank. `TM_PEER_LL=0` turns it off (read
//! once per process).
//!
//! # CUDA graphs
//! The kernels are launched through [`Gpu::launch`] on the rank's stream, so a step recorded for
//! a graph signs them like any kernel and a captured graph contains them. Their arguments are
//! constant per call site (buffer addresses, sizes, the deadline, a tag naming the step); the
//! epoch that orders successive calls is a counter in device memory that each call increments
//! itself, so a replayed graph continues the sequence. Because the sequence lives on the
//! device, it does not matter whether a rank runs a step from a graph or eagerly: every rank
//! runs each step's collectives exactly once either way (the record pass launches nothing, a
//! capture runs nothing), so ranks that decided differently still meet.
//!
//! # Never hanging
//! A kernel waits for its peers at most `deadline` (%globaltimer). Then it writes a report (the
//! peer that did not arrive, the epoch, the step's tag) into this rank's *status words*, mapped
//! host memory that the watchdog and [`crate::nccl::NcclComm`]'s `synchronize` read, poisons the
//! rank (its later collectives return at once) and returns, so the stream always drains. The host
//! turns the report into the same [`tm_core::Error::Timeout`] as an NCCL deadline and aborts the
//! group; [`PeerGroup::request_abort`] makes kernels that are still waiting give up at once.
//!
//! # When it is used
//! [`plan`]: two to [`MAX_RANKS`] GPUs, peer access between every pair, `NCCL_P2P_DISABLE` unset
//! (the user asked for no peer-to-peer traffic) and `TM_CUSTOM_ALLREDUCE` not `0`. Messages up
//! to `TM_CUSTOM_ALLREDUCE_MAX_BYTES` per rank (default [`DEFAULT_MAX_BYTES`]) of f32, f16 or bf16.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tm_core::{DType, Error, Result};

use crate::kernels::suffix;
use crate::nccl::PeerLink;
use crate::runtime::{Gpu, KernelArg};

/// The most ranks the kernels take (their buffer arguments).
pub const MAX_RANKS: usize = 8;
/// Blocks of every launch (the kernels keep one epoch counter per block).
const BLOCKS: u32 = 16;
/// Threads per block.
const THREADS: u32 = 256;
/// Bytes of the flag header before the slots.
const HEADER_BYTES: usize = 4096;
/// u32 status words per rank (host-mapped).
const STATUS_WORDS: usize = 16;
const ST_STATE: usize = 0;
const ST_PEER: usize = 1;
const ST_EPOCH: usize = 2;
const ST_TAG: usize = 3;
const ST_BLOCK: usize = 4;
const ST_WAITED_US: usize = 5;
const ST_ABORT: usize = 8;

/// Default and largest message per rank of the low-latency protocol: 64 KiB (the hidden state of
/// a batch of 4 rows at hidden 8192 in bf16). Its buffers take twice the payload, and above a few
/// tens of KiB the doubled traffic costs more than the flag round trip it saves.
pub const LL_MAX_BYTES: usize = 64 << 10;

/// Whether the low-latency protocol is on: `TM_PEER_LL` is not `0` (read once per process).
pub fn ll_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_PEER_LL").map_or(true, |v| v.trim() != "0"))
}

/// Default largest message per rank: 1 MiB. It covers every decode step's collectives of the
/// models tm targets at small batches — the hidden state after o_proj/down_proj (batch 64 at
/// hidden 8192 in bf16 is 1 MiB) and the vocab-parallel logits of one row (a 128k vocabulary over
/// two ranks is 125 KiB per rank in bf16) — so those steps can be captured into CUDA graphs. Above
/// it (prefill chunks) a one-shot exchange moves `world - 1` copies of the whole message per rank,
/// which stops paying against NCCL's ring, and the buffers (`2 · world · max` per rank) would grow.
pub const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// Whether the one-shot path can be used between GPUs with these `links` (`links[i][j]`, as
/// [`crate::nccl::peer_links`] reads them), and the largest message per rank it takes; `Err`
/// says why not. Reads `TM_CUSTOM_ALLREDUCE`, `TM_CUSTOM_ALLREDUCE_MAX_BYTES` and
/// `NCCL_P2P_DISABLE`.
pub fn plan(links: &[Vec<Option<PeerLink>>]) -> std::result::Result<usize, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let world = links.len();
    if world < 2 {
        return Err("one rank".into());
    }
    if world > MAX_RANKS {
        return Err(format!("{world} ranks (the one-shot kernels take at most {MAX_RANKS})"));
    }
    if env("TM_CUSTOM_ALLREDUCE").is_some_and(|v| v.trim() == "0") {
        return Err("turned off by TM_CUSTOM_ALLREDUCE=0".into());
    }
    if env("NCCL_P2P_DISABLE").is_some_and(|v| v.trim() != "0") {
        return Err("NCCL_P2P_DISABLE is set (no peer-to-peer traffic)".into());
    }
    for (i, row) in links.iter().enumerate() {
        for (j, l) in row.iter().enumerate() {
            if i != j && !l.as_ref().is_some_and(|l| l.access) {
                return Err(format!("rank {i} cannot access rank {j}'s memory (no peer access)"));
            }
        }
    }
    match env("TM_CUSTOM_ALLREDUCE_MAX_BYTES") {
        None => Ok(DEFAULT_MAX_BYTES),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if (256..=(64 << 20)).contains(&n) => Ok(n.next_multiple_of(256)),
            _ => Err(format!("TM_CUSTOM_ALLREDUCE_MAX_BYTES={v} is not a byte count from 256 to 64 MiB")),
        },
    }
}

/// What a rank's kernel reported when it gave up waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerTimeout {
    /// The rank whose kernel gave up.
    pub rank: usize,
    /// The rank whose flag never came.
    pub peer: usize,
    /// The epoch (this rank's count of one-shot collectives) it waited for.
    pub epoch: u32,
    /// The tag of the call (see [`crate::nccl::NcclComm`]'s step names).
    pub tag: u32,
    /// The block that gave up.
    pub block: u32,
    /// How long it waited.
    pub waited: Duration,
}

/// One rank's memory.
#[derive(Debug)]
struct Rank {
    gpu: Arc<Gpu>,
    /// The device buffer (header + slots).
    buf: u64,
    /// The status words: host address (mapped) and the device address of the same memory.
    status_host: usize,
    status_dev: u64,
}

/// Which exchange a one-shot all-reduce uses (every rank must pass the same for a call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// The low-latency protocol when the message fits it ([`PeerGroup::fits_ll`]), else flags.
    Auto,
    /// Data, then a system fence and a flag per block (every size).
    Flags,
    /// The flag inside every 8-byte word (an error when the message does not fit it).
    LowLatency,
}

/// Which collective a launch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Sum over ranks, in place allowed.
    AllReduce,
    /// Concatenate every rank's input.
    AllGather,
}

/// Device addresses of the tensors of [`PeerGroup::launch_add_rms_norm`].
#[derive(Clone, Copy, Debug)]
pub struct NormTensors {
    /// This rank's partial sums `[rows, cols]`; the sum over ranks afterwards.
    pub x: u64,
    /// The residual stream `[rows, cols]`, updated in place.
    pub residual: u64,
    /// The normalized rows `[rows, cols]`.
    pub out: u64,
    /// The norm's weight `[cols]`.
    pub weight: u64,
}

/// The buffers of every rank and the launches (see the module docs).
#[derive(Debug)]
pub struct PeerGroup {
    ranks: Vec<Rank>,
    slot_bytes: usize,
    /// The largest payload of the low-latency protocol (0: off); its region is twice that per
    /// slot.
    ll_bytes: usize,
}

/// Makes `gpu`'s context current without touching cudarc's per-thread error state.
fn set_current(gpu: &Gpu) {
    // SAFETY: the context is alive (the Gpu holds it).
    unsafe {
        let _ = sys::cuCtxSetCurrent(gpu.context().cu_ctx());
    }
}

/// The low-latency protocol's payload of `rows` rows of `cols` elements of `dtype`: each row in
/// whole 8-byte packs (`None` on overflow).
fn ll_payload(rows: usize, cols: usize, dtype: DType) -> Option<usize> {
    cols.checked_mul(dtype.bits() / 8)?.div_ceil(8).checked_mul(8)?.checked_mul(rows)
}

fn cu(call: &str, rc: sys::CUresult) -> std::result::Result<(), String> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call}: {rc:?}"))
    }
}

impl PeerGroup {
    /// Enables peer access between every pair of `gpus` (rank `r` on `gpus[r]`) and allocates
    /// every rank's buffer (`4 KiB + 2 · world · max_bytes`, plus `2 · world · 2 · ll` for the
    /// low-latency protocol's messages of up to `ll = min(max_bytes, LL_MAX_BYTES)` unless
    /// `TM_PEER_LL=0`; zeroed) and status words. `Err` says what failed (the caller then uses
    /// NCCL for everything).
    pub fn new(gpus: &[Arc<Gpu>], max_bytes: usize) -> std::result::Result<PeerGroup, String> {
        let world = gpus.len();
        if !(2..=MAX_RANKS).contains(&world) {
            return Err(format!("{world} ranks"));
        }
        let slot_bytes = max_bytes.max(256).next_multiple_of(256);
        for (i, g) in gpus.iter().enumerate() {
            set_current(g);
            for (j, p) in gpus.iter().enumerate() {
                if i == j {
                    continue;
                }
                // SAFETY: both contexts are alive; flags must be 0.
                let rc = unsafe { sys::cuCtxEnablePeerAccess(p.context().cu_ctx(), 0) };
                if rc != sys::CUresult::CUDA_SUCCESS && rc != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    return Err(format!(
                        "enabling rank {i}'s access to rank {j}'s memory: cuCtxEnablePeerAccess: {rc:?}"
                    ));
                }
            }
        }
        let ll_bytes = if ll_enabled() { slot_bytes.min(LL_MAX_BYTES) } else { 0 };
        let mut group = PeerGroup { ranks: Vec::with_capacity(world), slot_bytes, ll_bytes };
        let bytes = HEADER_BYTES + 2 * world * slot_bytes + 2 * world * 2 * ll_bytes;
        for g in gpus {
            set_current(g);
            let mut buf: sys::CUdeviceptr = 0;
            // SAFETY: a valid out pointer; the context is current.
            cu("cuMemAlloc (peer collectives)", unsafe { sys::cuMemAlloc_v2(&mut buf, bytes) })?;
            let mut host: *mut c_void = std::ptr::null_mut();
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: a valid out pointer.
            let rc = unsafe { sys::cuMemHostAlloc(&mut host, STATUS_WORDS * 4, flags) };
            if let Err(e) = cu("cuMemHostAlloc (peer collective status)", rc) {
                // SAFETY: allocated above, unused.
                unsafe {
                    let _ = sys::cuMemFree_v2(buf);
                }
                return Err(e);
            }
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: `host` is mapped pinned memory; a valid out pointer.
            let mapped =
                cu("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) });
            // SAFETY: STATUS_WORDS u32s of pinned memory that nothing else uses yet.
            unsafe { std::ptr::write_bytes(host as *mut u32, 0, STATUS_WORDS) };
            group.ranks.push(Rank { gpu: Arc::clone(g), buf, status_host: host as usize, status_dev: dev });
            mapped?;
            // SAFETY: `bytes` of device memory allocated above; synchronous.
            cu("cuMemsetD8 (peer collectives)", unsafe { sys::cuMemsetD8_v2(buf, 0, bytes) })?;
            // The memset may run on the legacy stream, which the rank's non-blocking stream does
            // not wait for: finish it now.
            // SAFETY: the context is current.
            cu("cuCtxSynchronize (peer collectives)", unsafe { sys::cuCtxSynchronize() })?;
        }
        Ok(group)
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The largest message per rank (bytes of one rank's input).
    pub fn max_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The largest message per rank of the low-latency protocol (0: turned off by `TM_PEER_LL=0`).
    pub fn ll_bytes(&self) -> usize {
        self.ll_bytes
    }

    /// Whether a collective of `count` elements of `dtype` per rank takes this path.
    pub fn fits(&self, count: usize, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && count > 0
            && count.checked_mul(dtype.bits() / 8).is_some_and(|b| b <= self.slot_bytes)
    }

    /// Whether an all-reduce of `count` elements of `dtype` per rank fits the low-latency
    /// protocol: its payload, in whole 8-byte packs, at most [`PeerGroup::ll_bytes`].
    pub fn fits_ll(&self, count: usize, dtype: DType) -> bool {
        self.fits(count, dtype) && ll_payload(1, count, dtype).is_some_and(|b| b <= self.ll_bytes)
    }

    /// Whether the fused all-reduce + add + norm of `rows x cols` fits the low-latency protocol
    /// (each row in whole 8-byte packs).
    pub fn fits_ll_rows(&self, rows: usize, cols: usize, dtype: DType) -> bool {
        rows.checked_mul(cols).is_some_and(|n| self.fits(n, dtype))
            && ll_payload(rows, cols, dtype).is_some_and(|b| b <= self.ll_bytes)
    }

    /// Whether a call with `protocol` takes the low-latency kernels, given whether the message
    /// `fits` them; `what` names the call in the error of a [`Protocol::LowLatency`] that does
    /// not fit.
    fn low_latency(&self, protocol: Protocol, fits: bool, what: impl FnOnce() -> String) -> Result<bool> {
        match protocol {
            Protocol::Flags => Ok(false),
            Protocol::Auto => Ok(fits),
            Protocol::LowLatency if fits => Ok(true),
            Protocol::LowLatency if self.ll_bytes == 0 => {
                Err(Error::invalid(format!("{}: the low-latency peer protocol is turned off (TM_PEER_LL=0)", what())))
            }
            Protocol::LowLatency => Err(Error::invalid(format!(
                "{}: more than the low-latency peer protocol's {} bytes per rank",
                what(),
                self.ll_bytes
            ))),
        }
    }

    /// Launches `kind` on rank `rank`'s stream (through [`Gpu::launch`], so it is signed and
    /// captured like any kernel): `count` elements of `dtype` from `src` (all-reduce: into `dst`,
    /// which may be `src`; all-gather: `world · count` into `dst`). An all-reduce exchanges
    /// through `protocol` (an all-gather always through flags). Waits for the peers at most
    /// `deadline` on the device. `tag` is written into the report if it gives up.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        kind: Kind,
        rank: usize,
        src: u64,
        dst: u64,
        count: usize,
        dtype: DType,
        protocol: Protocol,
        tag: u32,
        deadline: Duration,
    ) -> Result<()> {
        if !self.fits(count, dtype) {
            return Err(Error::invalid(format!(
                "peer collective of {count} {dtype} elements (at most {} bytes of f32, f16 or bf16)",
                self.slot_bytes
            )));
        }
        let me = self.ranks.get(rank).ok_or_else(|| Error::invalid(format!("peer collective on rank {rank}")))?;
        let name = match kind {
            Kind::AllReduce => {
                let ll = self.low_latency(protocol, self.fits_ll(count, dtype), || {
                    format!("peer all-reduce of {count} {dtype} elements")
                })?;
                if ll {
                    "peer_all_reduce_ll"
                } else {
                    "peer_all_reduce"
                }
            }
            Kind::AllGather if protocol == Protocol::LowLatency => {
                return Err(Error::invalid("the peer all-gather has no low-latency protocol"));
            }
            Kind::AllGather => "peer_all_gather",
        };
        let mut args = [KernelArg::Ptr(0); 18];
        args[0] = KernelArg::Ptr(src);
        args[1] = KernelArg::Ptr(dst);
        args[2] = KernelArg::I64(count as i64);
        self.group_args(rank, me, tag, deadline, &mut args[3..]);
        me.gpu.mark_collective();
        me.gpu.launch(&format!("{name}_{}", suffix(dtype)?), (BLOCKS, 1, 1), (THREADS, 1, 1), 0, &args)
    }

    /// Launches the all-reduce fused with the residual add and RMSNorm that follow it
    /// (`peer_all_reduce_add_rms_norm`) on rank `rank`'s stream, like [`PeerGroup::launch`]: `x`
    /// (`rows · cols` elements of `dtype`, this rank's partial sums) becomes the sum over ranks,
    /// then `residual += x` and `out = rms_norm(residual) * weight` (`weight`: `cols` elements),
    /// rounded as the separate all-reduce and `add_rms_norm` kernels round, through `protocol`.
    /// `x`, `residual`, `out` and `weight` must not overlap.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_add_rms_norm(
        &self,
        rank: usize,
        tensors: NormTensors,
        eps: f32,
        rows: usize,
        cols: usize,
        dtype: DType,
        protocol: Protocol,
        tag: u32,
        deadline: Duration,
    ) -> Result<()> {
        let count = rows.saturating_mul(cols);
        if !self.fits(count, dtype) {
            return Err(Error::invalid(format!(
                "peer all-reduce + add_rms_norm of {rows} x {cols} {dtype} elements (at most {} bytes of f32, f16 or \
                 bf16)",
                self.slot_bytes
            )));
        }
        let (Ok(r32), Ok(c32)) = (i32::try_from(rows), i32::try_from(cols)) else {
            return Err(Error::invalid(format!("peer all-reduce + add_rms_norm of {rows} x {cols} elements")));
        };
        let me = self.ranks.get(rank).ok_or_else(|| Error::invalid(format!("peer collective on rank {rank}")))?;
        let ll = self.low_latency(protocol, self.fits_ll_rows(rows, cols, dtype), || {
            format!("peer all-reduce + add_rms_norm of {rows} x {cols} {dtype} elements")
        })?;
        let mut args = [KernelArg::Ptr(0); 22];
        args[0] = KernelArg::Ptr(tensors.x);
        args[1] = KernelArg::Ptr(tensors.residual);
        args[2] = KernelArg::Ptr(tensors.out);
        args[3] = KernelArg::Ptr(tensors.weight);
        args[4] = KernelArg::F32(eps);
        args[5] = KernelArg::I32(r32);
        args[6] = KernelArg::I32(c32);
        self.group_args(rank, me, tag, deadline, &mut args[7..]);
        let threads = crate::kernels::elementwise::norm_row_threads(dtype, cols);
        let name = format!("peer_all_reduce_add_rms_norm{}_{}", if ll { "_ll" } else { "" }, suffix(dtype)?);
        me.gpu.mark_collective();
        me.gpu.launch(&name, (BLOCKS, 1, 1), (threads, 1, 1), 0, &args)
    }

    /// The arguments every kernel ends with: `rank, world, slot_bytes, ll_bytes, deadline_ns,
    /// status, tag, b0..b7` (15) into `args`.
    fn group_args(&self, rank: usize, me: &Rank, tag: u32, deadline: Duration, args: &mut [KernelArg]) {
        let deadline_ns = i64::try_from(deadline.as_nanos()).unwrap_or(i64::MAX).max(1);
        args[0] = KernelArg::I32(rank as i32);
        args[1] = KernelArg::I32(self.world() as i32);
        args[2] = KernelArg::I64(self.slot_bytes as i64);
        args[3] = KernelArg::I64(self.ll_bytes as i64);
        args[4] = KernelArg::I64(deadline_ns);
        args[5] = KernelArg::Ptr(me.status_dev);
        args[6] = KernelArg::U32(tag);
        for (a, r) in args[7..].iter_mut().zip(&self.ranks) {
            *a = KernelArg::Ptr(r.buf);
        }
    }

    fn status(&self, rank: usize) -> *mut u32 {
        self.ranks[rank].status_host as *mut u32
    }

    /// The report of a rank whose kernel gave up waiting, if one did.
    pub fn timeout(&self, rank: usize) -> Option<PeerTimeout> {
        let s = self.status(rank);
        // SAFETY: STATUS_WORDS u32s of mapped pinned memory, alive while `self` is; the GPU
        // writes them, so they are read volatile (the state word last written, first read).
        unsafe {
            if std::ptr::read_volatile(s.add(ST_STATE)) != 1 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            Some(PeerTimeout {
                rank,
                peer: std::ptr::read_volatile(s.add(ST_PEER)) as usize,
                epoch: std::ptr::read_volatile(s.add(ST_EPOCH)),
                tag: std::ptr::read_volatile(s.add(ST_TAG)),
                block: std::ptr::read_volatile(s.add(ST_BLOCK)),
                waited: Duration::from_micros(std::ptr::read_volatile(s.add(ST_WAITED_US)) as u64),
            })
        }
    }

    /// The first report of any rank.
    pub fn any_timeout(&self) -> Option<PeerTimeout> {
        (0..self.world()).find_map(|r| self.timeout(r))
    }

    /// Makes every kernel still waiting, on every rank, give up at once (and every later one
    /// return at once): the group is being aborted.
    pub fn request_abort(&self) {
        for r in 0..self.world() {
            // SAFETY: see `timeout`; the GPU reads this word.
            unsafe { std::ptr::write_volatile(self.status(r).add(ST_ABORT), 1) };
        }
    }

    /// Waits (at most `limit`) until no rank's stream has work queued.
    fn streams_idle(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        for r in &self.ranks {
            set_current(&r.gpu);
            loop {
                // SAFETY: the rank's live stream.
                match unsafe { sys::cuStreamQuery(r.gpu.stream().cu_stream()) } {
                    sys::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    sys::CUresult::CUDA_ERROR_NOT_READY => return false,
                    _ => break,
                }
            }
        }
        true
    }
}

impl Drop for PeerGroup {
    /// Frees the buffers once no stream can still run a kernel that uses them (any rank's kernel
    /// writes into every rank's buffer); if a stream does not drain within 10 s they are left to
    /// the process.
    fn drop(&mut self) {
        self.request_abort();
        let idle = self.streams_idle(Duration::from_secs(10));
        if !idle {
            tracing::error!("a GPU stream did not drain within 10 s; the peer collective buffers are left allocated");
        }
        for r in &self.ranks {
            set_current(&r.gpu);
            // SAFETY: allocated by `new`, freed once; no kernel uses them any more (`idle`).
            unsafe {
                if idle {
                    let _ = sys::cuMemFree_v2(r.buf);
                    let _ = sys::cuMemFreeHost(r.status_host as *mut c_void);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn links(world: usize, access: bool) -> Vec<Vec<Option<PeerLink>>> {
        (0..world)
            .map(|i| {
                (0..world)
                    .map(|j| (i != j).then_some(PeerLink { access, native_atomics: access, performance_rank: 0 }))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn launch_shape_and_layout_match_the_kernels() {
        let src = tm_kernels::cuda::modules().iter().find(|s| s.name == "collectives.cu").expect("collectives.cu").text;
        assert!(src.contains(&format!("constexpr int MAX_RANKS = {MAX_RANKS};")));
        assert!(src.contains(&format!("constexpr int BLOCKS = {BLOCKS};")));
        assert!(src.contains(&format!("constexpr u64 DATA_OFFSET = {HEADER_BYTES};")));
        assert!(src.contains(&format!("TM_KERNEL_BOUNDS(peer_all_reduce, {THREADS},")));
        assert!(src.contains(&format!("TM_KERNEL_BOUNDS(peer_all_gather, {THREADS},")));
        // The fused kernel runs the norms' block widths (up to 512 threads).
        assert!(src.contains("TM_KERNEL_BOUNDS(peer_all_reduce_add_rms_norm, NORM_MAX_THREADS,"));
        // The low-latency variants: the same widths and the same parameters (`group_args`).
        assert!(src.contains(&format!("TM_KERNEL_BOUNDS(peer_all_reduce_ll, {THREADS}, TMC_PARAMS, TMC_ARGS)")));
        assert!(src.contains(
            "TM_KERNEL_BOUNDS(peer_all_reduce_add_rms_norm_ll, NORM_MAX_THREADS, TMC_NORM_PARAMS, TMC_NORM_ARGS)"
        ));
        assert!(src.contains("int rank, int world, long long slot_bytes, long long ll_bytes,"));
        assert!(src.contains("long long deadline_ns, unsigned* status, unsigned tag, u64 b0,"));
        let norm = tm_kernels::cuda::headers().iter().find(|s| s.name == "norm.cuh").expect("norm.cuh").text;
        assert!(norm.contains("#define NORM_MAX_THREADS 512"));
        assert!(crate::kernels::elementwise::norm_row_threads(DType::BF16, 8192) <= 512);
        for (name, word) in [("ST_STATE", ST_STATE), ("ST_PEER", ST_PEER), ("ST_EPOCH", ST_EPOCH), ("ST_TAG", ST_TAG)]
            .into_iter()
            .chain([("ST_BLOCK", ST_BLOCK), ("ST_WAITED_US", ST_WAITED_US), ("ST_ABORT", ST_ABORT)])
        {
            assert!(src.contains(&format!("constexpr int {name} = {word};")), "{name}");
        }
    }

    #[test]
    fn low_latency_payload_keeps_every_row_in_whole_packs() {
        assert_eq!(ll_payload(1, 4096, DType::BF16), Some(8192));
        assert_eq!(ll_payload(1, 1, DType::F32), Some(8));
        assert_eq!(ll_payload(1, 7, DType::BF16), Some(16));
        assert_eq!(ll_payload(1, 4099, DType::F16), Some(8200));
        // 5 f32 are 20 bytes: 24 per row.
        assert_eq!(ll_payload(3, 5, DType::F32), Some(72));
        assert_eq!(ll_payload(usize::MAX, 8, DType::F32), None);
        assert!(LL_MAX_BYTES <= DEFAULT_MAX_BYTES && LL_MAX_BYTES.is_multiple_of(256));
    }

    #[test]
    fn plan_needs_peer_access_between_every_pair() {
        // The tests of this module never set these variables; skip if the environment does.
        if ["TM_CUSTOM_ALLREDUCE", "TM_CUSTOM_ALLREDUCE_MAX_BYTES", "NCCL_P2P_DISABLE"]
            .iter()
            .any(|k| std::env::var_os(k).is_some())
        {
            return;
        }
        assert_eq!(plan(&links(2, true)), Ok(DEFAULT_MAX_BYTES));
        assert!(plan(&links(2, false)).unwrap_err().contains("no peer access"));
        assert!(plan(&links(1, true)).is_err());
        assert!(plan(&links(9, true)).unwrap_err().contains("at most 8"));
        let mut partial = links(3, true);
        partial[2][0] = Some(PeerLink { access: false, native_atomics: false, performance_rank: 0 });
        assert!(plan(&partial).unwrap_err().contains("rank 2 cannot access rank 0"));
    }
}
