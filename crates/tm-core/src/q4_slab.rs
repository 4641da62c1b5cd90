//! Large-batch int4 products by slabs: the policy and arithmetic shared by the GPU backend that
//! runs them and the memory plan that charges their scratch.
//!
//! At `n` tokens an int4 product does `2 n` flops per weight element against half a byte read, so
//! for large `n` it is compute-bound and dequantizing the weights costs little next to the
//! product. A backend then dequantizes a *slab* of weight rows `[r0, r0 + R)` into a fixed
//! scratch buffer of [`SLAB_BYTES`] and multiplies it with a dense GEMM (cuBLASLt on CUDA),
//! writing `out[:, r0..r0 + R]` in place, slab after slab. The scratch is allocated once when
//! the workspace is (`Ops::reserve_matmul_scratch`): at most [`SLAB_BYTES`] of dequantized
//! weights exist at any time (one slab of one matrix, the whole matrix when it fits), never a
//! dequantized copy of the model.
//!
//! Environment:
//! - `TM_Q4_SLAB=0` (or `off`) turns the slab path off (no scratch is reserved either);
//! - `TM_Q4_SLAB_MIN_M=<tokens>` sets the smallest batch that takes it (default
//!   [`DEFAULT_MIN_TOKENS`]); smaller batches use the fused int4 kernels.

use std::sync::OnceLock;

/// Bytes of the slab scratch buffer: 64 MiB holds 8192 rows of a 4096-column matrix or 2340 of
/// a 14336-column one in f16/bf16, so every Llama-3-8B matrix takes at most two slabs and each
/// slab GEMM is still several waves of tiles.
pub const SLAB_BYTES: usize = 64 << 20;

/// Slab row counts are multiples of this (keeps every slab's output offset 256-byte aligned for
/// 2-byte elements and the GEMM's `rows` a multiple of its tiles).
pub const SLAB_ROW_ALIGN: usize = 128;

/// Default smallest batch (tokens) for the slab path. Next to cuBLAS on dense bf16 weights
/// (which reads 2 bytes per weight element itself) the slab path adds only the dequantization:
/// 2.5 bytes per element (read 0.5, write 2) against the GEMM's `2 n` flops. On an H200 (4.3 TB/s,
/// ~700 dense bf16 TFLOP/s achieved) that is about `290 / n` of the GEMM's time once it is
/// compute-bound: ~78% of cuBLAS at 512 tokens and ~90% at 2048, against 35-40% for the fused
/// mma.sync kernel; at 256 tokens (cuBLAS half memory-bound) the estimate is ~56%, close to the
/// fused kernel's. 512 leaves a margin; compare `slab %` with `best %` in `q4_gemm_bench` and
/// tune with `TM_Q4_SLAB_MIN_M`. On sm_90 the fused kernel uses wgmma (66-76% of cuBLAS from
/// 1024 tokens): there it is faster than slabs at 512 tokens, about even at 1024, slower from
/// 2048 (measured, H200).
pub const DEFAULT_MIN_TOKENS: usize = 512;

/// Whether and from which batch size the slab path is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabPolicy {
    /// The path is on (`TM_Q4_SLAB` is not `0`/`off`).
    pub enabled: bool,
    /// Smallest number of tokens that takes it.
    pub min_tokens: usize,
}

impl Default for SlabPolicy {
    fn default() -> Self {
        SlabPolicy { enabled: true, min_tokens: DEFAULT_MIN_TOKENS }
    }
}

impl SlabPolicy {
    /// Parses `TM_Q4_SLAB` and `TM_Q4_SLAB_MIN_M` values (`None`: unset).
    pub fn parse(slab: Option<&str>, min_m: Option<&str>) -> std::result::Result<SlabPolicy, String> {
        let enabled = match slab.map(|s| s.trim().to_ascii_lowercase()) {
            None => true,
            Some(s) if s.is_empty() || s == "1" || s == "on" || s == "auto" => true,
            Some(s) if s == "0" || s == "off" => false,
            Some(s) => return Err(format!("TM_Q4_SLAB = {s:?} is not one of 0, off, 1, on, auto")),
        };
        let min_tokens = match min_m.map(str::trim).filter(|s| !s.is_empty()) {
            None => DEFAULT_MIN_TOKENS,
            Some(s) => match s.parse::<usize>() {
                Ok(v) if v >= 1 => v,
                _ => return Err(format!("TM_Q4_SLAB_MIN_M = {s:?} is not a positive number of tokens")),
            },
        };
        Ok(SlabPolicy { enabled, min_tokens })
    }

    /// The process's policy from the environment (read once; a bad value is reported once on
    /// stderr and the default used).
    pub fn from_env() -> SlabPolicy {
        static POLICY: OnceLock<SlabPolicy> = OnceLock::new();
        *POLICY.get_or_init(|| {
            let (a, b) = (std::env::var("TM_Q4_SLAB").ok(), std::env::var("TM_Q4_SLAB_MIN_M").ok());
            SlabPolicy::parse(a.as_deref(), b.as_deref()).unwrap_or_else(|e| {
                eprintln!("warning: {e}; using the default int4 slab policy");
                SlabPolicy::default()
            })
        })
    }

    /// Whether a step of up to `max_tokens` tokens can take the path (so its scratch is needed).
    pub fn wants_scratch(&self, max_tokens: usize) -> bool {
        self.enabled && max_tokens >= self.min_tokens
    }

    /// Whether a product over `n` tokens takes the path.
    pub fn takes(&self, n: usize) -> bool {
        self.enabled && n >= self.min_tokens
    }
}

/// Rows per slab for a `[rows, cols]` matrix dequantized to `elem_bytes`-byte elements in
/// `budget` bytes: the rows split into the fewest slabs that fit, evened out and rounded up to
/// [`SLAB_ROW_ALIGN`] (never above what fits). `None` when not even [`SLAB_ROW_ALIGN`] rows fit
/// (or a size is zero).
pub fn slab_rows(rows: usize, cols: usize, elem_bytes: usize, budget: usize) -> Option<usize> {
    let row_bytes = cols.checked_mul(elem_bytes)?;
    if rows == 0 || row_bytes == 0 {
        return None;
    }
    let fit = budget / row_bytes / SLAB_ROW_ALIGN * SLAB_ROW_ALIGN;
    if fit == 0 {
        return None;
    }
    let count = rows.div_ceil(fit);
    Some(rows.div_ceil(count).next_multiple_of(SLAB_ROW_ALIGN).min(fit))
}

/// The slabs `(first row, row count)` covering `rows` rows `per_slab` at a time (the last one
/// shorter when `per_slab` does not divide `rows`).
pub fn slabs(rows: usize, per_slab: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = per_slab.max(1);
    (0..rows).step_by(step).map(move |r0| (r0, step.min(rows - r0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_from_text() {
        assert_eq!(SlabPolicy::parse(None, None), Ok(SlabPolicy::default()));
        assert_eq!(SlabPolicy::parse(Some("0"), None).map(|p| p.enabled), Ok(false));
        assert_eq!(SlabPolicy::parse(Some(" OFF "), None).map(|p| p.enabled), Ok(false));
        assert_eq!(SlabPolicy::parse(Some("1"), Some("1024")), Ok(SlabPolicy { enabled: true, min_tokens: 1024 }));
        assert!(SlabPolicy::parse(Some("maybe"), None).is_err());
        assert!(SlabPolicy::parse(None, Some("0")).is_err());
        assert!(SlabPolicy::parse(None, Some("-3")).is_err());
        let p = SlabPolicy { enabled: true, min_tokens: 512 };
        assert!(p.takes(512) && !p.takes(511) && p.wants_scratch(4096) && !p.wants_scratch(100));
        let off = SlabPolicy { enabled: false, ..p };
        assert!(!off.takes(8192) && !off.wants_scratch(8192));
    }

    #[test]
    fn slab_rows_fit_the_budget_and_split_evenly() {
        // Llama-3-8B in bf16 with the default budget: q/o/gate/up (4096 columns) whole or in
        // two even slabs, down (14336 columns) in two slabs of 2048.
        assert_eq!(slab_rows(4096, 4096, 2, SLAB_BYTES), Some(4096));
        assert_eq!(slab_rows(14336, 4096, 2, SLAB_BYTES), Some(7168));
        assert_eq!(slab_rows(4096, 14336, 2, SLAB_BYTES), Some(2048));
        // 1 MiB of 4096-column bf16 rows: 128 rows.
        assert_eq!(slab_rows(1000, 4096, 2, 1 << 20), Some(128));
        // Too wide for one aligned group of rows, and degenerate sizes.
        assert_eq!(slab_rows(1000, 8192, 2, 1 << 20), None);
        assert_eq!(slab_rows(0, 4096, 2, SLAB_BYTES), None);
        assert_eq!(slab_rows(8, 0, 2, SLAB_BYTES), None);
        for rows in [1, 8, 127, 128, 129, 1000, 4097, 14336, 28672, 152064] {
            for cols in [64, 576, 4096, 8192, 14336, 29568] {
                for budget in [1 << 20, 8 << 20, SLAB_BYTES] {
                    let Some(r) = slab_rows(rows, cols, 2, budget) else { continue };
                    assert!(r * cols * 2 <= budget, "{rows}x{cols} in {budget}: {r} rows");
                    assert!(r.is_multiple_of(SLAB_ROW_ALIGN) && r > 0);
                    // No more slabs than the fewest that fit.
                    let fit = budget / (cols * 2) / SLAB_ROW_ALIGN * SLAB_ROW_ALIGN;
                    assert_eq!(rows.div_ceil(r), rows.div_ceil(fit), "{rows}x{cols} in {budget}");
                }
            }
        }
    }

    #[test]
    fn slabs_cover_every_row_once() {
        assert_eq!(slabs(300, 128).collect::<Vec<_>>(), vec![(0, 128), (128, 128), (256, 44)]);
        assert_eq!(slabs(256, 128).collect::<Vec<_>>(), vec![(0, 128), (128, 128)]);
        assert_eq!(slabs(5, 128).collect::<Vec<_>>(), vec![(0, 5)]);
        assert_eq!(slabs(0, 128).count(), 0);
        for (rows, per) in [(1, 1), (4097, 2048), (14336, 7168), (1000, 384)] {
            let mut next = 0;
            for (r0, len) in slabs(rows, per) {
                assert_eq!(r0, next);
                assert!(len >= 1 && len <= per);
                next = r0 + len;
            }
            assert_eq!(next, rows);
        }
    }
}
