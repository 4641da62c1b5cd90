//! Tensor parallelism: a [`TpGroup`] runs one thread per rank, each with its own backend
//! (`Ops`), its shard of the model ([`LlamaModel::load_shard`]), its KV cache (its KV heads) and
//! its workspace, and drives them in lockstep: every [`TpGroup::forward`] sends the same step to
//! every rank and returns rank 0's logits.
//!
//! The same code serves CPU ranks ([`LocalComm`], [`TpGroup::start_cpu`]) and GPU ranks (one
//! thread per GPU with an NCCL communicator): the caller passes one [`Comm`] per rank and a
//! factory that makes each rank's backend on that rank's thread.
//!
//! # Never hanging
//! - Every collective inside a step has the group's deadline (`--comm-timeout`); a rank whose
//!   deadline passes fails with [`tm_core::Error::Timeout`] naming itself and the collective
//!   (`all_reduce #37 (layer 5 o_proj)`), and aborts the communicator so the others stop waiting.
//! - A rank that fails in any other way (or panics: panics are caught on the rank's thread)
//!   aborts the communicator too.
//! - The caller's thread waits for the ranks' replies with a watchdog: if no rank enters or
//!   leaves a collective for twice the deadline, or if ranks do not answer within a deadline of
//!   another rank's failure, the communicator is aborted and the unresponsive ranks are named.
//! - Errors from several ranks come back as one: the first in time (the cause; the others are
//!   its consequences), naming the rank and the step. After an error the group is finished:
//!   later calls fail at once.
//! - Dropping the group (or [`TpGroup::shutdown`]) stops and joins every rank thread; a thread
//!   that does not stop within a deadline is reported and left detached rather than waited for.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::llama::{LlamaModel, ShardLayout, ShardSpec, StepInput, Workspace};
use crate::weights::TensorSource;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tm_core::ops::{SampleRequest, SeqAttention};
use tm_core::sampling::{Rng, SamplingParams};
use tm_core::{Comm, DType, LocalComm, Ops, Tensor, TensorDesc};

/// The default deadline of every collective (`--comm-timeout`).
pub const DEFAULT_COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes rank `r`'s backend; called on rank `r`'s thread.
pub type BackendFactory = Arc<dyn Fn(usize) -> tm_core::Result<Box<dyn Ops>> + Send + Sync>;

/// Settings of a [`TpGroup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Deadline of every collective and barrier between ranks.
    pub comm_timeout: Duration,
    /// KV blocks per rank (each rank holds its KV heads of every block).
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Tokens per step the workspaces are first sized for (they grow on demand).
    pub max_tokens: usize,
    /// Logit rows per step the workspaces are first sized for.
    pub max_logit_rows: usize,
    /// What the KV cache stores keys and values as.
    pub kv_cache_dtype: KvCacheDtype,
    /// How long the rank threads poll for their next command, and the caller for the ranks'
    /// replies, before they block on the channel (zero: block at once). A blocked thread wakes
    /// tens of microseconds after a send, twice per step; GPU ranks poll so that a batch-1 step
    /// does not wait for that (it costs a busy core per rank and the caller's while they wait).
    /// CPU ranks, which need every core for their products, do not. `TM_TP_SPIN_US` overrides it.
    pub spin: Duration,
}

/// The polling time GPU ranks use ([`TpOptions::spin`]): longer than a batch-1 decode step of
/// an 8B model, so that the caller is still polling when the replies come.
pub const GPU_SPIN: Duration = Duration::from_millis(20);

impl Default for TpOptions {
    /// The default comm timeout, 256 blocks of 64 tokens, workspaces for one token, no polling.
    fn default() -> Self {
        TpOptions {
            comm_timeout: DEFAULT_COMM_TIMEOUT,
            num_blocks: 256,
            block_size: 64,
            max_tokens: 1,
            max_logit_rows: 1,
            kv_cache_dtype: KvCacheDtype::Auto,
            spin: Duration::ZERO,
        }
    }
}

/// A step's inputs, owned, shared by every rank.
#[derive(Debug, Default)]
struct OwnedStep {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slot_mapping: Vec<u32>,
    /// `(query_start, query_len, context_len, block table range in `tables`)`.
    seqs: Vec<(usize, usize, usize, std::ops::Range<usize>)>,
    tables: Vec<u32>,
    logit_rows: Vec<u32>,
}

impl OwnedStep {
    fn new(step: &StepInput<'_>) -> OwnedStep {
        let mut tables = Vec::new();
        let seqs = step
            .seqs
            .iter()
            .map(|s| {
                let start = tables.len();
                tables.extend_from_slice(s.block_table);
                (s.query_start, s.query_len, s.context_len, start..tables.len())
            })
            .collect();
        OwnedStep {
            tokens: step.tokens.to_vec(),
            positions: step.positions.to_vec(),
            slot_mapping: step.slot_mapping.to_vec(),
            seqs,
            tables,
            logit_rows: step.logit_rows.to_vec(),
        }
    }
}

/// One sequence's sampling state, owned, for rank 0's sampler ([`TpGroup::forward_sample`]).
#[derive(Clone, Debug)]
pub struct OwnedSample {
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Prompt tokens (only read by the repetition penalty: may be empty when it is off).
    pub prompt: Vec<u32>,
    /// Tokens generated so far (only read by the penalties: may be empty when they are off).
    pub output: Vec<u32>,
    /// The sequence's random stream; [`Sampled::rngs`] returns it advanced.
    pub rng: Rng,
}

impl OwnedSample {
    /// Whether the sampler reads the prompt and output tokens of `params` (penalties).
    pub fn needs_history(params: &SamplingParams) -> bool {
        params.repetition_penalty != 1.0 || params.presence_penalty != 0.0 || params.frequency_penalty != 0.0
    }
}

/// What [`TpGroup::forward_sample`] returns.
#[derive(Debug, Default)]
pub struct Sampled {
    /// One token per request.
    pub tokens: Vec<u32>,
    /// The requests' random streams after the draw, in request order.
    pub rngs: Vec<Rng>,
    /// The logits `[requests, vocab]`, when asked for (log-probabilities).
    pub logits: Option<Vec<f32>>,
}

/// A sampling job for rank 0.
#[derive(Debug)]
struct SampleJob {
    requests: Vec<OwnedSample>,
    want_logits: bool,
}

enum Command {
    /// A step: its id, inputs, rank 0's sampling job, and when the caller sent it.
    Forward(u64, Arc<OwnedStep>, Option<Arc<Mutex<Option<SampleJob>>>>, Instant),
    CopyBlocks(u64, Arc<Vec<(u32, u32)>>),
    SelfTest(u64, Duration),
    Shutdown,
}

enum Payload {
    Loaded { weight_bytes: u64 },
    Done,
    Logits(Vec<f32>),
    Sampled(Sampled),
    Exited,
}

struct Reply {
    rank: usize,
    id: u64,
    at: Instant,
    result: Result<Payload>,
    /// For a step: how long after the caller's send the rank took the command, and how long
    /// the rank then worked on it.
    timing: Option<(Duration, Duration)>,
}

/// Where the host time of the group's steps went, per rank (logged when the group stops).
#[derive(Debug, Default)]
struct StepTiming {
    steps: u64,
    /// Per rank, summed: send → the rank takes the command; the rank's work; the rank's reply →
    /// the caller takes it.
    ranks: Vec<[Duration; 3]>,
}

impl StepTiming {
    fn add(&mut self, rank: usize, woke: Duration, busy: Duration, back: Duration) {
        if self.ranks.len() <= rank {
            self.ranks.resize(rank + 1, [Duration::ZERO; 3]);
        }
        if rank == 0 {
            self.steps += 1;
        }
        for (sum, d) in self.ranks[rank].iter_mut().zip([woke, busy, back]) {
            *sum += d;
        }
    }

    /// One line per rank: mean microseconds per step.
    fn report(&self) -> Vec<String> {
        if self.steps == 0 {
            return Vec::new();
        }
        let us = |d: Duration| d.as_secs_f64() * 1e6 / self.steps as f64;
        self.ranks
            .iter()
            .enumerate()
            .map(|(r, [woke, busy, back])| {
                format!(
                    "tensor-parallel steps ({}): rank {r} took the command {:.1} us after the send, worked {:.1} us, \
                     its reply was taken {:.1} us later",
                    self.steps,
                    us(*woke),
                    us(*busy),
                    us(*back)
                )
            })
            .collect()
    }
}

/// Takes the next message from `rx`, polling it for up to `spin` (yielding the core between
/// polls) before blocking for the rest of `timeout`.
fn recv_polling<T>(rx: &Receiver<T>, spin: Duration, timeout: Duration) -> std::result::Result<T, RecvTimeoutError> {
    let start = Instant::now();
    let spin = spin.min(timeout);
    if !spin.is_zero() {
        loop {
            match rx.try_recv() {
                Ok(v) => return Ok(v),
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            if start.elapsed() >= spin {
                break;
            }
            std::thread::yield_now();
        }
    }
    rx.recv_timeout(timeout.saturating_sub(start.elapsed()))
}

/// [`TpOptions::spin`], unless `TM_TP_SPIN_US` sets it (microseconds).
fn spin_time(opts: &TpOptions) -> Duration {
    match std::env::var("TM_TP_SPIN_US").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(us) => Duration::from_micros(us),
        None => opts.spin,
    }
}

/// A communicator that counts the collectives its rank enters and leaves (the watchdog's sign
/// of life).
#[derive(Debug)]
struct Watched {
    inner: Box<dyn Comm>,
    progress: Arc<AtomicU64>,
}

impl Watched {
    fn tick<T>(&self, f: impl FnOnce() -> T) -> T {
        self.progress.fetch_add(1, Ordering::Relaxed);
        let r = f();
        self.progress.fetch_add(1, Ordering::Relaxed);
        r
    }
}

impl Comm for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, tensor: &mut Tensor, step: &str, deadline: Duration) -> tm_core::Result<()> {
        self.tick(|| self.inner.all_reduce_sum(tensor, step, deadline))
    }
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
    ) -> tm_core::Result<()> {
        self.tick(|| self.inner.all_reduce_add_rms_norm(ops, x, residual, weight, eps, out, step, deadline))
    }
    fn all_gather(&self, input: &Tensor, output: &mut Tensor, step: &str, deadline: Duration) -> tm_core::Result<()> {
        self.tick(|| self.inner.all_gather(input, output, step, deadline))
    }
    fn broadcast(&self, tensor: &mut Tensor, root: usize, step: &str, deadline: Duration) -> tm_core::Result<()> {
        self.tick(|| self.inner.broadcast(tensor, root, step, deadline))
    }
    fn barrier(&self, step: &str, deadline: Duration) -> tm_core::Result<()> {
        self.tick(|| self.inner.barrier(step, deadline))
    }
    fn synchronize(&self, step: &str, deadline: Duration) -> tm_core::Result<()> {
        self.tick(|| self.inner.synchronize(step, deadline))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

struct RankHandle {
    tx: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    exited: bool,
}

/// A tensor-parallel group of rank threads (see the module docs).
pub struct TpGroup {
    config: ModelConfig,
    timeout: Duration,
    block_size: usize,
    num_blocks: usize,
    ranks: Vec<RankHandle>,
    comms: Vec<Arc<Watched>>,
    replies: Receiver<Reply>,
    progress: Arc<AtomicU64>,
    next_id: u64,
    failed: Option<String>,
    weight_bytes: Vec<u64>,
    logits: Vec<f32>,
    /// [`TpOptions::spin`] (or `TM_TP_SPIN_US`).
    spin: Duration,
    timing: StepTiming,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("world", &self.ranks.len())
            .field("timeout", &self.timeout)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl TpGroup {
    /// Starts one thread per communicator (`comms[r]` must be rank `r` of `comms.len()`): each
    /// makes its backend with `backend(r)`, loads its shard of `config` from `source`, and
    /// allocates its KV cache and workspace. Then a small all-reduce checks the communicator
    /// (deadline: the comm timeout, at most 10 s). Fails, after stopping every thread, if any
    /// rank fails.
    pub fn start(
        source: Arc<dyn TensorSource>,
        config: ModelConfig,
        comms: Vec<Box<dyn Comm>>,
        backend: BackendFactory,
        opts: TpOptions,
    ) -> Result<TpGroup> {
        let world = comms.len();
        let layouts = ShardLayout::all(&config, world)?;
        if opts.num_blocks == 0 || opts.block_size == 0 {
            return Err(ModelError::InvalidInput("the KV cache needs at least one block of at least one token".into()));
        }
        for (r, c) in comms.iter().enumerate() {
            if c.rank() != r || c.world_size() != world {
                return Err(ModelError::InvalidInput(format!(
                    "communicator {r} is rank {} of {} (expected rank {r} of {world})",
                    c.rank(),
                    c.world_size()
                )));
            }
        }
        let progress = Arc::new(AtomicU64::new(0));
        let (reply_tx, replies) = mpsc::channel();
        let mut ranks = Vec::with_capacity(world);
        let mut watched = Vec::with_capacity(world);
        for (rank, (comm, layout)) in comms.into_iter().zip(layouts).enumerate() {
            let comm = Arc::new(Watched { inner: comm, progress: Arc::clone(&progress) });
            watched.push(Arc::clone(&comm));
            let (tx, rx) = mpsc::channel();
            let ctx = RankCtx {
                rank,
                comm,
                layout,
                config: config.clone(),
                source: Arc::clone(&source),
                backend: Arc::clone(&backend),
                opts: opts.clone(),
                replies: reply_tx.clone(),
            };
            let spawned =
                std::thread::Builder::new().name(format!("tm-tp-rank-{rank}")).spawn(move || rank_thread(ctx, rx));
            match spawned {
                Ok(thread) => ranks.push(RankHandle { tx, thread: Some(thread), exited: false }),
                Err(e) => {
                    for c in &watched {
                        c.abort("start-up failed");
                    }
                    let mut partial = TpGroup::assemble(config, &opts, ranks, watched, replies, progress);
                    let _ = partial.stop();
                    return Err(ModelError::Core(tm_core::Error::Backend {
                        backend: "tp".into(),
                        message: format!("could not start the thread of rank {rank}: {e}"),
                    }));
                }
            }
        }
        drop(reply_tx);
        let mut group = TpGroup::assemble(config, &opts, ranks, watched, replies, progress);
        let loaded = group.collect(0, "loading", None);
        match loaded {
            Ok(payloads) => {
                group.weight_bytes = payloads
                    .iter()
                    .map(|p| match p {
                        Payload::Loaded { weight_bytes } => *weight_bytes,
                        _ => 0,
                    })
                    .collect();
            }
            Err(e) => {
                let _ = group.stop();
                return Err(e);
            }
        }
        let self_test = opts.comm_timeout.min(Duration::from_secs(10));
        let id = group.next();
        if let Err(e) = group
            .send_all(|_| Command::SelfTest(id, self_test))
            .and_then(|_| group.collect(id, "start-up", Some(self_test.saturating_mul(2))))
        {
            let _ = group.stop();
            return Err(e);
        }
        tracing::info!("tensor parallelism: {world} ranks ready, comm timeout {:?}", opts.comm_timeout);
        Ok(group)
    }

    /// Starts `world` CPU ranks ([`LocalComm`], a `CpuBackend` per rank).
    pub fn start_cpu(
        source: Arc<dyn TensorSource>,
        config: ModelConfig,
        world: usize,
        opts: TpOptions,
    ) -> Result<TpGroup> {
        let comms = LocalComm::group(world).into_iter().map(|c| Box::new(c) as Box<dyn Comm>).collect();
        Self::start(source, config, comms, cpu_backend_factory(), opts)
    }

    fn assemble(
        config: ModelConfig,
        opts: &TpOptions,
        ranks: Vec<RankHandle>,
        comms: Vec<Arc<Watched>>,
        replies: Receiver<Reply>,
        progress: Arc<AtomicU64>,
    ) -> TpGroup {
        TpGroup {
            config,
            timeout: opts.comm_timeout,
            block_size: opts.block_size,
            num_blocks: opts.num_blocks,
            ranks,
            comms,
            replies,
            progress,
            next_id: 1,
            failed: None,
            weight_bytes: Vec::new(),
            logits: Vec::new(),
            spin: spin_time(opts),
            timing: StepTiming::default(),
        }
    }

    /// The whole model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }
    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// KV blocks (on every rank).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// The deadline of every collective.
    pub fn comm_timeout(&self) -> Duration {
        self.timeout
    }
    /// Bytes of weights each rank holds.
    pub fn weight_bytes(&self) -> &[u64] {
        &self.weight_bytes
    }
    /// Why the group stopped, if an error stopped it.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Runs `step` on every rank and returns rank 0's logits, `[logit_rows.len(), vocab]` row-major.
    pub fn forward(&mut self, step: &StepInput<'_>) -> Result<&[f32]> {
        validate(step)?;
        let id = self.next();
        let owned = Arc::new(OwnedStep::new(step));
        let what = format!("forward step {id}");
        let now = Instant::now();
        self.send_all(|_| Command::Forward(id, Arc::clone(&owned), None, now))?;
        let mut payloads = self.collect(id, &what, None)?;
        match payloads.first_mut().map(|p| std::mem::replace(p, Payload::Done)) {
            Some(Payload::Logits(v)) => {
                self.logits = v;
                Ok(&self.logits)
            }
            _ => Err(self.fail_with(0, &what, ModelError::InvalidInput("rank 0 returned no logits".into()))),
        }
    }

    /// Runs `step` on every rank, then rank 0 draws one token per request from the logits on
    /// its own device (`Ops::sample`: only the token ids travel back, and the logits too when
    /// `want_logits`). `requests[i]` samples logit row `step.logit_rows[i]`. `while_running` is
    /// called once while the ranks compute (host work that can overlap the step).
    pub fn forward_sample(
        &mut self,
        step: &StepInput<'_>,
        requests: Vec<OwnedSample>,
        want_logits: bool,
        while_running: &mut dyn FnMut(),
    ) -> Result<Sampled> {
        validate(step)?;
        if requests.len() != step.logit_rows.len() {
            return Err(ModelError::InvalidInput(format!(
                "{} sampling requests for {} logit rows",
                requests.len(),
                step.logit_rows.len()
            )));
        }
        let id = self.next();
        let owned = Arc::new(OwnedStep::new(step));
        let what = format!("forward step {id}");
        let job = Arc::new(Mutex::new(Some(SampleJob { requests, want_logits })));
        let now = Instant::now();
        let sent = self.send_all(|r| Command::Forward(id, Arc::clone(&owned), (r == 0).then(|| Arc::clone(&job)), now));
        while_running();
        sent?;
        let mut payloads = self.collect(id, &what, None)?;
        match payloads.first_mut().map(|p| std::mem::replace(p, Payload::Done)) {
            Some(Payload::Sampled(s)) => Ok(s),
            _ => Err(self.fail_with(0, &what, ModelError::InvalidInput("rank 0 returned no tokens".into()))),
        }
    }

    /// Copies whole KV blocks `(src, dst)` on every rank (copy-on-write of shared prefixes).
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let id = self.next();
        let pairs = Arc::new(pairs.to_vec());
        self.send_all(|_| Command::CopyBlocks(id, Arc::clone(&pairs)))?;
        self.collect(id, "copy_blocks", None).map(|_| ())
    }

    /// Stops and joins every rank thread, reporting a thread that would not stop.
    pub fn shutdown(mut self) -> Result<()> {
        match self.stop() {
            Ok(()) => Ok(()),
            Err(stuck) => Err(ModelError::Core(tm_core::Error::Backend {
                backend: "tp".into(),
                message: format!("rank threads {stuck:?} did not stop; they were left running"),
            })),
        }
    }

    fn next(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn send_all(&mut self, mut cmd: impl FnMut(usize) -> Command) -> Result<()> {
        if let Some(f) = &self.failed {
            return Err(ModelError::Unavailable(format!("the tensor-parallel group stopped after an error: {f}")));
        }
        for (r, h) in self.ranks.iter().enumerate() {
            if h.tx.send(cmd(r)).is_err() {
                let e = ModelError::InvalidInput("its thread has exited".into());
                return Err(self.fail_with(r, "sending a command", e));
            }
        }
        Ok(())
    }

    /// Records the group's failure and returns the error (wrapped with the rank unless it is a
    /// timeout, which names the rank itself).
    fn fail_with(&mut self, rank: usize, what: &str, e: ModelError) -> ModelError {
        let e = match e {
            ModelError::Core(tm_core::Error::Timeout { rank, step, waited, hint }) => {
                let step = if step.contains(what) { step } else { format!("{step} of {what}") };
                ModelError::Core(tm_core::Error::Timeout { rank, step, waited, hint })
            }
            e @ ModelError::Rank { .. } => e,
            e => ModelError::Rank { rank, step: what.to_string(), source: Box::new(e) },
        };
        self.failed = Some(e.to_string());
        for c in &self.comms {
            c.abort(&format!("the group failed: {e}"));
        }
        e
    }

    /// Waits for every rank's reply to command `id`, with the watchdog of the module docs.
    /// `limit` bounds the whole wait (for start-up commands).
    fn collect(&mut self, id: u64, what: &str, limit: Option<Duration>) -> Result<Vec<Payload>> {
        let world = self.ranks.len();
        let mut got: Vec<Option<Payload>> = (0..world).map(|_| None).collect();
        let mut first_err: Option<(Instant, usize, ModelError)> = None;
        let start = Instant::now();
        let mut seen = self.progress.load(Ordering::Relaxed);
        let mut last_change = start;
        let mut grace_until: Option<Instant> = None;
        let slice = (self.timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        // Loading has no deadline of its own (it can take minutes); a failed rank's peers get one.
        let watchdog = if id == 0 { None } else { Some(self.timeout.saturating_mul(2)) };
        loop {
            let missing: Vec<usize> = (0..world).filter(|&r| got[r].is_none()).collect();
            if first_err.is_none() {
                if let Some(&r) = missing.iter().find(|&&r| self.ranks[r].exited) {
                    let e = ModelError::InvalidInput("the rank's thread exited".into());
                    first_err = Some((Instant::now(), r, e));
                }
            }
            let pending: Vec<usize> = missing.into_iter().filter(|&r| !self.ranks[r].exited).collect();
            if pending.is_empty() {
                break;
            }
            let now = Instant::now();
            if first_err.is_some() && grace_until.is_none() && id != 0 {
                // The failed rank aborted the communicator: the others stop at their next collective.
                grace_until = Some(now + self.timeout.max(Duration::from_millis(100)));
            }
            let expired = grace_until.is_some_and(|g| now >= g) || limit.is_some_and(|l| now - start >= l);
            let stalled = watchdog.is_some_and(|w| now - last_change >= w);
            if expired || stalled {
                let reason = format!(
                    "ranks {pending:?} did not answer in {what} after {:?}{}",
                    now - start,
                    if stalled { " (no rank entered or left a collective meanwhile)" } else { "" }
                );
                tracing::error!("{reason}; aborting the communicator");
                for c in &self.comms {
                    c.abort(&reason);
                }
                if first_err.is_none() {
                    let e = ModelError::Core(tm_core::Error::Timeout {
                        rank: pending[0],
                        step: what.to_string(),
                        waited: now - start,
                        hint: format!(
                            "{reason}; check those ranks (a hang in a kernel or a dead device), raise --comm-timeout \
                             if the step is only slow, or use fewer ranks"
                        ),
                    });
                    first_err = Some((now, pending[0], e));
                }
                break;
            }
            match recv_polling(&self.replies, self.spin, slice) {
                Ok(reply) => {
                    let r = reply.rank;
                    if let (Some((woke, busy)), true) = (reply.timing, reply.id == id) {
                        self.timing.add(r, woke, busy, reply.at.elapsed());
                    }
                    if matches!(reply.result, Ok(Payload::Exited)) {
                        if let Some(h) = self.ranks.get_mut(r) {
                            h.exited = true;
                        }
                        continue;
                    }
                    if reply.id != id || r >= world {
                        continue; // a late answer to an earlier, failed command
                    }
                    match reply.result {
                        Ok(p) => got[r] = Some(p),
                        Err(e) => {
                            got[r] = Some(Payload::Done);
                            let better = match &first_err {
                                None => true,
                                Some((at, _, old)) => (cause_rank(&e), reply.at) < (cause_rank(old), *at),
                            };
                            if better {
                                first_err = Some((reply.at, r, e));
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    for h in &mut self.ranks {
                        h.exited = true;
                    }
                }
            }
            let p = self.progress.load(Ordering::Relaxed);
            if p != seen {
                seen = p;
                last_change = Instant::now();
            }
        }
        if let Some((_, rank, e)) = first_err {
            return Err(self.fail_with(rank, what, e));
        }
        if let Some(r) = got.iter().position(Option::is_none) {
            return Err(self.fail_with(r, what, ModelError::InvalidInput("the rank's thread exited".into())));
        }
        Ok(got.into_iter().flatten().collect())
    }

    /// Stops every rank and joins the threads that stop within a deadline; returns the ranks
    /// whose threads had to be left running.
    fn stop(&mut self) -> std::result::Result<(), Vec<usize>> {
        for c in &self.comms {
            if self.failed.is_some() {
                c.abort("the group is shutting down");
            }
        }
        for h in &self.ranks {
            let _ = h.tx.send(Command::Shutdown);
        }
        let until = Instant::now() + self.timeout.max(Duration::from_secs(1)).saturating_mul(2);
        while self.ranks.iter().any(|h| !h.exited && h.thread.is_some()) {
            let now = Instant::now();
            if now >= until {
                break;
            }
            match self.replies.recv_timeout(until - now) {
                Ok(Reply { rank, result: Ok(Payload::Exited), .. }) => {
                    if let Some(h) = self.ranks.get_mut(rank) {
                        h.exited = true;
                    }
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    for h in &mut self.ranks {
                        h.exited = true;
                    }
                }
            }
        }
        let mut stuck = Vec::new();
        for (r, h) in self.ranks.iter_mut().enumerate() {
            let Some(thread) = h.thread.take() else { continue };
            if h.exited || thread.is_finished() {
                if thread.join().is_err() {
                    tracing::error!("the thread of tensor-parallel rank {r} panicked while exiting");
                }
            } else {
                tracing::error!("the thread of tensor-parallel rank {r} did not stop; leaving it detached");
                stuck.push(r);
            }
        }
        if stuck.is_empty() {
            Ok(())
        } else {
            Err(stuck)
        }
    }
}

impl Drop for TpGroup {
    fn drop(&mut self) {
        for line in self.timing.report() {
            tracing::info!("{line}");
        }
        let _ = self.stop();
    }
}

/// Checks a step's shape on the caller's thread: a malformed step is the caller's error, not a
/// rank failure (which would stop the group).
fn validate(step: &StepInput<'_>) -> Result<()> {
    let n = step.tokens.len();
    let query: usize = step.seqs.iter().map(|s| s.query_len).sum();
    if n == 0 || step.positions.len() != n || step.slot_mapping.len() != n || query != n {
        return Err(ModelError::InvalidInput(format!(
            "step with {n} tokens, {} positions, {} slots and {query} query tokens",
            step.positions.len(),
            step.slot_mapping.len()
        )));
    }
    if step.logit_rows.is_empty() || step.logit_rows.iter().any(|&r| r as usize >= n) {
        return Err(ModelError::InvalidInput(format!("logit rows {:?} of a {n}-token step", step.logit_rows)));
    }
    Ok(())
}

/// How likely an error is to be the cause of a group's failure rather than a consequence (lower
/// is likelier): a rank's own failure, then a deadline that expired (the longest wait first: the
/// rank that gave up first), then collectives cut short by the abort.
fn cause_rank(e: &ModelError) -> (u8, std::cmp::Reverse<Duration>) {
    match e {
        ModelError::Core(tm_core::Error::Aborted { .. }) => (2, std::cmp::Reverse(Duration::ZERO)),
        ModelError::Core(tm_core::Error::Timeout { waited, .. }) => (1, std::cmp::Reverse(*waited)),
        _ => (0, std::cmp::Reverse(Duration::ZERO)),
    }
}

/// Backends for CPU ranks: a `CpuBackend` whose steps run on the rank's thread.
pub fn cpu_backend_factory() -> BackendFactory {
    Arc::new(|_| Ok(Box::new(tm_cpu::CpuBackend::for_rank_thread()) as Box<dyn Ops>))
}

/// What a rank thread starts with.
struct RankCtx {
    rank: usize,
    comm: Arc<Watched>,
    layout: ShardLayout,
    config: ModelConfig,
    source: Arc<dyn TensorSource>,
    backend: BackendFactory,
    opts: TpOptions,
    replies: Sender<Reply>,
}

/// A rank's loaded state.
struct RankState {
    ops: Box<dyn Ops>,
    model: LlamaModel,
    kv: KvCache,
    ws: Workspace,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Runs `f`, turning a panic into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(ModelError::InvalidInput(format!("panicked in {what}: {}", panic_message(p.as_ref())))),
    }
}

fn rank_thread(ctx: RankCtx, rx: Receiver<Command>) {
    let (rank, replies, comm) = (ctx.rank, ctx.replies.clone(), Arc::clone(&ctx.comm));
    let reply = |id: u64, result: Result<Payload>, timing: Option<(Duration, Duration)>| {
        let at = Instant::now();
        if let Err(e) = &result {
            comm.abort(&format!("rank {rank} failed: {e}"));
        }
        let _ = replies.send(Reply { rank, id, at, result, timing });
    };
    let loaded = guarded("loading", || load_rank(&ctx));
    let mut state = match loaded {
        Ok(s) => {
            reply(0, Ok(Payload::Loaded { weight_bytes: s.model.weight_bytes() }), None);
            Some(s)
        }
        Err(e) => {
            reply(0, Err(e), None);
            None
        }
    };
    if let Some(st) = state.as_mut() {
        let spin = spin_time(&ctx.opts);
        loop {
            let cmd = match recv_polling(&rx, spin, Duration::from_secs(3600)) {
                Ok(cmd) => cmd,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            let mut timing = None;
            let (id, result) = match cmd {
                Command::Shutdown => break,
                Command::Forward(id, step, job, sent) => {
                    let took = Instant::now();
                    let result = guarded("forward", || forward(&ctx, st, &step, job));
                    timing = Some((took.saturating_duration_since(sent), took.elapsed()));
                    (id, result)
                }
                Command::CopyBlocks(id, pairs) => {
                    (id, guarded("copy_blocks", || st.kv.copy_blocks(st.ops.as_ref(), &pairs).map(|_| Payload::Done)))
                }
                Command::SelfTest(id, deadline) => (id, guarded("self-test", || self_test(&ctx, st, deadline))),
            };
            let failed = result.is_err();
            reply(id, result, timing);
            if failed {
                break; // the communicator is aborted: this rank is done
            }
        }
    }
    drop(state);
    let _ = replies.send(Reply { rank, id: u64::MAX, at: Instant::now(), result: Ok(Payload::Exited), timing: None });
}

fn load_rank(ctx: &RankCtx) -> Result<RankState> {
    let ops = (ctx.backend)(ctx.rank)?;
    let spec = ShardSpec::new(ctx.rank, ctx.layout.spec.world)?;
    let model = LlamaModel::load_shard(ops.as_ref(), ctx.source.as_ref(), ctx.config.clone(), spec, &mut |_| {})?;
    let o = &ctx.opts;
    let kv = KvCache::for_shard(ops.as_ref(), &ctx.config, &ctx.layout, o.num_blocks, o.block_size, o.kv_cache_dtype)?;
    let ws = Workspace::for_shard(ops.as_ref(), &ctx.layout, o.max_tokens, o.max_logit_rows)?
        .with_int4_scratch(ops.as_ref(), model.has_int4())?;
    Ok(RankState { ops, model, kv, ws })
}

fn forward(
    ctx: &RankCtx,
    st: &mut RankState,
    s: &OwnedStep,
    job: Option<Arc<Mutex<Option<SampleJob>>>>,
) -> Result<Payload> {
    let result = forward_inner(ctx, st, s, job);
    // The collectives may still be queued on a device (NCCL): wait for them, with the deadline.
    // A collective's own error (a deadline, an abort) stays the step's error; any other error
    // (e.g. a copy cut short when the communicator was aborted) gives way to the
    // communicator's, which says why.
    let synced = ctx.comm.synchronize("end of forward step", ctx.opts.comm_timeout);
    match (result, synced) {
        (Err(e @ ModelError::Core(tm_core::Error::Timeout { .. } | tm_core::Error::Aborted { .. })), _) => Err(e),
        (_, Err(e)) => Err(e.into()),
        (r, Ok(())) => r,
    }
}

fn forward_inner(
    ctx: &RankCtx,
    st: &mut RankState,
    s: &OwnedStep,
    job: Option<Arc<Mutex<Option<SampleJob>>>>,
) -> Result<Payload> {
    let seqs: Vec<SeqAttention<'_>> = s
        .seqs
        .iter()
        .map(|(query_start, query_len, context_len, table)| SeqAttention {
            query_start: *query_start,
            query_len: *query_len,
            context_len: *context_len,
            block_table: &s.tables[table.clone()],
        })
        .collect();
    let step = StepInput {
        tokens: &s.tokens,
        positions: &s.positions,
        slot_mapping: &s.slot_mapping,
        seqs: &seqs,
        logit_rows: &s.logit_rows,
    };
    let ops = st.ops.as_ref();
    let comm: &dyn Comm = ctx.comm.as_ref();
    let logits = st.model.forward_tp(ops, comm, ctx.opts.comm_timeout, &mut st.kv, &step, &mut st.ws)?;
    if ctx.rank != 0 {
        return Ok(Payload::Done);
    }
    let Some(job) = job else {
        return Ok(Payload::Logits(ops.download_f32(logits)?));
    };
    let job = job.lock().ok().and_then(|mut j| j.take());
    let Some(SampleJob { mut requests, want_logits }) = job else {
        return Err(ModelError::InvalidInput("rank 0 got a sampling step without its requests".into()));
    };
    let host_logits = if want_logits { Some(ops.download_f32(logits)?) } else { None };
    let tokens = {
        let mut reqs: Vec<SampleRequest<'_>> = requests
            .iter_mut()
            .map(|r| SampleRequest { params: &r.params, prompt: &r.prompt, output: &r.output, rng: &mut r.rng })
            .collect();
        ops.sample(logits, &mut reqs)?
    };
    let rngs = requests.into_iter().map(|r| r.rng).collect();
    Ok(Payload::Sampled(Sampled { tokens, rngs, logits: host_logits }))
}

/// A small all-reduce: rank `r` contributes `r + 1` in slot `r`; everyone must get `1..=world`.
fn self_test(ctx: &RankCtx, st: &mut RankState, deadline: Duration) -> Result<Payload> {
    let world = ctx.layout.spec.world;
    let ops = st.ops.as_ref();
    let mut t = ops.zeros(TensorDesc::new(DType::F32, &[world]), "comm self-test")?;
    let mut mine = vec![0f32; world];
    mine[ctx.rank] = (ctx.rank + 1) as f32;
    ops.upload(&mut t, bytemuck::cast_slice(&mine))?;
    ctx.comm.all_reduce_sum(&mut t, "start-up self-test", deadline)?;
    ctx.comm.synchronize("start-up self-test", deadline)?;
    let got = ops.download_f32(&t)?;
    let want: Vec<f32> = (1..=world).map(|v| v as f32).collect();
    if got != want {
        return Err(ModelError::InvalidInput(format!(
            "the start-up all-reduce self-test summed to {got:?} instead of {want:?}: the communicator is broken"
        )));
    }
    Ok(Payload::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_receives_what_blocking_would() {
        for spin in [Duration::ZERO, Duration::from_millis(50)] {
            let (tx, rx) = mpsc::channel();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                tx.send(7u32).unwrap();
                std::thread::sleep(Duration::from_millis(5));
                tx.send(8u32).unwrap();
            });
            assert_eq!(recv_polling(&rx, spin, Duration::from_secs(5)), Ok(7));
            assert_eq!(recv_polling(&rx, spin, Duration::from_secs(5)), Ok(8));
            sender.join().unwrap();
            assert_eq!(recv_polling(&rx, spin, Duration::from_secs(5)), Err(RecvTimeoutError::Disconnected));
        }
        // Nothing comes: the timeout holds whether the wait polls or blocks.
        let (_tx, rx) = mpsc::channel::<u32>();
        let start = Instant::now();
        assert_eq!(
            recv_polling(&rx, Duration::from_millis(100), Duration::from_millis(20)),
            Err(RecvTimeoutError::Timeout)
        );
        assert!(start.elapsed() >= Duration::from_millis(20) && start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn step_timing_reports_means_per_rank() {
        let mut t = StepTiming::default();
        assert!(t.report().is_empty());
        for _ in 0..2 {
            t.add(0, Duration::from_micros(10), Duration::from_micros(100), Duration::from_micros(4));
            t.add(1, Duration::from_micros(30), Duration::from_micros(90), Duration::from_micros(6));
        }
        let r = t.report();
        assert_eq!(r.len(), 2);
        assert!(r[0].contains("rank 0 took the command 10.0 us") && r[0].contains("worked 100.0 us"), "{r:?}");
        assert!(r[1].contains("rank 1 took the command 30.0 us") && r[1].contains("taken 6.0 us later"), "{r:?}");
    }
}
