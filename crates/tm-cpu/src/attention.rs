//! Causal paged attention over the block table (prefill chunks and decode alike).

use rayon::prelude::*;
use tm_core::fp8::{self, E4M3};
use tm_core::ops::AttentionMeta;

/// An element of a KV cache the CPU reads: f32, or FP8 E4M3 decoded exactly on the fly.
pub trait KvElem: Copy + Send + Sync {
    /// The element's value.
    fn value(self) -> f32;
}

impl KvElem for f32 {
    #[inline]
    fn value(self) -> f32 {
        self
    }
}

impl KvElem for E4M3 {
    #[inline]
    fn value(self) -> f32 {
        fp8::decode(self.0)
    }
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

/// `out[t, h] = softmax(q[t, h] · K^T * scale) V` over the sequence's cached positions up to
/// and including the token's own. `k_cache`/`v_cache` are `[blocks, block_size, kv_heads,
/// head_dim]` of f32 or E4M3 elements.
pub fn paged_attention<E: KvElem>(
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    meta: &AttentionMeta<'_>,
    dims: AttnDims,
    out: &mut [f32],
) {
    let AttnDims { heads, kv_heads, head_dim } = dims;
    let group = heads / kv_heads;
    let bs = meta.block_size;
    // token index → (sequence, position)
    let mut owners = vec![(0usize, 0usize); q.len() / (heads * head_dim)];
    for (s, seq) in meta.seqs.iter().enumerate() {
        let first_pos = seq.context_len - seq.query_len;
        for i in 0..seq.query_len {
            owners[seq.query_start + i] = (s, first_pos + i);
        }
    }
    out.par_chunks_mut(head_dim).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
        let (t, h) = (idx / heads, idx % heads);
        let (s, pos) = owners[t];
        let seq = &meta.seqs[s];
        let kvh = h / group;
        let qv = &q[idx * head_dim..(idx + 1) * head_dim];
        let start = meta.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let offset = |j: usize| {
            let slot = seq.block_table[j / bs] as usize * bs + j % bs;
            (slot * kv_heads + kvh) * head_dim
        };
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for j in start..=pos {
            let k = &k_cache[offset(j)..offset(j) + head_dim];
            let dot = dot(qv, k) * meta.scale;
            max = max.max(dot);
            scores.push(dot);
        }
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        o.fill(0.0);
        for (j, &p) in (start..=pos).zip(scores.iter()) {
            let v = &v_cache[offset(j)..offset(j) + head_dim];
            let w = p / sum;
            for (oi, &vi) in o.iter_mut().zip(v) {
                *oi += w * vi.value();
            }
        }
    });
}

/// Dot product in eight independent lanes, so the compiler vectorizes it (a plain `sum` of a
/// float iterator must keep its order and stays scalar).
fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y.value()).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].value();
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_matches_the_plain_sum() {
        for n in [1usize, 7, 8, 9, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((super::dot(&a, &b) - plain).abs() < 1e-5, "n = {n}");
        }
    }
}
