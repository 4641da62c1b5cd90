//! f32 matrix products on faer that leave the CPU's SIMD state clean behind them.
//!
//! faer's kernels (the `gemm` crate) use 512-bit registers on CPUs that have them and leave the
//! upper halves of the vector registers marked in use on every thread that ran one (a
//! `vzeroupper` after them is what undoes the slowdown below). Until something clears them, each
//! SSE instruction of ordinary (non-VEX) code on that thread pays for a merge with the stale upper
//! halves: measured here (a 2-core Xeon with AVX-512), libm's `expf` took ~49 ns a call instead
//! of ~1.9 and the per-head attention loop 6x as long after a faer product,
//! and a dense 135M model's 512-token prefill spent 38% of its time in `expf` and 6% in the
//! products. Every faer product in tm goes through this module, which clears the state (one
//! `vzeroupper`) on each thread that may have run faer's kernels.

use faer::{Accum, MatMut, MatRef, Par};

/// `dst = lhs · rhs` (or `dst += lhs · rhs` with [`Accum::Add`]) over rayon's current pool:
/// `dst`'s columns in a few chunks per thread, each chunk's product on one thread
/// ([`matmul_here`], which then clears that thread's state), so no thread is left unclean.
pub fn matmul_pooled(dst: MatMut<'_, f32>, accum: Accum, lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) {
    use rayon::prelude::*;
    let chunks = rayon::current_num_threads() * CHUNKS_PER_THREAD;
    let chunk = dst.ncols().div_ceil(chunks).next_multiple_of(MIN_CHUNK_COLS / 4).max(MIN_CHUNK_COLS);
    dst.par_col_chunks_mut(chunk).zip(rhs.par_col_chunks(chunk)).for_each(|(d, r)| matmul_here(d, accum, lhs, r));
}

/// Chunks of a pooled product's columns per thread (so that uneven chunks even out).
const CHUNKS_PER_THREAD: usize = 4;
/// The fewest columns a pooled product's chunk has.
const MIN_CHUNK_COLS: usize = 64;

/// `dst = lhs · rhs` (or `dst += lhs · rhs`) on the calling thread alone, which then clears its
/// upper SIMD state.
pub fn matmul_here(dst: MatMut<'_, f32>, accum: Accum, lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) {
    faer::linalg::matmul::matmul(dst, accum, lhs, rhs, 1.0f32, Par::Seq);
    clear_upper_simd_state();
}

/// Whether this CPU has vector registers with upper halves to clear (AVX).
fn needs_clearing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `vzeroupper` on this thread, where the CPU has AVX; nothing elsewhere.
pub fn clear_upper_simd_state() {
    #[cfg(target_arch = "x86_64")]
    if needs_clearing() {
        // SAFETY: the CPU has AVX, which `zeroupper` requires.
        unsafe { zeroupper() }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn zeroupper() {
    std::arch::x86_64::_mm256_zeroupper();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lhs · rhs` by the definition, in f64.
    fn naive(lhs: &[f32], rhs: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k).map(|p| lhs[i * k + p] as f64 * rhs[p * m + j] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn pooled_and_local_products_match_the_definition() {
        // one row (decode), column counts around the chunking, and a prefill-sized product
        for (n, k, m) in [(1, 64, 1), (1, 576, 1536), (3, 17, 65), (5, 64, 64 * 9 + 1), (130, 96, 200)] {
            let lhs: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            let rhs: Vec<f32> = (0..k * m).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
            let want = naive(&lhs, &rhs, n, k, m);
            let (l, r) = (MatRef::from_row_major_slice(&lhs, n, k), MatRef::from_row_major_slice(&rhs, k, m));
            for pooled in [true, false] {
                // `Accum::Add` onto ones: the product plus one
                let mut out = vec![1f32; n * m];
                let dst = MatMut::from_row_major_slice_mut(&mut out, n, m);
                if pooled {
                    matmul_pooled(dst, Accum::Add, l, r);
                } else {
                    matmul_here(dst, Accum::Add, l, r);
                }
                for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (o - 1.0 - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "{n}x{k}x{m} pooled {pooled}, element {i}: {o} - 1 against {w}"
                    );
                }
            }
        }
    }
}
