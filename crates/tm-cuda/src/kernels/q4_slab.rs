//! The large-batch int4 product by slabs ([`tm_core::q4_slab`]): `out[n, rows] = x[n, cols] · Wᵀ`
//! as, for each slab of weight rows `[r0, r0 + R)`, `dequant_q4_rows` (quant.cu) into a scratch
//! buffer, then cuBLASLt ([`Blas::gemm_into`]) from that scratch straight into
//! `out[:, r0..r0 + R]`. Slabs are queued one after the other on the GPU's stream, so one scratch
//! buffer serves them all. The backend reserves the buffer and decides when to use this
//! (`tm-cuda/src/ops/q4_slab.rs`); benchmarks call it directly.

use tm_core::q4_slab::{slab_rows, slabs};
use tm_core::quant::Int4Layout;
use tm_core::{DType, Error, Result};

use super::quant::dequant_q4_rows;
use crate::blas::Blas;
use crate::runtime::Gpu;

/// Device addresses and shape of an int4 weight (tm's layout, [`tm_core::quant`]).
#[derive(Clone, Copy, Debug)]
pub struct Int4Matrix {
    /// u8 `[rows, cols / 2]`, 16-byte aligned.
    pub packed: u64,
    /// f16 `[rows, cols / group]`.
    pub scales: u64,
    /// f16 `[rows, cols / group]`.
    pub mins: u64,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Columns per group.
    pub group: usize,
    /// The order of `packed`.
    pub layout: Int4Layout,
}

/// Rows per slab for `w` in `dt` with `budget` bytes of scratch, or `None` when the path cannot
/// take it (f32, or not even one aligned group of rows fits).
pub fn rows_per_slab(dt: DType, w: &Int4Matrix, budget: usize) -> Option<usize> {
    if !matches!(dt, DType::F16 | DType::BF16) {
        return None;
    }
    slab_rows(w.rows, w.cols, dt.storage_bytes(1), budget)
}

/// `out[n, rows] = x[n, cols] · Wᵀ` (`x`, `out` in `dt`, f16 or bf16) slab by slab through the
/// scratch buffer at `scratch` of `scratch_bytes` bytes (16-byte aligned). Returns the slab
/// count. All pointers are device addresses; the work is queued on the GPU's stream.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q4_slabs(
    gpu: &Gpu,
    blas: &Blas,
    dt: DType,
    out: u64,
    x: u64,
    w: &Int4Matrix,
    n: usize,
    scratch: u64,
    scratch_bytes: usize,
) -> Result<usize> {
    let per_slab = rows_per_slab(dt, w, scratch_bytes).ok_or_else(|| {
        Error::invalid(format!(
            "matmul_q4_slabs: {dt} rows of {} columns do not fit a {scratch_bytes}-byte slab {} at a time",
            w.cols,
            tm_core::q4_slab::SLAB_ROW_ALIGN
        ))
    })?;
    let es = dt.storage_bytes(1);
    let mut count = 0;
    for (r0, len) in slabs(w.rows, per_slab) {
        dequant_q4_rows(gpu, dt, scratch, w.packed, w.scales, w.mins, r0, len, w.rows, w.cols, w.group, w.layout)?;
        blas.gemm_into(dt, n, len, w.cols, x, scratch, out + (r0 * es) as u64, w.rows)?;
        count += 1;
    }
    Ok(count)
}
