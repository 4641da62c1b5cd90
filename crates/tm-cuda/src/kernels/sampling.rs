//! Launchers for `sampling.cu`: token sampling on the device, so a step copies only the chosen
//! token ids (u32 `[n]`) back to the host, never the `[n, vocab]` logits.
//!
//! # Use
//! 1. [`build_inputs`] fills a reused [`SampleInputs`] from the step's requests: one
//!    [`DeviceSampleParams`] per row (with the row's uniform number drawn from its [`Rng`]) and the
//!    flat penalty lists. Upload [`SampleInputs::params_bytes`], [`SampleInputs::tokens_bytes`] and
//!    [`SampleInputs::counts_bytes`] (the token and count arrays are never empty).
//! 2. [`sample`] queues one 1024-thread block per row (`sample_T`); it needs a device scratch of
//!    [`scratch_bytes`]`(n, vocab)` bytes. Download `out_tokens`.
//! 3. Rows that are all greedy without penalties can use [`argmax`] (`argmax_T`, reads the logits
//!    directly, no scratch, no inputs).
//!
//! # Semantics (those of [`tm_core::ops::sample_rows`])
//! - Penalties as [`apply_penalties`]: the repetition penalty once per distinct token of prompt and
//!   output (`l > 0 ? l / r : l * r`), then presence/frequency once per distinct output token
//!   (`l -= presence + frequency * count`), in f32 with the same roundings. Token ids `>= vocab`
//!   are ignored, like the host.
//! - Greedy when `temperature == 0` (penalties still apply): the host's [`argmax`] exactly — the
//!   first index of the largest value; NaNs never win, except that a NaN at index 0 gives 0. Greedy
//!   rows draw no random number, like the host.
//! - Otherwise `v = l / temperature`, top-k, softmax, top-p (smallest prefix whose probability
//!   reaches `top_p`), min-p (`p >= p_max * min_p`), then a draw with the row's uniform `u`.
//!   `top_k == 0` or `>= vocab`, `top_p >= 1` and `min_p <= 0` switch the filters off.
//!   Every cut keeps an exact prefix of the host's descending order, with ties broken by the
//!   lowest index (the host breaks them in unspecified order), so `top_k = 1` is the argmax.
//!   When top-k is at most 4096 or top-p is set, and the top-p prefix holds at most 4096
//!   tokens (the usual case), the draw is the host's own inverse CDF over the sorted probabilities,
//!   so the same `u` gives the same token up to floating-point rounding at interval edges.
//!   Otherwise (no filter, min-p only, top-k above 4096, or a top-p prefix longer than 4096) the
//!   draw walks the kept tokens in a fixed device order: the distribution is the host's, the token
//!   for a given seed is not. Masses for top-p and that draw are exact fixed-point integers
//!   (`2^s · p/p_max`, `s = 62 - bits(vocab)`); tokens with `p < 2^-s · p_max` (about `1e-13`
//!   for a 150k vocabulary) are never drawn.
//! - NaN logits are never sampled (the host's result is unspecified for them); when the largest
//!   logit is `+inf`, or no logit is finite, a sampled row returns the argmax.
//! - Everything is deterministic: the same inputs give the same tokens on every run.
//!
//! Parameters are assumed valid ([`SamplingParams::validate`]). The vocabulary is limited to
//! [`MAX_VOCAB`].
//!
//! [`Rng`]: tm_core::sampling::Rng
//! [`apply_penalties`]: tm_core::sampling::apply_penalties
//! [`argmax`]: tm_core::sampling::argmax
//! [`SamplingParams::validate`]: tm_core::sampling::SamplingParams::validate

use bytemuck::{Pod, Zeroable};
use tm_core::ops::SampleRequest;
use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{Gpu, KernelArg};

/// Threads per block of both kernels (their `__launch_bounds__`).
const THREADS: u32 = 1024;
/// The largest vocabulary the kernels take (the fixed-point masses and the penalty-token
/// bookkeeping rely on it).
pub const MAX_VOCAB: usize = 1 << 24;

/// One row's sampling parameters as the kernel reads them (`tms::Params` in `sampling.cu`;
/// 48 bytes, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct DeviceSampleParams {
    /// The row's uniform number in `[0, 1)` (0 for greedy rows).
    pub uniform: f64,
    /// 0 means greedy.
    pub temperature: f32,
    /// `>= 1` disables.
    pub top_p: f32,
    /// `<= 0` disables.
    pub min_p: f32,
    /// 1 disables.
    pub repetition_penalty: f32,
    /// 0 (with `frequency_penalty` 0) disables.
    pub presence_penalty: f32,
    /// 0 (with `presence_penalty` 0) disables.
    pub frequency_penalty: f32,
    /// 0 or `>= vocab` disables.
    pub top_k: u32,
    /// 1 when `temperature == 0`.
    pub greedy: u32,
    /// The row's first entry in the penalty arrays.
    pub penalty_offset: u32,
    /// The row's number of penalty entries.
    pub penalty_count: u32,
}

const _: () = assert!(std::mem::size_of::<DeviceSampleParams>() == 48);

/// The host side of one sampling step, reused across steps (its vectors keep their capacity, so
/// a warm step allocates nothing).
#[derive(Debug, Default)]
pub struct SampleInputs {
    /// One entry per row.
    pub params: Vec<DeviceSampleParams>,
    /// Per row (at `penalty_offset`, `penalty_count` long): each distinct token the penalties
    /// touch, once — the prompt's and the output's when the repetition penalty is on, else the
    /// output's. Never empty (a 0 is appended), so it can always be uploaded.
    pub penalty_tokens: Vec<u32>,
    /// Parallel to `penalty_tokens`: how often the token occurs in the output (0 for
    /// prompt-only tokens).
    pub penalty_counts: Vec<u32>,
    /// `stamp[t] == epoch` marks token `t` as listed for the current row.
    stamp: Vec<u32>,
    /// Index into `penalty_tokens` of token `t` when stamped.
    slot: Vec<u32>,
    epoch: u32,
}

impl SampleInputs {
    /// The parameters as bytes, for the upload.
    pub fn params_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.params)
    }

    /// The penalty tokens as bytes, for the upload.
    pub fn tokens_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.penalty_tokens)
    }

    /// The penalty counts as bytes, for the upload.
    pub fn counts_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.penalty_counts)
    }

    /// Starts a row's distinct-token set.
    fn next_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.stamp.fill(0);
            self.epoch = 1;
        }
    }

    /// Lists token `t` for the current row (once), counting it when it comes from the output.
    fn add(&mut self, t: u32, from_output: bool) {
        let ti = t as usize;
        if ti >= MAX_VOCAB {
            return; // outside any vocabulary the kernels take: ignored there too
        }
        if ti >= self.stamp.len() {
            let len = (ti + 1).next_power_of_two().min(MAX_VOCAB);
            self.stamp.resize(len, 0);
            self.slot.resize(len, 0);
        }
        if self.stamp[ti] != self.epoch {
            self.stamp[ti] = self.epoch;
            self.slot[ti] = u32::try_from(self.penalty_tokens.len()).unwrap_or(u32::MAX);
            self.penalty_tokens.push(t);
            self.penalty_counts.push(0);
        }
        if from_output {
            if let Some(c) = self.penalty_counts.get_mut(self.slot[ti] as usize) {
                *c = c.saturating_add(1);
            }
        }
    }
}

/// Fills `inputs` for one step: clears it, then per request its [`DeviceSampleParams`] (drawing
/// the uniform number from the request's `rng` exactly when the host sampler would: once per
/// non-greedy row, never for greedy rows) and its penalty entries. Reuses the vectors' capacity.
pub fn build_inputs(requests: &mut [SampleRequest<'_>], inputs: &mut SampleInputs) {
    inputs.params.clear();
    inputs.penalty_tokens.clear();
    inputs.penalty_counts.clear();
    for req in requests.iter_mut() {
        let p = req.params;
        let greedy = p.is_greedy();
        let uniform = if greedy { 0.0 } else { req.rng.next_f64() };
        let offset = inputs.penalty_tokens.len();
        let rep = p.has_repetition_penalty();
        let pres = p.has_output_penalties();
        if rep || pres {
            inputs.next_epoch();
            if rep {
                for &t in req.prompt {
                    inputs.add(t, false);
                }
            }
            for &t in req.output {
                inputs.add(t, true);
            }
        }
        let count = inputs.penalty_tokens.len() - offset;
        inputs.params.push(DeviceSampleParams {
            uniform,
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            greedy: greedy as u32,
            // More than 2^32 penalty entries in one step cannot happen (each row lists fewer
            // than MAX_VOCAB distinct tokens and a step has far fewer than 256 rows of that).
            penalty_offset: u32::try_from(offset).unwrap_or(u32::MAX),
            penalty_count: u32::try_from(count).unwrap_or(u32::MAX),
        });
    }
    inputs.penalty_tokens.push(0);
    inputs.penalty_counts.push(0);
}

/// f32 elements of one scratch row: `vocab` rounded up to a multiple of 4 (16-byte rows).
fn scratch_stride(vocab: usize) -> usize {
    vocab.div_ceil(4).saturating_mul(4)
}

/// Bytes of device scratch [`sample`] needs for `n` rows of `vocab` logits (one f32 row each).
pub fn scratch_bytes(n: usize, vocab: usize) -> usize {
    n.saturating_mul(scratch_stride(vocab)).saturating_mul(4)
}

/// Checks `n` and `vocab` and returns them as kernel ints (`None` when `n == 0`).
fn check_rows(op: &str, n: usize, vocab: usize) -> Result<Option<(u32, i32)>> {
    if vocab == 0 || vocab > MAX_VOCAB {
        return Err(Error::invalid(format!("{op}: vocab = {vocab} must be in 1..={MAX_VOCAB}")));
    }
    let rows = u32::try_from(n)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or_else(|| Error::invalid(format!("{op}: n = {n} rows exceed the grid limit")))?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((rows, vocab as i32)))
}

/// Checks that device pointer `p` is aligned to `align` bytes.
fn check_align(op: &str, what: &str, p: u64, align: u64) -> Result<()> {
    if !p.is_multiple_of(align) {
        return Err(Error::invalid(format!("{op}: {what} pointer {p:#x} must be {align}-byte aligned")));
    }
    Ok(())
}

/// `scratch_len` bytes of scratch must hold the `need` bytes `op` asks for.
fn check_scratch(op: &str, scratch_len: usize, need: usize) -> Result<()> {
    if scratch_len < need {
        return Err(Error::invalid(format!("{op}: scratch of {scratch_len} bytes, need {need}")));
    }
    Ok(())
}

/// Samples one token per row of `logits` (`dt` `[n, vocab]`) into `out_tokens` (u32 `[n]`).
/// `params` (`[n]` [`DeviceSampleParams`], 8-byte aligned), `penalty_tokens` and
/// `penalty_counts` are the uploaded [`SampleInputs`] arrays; `scratch` is at least
/// [`scratch_bytes`]`(n, vocab)` bytes, 16-byte aligned, and its contents need not be preserved.
/// All pointers are device addresses; the kernel is queued on the GPU's stream.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    gpu: &Gpu,
    dt: DType,
    logits: u64,
    n: usize,
    vocab: usize,
    params: u64,
    penalty_tokens: u64,
    penalty_counts: u64,
    out_tokens: u64,
    scratch: u64,
    scratch_len: usize,
) -> Result<()> {
    let op = "sample";
    let name = format!("sample_{}", suffix(dt)?);
    let Some((rows, v32)) = check_rows(op, n, vocab)? else {
        return Ok(());
    };
    check_scratch(op, scratch_len, scratch_bytes(n, vocab))?;
    check_align(op, "logits", logits, (dt.bits() / 8) as u64)?;
    check_align(op, "params", params, 8)?;
    check_align(op, "penalty_tokens", penalty_tokens, 4)?;
    check_align(op, "penalty_counts", penalty_counts, 4)?;
    check_align(op, "out_tokens", out_tokens, 4)?;
    check_align(op, "scratch", scratch, 16)?;
    gpu.launch(
        &name,
        (rows, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            KernelArg::Ptr(logits),
            KernelArg::I32(v32),
            KernelArg::Ptr(params),
            KernelArg::Ptr(penalty_tokens),
            KernelArg::Ptr(penalty_counts),
            KernelArg::Ptr(out_tokens),
            KernelArg::Ptr(scratch),
        ],
    )
}

/// Greedy tokens: `out_tokens[r]` (u32) = the host [`argmax`] of row `r` of `logits` (`dt`
/// `[n, vocab]`), without penalties. Device addresses; queued on the GPU's stream.
///
/// [`argmax`]: tm_core::sampling::argmax
pub fn argmax(gpu: &Gpu, dt: DType, logits: u64, n: usize, vocab: usize, out_tokens: u64) -> Result<()> {
    let op = "argmax";
    let name = format!("argmax_{}", suffix(dt)?);
    let Some((rows, v32)) = check_rows(op, n, vocab)? else {
        return Ok(());
    };
    check_align(op, "logits", logits, (dt.bits() / 8) as u64)?;
    check_align(op, "out_tokens", out_tokens, 4)?;
    gpu.launch(
        &name,
        (rows, 1, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(logits), KernelArg::I32(v32), KernelArg::Ptr(out_tokens)],
    )
}

/// Logits per block of the split argmax ([`argmax_split`]): 8 per thread of a 1024-thread block,
/// one 16-byte load each for f16 and bf16.
pub const ARGMAX_CHUNK: usize = 8192;

/// Blocks per row of [`argmax_split`] for `vocab` logits.
pub fn argmax_parts(vocab: usize) -> usize {
    vocab.div_ceil(ARGMAX_CHUNK)
}

/// Bytes of scratch [`argmax_split`] needs: one (f32 value, u32 index) pair per block and row.
pub fn argmax_split_bytes(n: usize, vocab: usize) -> usize {
    n.saturating_mul(argmax_parts(vocab)).saturating_mul(8)
}

/// [`argmax`] split over blocks of [`ARGMAX_CHUNK`] logits (`argmax_part_T`, then one warp per
/// row in `argmax_final_T`): the same tokens, with [`argmax_parts`] blocks per row reading the
/// logits instead of one. `scratch` (8-byte aligned) holds [`argmax_split_bytes`], any contents.
#[allow(clippy::too_many_arguments)]
pub fn argmax_split(
    gpu: &Gpu,
    dt: DType,
    logits: u64,
    n: usize,
    vocab: usize,
    out_tokens: u64,
    scratch: u64,
    scratch_len: usize,
) -> Result<()> {
    let op = "argmax_split";
    let Some((rows, v32)) = check_rows(op, n, vocab)? else {
        return Ok(());
    };
    check_scratch(op, scratch_len, argmax_split_bytes(n, vocab))?;
    check_align(op, "logits", logits, (dt.bits() / 8) as u64)?;
    check_align(op, "out_tokens", out_tokens, 4)?;
    check_align(op, "scratch", scratch, 8)?;
    let parts = argmax_parts(vocab) as u32;
    let sfx = suffix(dt)?;
    gpu.launch(
        &format!("argmax_part_{sfx}"),
        (parts, rows, 1),
        (THREADS, 1, 1),
        0,
        &[KernelArg::Ptr(logits), KernelArg::I32(v32), KernelArg::I32(ARGMAX_CHUNK as i32), KernelArg::Ptr(scratch)],
    )?;
    gpu.launch(
        &format!("argmax_final_{sfx}"),
        (rows, 1, 1),
        (32, 1, 1),
        0,
        &[
            KernelArg::Ptr(logits),
            KernelArg::I32(v32),
            KernelArg::Ptr(scratch),
            KernelArg::I32(parts as i32),
            KernelArg::Ptr(out_tokens),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tm_core::sampling::{apply_penalties, Rng, SamplingParams};

    /// The kernel's penalty step, applied on the host to the listed tokens.
    fn apply_listed(logits: &mut [f32], p: &DeviceSampleParams, tokens: &[u32], counts: &[u32]) {
        let off = p.penalty_offset as usize;
        let rep = p.repetition_penalty != 1.0;
        let pres = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let mut seen = std::collections::HashSet::new();
        for j in off..off + p.penalty_count as usize {
            let (t, c) = (tokens[j], counts[j]);
            assert!(seen.insert(t), "token {t} listed twice");
            let Some(l) = logits.get_mut(t as usize) else { continue };
            let mut v = *l;
            if rep {
                v = if v > 0.0 { v / p.repetition_penalty } else { v * p.repetition_penalty };
            }
            if pres && c > 0 {
                v -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
            *l = v;
        }
    }

    fn request<'a>(
        params: &'a SamplingParams,
        prompt: &'a [u32],
        output: &'a [u32],
        rng: &'a mut Rng,
    ) -> SampleRequest<'a> {
        SampleRequest { params, prompt, output, rng }
    }

    #[test]
    fn layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<DeviceSampleParams>(), 48);
        assert_eq!(std::mem::align_of::<DeviceSampleParams>(), 8);
        assert_eq!(std::mem::offset_of!(DeviceSampleParams, temperature), 8);
        assert_eq!(std::mem::offset_of!(DeviceSampleParams, top_k), 32);
        assert_eq!(std::mem::offset_of!(DeviceSampleParams, penalty_count), 44);
    }

    #[test]
    fn uniforms_follow_the_host_sampler() {
        let greedy = SamplingParams::greedy();
        let hot = SamplingParams { temperature: 0.7, top_k: 1 << 40, seed: 5, ..Default::default() };
        let (mut r1, mut r2, mut r3) = (Rng::new(1), Rng::new(2), Rng::new(3));
        let mut reqs = vec![
            request(&greedy, &[], &[], &mut r1),
            request(&hot, &[], &[], &mut r2),
            request(&hot, &[], &[], &mut r3),
        ];
        let mut inputs = SampleInputs::default();
        build_inputs(&mut reqs, &mut inputs);
        drop(reqs);
        let p = &inputs.params;
        assert_eq!(p.len(), 3);
        assert_eq!((p[0].greedy, p[0].uniform), (1, 0.0));
        assert_eq!(p[1].greedy, 0);
        assert_eq!(p[1].top_k, u32::MAX);
        assert_eq!(p[1].temperature, 0.7);
        // greedy rows draw nothing; sampled rows draw exactly one number
        assert_eq!(r1.next_u64(), Rng::new(1).next_u64());
        let mut e2 = Rng::new(2);
        assert_eq!(p[1].uniform, e2.next_f64());
        assert_eq!(r2.next_u64(), e2.next_u64());
        let mut e3 = Rng::new(3);
        assert_eq!(p[2].uniform, e3.next_f64());
        assert!((0.0..1.0).contains(&p[1].uniform));
        // no penalties: no entries, but uploadable arrays
        assert!(p.iter().all(|q| q.penalty_count == 0));
        assert_eq!(inputs.penalty_tokens, vec![0]);
        assert_eq!(inputs.counts_bytes().len(), 4);
        assert_eq!(inputs.params_bytes().len(), 3 * 48);
    }

    #[test]
    fn penalty_lists_reproduce_apply_penalties() {
        let cases = [
            SamplingParams { repetition_penalty: 1.3, ..Default::default() },
            SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() },
            SamplingParams {
                repetition_penalty: 0.8,
                presence_penalty: -0.7,
                frequency_penalty: 1.1,
                ..Default::default()
            },
            SamplingParams { temperature: 1.0, ..Default::default() },
        ];
        let vocab = 50;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i as f32) * 0.77).sin() * 3.0).collect();
        let prompt = [3, 7, 7, 49, 60, 0, 3];
        let output = [7, 12, 12, 12, 55, 0, 49, 1_000_000_000];
        let mut rngs: Vec<Rng> = (0..cases.len()).map(|i| Rng::new(i as u64)).collect();
        let mut reqs: Vec<SampleRequest<'_>> =
            cases.iter().zip(rngs.iter_mut()).map(|(p, r)| request(p, &prompt, &output, r)).collect();
        let mut inputs = SampleInputs::default();
        build_inputs(&mut reqs, &mut inputs);
        let mut next = 0;
        for (p, dp) in cases.iter().zip(&inputs.params) {
            assert_eq!(dp.penalty_offset as usize, next, "rows are laid out back to back");
            next += dp.penalty_count as usize;
            let mut want = logits.clone();
            apply_penalties(&mut want, p, &prompt, &output);
            let mut got = logits.clone();
            apply_listed(&mut got, dp, &inputs.penalty_tokens, &inputs.penalty_counts);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{p:?}"
            );
        }
        assert_eq!(next + 1, inputs.penalty_tokens.len());
        // repetition only: prompt and output tokens, each once, with output counts
        let d = &inputs.params[0];
        let row = |d: &DeviceSampleParams| {
            let r = d.penalty_offset as usize..(d.penalty_offset + d.penalty_count) as usize;
            let mut v: Vec<(u32, u32)> = inputs.penalty_tokens[r.clone()]
                .iter()
                .copied()
                .zip(inputs.penalty_counts[r].iter().copied())
                .collect();
            v.sort_unstable();
            v
        };
        // (token 1e9 is past MAX_VOCAB: dropped, as the kernel and the host would ignore it)
        assert_eq!(row(d), vec![(0, 1), (3, 0), (7, 1), (12, 3), (49, 1), (55, 1), (60, 0)]);
        // presence/frequency only: output tokens only
        assert_eq!(row(&inputs.params[1]), vec![(0, 1), (7, 1), (12, 3), (49, 1), (55, 1)]);
        assert_eq!(inputs.params[3].penalty_count, 0);
    }

    #[test]
    fn tokens_beyond_any_vocabulary_are_dropped() {
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        let mut rng = Rng::new(0);
        let prompt = [u32::MAX, MAX_VOCAB as u32, 5];
        let mut reqs = vec![request(&p, &prompt, &[], &mut rng)];
        let mut inputs = SampleInputs::default();
        build_inputs(&mut reqs, &mut inputs);
        assert_eq!(inputs.penalty_tokens, vec![5, 0]);
        assert_eq!(inputs.params[0].penalty_count, 1);
    }

    #[test]
    fn warm_calls_reuse_capacity() {
        let p =
            SamplingParams { temperature: 1.0, repetition_penalty: 1.1, frequency_penalty: 0.2, ..Default::default() };
        let prompt: Vec<u32> = (0..300).map(|i| (i * 37) % 1000).collect();
        let output: Vec<u32> = (0..200).map(|i| (i * 11) % 500).collect();
        let mut rngs = [Rng::new(1), Rng::new(2)];
        let mut inputs = SampleInputs::default();
        let mut first = None;
        for step in 0..5 {
            let [a, b] = &mut rngs;
            let mut reqs = vec![request(&p, &prompt, &output, a), request(&p, &prompt[..100], &output, b)];
            build_inputs(&mut reqs, &mut inputs);
            let caps = (
                inputs.params.capacity(),
                inputs.penalty_tokens.capacity(),
                inputs.penalty_counts.capacity(),
                inputs.stamp.capacity(),
                inputs.params.as_ptr(),
                inputs.penalty_tokens.as_ptr(),
            );
            if step == 0 {
                first = Some(caps);
            } else {
                assert_eq!(Some(caps), first, "step {step} reallocated");
            }
            assert_eq!(inputs.params.len(), 2);
        }
    }

    #[test]
    fn epoch_wrap_resets_the_stamps() {
        let p = SamplingParams { repetition_penalty: 1.5, ..Default::default() };
        let mut inputs = SampleInputs { epoch: u32::MAX - 1, ..Default::default() };
        for _ in 0..4 {
            let mut rng = Rng::new(0);
            let mut reqs = vec![request(&p, &[4, 4, 9], &[9], &mut rng)];
            build_inputs(&mut reqs, &mut inputs);
            let mut got: Vec<(u32, u32)> =
                inputs.penalty_tokens.iter().copied().zip(inputs.penalty_counts.iter().copied()).collect();
            got.pop();
            got.sort_unstable();
            assert_eq!(got, vec![(4, 0), (9, 1)]);
        }
        assert!(inputs.epoch >= 1 && inputs.epoch < 10);
    }

    #[test]
    fn sizes_are_checked() {
        assert_eq!(scratch_bytes(2, 5), 2 * 8 * 4);
        assert_eq!(scratch_bytes(3, 151_936), 3 * 151_936 * 4);
        assert_eq!(scratch_bytes(usize::MAX, 8), usize::MAX);
        assert!(check_rows("op", 1, 0).is_err());
        assert!(check_rows("op", 1, MAX_VOCAB + 1).is_err());
        assert_eq!(check_rows("op", 0, 10).unwrap(), None);
        assert_eq!(check_rows("op", 3, 10).unwrap(), Some((3, 10)));
        assert!(check_rows("op", 1 << 31, 10).is_err());
        assert!(check_align("op", "p", 0x1008, 16).is_err());
        assert!(check_align("op", "p", 0x1010, 16).is_ok());
    }
}
