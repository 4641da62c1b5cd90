//! Rotary position embedding.

use rayon::prelude::*;
use tm_core::rope::{RopeFreqs, RopeStyle};

/// Rotates every head of `x: [tokens, heads * head_dim]` by its token's position.
pub fn rope(x: &mut [f32], head_dim: usize, positions: &[u32], freqs: &RopeFreqs) {
    let half = freqs.inv_freq.len();
    let row = x.len() / positions.len().max(1);
    x.par_chunks_mut(row).zip(positions.par_iter()).for_each(|(tok, &pos)| {
        for (i, &f) in freqs.inv_freq.iter().enumerate() {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            let (sin, cos) = (sin * freqs.attention_factor, cos * freqs.attention_factor);
            let (a, b) = match freqs.style {
                RopeStyle::Half => (i, i + half),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            for head in tok.chunks_mut(head_dim) {
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * cos - x2 * sin;
                head[b] = x2 * cos + x1 * sin;
            }
        }
    });
}
