//! The kernel-ops interface the model is written against.
//!
//! One method is one kernel launch. Activations are row-major `[tokens, features]` tensors in the
//! backend's [`Ops::activation_dtype`]; small per-step inputs (token ids, positions, slot mapping,
//! block tables) are passed as host slices and uploaded by the backend as it needs.
//!
//! The KV cache of a layer is two tensors `[num_blocks, block_size, kv_heads, head_dim]`, in the
//! activation dtype or, where [`Ops::supports_kv_cache_dtype`] says so, FP8 E4M3. A
//! token's slot is `block * block_size + offset`; a sequence's block table lists its blocks in
//! order, so attention reads keys and values through it (paged attention).

use crate::quant::Weight;
use crate::rope::RopeFreqs;
use crate::sampling::{apply_penalties, sample_from_logits, Rng, SamplingParams};
use crate::{Allocator, DType, Device, Error, Result, Tensor, TensorDesc};
use std::sync::Arc;

/// One sequence's part of a flat batch, as attention sees it.
#[derive(Clone, Debug)]
pub struct SeqAttention<'a> {
    /// Index of this sequence's first query token in the batch.
    pub query_start: usize,
    /// Number of query tokens (the prefill chunk length, or 1 when decoding).
    pub query_len: usize,
    /// Tokens in the cache for this sequence, this step's included. The query tokens are the
    /// last `query_len` of them.
    pub context_len: usize,
    /// Blocks holding the sequence's keys and values, in order.
    pub block_table: &'a [u32],
}

/// Everything attention needs about the batch.
#[derive(Clone, Debug)]
pub struct AttentionMeta<'a> {
    /// The sequences of the batch, in batch order.
    pub seqs: &'a [SeqAttention<'a>],
    /// Tokens per KV block.
    pub block_size: usize,
    /// Multiplier on q·k (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Attend only to the last `w` positions, if set.
    pub sliding_window: Option<usize>,
}

/// A residual join whose RMSNorm scale was left to the ops that read its output (see
/// [`Ops::matmul_add_rms_norm_deferred`]): that output holds `residual * weight` (rounded to the
/// activation dtype) and slot `slot` of `sums` the sums of squares of its rows of `residual`.
#[derive(Clone, Copy, Debug)]
pub struct DeferredNorm<'a> {
    /// The sums: f32 `[slots, 2 * DEFERRED_NORM_ROWS]`, each slot `DEFERRED_NORM_ROWS` f64 sums
    /// (one per batch row), zeroed by [`Ops::fill_zero`] before the step's first join.
    pub sums: &'a Tensor,
    /// The join's slot (each join of a step has its own).
    pub slot: usize,
    /// The norm's epsilon.
    pub eps: f32,
}

/// The most batch rows a deferred join handles (a slot's sums).
pub const DEFERRED_NORM_ROWS: usize = 8;

/// The f64 sums of slot `slot` of a deferred norm's `sums` (f32 `[slots, 2 * DEFERRED_NORM_ROWS]`,
/// see [`DeferredNorm::sums`]), as indices into the tensor's f64 view; an error when `sums` is not
/// f32 or has no such slot.
pub fn deferred_norm_slot(sums: &Tensor, slot: usize) -> Result<std::ops::Range<usize>> {
    sums.expect_dtype("deferred-norm sums", DType::F32)?;
    let slots = sums.numel() / (2 * DEFERRED_NORM_ROWS);
    if slot >= slots {
        return Err(Error::invalid(format!("deferred-norm slot {slot} of a sums tensor with {slots} slots")));
    }
    let at = slot * DEFERRED_NORM_ROWS;
    Ok(at..at + DEFERRED_NORM_ROWS)
}

/// What the sampler needs for one sequence.
#[derive(Debug)]
pub struct SampleRequest<'a> {
    /// Sampling parameters.
    pub params: &'a SamplingParams,
    /// Prompt tokens (for the repetition penalty).
    pub prompt: &'a [u32],
    /// Tokens generated so far.
    pub output: &'a [u32],
    /// The sequence's random stream.
    pub rng: &'a mut Rng,
}

/// The kernels a backend provides. Every method checks shapes and returns an error rather than
/// panicking.
pub trait Ops: Send + Sync + std::fmt::Debug {
    /// The device the kernels run on.
    fn device(&self) -> Arc<dyn Device>;
    /// The allocator tensors come from.
    fn allocator(&self) -> &Arc<dyn Allocator>;
    /// The dtype of activations (hidden states, q/k/v, logits) on this backend.
    fn activation_dtype(&self) -> DType;
    /// The dtype this backend stores a dense weight of `src` dtype in.
    fn weight_dtype(&self, src: DType) -> DType;
    /// The dtype this backend stores a 1-D float tensor (a norm weight, a bias) of `src` dtype in;
    /// the default is [`Ops::weight_dtype`]. Backends whose kernels take vectors in f32 widen them
    /// once at load instead of on every call.
    fn vector_dtype(&self, src: DType) -> DType {
        self.weight_dtype(src)
    }
    /// Whether [`Ops::write_kv`] and [`Ops::attention`] take KV caches of `dtype`. Every backend
    /// takes its activation dtype (the default); backends with an 8-bit cache also take
    /// [`DType::F8E4M3`] (`write_kv` encodes, `attention` decodes; see [`crate::fp8`]).
    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        dtype == self.activation_dtype()
    }

    /// Runs a whole forward step. Backends that fan kernels out over a thread pool run `step`
    /// inside it, so each kernel's fan-out is cheap; the default just calls it.
    fn run_step(&self, step: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        step()
    }

    /// Says, inside [`Ops::run_step`], that the step has uploaded every per-step input but
    /// `logit_rows` (the rows its final [`Ops::gather_rows`] will take, which the backend may
    /// upload now): nothing after this point uploads new bytes. Models call it once per step,
    /// after the first layer's attention. A backend that replays recorded steps may start the
    /// replay it predicts here, and check the rest of the step while the device runs it (the
    /// CUDA backend's early replay). The default does nothing.
    fn step_inputs_ready(&self, logit_rows: &[u32]) -> Result<()> {
        let _ = logit_rows;
        Ok(())
    }

    /// Reserves, once, the scratch the backend's matrix products need for steps of up to
    /// `max_tokens` tokens (the CUDA backend's int4 slab buffer, [`crate::q4_slab`]), so that no
    /// product allocates. Called when the activation workspace is allocated; the memory plan
    /// charges it as kernel scratch. Calling it again reserves nothing new unless a larger step
    /// needs scratch the first did not. The default reserves nothing.
    fn reserve_matmul_scratch(&self, max_tokens: usize) -> Result<()> {
        let _ = max_tokens;
        Ok(())
    }

    /// A zero-filled tensor. `phase` names what it is for (weights, kv cache, workspace).
    fn zeros(&self, desc: TensorDesc, phase: &str) -> Result<Tensor> {
        Tensor::zeros(self.allocator(), desc, phase)
    }
    /// Copies host bytes (already in `dst`'s dtype) into `dst`.
    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> Result<()>;
    /// Copies `src` into host bytes (in `src`'s dtype).
    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()>;
    /// The order this backend wants the packed bytes of a `[rows, cols]` int4 weight of
    /// `group_size` in (the loader repacks to it before uploading; see
    /// [`crate::quant::Int4Layout`]). Row-major unless a backend's kernels read another.
    fn int4_layout(&self, rows: usize, cols: usize, group_size: usize) -> crate::quant::Int4Layout {
        let _ = (rows, cols, group_size);
        crate::quant::Int4Layout::RowMajor
    }
    /// Re-stores a layer's gate and up weights (the two halves of one `gate_up_silu` product) in
    /// the order this backend's decode kernel reads fastest, once they are loaded. The CUDA
    /// backend gives int4 ones that its lean tile-major kernel takes tile-ordered scales and mins
    /// ([`crate::quant::Int4Layout::TilesAndScales16x128`], reordered in place: no extra memory).
    /// A no-op unless a backend says otherwise; every product still accepts the weights.
    fn prepare_gate_up(&self, gate: &mut Weight, up: &mut Weight) -> Result<()> {
        let _ = (gate, up);
        Ok(())
    }
    /// Makes a dense weight tensor from host bytes of dtype `src_dtype`, converting to
    /// [`Ops::weight_dtype`] (to [`Ops::vector_dtype`] for a 1-D `shape`).
    fn load_dense(&self, src_dtype: DType, shape: &[usize], src: &[u8], phase: &str) -> Result<Tensor>;

    /// `out[t] = table[ids[t]]`.
    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()>;
    /// The vocab-parallel embedding of one tensor-parallel rank: `table` holds vocabulary rows
    /// `first_id..first_id + rows`; `out[t] = table[ids[t] - first_id]` for ids in that range and
    /// zeros for the others (another rank holds them; an all-reduce sums the ranks' rows).
    ///
    /// The default runs [`Ops::embedding`] on ids mapped into the slice, then zeroes the rows of
    /// the ids outside it on the host (through a download and upload when the tensor is not
    /// host-accessible); GPU backends override it with a kernel.
    fn embedding_slice(&self, table: &Weight, ids: &[u32], first_id: u32, out: &mut Tensor) -> Result<()> {
        let (rows, _) = table.dims();
        let inside = |id: u32| id.checked_sub(first_id).filter(|&l| (l as usize) < rows);
        let local: Vec<u32> = ids.iter().map(|&id| inside(id).unwrap_or(0)).collect();
        self.embedding(table, &local, out)?;
        if ids.iter().all(|&id| inside(id).is_some()) {
            return Ok(());
        }
        let row_bytes = out.desc().bytes() / ids.len().max(1);
        let zero = |bytes: &mut [u8]| {
            for (t, &id) in ids.iter().enumerate() {
                if inside(id).is_none() {
                    bytes[t * row_bytes..(t + 1) * row_bytes].fill(0);
                }
            }
        };
        let n = out.desc().bytes();
        if let Some(bytes) = out.buffer_mut().host_bytes_mut() {
            zero(&mut bytes[..n]);
            return Ok(());
        }
        let mut host = vec![0u8; n];
        self.download(out, &mut host)?;
        zero(&mut host);
        self.upload(out, &host)
    }
    /// RMSNorm over rows of `weight.numel()` features: `out = x / rms(x) * weight`.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()>;
    /// Fused residual add and RMSNorm: `residual += x; out = rms_norm(residual)`.
    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()>;
    /// `out = x W^T (+ bias)` for `x: [n, cols]`, `W: [rows, cols]`, `out: [n, rows]`.
    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> Result<()>;
    /// Zeroes `t`. The default uploads zeros.
    fn fill_zero(&self, t: &mut Tensor) -> Result<()> {
        let zeros = vec![0u8; t.desc().bytes()];
        self.upload(t, &zeros)
    }
    /// Whether [`Ops::matmul_add_rms_norm_deferred`] may defer joins at all (default `false`):
    /// models ask before they allocate and zero the sums it needs.
    fn defers_norm_joins(&self) -> bool {
        false
    }
    /// [`Ops::matmul`] then [`Ops::add_rms_norm`] (`residual += x W^T; out = rms_norm(residual) *
    /// norm`) with the norm's per-row scale left to the ops that read `out`, which then get a
    /// [`DeferredNorm`] of `sums` and `slot` ([`Ops::gate_up_silu_deferred`],
    /// [`Ops::qkv_rope_write_kv_deferred`]); it saves the norm's kernel between two decode
    /// products. Returns `false` having done nothing when the backend does not defer this join
    /// (the default; the CUDA backend defers int4 decode products): the caller then runs the two
    /// ops. `slot` must be zero (see [`DeferredNorm::sums`]) and used by no other join of the step.
    #[allow(clippy::too_many_arguments)]
    fn matmul_add_rms_norm_deferred(
        &self,
        _x: &Tensor,
        _w: &Weight,
        _residual: &mut Tensor,
        _norm: &Tensor,
        _eps: f32,
        _out: &mut Tensor,
        _sums: &mut Tensor,
        _slot: usize,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Applies a deferred join's row scale to its output `x` in place (what the folding ops do
    /// inside their products). Only a backend that defers joins has such outputs; the default
    /// refuses.
    fn finish_deferred_norm(&self, _x: &mut Tensor, _norm: &DeferredNorm<'_>) -> Result<()> {
        Err(Error::invalid("this backend defers no RMSNorm, so it has none to finish"))
    }
    /// [`Ops::gate_up_silu`] of a deferred join's output `x`: the backend folds the row scale into
    /// the products where it can, else finishes the norm in `x` first (the default).
    #[allow(clippy::too_many_arguments)]
    fn gate_up_silu_deferred(
        &self,
        x: &mut Tensor,
        norm: &DeferredNorm<'_>,
        gate: &Weight,
        up: &Weight,
        gate_out: &mut Tensor,
        up_out: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        self.finish_deferred_norm(x, norm)?;
        self.gate_up_silu(x, gate, up, gate_out, up_out, out)
    }
    /// [`Ops::qkv_rope_write_kv`] of a deferred join's output `x`, as
    /// [`Ops::gate_up_silu_deferred`].
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_write_kv_deferred(
        &self,
        x: &mut Tensor,
        norm: &DeferredNorm<'_>,
        weights: [&Weight; 3],
        biases: [Option<&Tensor>; 3],
        qkv: [&mut Tensor; 3],
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        self.finish_deferred_norm(x, norm)?;
        self.qkv_rope_write_kv(x, weights, biases, qkv, k_cache, v_cache, positions, freqs, slot_mapping)
    }
    /// Products of one input with several weights of the same `cols` (a layer's q, k and v):
    /// `outs[i] = x W_i^T (+ biases[i])`. Backends may run them as one launch; the default calls
    /// [`Ops::matmul`] for each.
    fn matmul_many(
        &self,
        x: &Tensor,
        weights: &[&Weight],
        biases: &[Option<&Tensor>],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        matmul_each(self, x, weights, biases, outs)
    }
    /// The gated MLP input: `out = silu(x G^T) * (x U^T)`. `gate_out` and `up_out` (`[n, rows]`)
    /// are scratch: the default computes both products there and then [`Ops::silu_mul`];
    /// backends that fuse the three leave them unspecified.
    fn gate_up_silu(
        &self,
        x: &Tensor,
        gate: &Weight,
        up: &Weight,
        gate_out: &mut Tensor,
        up_out: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        gate_up_silu_unfused(self, x, gate, up, gate_out, up_out, out)
    }
    /// Rotates `x: [tokens, heads * head_dim]` in place; `head_dim = 2 * inv_freq.len()`.
    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> Result<()>;
    /// `out = silu(gate) * up`.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()>;
    /// `x += y`.
    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()>;
    /// Writes `k, v: [tokens, kv_heads * head_dim]` into the caches at `slot_mapping[t]`.
    fn write_kv(
        &self,
        k: &Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        slot_mapping: &[u32],
    ) -> Result<()>;
    /// RoPE on `q` and `k` and the KV-cache write of one layer, as one op: rotates `q` and `k`
    /// (`[tokens, heads * head_dim]` and `[tokens, kv_heads * head_dim]`) in place at
    /// `positions`, then writes the rotated `k` and `v` into the caches at `slot_mapping[t]` (the
    /// rotated `k` is what the cache holds). The same as [`Ops::rope`] on `q`, [`Ops::rope`] on
    /// `k`, then [`Ops::write_kv`], bit for bit: the default does exactly that
    /// ([`rope_write_kv_unfused`]); backends may run it as one launch.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        rope_write_kv_unfused(self, q, k, v, k_cache, v_cache, positions, freqs, slot_mapping)
    }
    /// A layer's q/k/v products of `x` ([`Ops::matmul_many`] with `weights` and `biases` into
    /// `q`, `k`, `v`) followed by [`Ops::rope_write_kv`]: the same values, bit for bit. The
    /// default does exactly that ([`qkv_rope_write_kv_unfused`]); backends may fold the RoPE and
    /// the cache write into the products' epilogue.
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_write_kv(
        &self,
        x: &Tensor,
        weights: [&Weight; 3],
        biases: [Option<&Tensor>; 3],
        qkv: [&mut Tensor; 3],
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        qkv_rope_write_kv_unfused(self, x, weights, biases, qkv, k_cache, v_cache, positions, freqs, slot_mapping)
    }
    /// Causal paged attention: `q: [tokens, heads * head_dim]` → `out` of the same shape. Query
    /// heads are grouped onto KV heads (GQA).
    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        meta: &AttentionMeta<'_>,
        out: &mut Tensor,
    ) -> Result<()>;
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()>;

    /// Copies chunks of `chunk_bytes` bytes within `t`: for each `(src, dst)`, chunk `src` onto
    /// chunk `dst` (KV-cache copy-on-write). The default works on host-accessible memory and
    /// otherwise goes through the host; device backends override it with device copies.
    fn copy_chunks(&self, t: &mut Tensor, chunk_bytes: usize, pairs: &[(u32, u32)]) -> Result<()> {
        let total = t.desc().bytes();
        if let Some(&(s, d)) = pairs.iter().find(|&&(s, d)| (s.max(d) as usize + 1) * chunk_bytes > total) {
            return Err(Error::invalid(format!(
                "chunk copy {s} -> {d} of {chunk_bytes} bytes is outside {total} bytes"
            )));
        }
        let copy = |bytes: &mut [u8]| {
            for &(s, d) in pairs {
                let (s, d) = (s as usize * chunk_bytes, d as usize * chunk_bytes);
                bytes.copy_within(s..s + chunk_bytes, d);
            }
        };
        if let Some(bytes) = t.buffer_mut().host_bytes_mut() {
            copy(bytes);
            return Ok(());
        }
        let mut staging = vec![0u8; total];
        self.download(t, &mut staging)?;
        copy(&mut staging);
        self.upload(t, &staging)
    }

    /// Draws one token per row of `logits: [n, vocab]`. The default downloads the logits and
    /// runs the host sampler; GPU backends override it to sample on the device.
    fn sample(&self, logits: &Tensor, requests: &mut [SampleRequest<'_>]) -> Result<Vec<u32>> {
        let shape = logits.shape();
        if shape.len() != 2 || shape[0] != requests.len() {
            return Err(Error::shape("sample", format!("[{}, vocab]", requests.len()), shape));
        }
        let all = self.download_f32(logits)?;
        let (mut row, mut scratch) = (Vec::new(), Vec::new());
        Ok(sample_rows(&all, shape[1], requests, &mut row, &mut scratch))
    }

    /// Downloads a float tensor as f32.
    fn download_f32(&self, src: &Tensor) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; src.desc().bytes()];
        self.download(src, &mut bytes)?;
        to_f32(src.dtype(), &bytes)
    }
}

/// Host sampling of `requests.len()` rows of `vocab` logits: penalties, then a draw per row.
/// `row` and `scratch` are reused between calls so a warm caller allocates nothing per token.
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    requests: &mut [SampleRequest<'_>],
    row: &mut Vec<f32>,
    scratch: &mut Vec<(f32, u32)>,
) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(requests.len());
    for (i, req) in requests.iter_mut().enumerate() {
        row.clear();
        row.extend_from_slice(&logits[i * vocab..(i + 1) * vocab]);
        apply_penalties(row, req.params, req.prompt, req.output);
        tokens.push(sample_from_logits(row, req.params, req.rng, scratch));
    }
    tokens
}

/// Converts host bytes of a float dtype (f8e4m3 included) to f32.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F8E4M3 => bytes.iter().map(|&b| crate::fp8::decode(b)).collect(),
        other => {
            return Err(Error::DType { op: "to_f32".into(), expected: "a float dtype".into(), got: other.to_string() })
        }
    })
}

/// [`Ops::matmul_many`] as one [`Ops::matmul`] per weight (the default, and a backend's
/// fallback when it cannot fuse).
pub fn matmul_each<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    weights: &[&Weight],
    biases: &[Option<&Tensor>],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    if weights.len() != outs.len() || biases.len() != outs.len() {
        return Err(Error::invalid(format!(
            "matmul_many: {} weights, {} biases and {} outputs",
            weights.len(),
            biases.len(),
            outs.len()
        )));
    }
    for ((w, b), out) in weights.iter().zip(biases).zip(outs.iter_mut()) {
        ops.matmul(x, w, *b, out)?;
    }
    Ok(())
}

/// [`Ops::rope_write_kv`] as [`Ops::rope`] on `q`, [`Ops::rope`] on `k` and [`Ops::write_kv`] of
/// the rotated `k` and `v` (the default, and a backend's fallback when it cannot fuse).
#[allow(clippy::too_many_arguments)]
pub fn rope_write_kv_unfused<O: Ops + ?Sized>(
    ops: &O,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    positions: &[u32],
    freqs: &RopeFreqs,
    slot_mapping: &[u32],
) -> Result<()> {
    ops.rope(q, positions, freqs)?;
    ops.rope(k, positions, freqs)?;
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
}

/// [`Ops::qkv_rope_write_kv`] as [`Ops::matmul_many`] then [`Ops::rope_write_kv`] (the default,
/// and a backend's fallback when it cannot fuse).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_write_kv_unfused<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    weights: [&Weight; 3],
    biases: [Option<&Tensor>; 3],
    qkv: [&mut Tensor; 3],
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    positions: &[u32],
    freqs: &RopeFreqs,
    slot_mapping: &[u32],
) -> Result<()> {
    let [q, k, v] = qkv;
    ops.matmul_many(x, &weights, &biases, &mut [&mut *q, &mut *k, &mut *v])?;
    ops.rope_write_kv(q, k, v, k_cache, v_cache, positions, freqs, slot_mapping)
}

/// [`Ops::gate_up_silu`] as two [`Ops::matmul`] calls and [`Ops::silu_mul`] (the default, and a
/// backend's fallback when it cannot fuse).
pub fn gate_up_silu_unfused<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    gate: &Weight,
    up: &Weight,
    gate_out: &mut Tensor,
    up_out: &mut Tensor,
    out: &mut Tensor,
) -> Result<()> {
    ops.matmul(x, gate, None, gate_out)?;
    ops.matmul(x, up, None, up_out)?;
    ops.silu_mul(gate_out, up_out, out)
}
