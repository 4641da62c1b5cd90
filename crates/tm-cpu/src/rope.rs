//! Rotary position embedding.

use rayon::prelude::*;
use tm_core::rope::{RopeFreqs, RopeStyle};

/// Rotates every head of `x: [tokens, heads * head_dim]` by its token's position.
pub fn rope(x: &mut [f32], head_dim: usize, positions: &[u32], freqs: &RopeFreqs) {
    let half = freqs.inv_freq.len();
    let row = x.len() / positions.len().max(1);
    x.par_chunks_mut(row).zip(positions.par_iter()).for_each(|(tok, &pos)| {
        let (cos, sin): (Vec<f32>, Vec<f32>) = freqs
            .inv_freq
            .iter()
            .map(|&f| {
                let a = pos as f32 * f;
                (a.cos() * freqs.attention_factor, a.sin() * freqs.attention_factor)
            })
            .unzip();
        for head in tok.chunks_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match freqs.style {
                    RopeStyle::Half => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * cos[i] - x2 * sin[i];
                head[b] = x2 * cos[i] + x1 * sin[i];
            }
        }
    });
}
