//! Launchers for `gemv.cu`: dense `out[n, rows] = x[n, cols] · Wᵀ` for decode batches
//! (`n <= GEMV_MAX_N`), f16 or bf16, f32 sums.
//!
//! - [`gemv`]: up to three weights that share the input (a layer's q, k and v) in one launch.
//! - [`gemv_silu`]: `out = silu(x·Gᵀ) * (x·Uᵀ)` (the gated MLP input) in one launch.
//!
//! [`fits`] says whether a product can take this path (dtype, `n`, `cols`, alignment); the caller
//! uses cuBLASLt otherwise. One warp per weight row, 8 rows per 256-thread block.

use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{Gpu, KernelArg};

/// Threads per block.
const THREADS: u32 = 256;
/// Weight rows per block (one per warp).
const ROWS_PER_BLOCK: usize = THREADS as usize / 32;
pub use super::quant::GEMV_MAX_N;

/// One weight of a [`gemv`] launch: device addresses of `W [rows, cols]`, the optional bias
/// `[rows]` (0 when absent) and `out [n, rows]`.
#[derive(Clone, Copy, Debug)]
pub struct GemvSlot {
    /// The weight matrix.
    pub w: u64,
    /// The bias, or 0.
    pub bias: u64,
    /// The output.
    pub out: u64,
    /// Rows of the weight (features of the output).
    pub rows: usize,
}

/// Whether `n` activation rows of `cols` features in `dt` can use these kernels with the given
/// device addresses (every one must be 16-byte aligned).
pub fn fits(dt: DType, n: usize, cols: usize, ptrs: &[u64]) -> bool {
    matches!(dt, DType::F16 | DType::BF16)
        && (1..=GEMV_MAX_N).contains(&n)
        && cols > 0
        && cols.is_multiple_of(8)
        && i32::try_from(cols).is_ok()
        && ptrs.iter().all(|p| p % 16 == 0)
}

/// The kernel variant for `n` rows: the next power of two.
fn nb(n: usize) -> usize {
    n.next_power_of_two()
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("gemv: {what} = {v} exceeds the kernel limit of {}", i32::MAX)))
}

fn grid(rows: usize) -> Result<(u32, u32, u32)> {
    let blocks = rows.div_ceil(ROWS_PER_BLOCK);
    let blocks =
        u32::try_from(blocks).map_err(|_| Error::invalid(format!("gemv: {rows} rows need too many blocks")))?;
    Ok((blocks, 1, 1))
}

/// `slot.out = x · slot.wᵀ (+ slot.bias)` for each of up to three slots, in one launch.
/// The caller checked [`fits`] (with every address) and the shapes.
pub fn gemv(gpu: &Gpu, dt: DType, x: u64, n: usize, cols: usize, slots: &[GemvSlot]) -> Result<()> {
    if slots.is_empty() || slots.len() > 3 {
        return Err(Error::invalid(format!("gemv: {} weights in one launch (1 to 3)", slots.len())));
    }
    let none = GemvSlot { w: 0, bias: 0, out: 0, rows: 0 };
    let s = |i: usize| slots.get(i).copied().unwrap_or(none);
    let total: usize = slots.iter().map(|s| s.rows).sum();
    if total == 0 {
        return Ok(());
    }
    let name = format!("gemv{}_{}", nb(n), suffix(dt)?);
    let args = [
        KernelArg::Ptr(s(0).out),
        KernelArg::Ptr(s(1).out),
        KernelArg::Ptr(s(2).out),
        KernelArg::Ptr(s(0).w),
        KernelArg::Ptr(s(1).w),
        KernelArg::Ptr(s(2).w),
        KernelArg::Ptr(s(0).bias),
        KernelArg::Ptr(s(1).bias),
        KernelArg::Ptr(s(2).bias),
        KernelArg::Ptr(x),
        KernelArg::I32(int("rows", s(0).rows)?),
        KernelArg::I32(int("rows", s(1).rows)?),
        KernelArg::I32(int("rows", s(2).rows)?),
        KernelArg::I32(int("n", n)?),
        KernelArg::I32(int("cols", cols)?),
    ];
    int("total rows", total)?;
    gpu.launch(&name, grid(total)?, (THREADS, 1, 1), 0, &args)
}

/// `out [n, rows] = silu(x · gateᵀ) * (x · upᵀ)` for `gate`, `up` `[rows, cols]`, in one launch.
/// The caller checked [`fits`] (with every address) and the shapes.
#[allow(clippy::too_many_arguments)]
pub fn gemv_silu(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    gate: u64,
    up: u64,
    x: u64,
    n: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let name = format!("gemv_silu{}_{}", nb(n), suffix(dt)?);
    let args = [
        KernelArg::Ptr(out),
        KernelArg::Ptr(gate),
        KernelArg::Ptr(up),
        KernelArg::Ptr(x),
        KernelArg::I32(int("rows", rows)?),
        KernelArg::I32(int("n", n)?),
        KernelArg::I32(int("cols", cols)?),
    ];
    gpu.launch(&name, grid(rows)?, (THREADS, 1, 1), 0, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_only_decode_shapes_of_16_bit_types() {
        assert!(fits(DType::BF16, 1, 4096, &[0, 4096]));
        assert!(fits(DType::F16, 8, 64, &[256]));
        assert!(!fits(DType::F32, 1, 4096, &[0]));
        assert!(!fits(DType::BF16, 9, 4096, &[0]));
        assert!(!fits(DType::BF16, 0, 4096, &[0]));
        assert!(!fits(DType::BF16, 1, 4100, &[0]));
        assert!(!fits(DType::BF16, 1, 4096, &[8]));
    }

    #[test]
    fn variants_round_up_to_powers_of_two() {
        assert_eq!([1, 2, 3, 5, 8].map(nb), [1, 2, 4, 8, 8]);
    }
}
