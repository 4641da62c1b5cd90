//! In-process collectives: the ranks are threads of one process and tensors are host memory.
//!
//! [`LocalComm::group`] makes one communicator per rank; each rank's thread calls the same
//! collectives in the same order (as NCCL requires). A collective is a *round*: every rank
//! deposits its contribution, the last to arrive publishes all of them, and each rank reads
//! what it needs (sums are taken in rank order, so every rank gets bit-identical results).
//!
//! # Never waiting forever
//! Every wait has the caller's deadline. A rank whose deadline passes returns
//! [`Error::Timeout`] naming itself, the collective (`all_reduce #37 (layer 5 o_proj)`: the
//! rank's 38th collective, and the caller's step) and which ranks never arrived, and marks the
//! group *aborted*: every other rank's wait ends at once with an error, and so does every later
//! collective (with [`Error::Timeout`] too when a deadline caused the abort, else
//! [`Error::Aborted`]). [`Comm::abort`] does the same for a rank that fails outside a collective,
//! so the others do not wait out their deadlines for a rank that will never come.
//!
//! # Fault injection
//! [`LocalComm::stall_after`] makes a rank stop answering at a chosen collective (as a hung
//! kernel or a dead peer would), for tests of the paths above. The stalled rank waits until the
//! group is aborted (at most four deadlines), then fails too, so its thread can be joined.

use super::Comm;
use crate::{DType, Error, Result, Tensor};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which collective a rank entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    AllGather,
    Broadcast,
    Barrier,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::Broadcast => "broadcast",
            Kind::Barrier => "barrier",
        }
    }
}

/// One rank's contribution to a round.
#[derive(Debug)]
struct Deposit {
    kind: Kind,
    /// `all_reduce #3 (layer 0 o_proj)`.
    label: String,
    dtype: DType,
    root: usize,
    /// The data (empty for a barrier and for the non-root ranks of a broadcast).
    bytes: Vec<u8>,
}

/// Why the group was aborted.
#[derive(Clone, Debug)]
enum AbortCause {
    /// A rank's deadline passed.
    Expired { rank: usize, label: String, missing: String },
    /// A rank failed or a collective was misused; the message says how.
    Failed(String),
}

#[derive(Debug)]
struct State {
    /// The round being collected (or read).
    round: u64,
    /// Contributions to the current round, by rank.
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
    /// Every contribution, once the last rank has arrived.
    ready: Option<Arc<Vec<Deposit>>>,
    /// Ranks that have not yet taken `ready`.
    readers: usize,
    /// The last collective each rank entered.
    last: Vec<Option<String>>,
    aborted: Option<AbortCause>,
}

#[derive(Debug)]
struct Group {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group (see the module docs).
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
    /// Collectives this rank has entered.
    started: AtomicU64,
    stall_after: Option<u64>,
}

impl LocalComm {
    /// One communicator per rank of a world of `world` ranks (none when `world` is 0); give
    /// communicator `r` to rank `r`'s thread.
    pub fn group(world: usize) -> Vec<LocalComm> {
        let state = State {
            round: 0,
            deposits: (0..world).map(|_| None).collect(),
            arrived: 0,
            ready: None,
            readers: 0,
            last: vec![None; world],
            aborted: None,
        };
        let group = Arc::new(Group { world, state: Mutex::new(state), cv: Condvar::new() });
        (0..world)
            .map(|rank| LocalComm { rank, group: Arc::clone(&group), started: AtomicU64::new(0), stall_after: None })
            .collect()
    }

    /// Test hook: this rank runs collectives `#0..#n` normally, then stops answering at
    /// collective `#n` (it neither contributes nor returns) until the group is aborted, as a hung
    /// rank would. The other ranks then hit their deadlines.
    pub fn stall_after(mut self, n: u64) -> Self {
        self.stall_after = Some(n);
        self
    }

    /// How many collectives this rank has entered.
    pub fn collectives_started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// Why the group was aborted, if it was.
    pub fn abort_reason(&self) -> Option<String> {
        let st = self.lock();
        st.aborted.is_some().then(|| self.abort_reason_of(&st))
    }

    fn abort_reason_of(&self, st: &State) -> String {
        match &st.aborted {
            Some(AbortCause::Expired { rank, label, missing }) => {
                format!("rank {rank} timed out in {label} ({missing})")
            }
            Some(AbortCause::Failed(msg)) => msg.clone(),
            None => "not aborted".into(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, so a poisoned state is still consistent.
        self.group.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the group aborted (first cause wins) and wakes every waiter.
    fn abort_with(&self, st: &mut State, cause: AbortCause) {
        if st.aborted.is_none() {
            st.aborted = Some(cause);
        }
        self.group.cv.notify_all();
    }

    /// The error of this rank for a group aborted by someone (or something) else.
    fn aborted_error(&self, cause: &AbortCause, label: &str, start: Instant) -> Error {
        match cause {
            AbortCause::Expired { rank, label: theirs, missing } => Error::Timeout {
                rank: self.rank,
                step: label.to_string(),
                waited: start.elapsed(),
                hint: format!(
                    "the group was aborted: rank {rank} timed out in {theirs} ({missing}); check that rank (a hang \
                     or a crash), raise --comm-timeout if the step is only slow, or use fewer ranks"
                ),
            },
            AbortCause::Failed(msg) => Error::Aborted {
                rank: self.rank,
                step: format!("{label} (after {:?})", start.elapsed()),
                reason: msg.clone(),
            },
        }
    }

    /// Which ranks have not contributed to the current round, and where they were last seen.
    fn missing(&self, st: &State) -> String {
        let absent: Vec<usize> = (0..self.group.world).filter(|&r| st.deposits[r].is_none()).collect();
        if st.ready.is_some() || absent.is_empty() {
            return "every rank arrived but the round was not handed out in time".into();
        }
        let list: Vec<String> = absent.iter().map(usize::to_string).collect();
        let mut s = format!("rank{} {} did not arrive", if absent.len() == 1 { "" } else { "s" }, list.join(", "));
        for r in absent {
            match &st.last[r] {
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

    /// Waits until `ready(state)`, the group is aborted, or `until` passes (then aborts the group).
    fn wait<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        label: &str,
        start: Instant,
        until: Option<Instant>,
        ready: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        loop {
            if let Some(cause) = &st.aborted {
                return Err(self.aborted_error(cause, label, start));
            }
            if ready(&st) {
                return Ok(st);
            }
            let now = Instant::now();
            match until {
                Some(t) if now >= t => {
                    let missing = self.missing(&st);
                    let cause =
                        AbortCause::Expired { rank: self.rank, label: label.to_string(), missing: missing.clone() };
                    self.abort_with(&mut st, cause);
                    return Err(Error::Timeout {
                        rank: self.rank,
                        step: label.to_string(),
                        waited: start.elapsed(),
                        hint: format!(
                            "{missing}; the group is aborted. Check that rank (a hang or a crash), raise \
                             --comm-timeout if the step is only slow, or use fewer ranks"
                        ),
                    });
                }
                Some(t) => st = self.group.cv.wait_timeout(st, t - now).unwrap_or_else(|e| e.into_inner()).0,
                None => st = self.group.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// The test hook's stall: wait for the abort (at most four deadlines), then fail.
    fn stall(&self, mut st: MutexGuard<'_, State>, label: &str, start: Instant, deadline: Duration) -> Error {
        tracing::warn!("rank {} stalls in {label} (LocalComm::stall_after test hook)", self.rank);
        let until = start.checked_add(deadline.saturating_mul(4));
        let stalled = |reason: String| Error::Aborted {
            rank: self.rank,
            step: format!("{label} (stalled by the test hook for {:?})", start.elapsed()),
            reason,
        };
        loop {
            if st.aborted.is_some() {
                return stalled(self.abort_reason_of(&st));
            }
            let now = Instant::now();
            match until {
                Some(t) if now >= t => {
                    let msg = format!("rank {} stalled in {label} (test hook)", self.rank);
                    self.abort_with(&mut st, AbortCause::Failed(msg.clone()));
                    return stalled(msg);
                }
                Some(t) => st = self.group.cv.wait_timeout(st, t - now).unwrap_or_else(|e| e.into_inner()).0,
                None => st = self.group.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Fails this rank's collective before it contributed: the group is aborted, since the
    /// others would otherwise wait for a contribution that never comes.
    fn fail_local(&self, label: &str, e: Error) -> Error {
        let mut st = self.lock();
        self.abort_with(&mut st, AbortCause::Failed(format!("rank {} failed in {label}: {e}", self.rank)));
        e
    }

    /// One round: contribute `bytes`, wait for everyone, return every contribution.
    fn round(
        &self,
        kind: Kind,
        step: &str,
        deadline: Duration,
        prepare: impl FnOnce(&str) -> Result<(DType, usize, Vec<u8>)>,
    ) -> Result<(Arc<Vec<Deposit>>, String)> {
        let start = Instant::now();
        let seq = self.started.fetch_add(1, Ordering::Relaxed);
        let label = format!("{} #{seq} ({step})", kind.name());
        let until = start.checked_add(deadline);
        let (dtype, root, bytes) = prepare(&label).map_err(|e| self.fail_local(&label, e))?;
        let mut st = self.lock();
        st.last[self.rank] = Some(label.clone());
        if let Some(cause) = &st.aborted {
            return Err(self.aborted_error(cause, &label, start));
        }
        if self.stall_after.is_some_and(|n| seq >= n) {
            return Err(self.stall(st, &label, start, deadline));
        }
        if st.round > seq {
            let msg =
                format!("rank {} entered {label} after round {} had started: ranks out of step", self.rank, st.round);
            self.abort_with(&mut st, AbortCause::Failed(msg.clone()));
            return Err(Error::invalid(msg));
        }
        let mut st = self.wait(st, &label, start, until, |s| s.round == seq && s.ready.is_none())?;
        st.deposits[self.rank] = Some(Deposit { kind, label: label.clone(), dtype, root, bytes });
        st.arrived += 1;
        if st.arrived == self.group.world {
            let deposits: Vec<Deposit> = st.deposits.iter_mut().filter_map(Option::take).collect();
            if let Some(msg) = mismatch(&deposits) {
                self.abort_with(&mut st, AbortCause::Failed(msg.clone()));
                return Err(Error::invalid(msg));
            }
            st.ready = Some(Arc::new(deposits));
            st.readers = self.group.world;
            self.group.cv.notify_all();
        }
        let mut st = self.wait(st, &label, start, until, |s| s.round == seq && s.ready.is_some())?;
        let ready = st.ready.clone().ok_or_else(|| Error::invalid("comm round without contributions"))?;
        st.readers -= 1;
        if st.readers == 0 {
            st.ready = None;
            st.arrived = 0;
            st.round += 1;
            self.group.cv.notify_all();
        }
        Ok((ready, label))
    }
}

/// Whether the ranks called different collectives (or with different sizes) in one round.
fn mismatch(deposits: &[Deposit]) -> Option<String> {
    let first = deposits.first()?;
    let same = deposits.iter().all(|d| {
        d.kind == first.kind
            && d.dtype == first.dtype
            && d.root == first.root
            && (first.kind == Kind::Broadcast || d.bytes.len() == first.bytes.len())
    });
    if same {
        return None;
    }
    let each: Vec<String> = deposits
        .iter()
        .enumerate()
        .map(|(r, d)| format!("rank {r} in {} ({} bytes of {}, root {})", d.label, d.bytes.len(), d.dtype, d.root))
        .collect();
    Some(format!("the ranks called different collectives in one round: {}", each.join(", ")))
}

fn host_bytes<'a>(t: &'a Tensor, label: &str) -> Result<&'a [u8]> {
    let n = t.desc().bytes();
    t.buffer()
        .host_bytes()
        .map(|b| &b[..n])
        .ok_or_else(|| Error::Unsupported(format!("{label}: LocalComm needs host-accessible tensors")))
}

fn host_bytes_mut<'a>(t: &'a mut Tensor, label: &str) -> Result<&'a mut [u8]> {
    let n = t.desc().bytes();
    t.buffer_mut()
        .host_bytes_mut()
        .map(|b| &mut b[..n])
        .ok_or_else(|| Error::Unsupported(format!("{label}: LocalComm needs host-accessible tensors")))
}

/// `out = Σ parts` element-wise, in rank order, for a float or i32 dtype.
fn sum_into(dtype: DType, out: &mut [u8], parts: &[Deposit]) -> Result<()> {
    fn go<const N: usize>(
        out: &mut [u8],
        parts: &[Deposit],
        read: impl Fn([u8; N]) -> f64,
        write: impl Fn(f64) -> [u8; N],
    ) {
        for (i, o) in out.chunks_exact_mut(N).enumerate() {
            let mut acc: Option<f64> = None;
            for p in parts {
                let mut b = [0u8; N];
                b.copy_from_slice(&p.bytes[i * N..(i + 1) * N]);
                let v = read(b);
                acc = Some(acc.map_or(v, |a| a + v));
            }
            o.copy_from_slice(&write(acc.unwrap_or(0.0)));
        }
    }
    match dtype {
        // f32 sums are taken in f32 (rank order) so they match what a ring of f32 adds gives.
        DType::F32 => {
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                let mut acc = 0f32;
                for (r, p) in parts.iter().enumerate() {
                    let v = f32::from_le_bytes([
                        p.bytes[4 * i],
                        p.bytes[4 * i + 1],
                        p.bytes[4 * i + 2],
                        p.bytes[4 * i + 3],
                    ]);
                    acc = if r == 0 { v } else { acc + v };
                }
                o.copy_from_slice(&acc.to_le_bytes());
            }
        }
        DType::F16 => go::<2>(
            out,
            parts,
            |b| f64::from(half::f16::from_le_bytes(b).to_f32()),
            |v| half::f16::from_f32(v as f32).to_le_bytes(),
        ),
        DType::BF16 => go::<2>(
            out,
            parts,
            |b| f64::from(half::bf16::from_le_bytes(b).to_f32()),
            |v| half::bf16::from_f32(v as f32).to_le_bytes(),
        ),
        DType::I32 => {
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                let mut acc = 0i32;
                for p in parts {
                    let b = [p.bytes[4 * i], p.bytes[4 * i + 1], p.bytes[4 * i + 2], p.bytes[4 * i + 3]];
                    acc = acc.wrapping_add(i32::from_le_bytes(b));
                }
                o.copy_from_slice(&acc.to_le_bytes());
            }
        }
        other => return Err(Error::Unsupported(format!("all_reduce_sum of {other} tensors"))),
    }
    Ok(())
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, tensor: &mut Tensor, step: &str, deadline: Duration) -> Result<()> {
        let dtype = tensor.dtype();
        let (parts, label) = self.round(Kind::AllReduce, step, deadline, |label| {
            if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::I32) {
                return Err(Error::Unsupported(format!("{label}: all_reduce_sum of {dtype} tensors")));
            }
            Ok((dtype, 0, host_bytes(tensor, label)?.to_vec()))
        })?;
        sum_into(dtype, host_bytes_mut(tensor, &label)?, &parts)
    }

    fn all_gather(&self, input: &Tensor, output: &mut Tensor, step: &str, deadline: Duration) -> Result<()> {
        let world = self.group.world;
        let (parts, label) = self.round(Kind::AllGather, step, deadline, |label| {
            let (i, o) = (input.shape(), output.shape());
            let fits = input.dtype() == output.dtype()
                && output.numel() == world * input.numel()
                && match (i.split_first(), o.split_first()) {
                    (Some((i0, irest)), Some((o0, orest))) => *o0 == world * i0 && irest == orest,
                    _ => false,
                };
            if !fits {
                return Err(Error::shape(
                    format!("{label} output"),
                    format!("{world} × {:?} of {}", input.shape(), input.dtype()),
                    format!("{:?} of {}", output.shape(), output.dtype()),
                ));
            }
            Ok((input.dtype(), 0, host_bytes(input, label)?.to_vec()))
        })?;
        let out = host_bytes_mut(output, &label)?;
        for (chunk, p) in out.chunks_exact_mut(parts.first().map_or(1, |p| p.bytes.len().max(1))).zip(parts.iter()) {
            chunk.copy_from_slice(&p.bytes);
        }
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize, step: &str, deadline: Duration) -> Result<()> {
        let (rank, world) = (self.rank, self.group.world);
        let (parts, label) = self.round(Kind::Broadcast, step, deadline, |label| {
            if root >= world {
                return Err(Error::invalid(format!("{label}: root {root} but the world has {world} ranks")));
            }
            let bytes = if rank == root { host_bytes(tensor, label)?.to_vec() } else { Vec::new() };
            Ok((tensor.dtype(), root, bytes))
        })?;
        if rank != root {
            let src = &parts[root].bytes;
            let dst = host_bytes_mut(tensor, &label)?;
            if dst.len() != src.len() {
                return Err(Error::shape(label, format!("{} bytes from rank {root}", src.len()), dst.len()));
            }
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn barrier(&self, step: &str, deadline: Duration) -> Result<()> {
        self.round(Kind::Barrier, step, deadline, |_| Ok((DType::U8, 0, Vec::new()))).map(|_| ())
    }

    /// Collectives complete before they return, so this only reports an abort.
    fn synchronize(&self, step: &str, _deadline: Duration) -> Result<()> {
        let st = self.lock();
        match &st.aborted {
            Some(cause) => Err(self.aborted_error(cause, &format!("synchronize ({step})"), Instant::now())),
            None => Ok(()),
        }
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        self.abort_with(&mut st, AbortCause::Failed(format!("rank {} aborted the group: {reason}", self.rank)));
    }
}
