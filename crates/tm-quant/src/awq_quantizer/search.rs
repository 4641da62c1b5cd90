//! The two searches of AWQ: the per-channel scale of a group of linears, and the clipping range
//! of each group of weights.

use super::{pseudo_quantize, InputStats, Matrix, GRID, MAX_SHRINK};
use rayon::prelude::*;
use tm_core::{Error, Result};

/// The outcome of [`search_scales`].
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleSearch {
    /// The chosen scale per input channel (all ones when plain RTN won).
    pub scales: Vec<f32>,
    /// The chosen exponent α, or `None` when the unscaled weights (RTN) won.
    pub alpha: Option<f32>,
    /// The output error with the chosen scales (mean over outputs and tokens).
    pub loss: f64,
    /// The output error of plain round-to-nearest (`s = 1`), for comparison.
    pub rtn_loss: f64,
}

/// Mean over the output rows of all `linears` of `|w|` relative to the max `|w|` of its group
/// (AutoAWQ's `w_mean`).
fn weight_mean(linears: &[&Matrix], group_size: usize) -> Vec<f32> {
    let cols = linears[0].cols;
    let mut sum = vec![0f64; cols];
    let mut rows = 0usize;
    for w in linears {
        for r in 0..w.rows {
            for (g, grp) in w.row(r).chunks_exact(group_size).enumerate() {
                let m = grp.iter().fold(0f32, |m, v| m.max(v.abs())) + 1e-6;
                for (i, v) in grp.iter().enumerate() {
                    sum[g * group_size + i] += (v.abs() / m) as f64;
                }
            }
        }
        rows += w.rows;
    }
    sum.iter().map(|s| (s / rows.max(1) as f64) as f32).collect()
}

/// The output error of `linears` quantized after multiplying their columns by `s` (`None`: as
/// they are), with inputs divided by `s`: `Σ |X (Q(W s)/s - W)ᵀ|²`, averaged over tokens and
/// outputs.
fn scaled_loss(linears: &[&Matrix], stats: &InputStats, s: Option<&[f32]>, group_size: usize) -> f64 {
    let inv: Option<Vec<f32>> = s.map(|s| s.iter().map(|v| 1.0 / v).collect());
    let mut total = 0f64;
    let mut outputs = 0usize;
    for w in linears {
        let mut e = (*w).clone();
        if let Some(s) = s {
            e.mul_cols(s);
        }
        pseudo_quantize(&mut e.data, group_size);
        if let Some(inv) = &inv {
            e.mul_cols(inv);
        }
        e.data.iter_mut().zip(&w.data).for_each(|(q, w)| *q -= w);
        total += stats.output_error(&e);
        outputs += w.rows;
    }
    total / outputs.max(1) as f64
}

/// The candidate scales for exponent `alpha`: `x̄^α / (w̄^(1-α) + 1e-4)`, at least `1e-4`,
/// normalised to `sqrt(max · min) = 1`, non-finite values replaced by 1.
fn candidate(x_mean: &[f32], w_mean: &[f32], alpha: f32) -> Vec<f32> {
    let mut s: Vec<f32> =
        x_mean.iter().zip(w_mean).map(|(x, w)| (x.powf(alpha) / (w.powf(1.0 - alpha) + 1e-4)).max(1e-4)).collect();
    let (lo, hi) = s.iter().fold((f32::MAX, 0f32), |(l, h), v| (l.min(*v), h.max(*v)));
    let norm = (hi * lo).sqrt();
    s.iter_mut().for_each(|v| {
        *v /= norm;
        if !v.is_finite() {
            *v = 1.0;
        }
    });
    s
}

/// Searches the scale of a group of linears that read the same input (see the module docs of
/// [`crate::awq_quantizer`]). Every linear must have `stats.channels` columns, a multiple of
/// `group_size`.
pub fn search_scales(linears: &[&Matrix], stats: &InputStats, group_size: usize) -> Result<ScaleSearch> {
    let c = stats.channels;
    if linears.is_empty() || linears.iter().any(|w| w.cols != c) || !c.is_multiple_of(group_size.max(1)) {
        return Err(Error::invalid(format!(
            "scale search: every linear needs {c} inputs (the statistics' channels), a multiple of the group size {group_size}"
        )));
    }
    if stats.tokens == 0 {
        return Err(Error::invalid("scale search without calibration tokens"));
    }
    let x_mean = stats.mean_abs();
    let w_mean = weight_mean(linears, group_size);
    let rtn_loss = scaled_loss(linears, stats, None, group_size);
    let mut best = ScaleSearch { scales: vec![1.0; c], alpha: None, loss: rtn_loss, rtn_loss };
    for i in 0..GRID {
        let alpha = i as f32 / GRID as f32;
        let s = candidate(&x_mean, &w_mean, alpha);
        let loss = scaled_loss(linears, stats, Some(&s), group_size);
        if loss < best.loss {
            best = ScaleSearch { scales: s, alpha: Some(alpha), loss, rtn_loss };
        }
    }
    Ok(best)
}

/// Searches, for every row and group of `w`, the clamp `±max` that minimises the squared error
/// of the quantized partial products over the inputs `stats` describes. Returns the chosen
/// `max` per `[row, group]`, row-major.
pub fn search_clip(w: &Matrix, stats: &InputStats, group_size: usize) -> Result<Vec<f32>> {
    if w.cols != stats.channels || group_size == 0 || !w.cols.is_multiple_of(group_size) {
        return Err(Error::invalid(format!(
            "clip search: {} inputs with statistics of {} channels and groups of {group_size}",
            w.cols, stats.channels
        )));
    }
    let groups = w.cols / group_size;
    let steps = (MAX_SHRINK * GRID as f32) as usize;
    let mut best = vec![0f32; w.rows * groups];
    best.par_chunks_mut(groups).enumerate().for_each(|(r, best_row)| {
        let mut cur = vec![0f32; group_size];
        for (g, grp) in w.row(r).chunks_exact(group_size).enumerate() {
            let max0 = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (mut best_err, mut best_max) = (f64::INFINITY, max0);
            for i in 0..steps {
                let m = max0 * (1.0 - i as f32 / GRID as f32);
                cur.iter_mut().zip(grp).for_each(|(c, v)| *c = v.clamp(-m, m));
                pseudo_quantize(&mut cur, group_size);
                cur.iter_mut().zip(grp).for_each(|(c, v)| *c -= v);
                let err = stats.block_error(&cur, g * group_size);
                if err < best_err {
                    (best_err, best_max) = (err, m);
                }
            }
            best_row[g] = best_max;
        }
    });
    Ok(best)
}

/// Clamps each group of `w` to `±max` (from [`search_clip`]).
pub fn apply_clip(w: &mut Matrix, max: &[f32], group_size: usize) {
    let groups = w.cols / group_size;
    for (r, row) in w.data.chunks_exact_mut(w.cols).enumerate() {
        for (g, grp) in row.chunks_exact_mut(group_size).enumerate() {
            let m = max[r * groups + g];
            grp.iter_mut().for_each(|v| *v = v.clamp(-m, m));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of values in [-1, 1).
    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Inputs where a few channels are 40x larger than the rest (the activation outliers LLMs
    /// have and AWQ is built for), and weights of the usual uniform spread.
    fn outlier_case() -> (Matrix, Vec<f32>, usize) {
        let (tokens, cin, cout) = (256, 128, 64);
        let mut x = noise(tokens * cin, 7);
        for t in 0..tokens {
            for c in [3, 40, 77, 100] {
                x[t * cin + c] *= 40.0;
            }
        }
        (Matrix::new(cout, cin, noise(cout * cin, 11)).unwrap(), x, tokens)
    }

    /// The squared output error of `wq` against `w` on the tokens `x`, computed product by
    /// product (independently of the Gram matrix the search uses).
    fn direct_error(w: &Matrix, wq: &[f32], x: &[f32], tokens: usize) -> f64 {
        let mut total = 0f64;
        for t in 0..tokens {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            for o in 0..w.rows {
                let d: f64 = (0..w.cols).map(|i| xt[i] as f64 * (wq[o * w.cols + i] - w.row(o)[i]) as f64).sum();
                total += d * d;
            }
        }
        total / (tokens * w.rows) as f64
    }

    #[test]
    fn awq_scales_beat_round_to_nearest_on_outlier_channels() {
        let (w, x, tokens) = outlier_case();
        let mut stats = InputStats::new(w.cols);
        stats.add_rows(&x, tokens).unwrap();
        let found = search_scales(&[&w], &stats, 32).unwrap();
        let alpha = found.alpha.expect("scaling must win over RTN here");
        // The outlier channels get the largest scales.
        let mut order: Vec<usize> = (0..w.cols).collect();
        order.sort_by(|a, b| found.scales[*b].total_cmp(&found.scales[*a]));
        let mut top = order[..4].to_vec();
        top.sort_unstable();
        assert_eq!(top, [3, 40, 77, 100], "scales {:?}", found.scales);

        // Measured independently: quantize W·s, divide by s, multiply the real tokens.
        let mut rtn = w.data.clone();
        pseudo_quantize(&mut rtn, 32);
        let mut awq = w.clone();
        awq.mul_cols(&found.scales);
        pseudo_quantize(&mut awq.data, 32);
        awq.mul_cols(&found.scales.iter().map(|s| 1.0 / s).collect::<Vec<_>>());
        let (e_rtn, e_awq) = (direct_error(&w, &rtn, &x, tokens), direct_error(&w, &awq.data, &x, tokens));
        eprintln!("alpha {alpha}: output MSE {e_awq:.4e} (AWQ) vs {e_rtn:.4e} (RTN)");
        assert!((found.rtn_loss - e_rtn).abs() <= 1e-3 * e_rtn, "{} vs {e_rtn}", found.rtn_loss);
        assert!((found.loss - e_awq).abs() <= 1e-3 * e_awq, "{} vs {e_awq}", found.loss);
        assert!(e_awq < 0.6 * e_rtn, "AWQ {e_awq} is not clearly below RTN {e_rtn}");
    }

    #[test]
    fn uniform_inputs_keep_rtn_or_better() {
        let (w, _, _) = outlier_case();
        let x = noise(256 * w.cols, 5);
        let mut stats = InputStats::new(w.cols);
        stats.add_rows(&x, 256).unwrap();
        let found = search_scales(&[&w], &stats, 32).unwrap();
        assert!(found.loss <= found.rtn_loss);
        assert!(search_scales(&[&w], &InputStats::new(w.cols), 32).is_err());
        assert!(search_scales(&[&w], &InputStats::new(64), 32).is_err());
    }

    #[test]
    fn clipping_lowers_the_error_of_heavy_tailed_groups() {
        // Heavy-tailed weights (cubes of uniform noise: most near zero, a few near ±1), where
        // clipping the rare large ones buys a finer grid for the many small ones.
        let (mut w, x, tokens) = outlier_case();
        w.data.iter_mut().for_each(|v| *v = v.powi(3));
        let mut stats = InputStats::new(w.cols);
        stats.add_rows(&x, tokens).unwrap();
        let max = search_clip(&w, &stats, 32).unwrap();
        let mut clipped = w.clone();
        apply_clip(&mut clipped, &max, 32);
        assert!(clipped.data.iter().zip(&w.data).all(|(c, v)| c.abs() <= v.abs()));
        let shrunk = max.iter().enumerate().filter(|(i, m)| {
            let (r, g) = (i / 4, i % 4);
            let max0 = w.row(r)[32 * g..32 * (g + 1)].iter().fold(0f32, |a, v| a.max(v.abs()));
            **m < max0
        });
        let shrunk = shrunk.count();
        eprintln!("{shrunk} of {} groups clipped", max.len());
        assert!(shrunk > max.len() / 4, "only {shrunk} groups clipped");
        let mut plain = w.data.clone();
        pseudo_quantize(&mut plain, 32);
        pseudo_quantize(&mut clipped.data, 32);
        let (e_plain, e_clip) = (direct_error(&w, &plain, &x, tokens), direct_error(&w, &clipped.data, &x, tokens));
        eprintln!("clipping: output MSE {e_clip:.4e} vs {e_plain:.4e} unclipped");
        assert!(e_clip < e_plain);
        assert!(search_clip(&w, &InputStats::new(64), 32).is_err());
    }
}
