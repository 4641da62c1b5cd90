//! RMSNorm kernels.

use rayon::prelude::*;

/// `out = x / sqrt(mean(x²) + eps) * weight` for each row of `weight.len()` features.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, row)| norm_row(row, weight, eps, o));
}

/// `residual += x; out = rms_norm(residual)`.
pub fn add_rms_norm(x: &[f32], residual: &mut [f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d).zip(residual.par_chunks_mut(d)).zip(x.par_chunks(d)).for_each(|((o, r), xr)| {
        for (ri, xi) in r.iter_mut().zip(xr) {
            *ri += xi;
        }
        norm_row(r, weight, eps, o);
    });
}

fn norm_row(row: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / row.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
        *o = v * inv * w;
    }
}
