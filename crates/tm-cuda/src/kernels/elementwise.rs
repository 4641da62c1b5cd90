//! Launchers for `elementwise.cu`: embeddings, RMSNorm, RoPE, SiLU·up, additions, KV-cache writes
//! and row gathers (parameter lists: `tm-kernels/cuda/ABI.md`).
//!
//! Pointers are device addresses; every function validates its sizes (they must fit the kernels'
//! `int` parameters), returns `Ok(())` without launching when there is nothing to do, and queues
//! the kernel on the GPU's stream. The kernels take their 16-byte vector paths by themselves when
//! the pointers and row lengths allow it, so any alignment of the element type works.

use tm_core::quant::Int4Layout;
use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{Dim3, Gpu, KernelArg};

/// Threads per block for the flat and row-copy kernels.
const THREADS: u32 = 256;
/// The most threads the norms use per block (the kernels' `__launch_bounds__`).
const NORM_THREADS: u32 = 512;
/// Rows per block when one warp handles a norm row.
const NORM_ROWS_PER_WARP_BLOCK: u32 = 8;
/// Cap on the blocks of the grid-stride kernels (each thread loops over the rest).
const MAX_FLAT_BLOCKS: u64 = 8192;
/// Cap on `grid.y` (the hardware limit).
const MAX_GRID_Y: usize = 65535;
/// The dynamic shared memory RoPE may use without opting in (48 KiB).
const MAX_ROPE_SHARED: usize = 48 * 1024;

/// `v` as the kernels' `int`, or an error naming it.
fn int(op: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("{op}: {what} = {v} exceeds the kernel limit of {}", i32::MAX)))
}

/// The name of kernel `base` for `dt`.
fn name(base: &str, dt: DType) -> Result<String> {
    Ok(format!("{base}_{}", suffix(dt)?))
}

/// Elements of `dt` in 16 bytes (the kernels' vector width).
fn vec_width(dt: DType) -> usize {
    match dt {
        DType::F32 => 4,
        _ => 8,
    }
}

/// A multiple of 32 covering `work` items, between 32 and `max`.
fn threads_for(work: usize, max: u32) -> u32 {
    let t = work.div_ceil(32).saturating_mul(32);
    u32::try_from(t).unwrap_or(max).clamp(32, max)
}

/// One block of `threads` per row for `rows` rows (`rows` already checked to fit `int`).
fn row_grid(rows: i32) -> Dim3 {
    (rows as u32, 1, 1)
}

/// Blocks for `n` items of a grid-stride kernel with `THREADS` threads, `per_thread` each.
fn flat_blocks(n: usize, per_thread: usize) -> u32 {
    let blocks = (n as u64).div_ceil(THREADS as u64 * per_thread as u64).clamp(1, MAX_FLAT_BLOCKS);
    blocks as u32
}

/// Checks a quantized embedding's `hidden` and `group`.
fn check_groups(op: &str, hidden: usize, group: usize) -> Result<()> {
    if group == 0 || !group.is_multiple_of(32) || !hidden.is_multiple_of(group) {
        return Err(Error::invalid(format!(
            "{op}: group size {group} must be a positive multiple of 32 dividing hidden size {hidden}"
        )));
    }
    Ok(())
}

/// `out[i, :] = table[ids[i], :]` for `n` ids into a dense `[vocab, hidden]` table of `dt`.
/// `ids` are u32 and must be in the vocabulary (not checked on the device).
pub fn embedding(gpu: &Gpu, dt: DType, out: u64, table: u64, ids: u64, n: usize, hidden: usize) -> Result<()> {
    let op = "embedding";
    let (n32, h32) = (int(op, "n", n)?, int(op, "hidden", hidden)?);
    if n == 0 || hidden == 0 {
        return Ok(());
    }
    let threads = threads_for(hidden.div_ceil(vec_width(dt)), THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(n32),
        (threads, 1, 1),
        0,
        &[KernelArg::Ptr(out), KernelArg::Ptr(table), KernelArg::Ptr(ids), KernelArg::I32(n32), KernelArg::I32(h32)],
    )
}

/// `out[i, :]` = row `ids[i]` of an int8 table (`q`: i8 `[vocab, hidden]`, `scales`: f16
/// `[vocab, hidden / group]`), dequantized to `dt`.
#[allow(clippy::too_many_arguments)]
pub fn embedding_q8(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    q: u64,
    scales: u64,
    ids: u64,
    n: usize,
    hidden: usize,
    group: usize,
) -> Result<()> {
    let op = "embedding_q8";
    let (n32, h32, g32) = (int(op, "n", n)?, int(op, "hidden", hidden)?, int(op, "group", group)?);
    if n == 0 || hidden == 0 {
        return Ok(());
    }
    check_groups(op, hidden, group)?;
    let threads = threads_for(hidden.div_ceil(4), THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(n32),
        (threads, 1, 1),
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(q),
            KernelArg::Ptr(scales),
            KernelArg::Ptr(ids),
            KernelArg::I32(n32),
            KernelArg::I32(h32),
            KernelArg::I32(g32),
        ],
    )
}

/// `out[i, :]` = row `ids[i]` of an int4 table (`packed`: u8 `[vocab, hidden / 2]` in tm's nibble
/// order, `scales` and `mins`: f16 `[vocab, hidden / group]`), dequantized to `dt`.
/// `layout`: the order of `packed` and the table's row count (vocab; a tile-major table has whole
/// 16-row tiles).
#[allow(clippy::too_many_arguments)]
pub fn embedding_q4(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    packed: u64,
    scales: u64,
    mins: u64,
    ids: u64,
    n: usize,
    hidden: usize,
    group: usize,
    layout: (Int4Layout, usize),
) -> Result<()> {
    let op = "embedding_q4";
    let (n32, h32, g32) = (int(op, "n", n)?, int(op, "hidden", hidden)?, int(op, "group", group)?);
    if layout.0 == Int4Layout::TilesAndScales16x128 {
        // Only gate and up weights are stored so (Ops::prepare_gate_up), never a table.
        return Err(Error::invalid(format!("{op}: a table with tile-ordered scales is not supported")));
    }
    let tiled = super::layout_arg(op, layout.0, layout.1, hidden)?;
    if n == 0 || hidden == 0 {
        return Ok(());
    }
    check_groups(op, hidden, group)?;
    let threads = threads_for(hidden.div_ceil(8), THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(n32),
        (threads, 1, 1),
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(packed),
            KernelArg::Ptr(scales),
            KernelArg::Ptr(mins),
            KernelArg::Ptr(ids),
            KernelArg::I32(n32),
            KernelArg::I32(h32),
            KernelArg::I32(g32),
            tiled,
        ],
    )
}

/// The threads that share one norm row of `cols` elements of `dt`: one warp for rows of at most
/// 64 16-byte vectors, else a multiple of 32 up to `NORM_THREADS`. The row's sum of squares is
/// reduced in an order that depends on it, so a kernel that must round exactly as `rms_norm` and
/// `add_rms_norm` do (the fused collective of [`crate::peer`]) uses the same width.
pub(crate) fn norm_row_threads(dt: DType, cols: usize) -> u32 {
    let vectors = cols.div_ceil(vec_width(dt));
    if vectors <= 64 {
        32
    } else {
        threads_for(vectors, NORM_THREADS)
    }
}

/// Block and grid for a norm over `rows` rows of `cols`: one warp per row (several rows per
/// block) for short rows, else one block of up to `NORM_THREADS` threads per row.
fn norm_shape(dt: DType, rows: usize, cols: usize) -> (Dim3, Dim3) {
    let threads = norm_row_threads(dt, cols);
    if threads == 32 {
        let by = NORM_ROWS_PER_WARP_BLOCK;
        let blocks = (rows as u64).div_ceil(by as u64) as u32;
        ((blocks, 1, 1), (32, by, 1))
    } else {
        ((rows as u32, 1, 1), (threads, 1, 1))
    }
}

/// `out = x / sqrt(mean(x²) + eps) * w` for each of `rows` rows of `cols` (`w`: `[cols]`).
/// `out` may be `x`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(gpu: &Gpu, dt: DType, out: u64, x: u64, w: u64, eps: f32, rows: usize, cols: usize) -> Result<()> {
    let op = "rms_norm";
    let (r32, c32) = (int(op, "rows", rows)?, int(op, "cols", cols)?);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (grid, block) = norm_shape(dt, rows, cols);
    gpu.launch(
        &name(op, dt)?,
        grid,
        block,
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(x),
            KernelArg::Ptr(w),
            KernelArg::F32(eps),
            KernelArg::I32(r32),
            KernelArg::I32(c32),
        ],
    )
}

/// `residual += x` (rounded to `dt`), then `out = rms_norm(residual)`, for `rows` rows of `cols`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    residual: u64,
    x: u64,
    w: u64,
    eps: f32,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let op = "add_rms_norm";
    let (r32, c32) = (int(op, "rows", rows)?, int(op, "cols", cols)?);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (grid, block) = norm_shape(dt, rows, cols);
    gpu.launch(
        &name(op, dt)?,
        grid,
        block,
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(residual),
            KernelArg::Ptr(x),
            KernelArg::Ptr(w),
            KernelArg::F32(eps),
            KernelArg::I32(r32),
            KernelArg::I32(c32),
        ],
    )
}

/// The launch shape of the RoPE kernels (`rope`, `rope_write_kv`) over `heads` rotated heads per
/// token: blocks per token, threads per block and the shared cos/sin table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RopeGrid {
    head_blocks: u32,
    threads: u32,
    shared: u32,
}

/// [`RopeGrid`] for `tokens` rows of `heads` heads of `head_dim` (`None`: nothing to do); errors
/// (naming `op`) for an odd or too large `head_dim` or sizes beyond the kernels' `int`. Few
/// tokens (decoding) spread each token's heads over several blocks, 4 heads per block.
fn rope_grid(op: &str, tokens: usize, heads: usize, head_dim: usize) -> Result<Option<RopeGrid>> {
    int(op, "heads * head_dim", heads.saturating_mul(head_dim))?;
    if tokens == 0 || heads == 0 || head_dim == 0 {
        return Ok(None);
    }
    if !head_dim.is_multiple_of(2) {
        return Err(Error::invalid(format!("{op}: head_dim {head_dim} must be even")));
    }
    let shared = head_dim * std::mem::size_of::<f32>();
    if shared > MAX_ROPE_SHARED {
        return Err(Error::invalid(format!(
            "{op}: head_dim {head_dim} is too large (at most {})",
            MAX_ROPE_SHARED / 4
        )));
    }
    let head_blocks = if tokens < 128 { heads.div_ceil(4) } else { 1 };
    let threads = threads_for(heads.div_ceil(head_blocks) * head_dim / 2, THREADS);
    Ok(Some(RopeGrid { head_blocks: head_blocks as u32, threads, shared: shared as u32 }))
}

/// Rotary embedding in place on `x: [tokens, heads * head_dim]`: token `t` at `positions[t]`
/// (u32), `inv_freq`: f32 `[head_dim / 2]`, cos and sin scaled by `attention_factor`; pairs
/// `(i, i + head_dim/2)`, or `(2i, 2i+1)` when `interleaved`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    gpu: &Gpu,
    dt: DType,
    x: u64,
    positions: u64,
    inv_freq: u64,
    attention_factor: f32,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    interleaved: bool,
) -> Result<()> {
    let op = "rope";
    let (t32, h32, d32) = (int(op, "tokens", tokens)?, int(op, "heads", heads)?, int(op, "head_dim", head_dim)?);
    let Some(g) = rope_grid(op, tokens, heads, head_dim)? else { return Ok(()) };
    gpu.launch(
        &name(op, dt)?,
        (t32 as u32, g.head_blocks, 1),
        (g.threads, 1, 1),
        g.shared,
        &[
            KernelArg::Ptr(x),
            KernelArg::Ptr(positions),
            KernelArg::Ptr(inv_freq),
            KernelArg::F32(attention_factor),
            KernelArg::I32(t32),
            KernelArg::I32(h32),
            KernelArg::I32(d32),
            KernelArg::I32(i32::from(interleaved)),
        ],
    )
}

/// The shapes of a fused RoPE + KV-cache write ([`rope_write_kv`]).
#[derive(Clone, Copy, Debug)]
pub struct RopeKvShape {
    /// Tokens (rows of `q`, `k` and `v`).
    pub tokens: usize,
    /// Query heads per row of `q`.
    pub heads: usize,
    /// Key (and value) heads per row of `k` and `v`.
    pub kv_heads: usize,
    /// Elements per head (even).
    pub head_dim: usize,
    /// Pairs `(2i, 2i+1)` instead of `(i, i + head_dim/2)`.
    pub interleaved: bool,
}

/// The device buffers of a fused RoPE + KV-cache write ([`rope_write_kv`]).
#[derive(Clone, Copy, Debug)]
pub struct RopeKvBuffers {
    /// `[tokens, heads * head_dim]` in `dt`, rotated in place.
    pub q: u64,
    /// `[tokens, kv_heads * head_dim]` in `dt`, rotated in place.
    pub k: u64,
    /// `[tokens, kv_heads * head_dim]` in `dt`.
    pub v: u64,
    /// The key cache: rows of `kv_heads * head_dim` in `dt`, or E4M3 codes when `fp8`.
    pub k_cache: u64,
    /// The value cache, as `k_cache`.
    pub v_cache: u64,
    /// u32 `[tokens]`.
    pub positions: u64,
    /// u32 `[tokens]` cache slots (`u32::MAX`: a padding token, not written).
    pub slots: u64,
    /// f32 `[head_dim / 2]`.
    pub inv_freq: u64,
}

/// [`rope`] of `q`, [`rope`] of `k`, then [`write_kv`] of the rotated `k` and `v` (or
/// `write_kv_e4m3` into FP8 caches when `fp8`), in one launch with the same results bit for bit:
/// `rope_write_kv_T` (elementwise.cu) or `rope_write_kv_e4m3_T` (attention.cu). The grid is
/// rope's, over the `heads + kv_heads` rotated heads.
pub fn rope_write_kv(
    gpu: &Gpu,
    dt: DType,
    b: &RopeKvBuffers,
    shape: RopeKvShape,
    attention_factor: f32,
    fp8: bool,
) -> Result<()> {
    let op = "rope_write_kv";
    let RopeKvShape { tokens, heads, kv_heads, head_dim, interleaved } = shape;
    let (t32, h32, kh32, d32) = (
        int(op, "tokens", tokens)?,
        int(op, "heads", heads)?,
        int(op, "kv_heads", kv_heads)?,
        int(op, "head_dim", head_dim)?,
    );
    // rope's grid over the `heads + kv_heads` rotated heads.
    let Some(g) = rope_grid(op, tokens, heads.saturating_add(kv_heads), head_dim)? else { return Ok(()) };
    let kernel = if fp8 { format!("rope_write_kv_e4m3_{}", suffix(dt)?) } else { name(op, dt)? };
    gpu.launch(
        &kernel,
        (t32 as u32, g.head_blocks, 1),
        (g.threads, 1, 1),
        g.shared,
        &[
            KernelArg::Ptr(b.q),
            KernelArg::Ptr(b.k),
            KernelArg::Ptr(b.v),
            KernelArg::Ptr(b.k_cache),
            KernelArg::Ptr(b.v_cache),
            KernelArg::Ptr(b.positions),
            KernelArg::Ptr(b.slots),
            KernelArg::Ptr(b.inv_freq),
            KernelArg::F32(attention_factor),
            KernelArg::I32(t32),
            KernelArg::I32(h32),
            KernelArg::I32(kh32),
            KernelArg::I32(d32),
            KernelArg::I32(i32::from(interleaved)),
        ],
    )
}

/// `out = silu(gate) * up` over `n` elements (`silu(g) = g / (1 + exp(-g))`).
pub fn silu_mul(gpu: &Gpu, dt: DType, out: u64, gate: u64, up: u64, n: usize) -> Result<()> {
    let op = "silu_mul";
    let n64 = i64::try_from(n).map_err(|_| Error::invalid(format!("{op}: n = {n} is too large")))?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        &name(op, dt)?,
        (flat_blocks(n, vec_width(dt)), 1, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(out), KernelArg::Ptr(gate), KernelArg::Ptr(up), KernelArg::I64(n64)],
    )
}

/// `x += y` over `n` elements.
pub fn add(gpu: &Gpu, dt: DType, x: u64, y: u64, n: usize) -> Result<()> {
    let op = "add";
    let n64 = i64::try_from(n).map_err(|_| Error::invalid(format!("{op}: n = {n} is too large")))?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        &name(op, dt)?,
        (flat_blocks(n, vec_width(dt)), 1, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(x), KernelArg::Ptr(y), KernelArg::I64(n64)],
    )
}

/// `x[i] = 0` for the `n` elements of `x`.
pub fn fill_zero(gpu: &Gpu, dt: DType, x: u64, n: usize) -> Result<()> {
    let op = "fill_zero";
    let n64 = i64::try_from(n).map_err(|_| Error::invalid(format!("{op}: n = {n} is too large")))?;
    if n == 0 {
        return Ok(());
    }
    gpu.launch(&name(op, dt)?, (flat_blocks(n, 1), 1, 1), (THREADS, 1, 1), 0, &[KernelArg::Ptr(x), KernelArg::I64(n64)])
}

/// A deferred RMSNorm finished in place: `x[r, c] = T(x[r, c] · rsqrt(sums[r] / cols + eps))` for
/// `rows` rows of `cols` (`sums`: f64 `[rows]`, a `q4_gemv_join` slot).
pub fn norm_finish(gpu: &Gpu, dt: DType, x: u64, sums: u64, rows: usize, cols: usize, eps: f32) -> Result<()> {
    let op = "norm_finish";
    let (r32, c32) = (int(op, "rows", rows)?, int(op, "cols", cols)?);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    gpu.launch(
        &name(op, dt)?,
        (flat_blocks(rows * cols, 1), 1, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(x), KernelArg::Ptr(sums), KernelArg::I32(r32), KernelArg::I32(c32), KernelArg::F32(eps)],
    )
}

/// `x[r, :] += bias` for each of `rows` rows of `cols` (`bias`: `[cols]`).
pub fn add_bias(gpu: &Gpu, dt: DType, x: u64, bias: u64, rows: usize, cols: usize) -> Result<()> {
    let op = "add_bias";
    let (r32, c32) = (int(op, "rows", rows)?, int(op, "cols", cols)?);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let gx = cols.div_ceil(vec_width(dt)).div_ceil(THREADS as usize) as u32;
    let gy = rows.min(MAX_GRID_Y) as u32;
    gpu.launch(
        &name(op, dt)?,
        (gx, gy, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(x), KernelArg::Ptr(bias), KernelArg::I32(r32), KernelArg::I32(c32)],
    )
}

/// Writes `tokens` rows of `kv_dim` (`kv_heads * head_dim`) from `k` and `v` into the paged
/// caches at the u32 token slots `slots` (element offset `slot * kv_dim`, in 64 bits). A slot of
/// `u32::MAX` marks a padding token, which is skipped.
#[allow(clippy::too_many_arguments)]
pub fn write_kv(
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
    let op = "write_kv";
    let (t32, d32) = (int(op, "tokens", tokens)?, int(op, "kv_dim", kv_dim)?);
    if tokens == 0 || kv_dim == 0 {
        return Ok(());
    }
    let threads = threads_for(kv_dim.div_ceil(vec_width(dt)), THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(t32),
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

/// `out[i, :] = x[rows[i], :]` for `n` u32 row indices into `x: [_, cols]`.
pub fn gather_rows(gpu: &Gpu, dt: DType, out: u64, x: u64, rows: u64, n: usize, cols: usize) -> Result<()> {
    let op = "gather_rows";
    let (n32, c32) = (int(op, "n", n)?, int(op, "cols", cols)?);
    if n == 0 || cols == 0 {
        return Ok(());
    }
    let threads = threads_for(cols.div_ceil(vec_width(dt)), THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(n32),
        (threads, 1, 1),
        0,
        &[KernelArg::Ptr(out), KernelArg::Ptr(x), KernelArg::Ptr(rows), KernelArg::I32(n32), KernelArg::I32(c32)],
    )
}

/// Zeroes every row `r < n` of `x` (`[n, cols]`) whose `keep[r]` (device u32s) is 0.
pub fn zero_rows(gpu: &Gpu, dt: DType, x: u64, keep: u64, n: usize, cols: usize) -> Result<()> {
    let op = "zero_rows";
    let (n32, c32) = (int(op, "n", n)?, int(op, "cols", cols)?);
    if n == 0 || cols == 0 {
        return Ok(());
    }
    let threads = threads_for(cols, THREADS);
    gpu.launch(
        &name(op, dt)?,
        row_grid(n32),
        (threads, 1, 1),
        0,
        &[KernelArg::Ptr(x), KernelArg::Ptr(keep), KernelArg::I32(n32), KernelArg::I32(c32)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_grids() {
        // Llama-3-8B decode: rope_write_kv over 32 + 8 heads of 128 (10 blocks of 4 heads per
        // token); rope of q alone; a prefill of 200 tokens (one block per token).
        assert_eq!(rope_grid("t", 1, 40, 128).unwrap(), Some(RopeGrid { head_blocks: 10, threads: 256, shared: 512 }));
        assert_eq!(rope_grid("t", 1, 32, 128).unwrap(), Some(RopeGrid { head_blocks: 8, threads: 256, shared: 512 }));
        assert_eq!(rope_grid("t", 200, 40, 128).unwrap(), Some(RopeGrid { head_blocks: 1, threads: 256, shared: 512 }));
        assert_eq!(rope_grid("t", 3, 2, 16).unwrap(), Some(RopeGrid { head_blocks: 1, threads: 32, shared: 64 }));
        assert_eq!(rope_grid("t", 0, 40, 128).unwrap(), None);
        assert_eq!(rope_grid("t", 1, 0, 128).unwrap(), None);
        assert!(rope_grid("t", 1, 4, 7).unwrap_err().to_string().contains("must be even"));
        assert!(rope_grid("t", 1, 4, 1 << 14).unwrap_err().to_string().contains("too large"));
    }

    #[test]
    fn launch_shapes() {
        assert_eq!(threads_for(1, 256), 32);
        assert_eq!(threads_for(33, 256), 64);
        assert_eq!(threads_for(10_000, 256), 256);
        assert_eq!(threads_for(usize::MAX, 512), 512);
        // short rows: a warp per row, 8 rows per block
        assert_eq!(norm_shape(DType::F16, 17, 128), ((3, 1, 1), (32, 8, 1)));
        // long rows: a block per row
        assert_eq!(norm_shape(DType::F16, 5, 4096), ((5, 1, 1), (512, 1, 1)));
        assert_eq!(norm_shape(DType::F32, 5, 1000), ((5, 1, 1), (256, 1, 1)));
        assert_eq!(flat_blocks(1, 8), 1);
        assert_eq!(flat_blocks(1 << 40, 8), MAX_FLAT_BLOCKS as u32);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(int("op", "n", i32::MAX as usize).is_ok());
        assert!(int("op", "n", i32::MAX as usize + 1).is_err());
        assert!(check_groups("op", 4096, 32).is_ok());
        assert!(check_groups("op", 4096, 0).is_err());
        assert!(check_groups("op", 4096, 48).is_err());
        assert!(check_groups("op", 4000, 64).is_err());
        assert!(name("rope", DType::I8).is_err());
        assert_eq!(name("rope", DType::BF16).unwrap(), "rope_bf16");
    }
}
