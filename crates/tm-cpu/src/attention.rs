//! Causal paged attention over the block table (prefill chunks and decode alike).

use rayon::prelude::*;
use tm_core::ops::AttentionMeta;

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
/// head_dim]`.
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
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
            let dot: f32 = qv.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * meta.scale;
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
            for (oi, vi) in o.iter_mut().zip(v) {
                *oi += w * vi;
            }
        }
    });
}
