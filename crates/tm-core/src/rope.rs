//! Rotary position embedding: the inverse frequencies and attention factor for each scaling
//! type the supported models use, computed on the host once per step and handed to the
//! backend's RoPE kernel.
//!
//! Formulas follow the published definitions (as implemented by Hugging Face transformers'
//! `modeling_rope_utils`): inverse frequencies are `base^(-2i/d)` in f32, modified per type.

use crate::{Error, Result};
use std::f64::consts::PI;

/// How the rotated pairs are laid out within a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(i, i + d/2)` ("rotate half", Hugging Face layout).
    Half,
    /// Pairs `(2i, 2i + 1)` (GPT-J / original Meta layout, GGUF llama).
    Interleaved,
}

/// RoPE scaling type and its parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Dynamic NTK: the base grows once the sequence exceeds `original_max`.
    Dynamic {
        /// Scale factor.
        factor: f64,
        /// Context length the model was trained with.
        original_max: usize,
    },
    /// Llama 3 frequency-dependent scaling.
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Low-frequency factor.
        low_freq_factor: f64,
        /// High-frequency factor.
        high_freq_factor: f64,
        /// Context length the model was trained with.
        original_max: usize,
    },
    /// YaRN.
    Yarn {
        /// Scale factor.
        factor: f64,
        /// Context length the model was trained with.
        original_max: usize,
        /// Fast correction boundary (default 32).
        beta_fast: f64,
        /// Slow correction boundary (default 1).
        beta_slow: f64,
        /// Multiplier on cos/sin; `None` means `0.1 ln(factor) + 1` (or from mscale).
        attention_factor: Option<f64>,
        /// DeepSeek-style `mscale`.
        mscale: Option<f64>,
        /// DeepSeek-style `mscale_all_dim`.
        mscale_all_dim: Option<f64>,
        /// Whether correction bounds are floored/ceiled (default true).
        truncate: bool,
    },
}

/// Static RoPE configuration of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Rotated dimensions per head (usually the head dimension).
    pub dim: usize,
    /// Frequency base (`rope_theta`).
    pub base: f64,
    /// Scaling type.
    pub scaling: RopeScaling,
    /// Pair layout.
    pub style: RopeStyle,
}

/// What the RoPE kernel needs for one step.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    /// `dim / 2` inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplier applied to cos and sin.
    pub attention_factor: f32,
    /// Pair layout.
    pub style: RopeStyle,
}

fn default_inv_freq(dim: usize, base: f64) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            1.0f32 / (base as f32).powf(exponent)
        })
        .collect()
}

fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeConfig {
    /// Checks parameters.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 || !self.dim.is_multiple_of(2) {
            return Err(Error::invalid(format!("rotary dimension {} must be even and positive", self.dim)));
        }
        if self.base <= 0.0 {
            return Err(Error::invalid(format!("rope_theta {} must be positive", self.base)));
        }
        let factor = match &self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor }
            | RopeScaling::Dynamic { factor, .. }
            | RopeScaling::Llama3 { factor, .. }
            | RopeScaling::Yarn { factor, .. } => *factor,
        };
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::invalid(format!("rope scaling factor {factor} must be positive")));
        }
        Ok(())
    }

    /// Frequencies for a step whose largest position is `max_position` (only dynamic scaling
    /// depends on it).
    pub fn freqs(&self, max_position: usize) -> RopeFreqs {
        let dim = self.dim;
        let mut attention_factor = 1.0f32;
        let inv_freq = match &self.scaling {
            RopeScaling::None => default_inv_freq(dim, self.base),
            RopeScaling::Linear { factor } => {
                default_inv_freq(dim, self.base).into_iter().map(|f| f / *factor as f32).collect()
            }
            RopeScaling::Dynamic { factor, original_max } => {
                let seq_len = max_position + 1;
                if seq_len > *original_max {
                    let ratio = factor * seq_len as f64 / *original_max as f64 - (factor - 1.0);
                    let base = self.base * ratio.powf(dim as f64 / (dim as f64 - 2.0));
                    default_inv_freq(dim, base)
                } else {
                    default_inv_freq(dim, self.base)
                }
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max } => {
                let old = *original_max as f32;
                let (factor, low, high) = (*factor as f32, *low_freq_factor as f32, *high_freq_factor as f32);
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                default_inv_freq(dim, self.base)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max,
                beta_fast,
                beta_slow,
                attention_factor: af,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                attention_factor = match (af, mscale, mscale_all_dim) {
                    (Some(a), _, _) => *a as f32,
                    (None, Some(m), Some(mad)) => {
                        (yarn_get_mscale(*factor, *m) / yarn_get_mscale(*factor, *mad)) as f32
                    }
                    _ => yarn_get_mscale(*factor, 1.0) as f32,
                };
                let base = self.base;
                let correction_dim = |rotations: f64| {
                    (dim as f64 * (*original_max as f64 / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                (0..dim / 2)
                    .map(|i| {
                        let pos_freq = (base as f32).powf((2 * i) as f32 / dim as f32);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (*factor as f32 * pos_freq);
                        let ramp = (((i as f64 - low) / (high - low)).clamp(0.0, 1.0)) as f32;
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        };
        RopeFreqs { inv_freq, attention_factor, style: self.style }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig { dim: 16, base: 10000.0, scaling, style: RopeStyle::Half }
    }

    #[test]
    fn default_frequencies() {
        let f = cfg(RopeScaling::None).freqs(0);
        assert_eq!(f.inv_freq.len(), 8);
        assert_eq!(f.inv_freq[0], 1.0);
        assert!((f.inv_freq[1] - 10000f32.powf(-2.0 / 16.0)).abs() < 1e-7);
    }

    #[test]
    fn linear_divides() {
        let a = cfg(RopeScaling::None).freqs(0);
        let b = cfg(RopeScaling::Linear { factor: 2.0 }).freqs(0);
        for (x, y) in a.inv_freq.iter().zip(&b.inv_freq) {
            assert!((x / 2.0 - y).abs() < 1e-9);
        }
    }

    #[test]
    fn dynamic_only_past_original_length() {
        let c = cfg(RopeScaling::Dynamic { factor: 2.0, original_max: 32 });
        assert_eq!(c.freqs(31).inv_freq, cfg(RopeScaling::None).freqs(0).inv_freq);
        assert!(c.freqs(40).inv_freq[1] < c.freqs(31).inv_freq[1]);
    }

    #[test]
    fn yarn_default_attention_factor() {
        let c = cfg(RopeScaling::Yarn {
            factor: 4.0,
            original_max: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        });
        let f = c.freqs(0);
        assert!((f.attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        assert_eq!(f.inv_freq[0], 1.0, "highest frequency is extrapolated");
    }

    #[test]
    fn rejects_bad_factor() {
        assert!(cfg(RopeScaling::Linear { factor: 0.0 }).validate().is_err());
        assert!(RopeConfig { dim: 3, ..cfg(RopeScaling::None) }.validate().is_err());
    }
}
