//! Sampling parameters and the host reference sampler.
//!
//! Order of operations (as in Hugging Face and vLLM): penalties → greedy if temperature is 0 →
//! temperature → top-k → softmax → top-p → min-p → draw.

use crate::{Error, Result};

/// Per-request sampling parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the `k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// Hugging Face repetition penalty over prompt and output; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over the output; 0 disables.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over the output; 0 disables.
    pub frequency_penalty: f32,
    /// Seed of the random stream; the same seed gives the same text.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether tokens are picked by argmax (`temperature == 0`; penalties still apply).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the repetition penalty applies (over prompt and output tokens).
    pub fn has_repetition_penalty(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    /// Whether the presence or frequency penalty applies (over output tokens).
    pub fn has_output_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether a row's token is the plain argmax of its logits: greedy with no penalty that
    /// changes them ([`apply_penalties`] is then a no-op).
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy() && !self.has_repetition_penalty() && !self.has_output_penalties()
    }

    /// Checks every field's range, naming the field in the error.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, value: f32, range: &str| {
            Err(Error::invalid(format!("{field} = {value} is out of range (must be {range})")))
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature, ">= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", self.repetition_penalty, "> 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]");
        }
        Ok(())
    }
}

/// A small deterministic random stream (SplitMix64) so a seed reproduces a sample on every
/// platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Applies repetition, presence and frequency penalties in place. `prompt` and `output` are
/// the tokens so far.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, prompt: &[u32], output: &[u32]) {
    if params.has_repetition_penalty() {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            let t = t as usize;
            if t < logits.len() && !seen[t] {
                seen[t] = true;
                let l = &mut logits[t];
                *l = if *l > 0.0 { *l / params.repetition_penalty } else { *l * params.repetition_penalty };
            }
        }
    }
    if params.has_output_penalties() {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * c as f32;
            }
        }
    }
}

/// Index of the largest value (the first on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// Draws one token from `logits` (penalties already applied). `scratch` is reused between
/// calls so sampling allocates nothing per token once warm.
pub fn sample_from_logits(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut Rng,
    scratch: &mut Vec<(f32, u32)>,
) -> u32 {
    if params.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &l)| (l / params.temperature, i as u32)));
    let by_logit_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0);
    if params.top_k > 0 && params.top_k < scratch.len() {
        scratch.select_nth_unstable_by(params.top_k - 1, by_logit_desc);
        scratch.truncate(params.top_k);
    }
    scratch.sort_unstable_by(by_logit_desc);
    let max = scratch[0].0;
    let mut sum = 0.0f64;
    for e in scratch.iter_mut() {
        e.0 = (e.0 - max).exp();
        sum += e.0 as f64;
    }
    for e in scratch.iter_mut() {
        e.0 = (e.0 as f64 / sum) as f32;
    }
    if params.top_p < 1.0 {
        let mut acc = 0.0f32;
        let mut keep = scratch.len();
        for (i, e) in scratch.iter().enumerate() {
            acc += e.0;
            if acc >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        scratch.truncate(keep);
    }
    if params.min_p > 0.0 {
        let threshold = scratch[0].0 * params.min_p;
        let keep = scratch.iter().take_while(|e| e.0 >= threshold).count().max(1);
        scratch.truncate(keep);
    }
    let total: f64 = scratch.iter().map(|e| e.0 as f64).sum();
    let mut r = rng.next_f64() * total;
    for e in scratch.iter() {
        r -= e.0 as f64;
        if r <= 0.0 {
            return e.1;
        }
    }
    scratch[scratch.len() - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_max() {
        let p = SamplingParams::greedy();
        let mut rng = Rng::new(1);
        assert_eq!(sample_from_logits(&[0.1, 3.0, 2.0], &p, &mut rng, &mut Vec::new()), 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let p = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            let mut s = Vec::new();
            (0..20).map(|_| sample_from_logits(&logits, &p, &mut rng, &mut s)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let p = SamplingParams { temperature: 5.0, top_k: 1, ..Default::default() };
        let mut rng = Rng::new(3);
        for _ in 0..20 {
            assert_eq!(sample_from_logits(&[0.0, 1.0, 0.5], &p, &mut rng, &mut Vec::new()), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [10.0, 9.9, -10.0, -10.0];
        let mut rng = Rng::new(3);
        let p = SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() };
        let q = SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() };
        for _ in 0..100 {
            assert!(sample_from_logits(&logits, &p, &mut rng, &mut Vec::new()) < 2);
            assert!(sample_from_logits(&logits, &q, &mut rng, &mut Vec::new()) < 2);
        }
    }

    #[test]
    fn penalties_follow_definitions() {
        let mut l = vec![2.0, -2.0, 1.0];
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        apply_penalties(&mut l, &p, &[0, 1, 1], &[]);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
        let mut l = vec![0.0, 0.0];
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        apply_penalties(&mut l, &p, &[], &[1, 1]);
        assert_eq!(l, vec![0.0, -1.0]);
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().unwrap_err().to_string().contains("top_p"));
        let p = SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(p.validate().unwrap_err().to_string().contains("temperature"));
        assert!(SamplingParams::default().validate().is_ok());
    }
}
