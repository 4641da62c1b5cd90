//! Causal paged attention (`attention.cu`): split-K flash decoding for sequences with one query
//! token, flash-attention-2 for longer chunks, both on tensor cores for f16/bf16, and a CUDA-core
//! path for f32 and every other case.
//!
//! Paths:
//! - **Tensor cores** (f16/bf16, `head_dim` in [`TC_HEAD_DIMS`], compute capability 8.0 or newer,
//!   `q`, the caches and `out` 16-byte aligned): `attn_decode_d<D>` handles the sequences with
//!   `q_len == 1`, `attn_prefill_d<D>` those with `q_len > 1`; in a mixed batch both run, each
//!   skipping the other's sequences. When a decode sequence needs several partitions of its
//!   context, each split CTA writes its partial output to the scratch buffer and the last one of
//!   each (sequence, head group) to finish merges them (the *fused combine*: a per-group counter
//!   in [`AttentionScratch::counters`], `__threadfence` + `atomicAdd`, and the last CTA resets it
//!   to zero); with `TM_ATTN_FUSED_COMBINE=0` (or [`set_fused_combine`]) a second kernel,
//!   `attn_combine`, merges them instead, as before.
//! - **CUDA cores** (`attn_simple`): f32, any other `head_dim` up to 256, misaligned pointers, or
//!   `TM_ATTENTION=simple` in the environment (a debugging switch).
//!
//! **FP8 KV cache** (`kv` = [`DType::F8E4M3`]): the same kernels with the `_kv8` suffix read E4M3
//! codes and convert them in registers (decode: straight from a ring of raw shared-memory stages
//! of codes into the mma fragments; prefill: through one raw stage and one stage of converted
//! tiles); [`write_kv_e4m3`] converts K and V as it writes them. Decode with `head_dim` 128 and
//! groups of at most 8 heads takes `attn_decode_gqa_d128`, which puts the keys rather than the
//! query heads in the mma's 16 rows (half the tensor-core and fragment work for a group of 4).
//!
//! The split-K plan depends only on `num_seqs`, `kv_heads`, `heads / kv_heads`, `max_ctx_len` and
//! `window`, so [`scratch_bytes`], [`counter_bytes`] and [`attention`] agree without the device.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute;
use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{driver_err, Gpu, KernelArg};

/// Head sizes with a tensor-core kernel (other sizes up to 256 use the CUDA-core path).
pub const TC_HEAD_DIMS: [usize; 9] = [32, 64, 80, 96, 112, 128, 160, 192, 256];
/// The largest supported head size.
pub const MAX_HEAD_DIM: usize = 256;

// The tile geometry mirrors `DecodeCfg` and `PrefillCfg` in attention.cu.
/// Keys per shared-memory tile of the decode kernel (a partition is a multiple of it).
const DECODE_TILE: usize = 64;
/// Query rows (heads of one KV group) per decode CTA.
const DECODE_ROWS: usize = 16;
/// Fewest keys a decode split covers: one tile (batch-1 decode on an H200 measured 2% faster
/// than with 128).
const MIN_PARTITION: usize = 64;
/// Most decode splits (`TM_ATTN_MAX_SPLITS` in attention.cu; the partials' scratch is sized by it).
const MAX_SPLITS: usize = 64;
/// Decode CTAs to aim for before splitting the context further (several waves on an H200).
const TARGET_CTAS: usize = 1536;
/// Threads per CTA of every attention kernel.
const THREADS: u32 = 128;

/// The heads and cache geometry of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; `heads` is a multiple of it (query head `h` reads KV head
    /// `h / (heads / kv_heads)`).
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// Multiplier on q·k.
    pub scale: f32,
    /// Attend only to the last `window` positions; 0 = no window.
    pub window: usize,
}

/// One batch: sizes known on the host and the device pointers of the per-sequence metadata.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBatch {
    /// Sequences in the batch.
    pub num_seqs: usize,
    /// Query rows (tokens) in `q` and `out`.
    pub total_q: usize,
    /// The largest `q_len` of the batch.
    pub max_q_len: usize,
    /// The largest `ctx_len` of the batch.
    pub max_ctx_len: usize,
    /// Every sequence has `q_len == 1`.
    pub all_decode: bool,
    /// Device `i32 [num_seqs]`: first query row of each sequence.
    pub q_start: u64,
    /// Device `i32 [num_seqs]`: query rows of each sequence.
    pub q_len: u64,
    /// Device `i32 [num_seqs]`: tokens in the cache, this step's included.
    pub ctx_len: u64,
    /// Device `i32 [num_seqs]`: offset of each sequence's block table in `block_tables`.
    pub bt_start: u64,
    /// Device `u32`: the flat block tables.
    pub block_tables: u64,
}

/// Device memory of one [`attention`] call besides its inputs and output.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionScratch {
    /// Device address of the split-K partial outputs and their (max, sum) pairs: any contents,
    /// free for other kernels between calls.
    pub scratch: u64,
    /// Bytes at `scratch`: at least [`scratch_bytes`].
    pub scratch_len: usize,
    /// Device address of the fused combine's split counters (u32, 4-byte aligned): zero-filled
    /// when allocated and used by nothing else, since every call leaves them zero and the next
    /// one relies on that (a CUDA graph replays the same addresses).
    pub counters: u64,
    /// Bytes at `counters`: at least [`counter_bytes`].
    pub counters_len: usize,
}

/// The split-K plan of the decode kernel.
#[derive(Clone, Copy, Debug)]
struct DecodePlan {
    /// Partitions of the context (1 = no combine pass, no scratch).
    splits: usize,
    /// Keys per partition, a multiple of [`DECODE_TILE`].
    partition: usize,
}

fn group_of(shape: &AttentionShape) -> usize {
    (shape.heads / shape.kv_heads.max(1)).max(1)
}

/// Head sub-groups of `group` heads for CTAs of `rows` query rows: `(heads per sub-group, count)`.
fn sub_groups(group: usize, rows: usize) -> (usize, usize) {
    let gs = group.min(rows);
    (gs, group.div_ceil(gs))
}

/// K/V stages of the decode kernel (`DecodeCfg::ST`).
fn decode_stages(head_dim: usize) -> usize {
    if head_dim <= 112 {
        2
    } else {
        1
    }
}

/// Raw fp8 K/V stages of the decode kernel's ring (`DecodeCfg::NS8`).
fn decode_kv8_stages(head_dim: usize) -> usize {
    if head_dim <= 128 {
        3
    } else {
        2
    }
}

/// Byte row stride of a raw fp8 decode stage (`Kv8Row::RS`): `head_dim`, plus 16 when
/// `head_dim / 16` is even (an odd number of 16-byte chunks keeps the fragment loads free of bank
/// conflicts).
fn decode_kv8_row(head_dim: usize) -> usize {
    if (head_dim / 16).is_multiple_of(2) {
        head_dim + 16
    } else {
        head_dim
    }
}

/// Largest KV group with the transposed fp8 decode kernel (`attn_decode_gqa_d128_*_kv8`: the
/// group's heads are the 8 columns of the mma's B operand).
const GQA_MAX_GROUP: usize = 8;

/// Whether the decode of this shape takes the transposed fp8 kernel: an fp8 cache, `head_dim`
/// 128, a group of at most [`GQA_MAX_GROUP`] heads, and `TM_ATTN_DECODE_GQA` not `0` (read once;
/// `0` gives the 16-row kernel, to compare).
fn gqa_decode(head_dim: usize, group: usize, kv8: bool) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("TM_ATTN_DECODE_GQA").map_or(true, |v| v.trim() != "0"));
    on && kv8 && head_dim == 128 && group <= GQA_MAX_GROUP
}

/// Raw K/V stages of the transposed fp8 decode kernel: 3 (the `attn_decode_gqa_d128_*_kv8`
/// kernels), or 2 / 4 (`..._kv8_s2`, `..._kv8_s4`) with `TM_ATTN_GQA_STAGES=2|4` (read once).
fn gqa_decode_stages() -> usize {
    static STAGES: OnceLock<usize> = OnceLock::new();
    *STAGES.get_or_init(|| match std::env::var("TM_ATTN_GQA_STAGES").ok().as_deref().map(str::trim) {
        Some("2") => 2,
        Some("4") => 4,
        _ => 3,
    })
}

/// Dynamic shared memory of the transposed fp8 decode kernel (`GqaKv8Cfg`): 8 query rows and a
/// ring of `stages` raw stages of 64 K rows and 64 V rows of `head_dim` bytes (swizzled, unpadded).
fn gqa_decode_smem(head_dim: usize, esize: usize, stages: usize) -> usize {
    8 * (head_dim + 8) * esize + stages * DECODE_TILE * 2 * head_dim
}

/// Query rows (tokens x group heads) per prefill CTA (`PrefillCfg::BM`).
fn prefill_rows(head_dim: usize) -> usize {
    if head_dim <= 128 {
        128
    } else {
        64
    }
}

/// Keys per prefill K/V tile (`PrefillCfg::BN`).
fn prefill_block_n(head_dim: usize) -> usize {
    if head_dim <= 128 {
        64
    } else {
        32
    }
}

/// Dynamic shared memory of the decode and prefill kernels for elements of `esize` bytes: with a
/// 16-bit cache, Q and `stages` K/V tiles; with an fp8 cache (`kv8`): decode, Q and a ring of
/// raw K/V stages of codes (`2 * tile * row` bytes each, see [`decode_kv8_row`]); prefill, Q, one
/// converted K/V tile and one raw stage of codes (`2 * tile * head_dim` bytes).
fn tc_smem(head_dim: usize, esize: usize, kv8: bool) -> (usize, usize) {
    let ld = head_dim + 8; // shared-memory row stride in elements
    let (decode, prefill) = if kv8 {
        let (dn, pn) = (DECODE_TILE, prefill_block_n(head_dim));
        (
            DECODE_ROWS * ld * esize + decode_kv8_stages(head_dim) * 2 * dn * decode_kv8_row(head_dim),
            (prefill_rows(head_dim) + 2 * pn) * ld * esize + 2 * pn * head_dim,
        )
    } else {
        (
            (DECODE_ROWS + 2 * decode_stages(head_dim) * DECODE_TILE) * ld * esize,
            (prefill_rows(head_dim) + 4 * prefill_block_n(head_dim)) * ld * esize,
        )
    };
    (decode, prefill)
}

/// The kernel-name suffix of a KV-cache dtype next to activations `dt`: none for a cache in `dt`,
/// `_kv8` for FP8 E4M3.
fn kv_suffix(dt: DType, kv: DType) -> Result<&'static str> {
    match kv {
        DType::F8E4M3 => Ok("_kv8"),
        k if k == dt => Ok(""),
        other => Err(Error::DType {
            op: "cuda attention kv cache".into(),
            expected: format!("{dt} or f8e4m3"),
            got: other.to_string(),
        }),
    }
}

/// [`MIN_PARTITION`] and [`TARGET_CTAS`], or the tuning overrides `TM_ATTN_MIN_PARTITION` (a
/// multiple of the 64-key tile) and `TM_ATTN_TARGET_CTAS` from the environment, read once.
fn split_tuning() -> (usize, usize) {
    static TUNING: OnceLock<(usize, usize)> = OnceLock::new();
    *TUNING.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<usize>().ok());
        let min_partition =
            var("TM_ATTN_MIN_PARTITION").filter(|&p| p > 0).map_or(MIN_PARTITION, |p| p.next_multiple_of(DECODE_TILE));
        (min_partition, var("TM_ATTN_TARGET_CTAS").filter(|&t| t > 0).unwrap_or(TARGET_CTAS))
    })
}

fn decode_plan(shape: &AttentionShape, batch: &AttentionBatch) -> DecodePlan {
    let (_, n_sub) = sub_groups(group_of(shape), DECODE_ROWS);
    let keys = if shape.window > 0 { batch.max_ctx_len.min(shape.window) } else { batch.max_ctx_len };
    let keys = keys.clamp(1, i32::MAX as usize);
    let ctas = (batch.num_seqs * shape.kv_heads * n_sub).max(1);
    let (min_partition, target_ctas) = split_tuning();
    let cap = keys.div_ceil(min_partition).clamp(1, MAX_SPLITS);
    let want = target_ctas.div_ceil(ctas).clamp(1, cap);
    let partition = keys.div_ceil(want).next_multiple_of(DECODE_TILE);
    let splits = keys.div_ceil(partition);
    // One split covers any context: pass a partition that does not grow with the longest
    // context, so that the kernel's arguments (a CUDA graph's signature) stay the same while
    // the sequences grow (large batches take one split for contexts up to thousands of keys).
    let partition = if splits == 1 { ONE_SPLIT_PARTITION } else { partition };
    DecodePlan { splits, partition }
}

/// The partition passed when one split covers the context (any context fits in it).
const ONE_SPLIT_PARTITION: usize = (i32::MAX as usize / DECODE_TILE) * DECODE_TILE;

/// Bytes of scratch [`attention`] needs for this call: the split-K partial outputs and their
/// (max, sum) pairs, `num_seqs * heads * splits * (head_dim + 2)` f32 (0 when one split
/// suffices). The same for every dtype.
pub fn scratch_bytes(shape: &AttentionShape, batch: &AttentionBatch) -> usize {
    let plan = decode_plan(shape, batch);
    if plan.splits <= 1 {
        return 0;
    }
    [batch.num_seqs, shape.heads, plan.splits, shape.head_dim.saturating_add(2), 4]
        .into_iter()
        .fold(1, usize::saturating_mul)
}

/// Bytes of split counters [`attention`] needs for this call ([`AttentionScratch::counters`]): one
/// u32 per (sequence, KV head, head sub-group) when the decode context is split, else 0. Needed
/// whether or not the combine is fused (so that [`set_fused_combine`] may switch between calls).
pub fn counter_bytes(shape: &AttentionShape, batch: &AttentionBatch) -> usize {
    if decode_plan(shape, batch).splits <= 1 {
        return 0;
    }
    let (_, n_sub) = sub_groups(group_of(shape), DECODE_ROWS);
    [batch.num_seqs, shape.kv_heads, n_sub, 4].into_iter().fold(1, usize::saturating_mul)
}

/// The number of partitions the decode kernel splits the context into for this call (1: each
/// sequence's CTAs write the output directly, no merge). For tests and benchmarks.
pub fn decode_splits(shape: &AttentionShape, batch: &AttentionBatch) -> usize {
    decode_plan(shape, batch).splits
}

/// [`set_fused_combine`]'s override: 0 = none (the environment decides), 1 = off, 2 = on.
static FUSED_OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Forces the fused split-K combine on or off for the whole process, over
/// `TM_ATTN_FUSED_COMBINE` (`None`: back to the environment). For tests and benchmarks that run
/// both paths in one process.
pub fn set_fused_combine(on: Option<bool>) {
    FUSED_OVERRIDE.store(on.map_or(0, |on| 1 + u8::from(on)), Ordering::Relaxed);
}

/// Whether split decode merges its partials in the last split CTA of each group (one launch)
/// rather than in a second launch of `attn_combine`: [`set_fused_combine`]'s choice, else
/// `TM_ATTN_FUSED_COMBINE` not `0` (read once).
pub fn fused_combine() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    match FUSED_OVERRIDE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => *ENV.get_or_init(|| std::env::var("TM_ATTN_FUSED_COMBINE").map_or(true, |v| v.trim() != "0")),
    }
}

/// `TM_ATTENTION=simple` forces the CUDA-core kernel (read once).
fn force_simple() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var("TM_ATTENTION").is_ok_and(|v| v.eq_ignore_ascii_case("simple")))
}

fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("attention: {what} = {v} does not fit in i32")))
}

fn to_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(format!("attention: {what} = {v} exceeds the launch limits")))
}

fn validate(shape: &AttentionShape, batch: &AttentionBatch) -> Result<()> {
    let AttentionShape { heads, kv_heads, head_dim, block_size, scale, .. } = *shape;
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::invalid(format!(
            "attention: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})"
        )));
    }
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(Error::Unsupported(format!(
            "attention: head_dim {head_dim} (supported: 1..={MAX_HEAD_DIM}; tensor-core kernels for {TC_HEAD_DIMS:?})"
        )));
    }
    if block_size == 0 {
        return Err(Error::invalid("attention: block_size must be positive"));
    }
    if !scale.is_finite() {
        return Err(Error::invalid(format!("attention: scale {scale} is not finite")));
    }
    if batch.num_seqs > 65_535 {
        return Err(Error::invalid(format!("attention: {} sequences (at most 65535 per call)", batch.num_seqs)));
    }
    if batch.max_q_len > batch.total_q {
        return Err(Error::invalid(format!(
            "attention: max_q_len {} exceeds total_q {}",
            batch.max_q_len, batch.total_q
        )));
    }
    to_i32("max_ctx_len", batch.max_ctx_len)?;
    to_i32("window", shape.window)?;
    to_i32("total_q", batch.total_q).map(|_| ())
}

/// Causal paged attention of `q: [total_q, heads * head_dim]` over the KV caches
/// `[num_blocks, block_size, kv_heads, head_dim]` into `out` (same shape as `q`): `q` and `out`
/// in `dt` (f32, f16 or bf16), the caches in `kv` (`dt`, or f8e4m3). Sequence `s` owns query
/// rows `q_start[s] .. q_start[s] + q_len[s]`; its query `j` sits at position
/// `ctx_len[s] - q_len[s] + j` and attends to the keys at positions `0..=pos` (only those
/// `> pos - window` when `window > 0`), read through its block table.
/// `work` must hold [`scratch_bytes`] bytes of scratch and [`counter_bytes`] bytes of counters
/// (see [`AttentionScratch`]). Rows of `out` that belong to no sequence are not written.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    dt: DType,
    kv: DType,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    out: u64,
    shape: &AttentionShape,
    batch: &AttentionBatch,
    work: &AttentionScratch,
) -> Result<()> {
    let sfx = suffix(dt)?;
    let ksfx = kv_suffix(dt, kv)?;
    validate(shape, batch)?;
    let need = scratch_bytes(shape, batch);
    if work.scratch_len < need {
        return Err(Error::invalid(format!("attention: scratch holds {} bytes, {need} needed", work.scratch_len)));
    }
    let need = counter_bytes(shape, batch);
    if work.counters_len < need || (need > 0 && !work.counters.is_multiple_of(4)) {
        return Err(Error::invalid(format!(
            "attention: the split counters hold {} bytes at {:#x}, {need} needed (4-byte aligned)",
            work.counters_len, work.counters
        )));
    }
    if batch.num_seqs == 0 || batch.total_q == 0 {
        return Ok(());
    }
    let AttentionShape { heads, kv_heads, head_dim, block_size, scale, window } = *shape;
    let group = heads / kv_heads;
    let meta = [
        KernelArg::Ptr(batch.q_start),
        KernelArg::Ptr(batch.q_len),
        KernelArg::Ptr(batch.ctx_len),
        KernelArg::Ptr(batch.bt_start),
        KernelArg::Ptr(batch.block_tables),
    ];
    let (heads_i, kv_heads_i) = (to_i32("heads", heads)?, to_i32("kv_heads", kv_heads)?);
    let (block_size_i, window_i) = (to_i32("block_size", block_size)?, to_i32("window", window)?);
    let seqs_u = to_u32("num_seqs", batch.num_seqs)?;

    let esize = dt.bits() / 8;
    let kv8 = kv == DType::F8E4M3;
    let gqa = gqa_decode(head_dim, group, kv8);
    let (decode_smem, prefill_smem) = tc_smem(head_dim, esize, kv8);
    let gqa_stages = gqa_decode_stages();
    let decode_smem = if gqa { gqa_decode_smem(head_dim, esize, gqa_stages) } else { decode_smem };
    // A single sequence is a decode exactly when it has one query row.
    let decode = batch.all_decode || batch.num_seqs > 1 || batch.total_q == 1;
    let prefill = !batch.all_decode && batch.max_q_len > 1;
    let aligned = [q, k_cache, v_cache, out].iter().all(|p| p % 16 == 0);
    let mut tensor_cores =
        dt != DType::F32 && TC_HEAD_DIMS.contains(&head_dim) && gpu.sm() >= 80 && aligned && !force_simple();
    if tensor_cores {
        // Devices with 99 KiB per block (sm_86, sm_89, sm_120) cannot take the largest tiles.
        let smem_max = gpu
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver_err("cuDeviceGetAttribute(max shared memory per block)"))?;
        let need = if prefill { decode_smem.max(prefill_smem) } else { decode_smem } + 1024; // + static
        tensor_cores = need <= usize::try_from(smem_max).unwrap_or(0);
    }
    if !tensor_cores {
        let mut args = vec![KernelArg::Ptr(q), KernelArg::Ptr(k_cache), KernelArg::Ptr(v_cache), KernelArg::Ptr(out)];
        args.extend_from_slice(&meta);
        args.extend_from_slice(&[
            KernelArg::I32(to_i32("num_seqs", batch.num_seqs)?),
            KernelArg::I32(heads_i),
            KernelArg::I32(kv_heads_i),
            KernelArg::I32(to_i32("head_dim", head_dim)?),
            KernelArg::I32(block_size_i),
            KernelArg::F32(scale),
            KernelArg::I32(window_i),
        ]);
        let grid = (to_u32("total_q", batch.total_q)?, to_u32("heads", heads.div_ceil(4))?, 1);
        return gpu.launch(&format!("attn_simple_{sfx}{ksfx}"), grid, (THREADS, 1, 1), 0, &args);
    }

    let scale_log2 = scale * std::f32::consts::LOG2_E;

    if decode {
        let plan = decode_plan(shape, batch);
        // The transposed kernel takes the whole group (<= 8 heads) in one CTA, as the 16-row
        // kernel does for groups up to 16: the same grid and split plan.
        let (gs, n_sub) = sub_groups(group, DECODE_ROWS);
        let part_o = work.scratch;
        let part_ml = work.scratch + (batch.num_seqs * heads * plan.splits * head_dim * 4) as u64;
        // Null counters: the kernel leaves the partials to attn_combine.
        let fused = plan.splits > 1 && fused_combine();
        let counters = if fused { work.counters } else { 0 };
        let mut args = vec![
            KernelArg::Ptr(q),
            KernelArg::Ptr(k_cache),
            KernelArg::Ptr(v_cache),
            KernelArg::Ptr(out),
            KernelArg::Ptr(part_o),
            KernelArg::Ptr(part_ml),
            KernelArg::Ptr(counters),
        ];
        args.extend_from_slice(&meta);
        args.extend_from_slice(&[
            KernelArg::I32(heads_i),
            KernelArg::I32(kv_heads_i),
            KernelArg::I32(to_i32("gs", gs)?),
            KernelArg::I32(block_size_i),
            KernelArg::F32(scale_log2),
            KernelArg::I32(window_i),
            KernelArg::I32(to_i32("splits", plan.splits)?),
            KernelArg::I32(to_i32("partition", plan.partition)?),
        ]);
        let grid = (to_u32("splits", plan.splits)?, to_u32("kv_heads * sub-groups", kv_heads * n_sub)?, seqs_u);
        let name = if gqa {
            let ns = match gqa_stages {
                2 => "_s2",
                4 => "_s4",
                _ => "",
            };
            format!("attn_decode_gqa_d{head_dim}_{sfx}{ksfx}{ns}")
        } else {
            format!("attn_decode_d{head_dim}_{sfx}{ksfx}")
        };
        gpu.launch(&name, grid, (THREADS, 1, 1), decode_smem as u32, &args)?;
        if plan.splits > 1 && !fused {
            let args = [
                KernelArg::Ptr(out),
                KernelArg::Ptr(part_o),
                KernelArg::Ptr(part_ml),
                KernelArg::Ptr(batch.q_start),
                KernelArg::Ptr(batch.q_len),
                KernelArg::Ptr(batch.ctx_len),
                KernelArg::I32(heads_i),
                KernelArg::I32(to_i32("head_dim", head_dim)?),
                KernelArg::I32(window_i),
                KernelArg::I32(to_i32("splits", plan.splits)?),
                KernelArg::I32(to_i32("partition", plan.partition)?),
            ];
            let grid = (to_u32("heads", heads)?, seqs_u, 1);
            gpu.launch(&format!("attn_combine_{sfx}"), grid, (THREADS, 1, 1), 0, &args)?;
        }
    }

    if prefill {
        let rows = prefill_rows(head_dim);
        let (gs, n_sub) = sub_groups(group, rows);
        // tokens per tile; the sum over sequences of ceil(q_len / tq) is at most `tiles`
        let tq = rows / gs;
        let tiles = (batch.total_q + batch.num_seqs * (tq - 1)) / tq;
        let mut args = vec![KernelArg::Ptr(q), KernelArg::Ptr(k_cache), KernelArg::Ptr(v_cache), KernelArg::Ptr(out)];
        args.extend_from_slice(&meta);
        args.extend_from_slice(&[
            KernelArg::I32(to_i32("num_seqs", batch.num_seqs)?),
            KernelArg::I32(heads_i),
            KernelArg::I32(kv_heads_i),
            KernelArg::I32(to_i32("gs", gs)?),
            KernelArg::I32(block_size_i),
            KernelArg::F32(scale_log2),
            KernelArg::I32(window_i),
        ]);
        let grid = (to_u32("prefill tiles", tiles)?, to_u32("kv_heads * sub-groups", kv_heads * n_sub)?, 1);
        gpu.launch(
            &format!("attn_prefill_d{head_dim}_{sfx}{ksfx}"),
            grid,
            (THREADS, 1, 1),
            prefill_smem as u32,
            &args,
        )?;
    }
    Ok(())
}

/// Writes `k, v: [tokens, kv_dim]` (in `dt`) as FP8 E4M3 codes into the caches at the u32 slots
/// `slots` (rows of `kv_dim` codes; slot `0xffffffff` skips the token): round to nearest even,
/// saturating at ±448 (`tm_core::fp8`).
#[allow(clippy::too_many_arguments)]
pub fn write_kv_e4m3(
    gpu: &Gpu,
    dt: DType,
    k_cache: u64,
    v_cache: u64,
    k: u64,
    v: u64,
    slots: u64,
    tokens: usize,
    kv_dim: usize,
) -> Result<()> {
    let sfx = suffix(dt)?;
    let (t32, d32) = (to_i32("tokens", tokens)?, to_i32("kv_dim", kv_dim)?);
    if tokens == 0 || kv_dim == 0 {
        return Ok(());
    }
    // one block per token row (at most 65535 rows of blocks; the kernel loops over the rest)
    let grid = (t32.clamp(1, 65_535) as u32, 1, 1);
    let threads = kv_dim.div_ceil(16).next_multiple_of(32).clamp(32, THREADS as usize) as u32;
    gpu.launch(
        &format!("write_kv_e4m3_{sfx}"),
        grid,
        (threads, 1, 1),
        0,
        &[
            KernelArg::Ptr(k_cache),
            KernelArg::Ptr(v_cache),
            KernelArg::Ptr(k),
            KernelArg::Ptr(v),
            KernelArg::Ptr(slots),
            KernelArg::I32(t32),
            KernelArg::I32(d32),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(heads: usize, kv_heads: usize, window: usize) -> AttentionShape {
        AttentionShape { heads, kv_heads, head_dim: 128, block_size: 16, scale: 0.1, window }
    }

    fn batch(num_seqs: usize, max_ctx_len: usize) -> AttentionBatch {
        AttentionBatch {
            num_seqs,
            total_q: num_seqs,
            max_q_len: 1,
            max_ctx_len,
            all_decode: true,
            q_start: 0,
            q_len: 0,
            ctx_len: 0,
            bt_start: 0,
            block_tables: 0,
        }
    }

    #[test]
    fn decode_plan_covers_the_context() {
        for seqs in [1, 3, 16, 64, 256] {
            for ctx in [1, 17, 128, 129, 1000, 4096, 32_768, 131_072] {
                for (h, kv) in [(32, 8), (28, 4), (32, 32), (64, 1)] {
                    for window in [0, 100, 4096] {
                        let (s, b) = (shape(h, kv, window), batch(seqs, ctx));
                        let p = decode_plan(&s, &b);
                        let keys = if window > 0 { ctx.min(window) } else { ctx };
                        assert!(p.splits >= 1 && p.splits <= MAX_SPLITS);
                        assert_eq!(p.partition % DECODE_TILE, 0);
                        assert!(p.splits * p.partition >= keys, "{seqs} {ctx} {h}/{kv} {window}: {p:?}");
                        assert!((p.splits - 1) * p.partition < keys.max(1));
                        assert!(p.splits > 1 || p.partition == ONE_SPLIT_PARTITION);
                        assert_eq!(scratch_bytes(&s, &b) == 0, p.splits == 1);
                        assert_eq!(counter_bytes(&s, &b) == 0, p.splits == 1);
                    }
                }
            }
        }
    }

    #[test]
    fn split_counters_cover_every_head_group() {
        // Llama 3 8B at batch 1, 550 keys: 9 splits of 64 keys over 8 KV heads (the profiled case)
        let (s, b) = (shape(32, 8, 0), batch(1, 550));
        if split_tuning() == (MIN_PARTITION, TARGET_CTAS) {
            assert_eq!(decode_splits(&s, &b), 9);
        }
        assert_eq!(scratch_bytes(&s, &b), 32 * decode_splits(&s, &b) * 130 * 4);
        assert_eq!(counter_bytes(&s, &b), 8 * 4);
        // 64 heads on one KV head: four sub-groups of 16; 3 sequences
        assert_eq!(counter_bytes(&shape(64, 1, 0), &batch(3, 4000)), 3 * 4 * 4);
        // one split: no counters
        assert_eq!(counter_bytes(&s, &batch(1, 64)), 0);
    }

    #[test]
    fn set_fused_combine_overrides_the_environment() {
        // The only test that sets the override (tests of this module share the process).
        set_fused_combine(Some(false));
        assert!(!fused_combine());
        set_fused_combine(Some(true));
        assert!(fused_combine());
        set_fused_combine(None);
        let env = std::env::var("TM_ATTN_FUSED_COMBINE").map_or(true, |v| v.trim() != "0");
        assert_eq!(fused_combine(), env);
    }

    #[test]
    fn shared_memory_fits_the_big_arches() {
        // 163 KiB per block on sm_80/sm_87, 227 KiB on sm_90; the 16-bit tiles at most ~105 KB.
        for d in TC_HEAD_DIMS {
            for kv8 in [false, true] {
                let (decode, prefill) = tc_smem(d, 2, kv8);
                assert!(decode + 1024 <= 163 * 1024 && prefill + 1024 <= 163 * 1024, "head_dim {d}, kv8 {kv8}");
            }
        }
        assert_eq!(tc_smem(128, 2, false), ((16 + 128) * 136 * 2, (128 + 256) * 136 * 2));
        assert_eq!(tc_smem(64, 2, false), ((16 + 256) * 72 * 2, (128 + 256) * 72 * 2));
        assert_eq!(tc_smem(256, 2, false), ((16 + 128) * 264 * 2, (64 + 128) * 264 * 2));
        // fp8 decode: Q + a ring of raw K/V stages (rows padded to an odd number of 16-byte
        // chunks); prefill: Q + one converted K/V tile + the raw K/V codes
        assert_eq!(tc_smem(128, 2, true), (16 * 136 * 2 + 3 * 128 * 144, (128 + 128) * 136 * 2 + 128 * 128));
        assert_eq!(tc_smem(80, 2, true).0, 16 * 88 * 2 + 3 * 128 * 80);
        assert_eq!(tc_smem(256, 2, true), (16 * 264 * 2 + 2 * 128 * 272, (64 + 64) * 264 * 2 + 64 * 256));
        for d in TC_HEAD_DIMS {
            // the decode kernel's final merge reuses the ring: [4][16][D] floats
            let ring = decode_kv8_stages(d) * 2 * DECODE_TILE * decode_kv8_row(d);
            assert!(ring >= 256 * d && decode_kv8_row(d).is_multiple_of(16), "head_dim {d}");
            // and 99 KB per block (sm_86/sm_89) still holds every fp8 decode kernel
            assert!(tc_smem(d, 2, true).0 + 1024 <= 99 * 1024, "head_dim {d}");
        }
        // the transposed fp8 decode kernel (GqaKv8Cfg): 8 Q rows and stages of 64 K + 64 V rows
        // of 128 bytes; four CTAs fit on an sm_90 SM with 3 stages; the merge ([4][8][128]
        // floats) fits in the ring
        assert_eq!(gqa_decode_smem(128, 2, 3), 8 * 136 * 2 + 3 * 64 * 256);
        // (400 bytes of static shared memory, 1 KiB per CTA reserved by the hardware)
        assert!(4 * (gqa_decode_smem(128, 2, 3) + 1024 + 400) <= 228 * 1024);
        assert!(gqa_decode_smem(128, 2, 4) + 1024 <= 99 * 1024);
        let ring = gqa_decode_smem(128, 2, 3) - 8 * 136 * 2;
        assert!(ring >= 4 * 8 * 128 * 4);
    }

    #[test]
    fn transposed_fp8_decode_takes_groups_up_to_8_at_head_dim_128() {
        assert!(gqa_decode(128, 4, true) && gqa_decode(128, 8, true) && gqa_decode(128, 1, true));
        assert!(!gqa_decode(128, 16, true) && !gqa_decode(64, 4, true) && !gqa_decode(128, 4, false));
    }

    #[test]
    fn kv_suffixes_name_the_cache() {
        assert_eq!(kv_suffix(DType::BF16, DType::BF16).unwrap(), "");
        assert_eq!(kv_suffix(DType::F16, DType::F8E4M3).unwrap(), "_kv8");
        assert_eq!(kv_suffix(DType::F32, DType::F8E4M3).unwrap(), "_kv8");
        assert!(kv_suffix(DType::BF16, DType::F16).is_err());
    }

    #[test]
    fn sub_groups_cover_the_group() {
        for group in 1..=200 {
            for rows in [DECODE_ROWS, 64, 128] {
                let (gs, n) = sub_groups(group, rows);
                assert!(gs <= rows && gs * n >= group && gs * (n - 1) < group);
            }
        }
    }

    #[test]
    fn validation_rejects_bad_shapes() {
        let b = batch(1, 10);
        assert!(validate(&shape(32, 8, 0), &b).is_ok());
        assert!(validate(&shape(30, 8, 0), &b).is_err());
        assert!(validate(&shape(8, 0, 0), &b).is_err());
        assert!(validate(&AttentionShape { head_dim: 320, ..shape(8, 8, 0) }, &b).is_err());
        assert!(validate(&AttentionShape { block_size: 0, ..shape(8, 8, 0) }, &b).is_err());
        assert_eq!(scratch_bytes(&shape(8, 0, 0), &b), scratch_bytes(&shape(8, 0, 0), &b));
    }
}
