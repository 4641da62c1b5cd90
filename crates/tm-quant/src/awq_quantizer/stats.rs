//! Calibration statistics of one linear layer's input: what the AWQ searches need of it.

use super::Matrix;
use faer::{Accum, MatMut, MatRef};
use tm_core::{Error, Result};

/// The statistics of the inputs `x_t` (`t` over calibration tokens) of a linear layer with
/// `channels` inputs: the token count, `Σ_t |x_t|` per channel and the Gram matrix
/// `G = Σ_t x_tᵀ x_t` (`[channels, channels]`, f32).
///
/// For any weight error `E` (`[out, channels]`), the squared error of the outputs over the
/// calibration tokens is `|X Eᵀ|² = Σ_rows e G eᵀ` ([`InputStats::output_error`]), and that of
/// the partial products of one group of inputs uses the diagonal block of `G`
/// ([`InputStats::block_error`]), so no token needs to be kept.
#[derive(Clone, Debug, PartialEq)]
pub struct InputStats {
    /// Input channels.
    pub channels: usize,
    /// Calibration tokens seen.
    pub tokens: u64,
    /// `Σ_t |x_t[c]|` per channel.
    pub abs_sum: Vec<f64>,
    /// `G[i][j] = Σ_t x_t[i] x_t[j]`, row-major.
    pub gram: Vec<f32>,
}

impl InputStats {
    /// Empty statistics for `channels` inputs (allocates `channels²` floats).
    pub fn new(channels: usize) -> InputStats {
        InputStats { channels, tokens: 0, abs_sum: vec![0.0; channels], gram: vec![0.0; channels * channels] }
    }

    /// Bytes that statistics of `channels` inputs take.
    pub fn bytes_for(channels: usize) -> u64 {
        (channels * channels * 4 + channels * 8) as u64
    }

    /// Adds `rows` tokens of input (row-major `[rows, channels]`).
    pub fn add_rows(&mut self, x: &[f32], rows: usize) -> Result<()> {
        let c = self.channels;
        if x.len() != rows * c {
            return Err(Error::shape(format!("calibration input [{rows}, {c}]"), rows * c, x.len()));
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(format!(
                "calibration input of token {}, channel {} is {} (the float model overflows?)",
                i / c,
                i % c,
                x[i]
            )));
        }
        for row in x.chunks_exact(c) {
            self.abs_sum.iter_mut().zip(row).for_each(|(a, v)| *a += v.abs() as f64);
        }
        let xm = MatRef::from_row_major_slice(x, rows, c);
        let g = MatMut::from_row_major_slice_mut(&mut self.gram, c, c);
        crate::f32_products::matmul_pooled(g, Accum::Add, xm.transpose(), xm);
        self.tokens += rows as u64;
        Ok(())
    }

    /// Mean `|x|` per channel (zeros before any token).
    pub fn mean_abs(&self) -> Vec<f32> {
        let n = self.tokens.max(1) as f64;
        self.abs_sum.iter().map(|a| (a / n) as f32).collect()
    }

    /// The statistics of the inputs divided by `s` per channel (`x / s`, what a linear whose
    /// weight columns were multiplied by `s` sees).
    pub fn scaled(&self, s: &[f32]) -> InputStats {
        let c = self.channels;
        let mut gram = self.gram.clone();
        for (i, row) in gram.chunks_exact_mut(c).enumerate() {
            row.iter_mut().zip(s).for_each(|(g, sj)| *g /= s[i] * sj);
        }
        let abs_sum = self.abs_sum.iter().zip(s).map(|(a, s)| a / *s as f64).collect();
        InputStats { channels: c, tokens: self.tokens, abs_sum, gram }
    }

    /// `Σ_rows e G eᵀ / tokens` for a weight error `e` (`[out, channels]`): the squared output
    /// error summed over outputs, averaged over tokens.
    pub fn output_error(&self, e: &Matrix) -> f64 {
        let c = self.channels;
        let mut eg = vec![0f32; e.rows * c];
        let em = MatRef::from_row_major_slice(&e.data, e.rows, c);
        let gm = MatRef::from_row_major_slice(&self.gram, c, c);
        let dst = MatMut::from_row_major_slice_mut(&mut eg, e.rows, c);
        crate::f32_products::matmul_pooled(dst, Accum::Replace, em, gm);
        let total: f64 = eg.iter().zip(&e.data).map(|(a, b)| *a as f64 * *b as f64).sum();
        total / self.tokens.max(1) as f64
    }

    /// `e G[r, r] eᵀ / tokens` for the error `e` of the inputs `r = start .. start + e.len()`:
    /// the squared error of the partial products over those inputs, averaged over tokens.
    pub fn block_error(&self, e: &[f32], start: usize) -> f64 {
        let c = self.channels;
        let mut total = 0f64;
        for (i, &ei) in e.iter().enumerate() {
            let g = &self.gram[(start + i) * c + start..(start + i) * c + start + e.len()];
            let dot: f32 = g.iter().zip(e).map(|(g, ej)| g * ej).sum();
            total += ei as f64 * dot as f64;
        }
        total / self.tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Gram-matrix errors equal the errors of the products computed token by token.
    #[test]
    fn gram_errors_match_direct_products() {
        let (tokens, c, out) = (37, 8, 3);
        let x: Vec<f32> = (0..tokens * c).map(|i| ((i * 7919 % 97) as f32 - 48.0) / 17.0).collect();
        let e: Vec<f32> = (0..out * c).map(|i| ((i * 31 % 13) as f32 - 6.0) / 5.0).collect();
        let mut st = InputStats::new(c);
        st.add_rows(&x[..10 * c], 10).unwrap();
        st.add_rows(&x[10 * c..], tokens - 10).unwrap();
        assert_eq!(st.tokens, tokens as u64);
        let mut direct = 0f64;
        let mut block = 0f64;
        for t in 0..tokens {
            let xt = &x[t * c..(t + 1) * c];
            for o in 0..out {
                let y: f64 = (0..c).map(|i| xt[i] as f64 * e[o * c + i] as f64).sum();
                direct += y * y;
            }
            let yb: f64 = (2..6).map(|i| xt[i] as f64 * e[i] as f64).sum();
            block += yb * yb;
        }
        let em = Matrix::new(out, c, e.clone()).unwrap();
        let got = st.output_error(&em);
        assert!((got - direct / tokens as f64).abs() <= 1e-4 * got.abs(), "{got} vs {}", direct / tokens as f64);
        let got_b = st.block_error(&e[2..6], 2);
        assert!((got_b - block / tokens as f64).abs() <= 1e-4 * got_b.abs(), "{got_b}");
        // Scaling: the statistics of x / s are those of the divided inputs.
        let s: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.25).collect();
        let xs: Vec<f32> = x.iter().enumerate().map(|(i, v)| v / s[i % c]).collect();
        let mut st2 = InputStats::new(c);
        st2.add_rows(&xs, tokens).unwrap();
        let sc = st.scaled(&s);
        for (a, b) in sc.gram.iter().zip(&st2.gram) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} {b}");
        }
        for (a, b) in sc.mean_abs().iter().zip(st2.mean_abs()) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
        }
        assert!(st.add_rows(&[f32::NAN; 8], 1).unwrap_err().to_string().contains("NaN"));
        assert!(st.add_rows(&[0.0; 7], 1).is_err());
    }
}
