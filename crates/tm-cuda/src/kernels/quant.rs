//! Launchers for `quant.cu`: `out[n, rows] = x[n, cols] · Wᵀ` with `W` in tm's int4 or int8 group
//! layout ([`tm_core::quant`]), activations and outputs in `dt` (f32, f16 or bf16), f32 sums.
//!
//! Two paths, picked by `n` (int4 with f16/bf16 activations and `n <= 8` goes through
//! [`super::q4_gemv`], the tensor-core GEMV, instead when it fits; the backend decides):
//! - `n <= 8` (decode): `matmul_q{4,8}_gemv{NB}_T` with `NB` the next power of two `>= n`. One
//!   warp per weight row, 8 rows per 256-thread block; the lanes stride over 16-byte chunks of the
//!   packed row, dequantize each in registers once and multiply it with all `n` activation rows.
//! - `n > 8` (prefill), int4 with f16/bf16 on sm_80+ when [`q4_gemm::eligible`]: the w4a16
//!   tensor-core GEMM of [`q4_gemm`] (packed weights in shared memory, dequantized in registers).
//! - `n > 8` (prefill) otherwise: `matmul_q{4,8}_tiled_T`, 256 threads per block. Each k-step
//!   dequantizes a weight tile into shared memory (no dequantized copy of `W` is ever written to
//!   global memory).
//!   f16/bf16 use tensor cores (mma.sync m16n8k16, f32 accumulators) on 64 × 128 (`n` × `rows`)
//!   block tiles; f32 uses CUDA cores on 64 × 64 tiles, so f32 results stay f32-accurate (only the
//!   order of the f32 sums differs from the CPU's exact path). With f16/bf16 the dequantized
//!   weights are rounded to `dt` before the tensor-core product.
//!
//! Requirements (checked, errors otherwise): `cols % 32 == 0`, `group % 32 == 0`,
//! `cols % group == 0`, sizes that fit the kernels' `int`, and 16-byte aligned packed weights (any
//! allocation is). `x` and `out` need only element alignment.

use tm_core::{DType, Error, Result};

use super::{layout_arg, q4_gemm, suffix};
use crate::runtime::{Dim3, Gpu, KernelArg};
use tm_core::quant::Int4Layout;

/// Threads per block of every quant kernel.
const THREADS: u32 = 256;
/// Weight rows per GEMV block (one per warp).
const GEMV_ROWS: usize = THREADS as usize / 32;
/// The most activation rows the GEMV kernels take.
pub const GEMV_MAX_N: usize = 8;
/// Activation rows per tiled block.
const TILE_N: usize = 64;
/// Weight rows per tiled block: tensor-core (f16/bf16) and CUDA-core (f32) kernels.
const TILE_ROWS_MMA: usize = 128;
const TILE_ROWS_SIMT: usize = 64;
/// The hardware's limit on `grid.y`.
const MAX_GRID_Y: usize = 65535;

/// The quantization of a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Int4,
    Int8,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::Int4 => "q4",
            Kind::Int8 => "q8",
        }
    }
}

/// `v` as the kernels' `int`, or an error naming it.
fn int(op: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("{op}: {what} = {v} exceeds the kernel limit of {}", i32::MAX)))
}

/// Checks the column and group sizes.
fn check_shape(op: &str, cols: usize, group: usize) -> Result<()> {
    if !cols.is_multiple_of(32) {
        return Err(Error::invalid(format!("{op}: cols = {cols} must be a multiple of 32")));
    }
    if group == 0 || !group.is_multiple_of(32) || !cols.is_multiple_of(group) {
        return Err(Error::invalid(format!(
            "{op}: group size {group} must be a positive multiple of 32 dividing cols = {cols}"
        )));
    }
    Ok(())
}

/// Checks that device pointer `p` is aligned to `align` bytes.
fn check_align(op: &str, what: &str, p: u64, align: u64) -> Result<()> {
    if !p.is_multiple_of(align) {
        return Err(Error::invalid(format!("{op}: {what} pointer {p:#x} must be {align}-byte aligned")));
    }
    Ok(())
}

/// Kernel name, grid and block for a call.
fn plan(kind: Kind, dt: DType, n: usize, rows: usize) -> Result<(String, Dim3, Dim3)> {
    let sfx = suffix(dt)?;
    let tag = kind.tag();
    let blocks = |count: usize, per: usize, what: &str| {
        u32::try_from(count.div_ceil(per))
            .map_err(|_| Error::invalid(format!("matmul_{tag}: {what} = {count} needs too many blocks")))
    };
    if n <= GEMV_MAX_N {
        let nb = n.next_power_of_two();
        let grid = (blocks(rows, GEMV_ROWS, "rows")?, 1, 1);
        return Ok((format!("matmul_{tag}_gemv{nb}_{sfx}"), grid, (THREADS, 1, 1)));
    }
    let tile_rows = if dt == DType::F32 { TILE_ROWS_SIMT } else { TILE_ROWS_MMA };
    if n.div_ceil(TILE_N) > MAX_GRID_Y {
        return Err(Error::invalid(format!("matmul_{tag}: n = {n} exceeds the grid limit of {}", MAX_GRID_Y * TILE_N)));
    }
    let grid = (blocks(rows, tile_rows, "rows")?, blocks(n, TILE_N, "n")?, 1);
    Ok((format!("matmul_{tag}_tiled_{sfx}"), grid, (THREADS, 1, 1)))
}

/// Validates a call and returns `(n, rows, cols, group)` as `int`s, or `None` when there is
/// nothing to compute.
fn validate(
    op: &str,
    dt: DType,
    packed: u64,
    n: usize,
    rows: usize,
    cols: usize,
    group: usize,
) -> Result<Option<[i32; 4]>> {
    suffix(dt)?;
    let v = [int(op, "n", n)?, int(op, "rows", rows)?, int(op, "cols", cols)?, int(op, "group", group)?];
    check_shape(op, cols, group)?;
    if n.checked_mul(cols).and_then(|_| rows.checked_mul(cols)).and_then(|_| n.checked_mul(rows)).is_none() {
        return Err(Error::invalid(format!("{op}: sizes n = {n}, rows = {rows}, cols = {cols} overflow")));
    }
    check_align(op, "packed weight", packed, 16)?;
    if n == 0 || rows == 0 {
        return Ok(None);
    }
    Ok(Some(v))
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int4 `W`: `packed` u8 `[rows, cols/2]` (tm's nibble
/// order), `scales` and `mins` f16 `[rows, cols/group]`, `w = q * scale + min`. `x` and `out` are
/// `dt` (f32, f16 or bf16). All pointers are device addresses; the kernel is queued on the GPU's
/// stream. `partials` (address, bytes): scratch the prefill GEMM may split K into
/// ([`q4_gemm::split_k`]), or `None`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q4(
    gpu: &Gpu,
    partials: Option<(u64, usize)>,
    dt: DType,
    out: u64,
    x: u64,
    packed: u64,
    scales: u64,
    mins: u64,
    n: usize,
    rows: usize,
    cols: usize,
    group: usize,
    layout: Int4Layout,
) -> Result<()> {
    let op = "matmul_q4";
    let tiled = layout_arg(op, layout, rows, cols)?;
    let Some([n32, r32, c32, g32]) = validate(op, dt, packed, n, rows, cols, group)? else {
        return Ok(());
    };
    check_align(op, "scales", scales, 2)?;
    check_align(op, "mins", mins, 2)?;
    if n > GEMV_MAX_N && q4_gemm::eligible(gpu.sm(), dt, n, rows, cols, group, x, out, packed, scales, mins) {
        let sms = gpu.info().multiprocessors as usize;
        let wgmma = q4_gemm::wgmma_available(gpu);
        if let Some(tile) = q4_gemm::choose(q4_gemm::policy(), n, rows, cols, group, sms, wgmma) {
            let part = q4_gemm::Part { out, packed, scales, mins, rows, layout };
            return q4_gemm::launch(gpu, partials, tile, dt, x, n, cols, group, &[part]);
        }
    }
    let (name, grid, block) = plan(Kind::Int4, dt, n, rows)?;
    gpu.launch(
        &name,
        grid,
        block,
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(x),
            KernelArg::Ptr(packed),
            KernelArg::Ptr(scales),
            KernelArg::Ptr(mins),
            KernelArg::I32(n32),
            KernelArg::I32(r32),
            KernelArg::I32(c32),
            KernelArg::I32(g32),
            tiled,
        ],
    )
}

/// [`matmul_q4`] for 2 to [`q4_gemm::MAX_PARTS`] int4 weights of one `x` (`parts`: each with its
/// output, all of `cols` columns and groups of `group`) in one launch: a decode batch's q/k/v or
/// gate/up, where one grid for them all fills the GPU better than a small grid per weight. Taken
/// for the batches [`q4_gemm::groups`] names when every weight is [`q4_gemm::eligible`] and the
/// chosen tile is a wgmma one (sm_90a); `Ok(false)`, nothing queued, otherwise (the caller then
/// runs the products one by one).
#[allow(clippy::too_many_arguments)]
pub fn matmul_q4_grouped(
    gpu: &Gpu,
    partials: Option<(u64, usize)>,
    dt: DType,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    parts: &[q4_gemm::Part],
) -> Result<bool> {
    let op = "matmul_q4";
    if !q4_gemm::groups(n) || !(2..=q4_gemm::MAX_PARTS).contains(&parts.len()) {
        return Ok(false);
    }
    for p in parts {
        layout_arg(op, p.layout, p.rows, cols)?;
        if validate(op, dt, p.packed, n, p.rows, cols, group)?.is_none() {
            return Ok(false);
        }
        if !q4_gemm::eligible(gpu.sm(), dt, n, p.rows, cols, group, x, p.out, p.packed, p.scales, p.mins) {
            return Ok(false);
        }
    }
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let sms = gpu.info().multiprocessors as usize;
    let wgmma = q4_gemm::wgmma_available(gpu);
    match q4_gemm::choose(q4_gemm::policy(), n, rows, cols, group, sms, wgmma) {
        Some(tile) if tile.wgmma() => {
            q4_gemm::launch(gpu, partials, tile, dt, x, n, cols, group, parts)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int8 `W`: `q` i8 `[rows, cols]`, `scales` f16
/// `[rows, cols/group]`, `w = q * scale`. `x` and `out` are `dt` (f32, f16 or bf16). All pointers
/// are device addresses; the kernel is queued on the GPU's stream.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q8(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    x: u64,
    q: u64,
    scales: u64,
    n: usize,
    rows: usize,
    cols: usize,
    group: usize,
) -> Result<()> {
    let op = "matmul_q8";
    let Some([n32, r32, c32, g32]) = validate(op, dt, q, n, rows, cols, group)? else {
        return Ok(());
    };
    check_align(op, "scales", scales, 2)?;
    let (name, grid, block) = plan(Kind::Int8, dt, n, rows)?;
    gpu.launch(
        &name,
        grid,
        block,
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(x),
            KernelArg::Ptr(q),
            KernelArg::Ptr(scales),
            KernelArg::I32(n32),
            KernelArg::I32(r32),
            KernelArg::I32(c32),
            KernelArg::I32(g32),
        ],
    )
}

/// Threads per block of `dequant_q4_rows`; each takes one 32-column block of a row.
const DEQUANT_THREADS: u32 = 256;

/// Kernel name and grid of `dequant_q4_rows` for `nrows` rows of `cols` columns.
fn dequant_plan(dt: DType, nrows: usize, cols: usize) -> Result<(String, Dim3)> {
    if !matches!(dt, DType::F16 | DType::BF16) {
        return Err(Error::invalid(format!("dequant_q4_rows: dtype {dt} (f16 or bf16 only)")));
    }
    let threads = nrows
        .checked_mul(cols / 32)
        .ok_or_else(|| Error::invalid(format!("dequant_q4_rows: {nrows} rows × {cols} columns overflow")))?;
    let blocks = u32::try_from(threads.div_ceil(DEQUANT_THREADS as usize))
        .map_err(|_| Error::invalid(format!("dequant_q4_rows: {nrows} rows × {cols} columns need too many blocks")))?;
    Ok((format!("dequant_q4_rows_{}", suffix(dt)?), (blocks, 1, 1)))
}

/// Dequantizes rows `[r0, r0 + nrows)` of an int4 `W` (`packed` u8 `[rows, cols/2]`, `scales` and
/// `mins` f16 `[rows, cols/group]`, all of the whole matrix) into `out`, row-major
/// `[nrows, cols]` of `dt` (f16 or bf16): `out[r - r0][c] = dt(q * scale + min)`, rounded like
/// the tiled kernel's tiles. `out` must hold `nrows * cols` elements and be 16-byte aligned. All
/// pointers are device addresses; the kernel is queued on the GPU's stream.
#[allow(clippy::too_many_arguments)]
pub fn dequant_q4_rows(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    packed: u64,
    scales: u64,
    mins: u64,
    r0: usize,
    nrows: usize,
    rows: usize,
    cols: usize,
    group: usize,
    layout: Int4Layout,
) -> Result<()> {
    let op = "dequant_q4_rows";
    check_shape(op, cols, group)?;
    let tiled = layout_arg(op, layout, rows, cols)?;
    let end = r0
        .checked_add(nrows)
        .filter(|&e| e <= rows)
        .ok_or_else(|| Error::invalid(format!("{op}: rows {r0}..{r0}+{nrows} are outside the matrix's {rows} rows")))?;
    let (r32, n32, c32, g32) =
        (int(op, "r0", r0)?, int(op, "nrows", nrows)?, int(op, "cols", cols)?, int(op, "group", group)?);
    int(op, "last row", end)?;
    check_align(op, "packed weight", packed, 16)?;
    check_align(op, "output", out, 16)?;
    check_align(op, "scales", scales, 2)?;
    check_align(op, "mins", mins, 2)?;
    if nrows == 0 || cols == 0 {
        return Ok(());
    }
    let (name, grid) = dequant_plan(dt, nrows, cols)?;
    gpu.launch(
        &name,
        grid,
        (DEQUANT_THREADS, 1, 1),
        0,
        &[
            KernelArg::Ptr(out),
            KernelArg::Ptr(packed),
            KernelArg::Ptr(scales),
            KernelArg::Ptr(mins),
            KernelArg::I32(r32),
            KernelArg::I32(n32),
            KernelArg::I32(c32),
            KernelArg::I32(g32),
            tiled,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_gemv_for_decode_and_tiles_for_prefill() {
        let (name, grid, block) = plan(Kind::Int4, DType::F16, 1, 4096).unwrap();
        assert_eq!((name.as_str(), grid, block), ("matmul_q4_gemv1_f16", (512, 1, 1), (256, 1, 1)));
        assert_eq!(plan(Kind::Int8, DType::BF16, 3, 9).unwrap().0, "matmul_q8_gemv4_bf16");
        assert_eq!(plan(Kind::Int8, DType::F32, 8, 9).unwrap().1, (2, 1, 1));
        assert_eq!(plan(Kind::Int8, DType::F32, 8, 9).unwrap().0, "matmul_q8_gemv8_f32");
        let (name, grid, _) = plan(Kind::Int4, DType::BF16, 9, 4097).unwrap();
        assert_eq!((name.as_str(), grid), ("matmul_q4_tiled_bf16", (33, 1, 1)));
        let (name, grid, _) = plan(Kind::Int8, DType::F32, 130, 4097).unwrap();
        assert_eq!((name.as_str(), grid), ("matmul_q8_tiled_f32", (65, 3, 1)));
        assert!(plan(Kind::Int4, DType::I8, 1, 1).is_err());
        assert!(plan(Kind::Int4, DType::F16, MAX_GRID_Y * TILE_N + 1, 1).is_err());
    }

    #[test]
    fn dequant_grid_covers_every_block() {
        let (name, grid) = dequant_plan(DType::BF16, 2048, 14336).unwrap();
        assert_eq!((name.as_str(), grid), ("dequant_q4_rows_bf16", (2048 * 448 / 256, 1, 1)));
        assert_eq!(dequant_plan(DType::F16, 3, 96).unwrap(), ("dequant_q4_rows_f16".to_string(), (1, 1, 1)));
        assert!(dequant_plan(DType::F32, 8, 64).is_err());
    }

    #[test]
    fn shapes_and_alignment_are_checked() {
        assert!(check_shape("op", 4096, 32).is_ok());
        assert!(check_shape("op", 4096, 128).is_ok());
        assert!(check_shape("op", 0, 32).is_ok());
        assert!(check_shape("op", 4016, 32).is_err());
        assert!(check_shape("op", 4096, 0).is_err());
        assert!(check_shape("op", 4096, 48).is_err());
        assert!(check_shape("op", 96, 64).is_err());
        assert!(check_align("op", "p", 0x1000, 16).is_ok());
        assert!(check_align("op", "p", 0x1008, 16).is_err());
        assert!(validate("op", DType::F16, 0x1000, 0, 8, 64, 32).unwrap().is_none());
        assert_eq!(validate("op", DType::F16, 0x1000, 2, 8, 64, 32).unwrap(), Some([2, 8, 64, 32]));
        assert!(validate("op", DType::F16, 0x1001, 2, 8, 64, 32).is_err());
        assert!(validate("op", DType::F16, 0x1000, 2, 8, 64, 24).is_err());
        assert!(validate("op", DType::F16, 0x1000, 1 << 31, 8, 64, 32).is_err());
    }
}
