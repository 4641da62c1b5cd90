//! RoPE on q and k plus the KV-cache write of one layer in one launch
//! ([`CudaBackend::fused_rope_write_kv`]): at batch-1 decode the separate `rope`, `rope` and
//! `write_kv` kernels are each mostly launch latency. `TM_CUDA_ROPE_KV=0` turns the fusion off
//! (the three kernels run instead; to compare).
//!
//! For int4 q/k/v at decode, the RoPE and the cache write go into the products' epilogue instead
//! ([`CudaBackend::fused_q4_qkv_rope`], `q4_gemv_ln_rope`; `TM_Q4_GEMV_ROPE=0` turns it off).

use std::sync::OnceLock;

use tm_core::checks::{self, rows_of};
use tm_core::ops::DeferredNorm;
use tm_core::quant::Weight;
use tm_core::rope::{RopeFreqs, RopeStyle};
use tm_core::{DType, Error, Result, Tensor};

use super::meta::Slot;
use super::{as_bytes, ptr, CudaBackend};
use crate::kernels::elementwise::{self as ew, RopeKvBuffers, RopeKvShape};
use crate::kernels::q4_gemv::{self, Q4Slot, RopeKv};

/// Whether the fused kernel is on (`TM_CUDA_ROPE_KV` is not `0`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_CUDA_ROPE_KV").map_or(true, |v| v.trim() != "0"))
}

impl CudaBackend {
    /// `Ops::rope_write_kv` as one `rope_write_kv` launch (`rope_write_kv_e4m3` for FP8
    /// caches), after the checks `rope` and `write_kv` make. `Ok(false)` (nothing done) when the
    /// fusion is turned off.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<bool> {
        if !enabled() {
            return Ok(false);
        }
        let head_dim = 2 * freqs.inv_freq.len();
        let tokens = positions.len();
        for (t, what) in [(&*q, "rope q"), (&*k, "rope k")] {
            if tokens == 0 || head_dim == 0 || !t.numel().is_multiple_of(tokens * head_dim) {
                return Err(Error::shape(what, format!("[{tokens}, heads * {head_dim}]"), t.shape()));
            }
        }
        if slot_mapping.len() != tokens {
            return Err(Error::invalid(format!(
                "rope_write_kv: {} kv slots for {tokens} positions (one per token)",
                slot_mapping.len()
            )));
        }
        // k: [tokens, width] with `width` the caches' row (so kv_heads * head_dim == width).
        checks::write_kv(k, v, k_cache, v_cache, slot_mapping)?;
        for (t, what) in [(&*q, "rope q"), (&*k, "k"), (v, "v")] {
            self.check(t, what)?;
        }
        let kv = self.check_kv(k_cache, v_cache)?;
        let shape = RopeKvShape {
            tokens,
            heads: q.numel() / (tokens * head_dim),
            kv_heads: k.numel() / (tokens * head_dim),
            head_dim,
            interleaved: freqs.style == RopeStyle::Interleaved,
        };
        let mut st = self.state()?;
        let buffers = RopeKvBuffers {
            q: ptr(q),
            k: ptr(k),
            v: ptr(v),
            k_cache: ptr(k_cache),
            v_cache: ptr(v_cache),
            positions: self.put(&mut st, Slot::Positions, as_bytes(positions))?,
            slots: self.put(&mut st, Slot::Slots, as_bytes(slot_mapping))?,
            inv_freq: self.put(&mut st, Slot::InvFreq, as_bytes(&freqs.inv_freq))?,
        };
        let fp8 = kv == DType::F8E4M3;
        ew::rope_write_kv(&self.gpu, self.dtype, &buffers, shape, freqs.attention_factor, fp8)?;
        Ok(true)
    }

    /// `Ops::qkv_rope_write_kv` as one `q4_gemv_ln_rope` launch: int4 q, k, v of one shape class
    /// ([`q4_gemv::fits`] and [`q4_gemv::rope_fits`]) and caches in the activation dtype.
    /// `Ok(false)` (nothing done) sends the caller to the products and `rope_write_kv`. With
    /// `norm`, `x` is a deferred join's output whose row scale the kernel applies.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_q4_qkv_rope(
        &self,
        x: &Tensor,
        weights: [&Weight; 3],
        biases: [Option<&Tensor>; 3],
        qkv: &mut [&mut Tensor; 3],
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
        norm: Option<&DeferredNorm<'_>>,
    ) -> Result<bool> {
        let [Weight::Int4(wq), Weight::Int4(wk), Weight::Int4(wv)] = weights else { return Ok(false) };
        let (cols, group) = (wq.cols, wq.group_size);
        if !q4_gemv::enabled() || [wk, wv].iter().any(|w| w.cols != cols || w.group_size != group) {
            return Ok(false);
        }
        if k_cache.dtype() != self.dtype || v_cache.dtype() != self.dtype {
            return Ok(false);
        }
        let n = rows_of("matmul input", x, cols)?;
        if positions.len() != n || slot_mapping.len() != n {
            return Ok(false);
        }
        let slots: [Q4Slot; 3] = self.q4_slots(n, &[wq, wk, wv], &biases, &qkv[..])?[..]
            .try_into()
            .map_err(|_| Error::invalid("q/k/v: three launch slots expected"))?;
        let head_dim = 2 * freqs.inv_freq.len();
        let interleaved = freqs.style == RopeStyle::Interleaved;
        if !q4_gemv::fits(self.dtype, n, cols, group, ptr(x), &slots)
            || !q4_gemv::rope_fits(cols, group, &slots, head_dim, interleaved)
        {
            return Ok(false);
        }
        self.check(x, "matmul input")?;
        let [_, k, v] = qkv;
        checks::write_kv(k, v, k_cache, v_cache, slot_mapping)?;
        let mut st = self.state()?;
        let rope = RopeKv {
            k_cache: ptr(k_cache),
            v_cache: ptr(v_cache),
            positions: self.put(&mut st, Slot::Positions, as_bytes(positions))?,
            slots: self.put(&mut st, Slot::Slots, as_bytes(slot_mapping))?,
            inv_freq: self.put(&mut st, Slot::InvFreq, as_bytes(&freqs.inv_freq))?,
            attention_factor: freqs.attention_factor,
            head_dim,
            interleaved,
        };
        let norm = norm.map(|d| self.norm_args(d)).transpose()?;
        q4_gemv::q4_gemv_rope(&self.gpu, self.dtype, ptr(x), n, cols, group, &slots, &rope, norm.as_ref())?;
        Ok(true)
    }
}
