//! Calibration: the float model run on the CPU over the calibration text, with the inputs of
//! every linear layer gathered into [`InputStats`] as they go by.
//!
//! The model graph (`tm_model::llama`) is not changed for this: [`Recorder`] is an [`Ops`] that
//! hands every kernel to the CPU backend and looks at the inputs of `matmul`. A forward step
//! calls `matmul` 7 times per layer in a fixed order (q, k, v, o, gate, up, down), then once for
//! the LM head; the recorder counts calls to know which linear it sees, and checks that k and v
//! (up) read the very tensor q (gate) read and that every width is the expected one, so a change
//! of the graph makes calibration fail loudly rather than gather the wrong statistics.

use anyhow::{bail, Context, Result};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use tm_core::ops::{AttentionMeta, SampleRequest};
use tm_core::quant::Weight;
use tm_core::rope::RopeFreqs;
use tm_core::{Allocator, DType, Device, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;
use tm_model::config::ModelConfig;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::tokenizer::Tokenizer;
use tm_quant::awq_quantizer::{InputStats, LayerStats};

/// The calibration text shipped with tm (varied English prose, dialogue and code).
pub const DEFAULT_CALIB: &str = include_str!("../../../../fixtures/calib/awq_calib.txt");

/// Matmuls per layer in a forward step: q, k, v, o, gate, up, down.
const PER_LAYER: usize = 7;

/// The calibration token sequences: the text tokenized in one piece and cut into `samples`
/// blocks of `seq_len` tokens (fewer when the text is shorter; a text shorter than one block is
/// one shorter block). AutoAWQ cuts its calibration set the same way.
pub fn chunks(tokenizer: &Tokenizer, text: &str, samples: usize, seq_len: usize) -> Result<Vec<Vec<u32>>> {
    let ids = tokenizer.encode(text, false).context("tokenizing the calibration text")?;
    if ids.is_empty() {
        bail!("the calibration text has no tokens");
    }
    let mut out: Vec<Vec<u32>> = ids.chunks_exact(seq_len).take(samples).map(<[u32]>::to_vec).collect();
    if out.is_empty() {
        out.push(ids);
    }
    Ok(out)
}

/// What the recorder keeps between calls.
#[derive(Debug)]
struct State {
    /// `matmul` calls seen.
    calls: usize,
    /// The tensor q (gate) read in the current layer, to check k and v (up) read the same.
    shared_input: usize,
    /// Statistics of the layers in `layers`.
    stats: Vec<LayerStats>,
}

/// An [`Ops`] that runs everything on the CPU backend and gathers the statistics of the linear
/// inputs of the layers `layers` (see the module docs).
#[derive(Debug)]
pub struct Recorder<'a> {
    inner: &'a CpuBackend,
    num_layers: usize,
    layers: Range<usize>,
    state: Mutex<State>,
}

/// Bytes of statistics one layer needs.
pub fn layer_stats_bytes(c: &ModelConfig) -> u64 {
    2 * InputStats::bytes_for(c.hidden_size)
        + InputStats::bytes_for(c.q_dim())
        + InputStats::bytes_for(c.intermediate_size)
}

impl<'a> Recorder<'a> {
    /// A recorder for the layers `layers` of a model of `config`.
    pub fn new(inner: &'a CpuBackend, config: &ModelConfig, layers: Range<usize>) -> Self {
        let (h, inter) = (config.hidden_size, config.intermediate_size);
        let stats = layers
            .clone()
            .map(|_| LayerStats {
                attn_in: InputStats::new(h),
                o_in: InputStats::new(config.q_dim()),
                mlp_in: InputStats::new(h),
                down_in: InputStats::new(inter),
            })
            .collect();
        let state = Mutex::new(State { calls: 0, shared_input: 0, stats });
        Recorder { inner, num_layers: config.num_layers, layers, state }
    }

    /// The statistics gathered; errors when the last step did not end after the LM head.
    pub fn finish(self) -> Result<Vec<LayerStats>> {
        let state = self.state.into_inner().map_err(|_| anyhow::anyhow!("calibration state poisoned"))?;
        if state.calls % (PER_LAYER * self.num_layers + 1) != 0 {
            bail!("calibration saw {} matmuls, not a whole number of forward steps", state.calls);
        }
        Ok(state.stats)
    }

    /// Looks at the input of one `matmul` call.
    fn record(&self, x: &Tensor) -> tm_core::Result<()> {
        let mut guard = self.state.lock().map_err(|_| tm_core::Error::invalid("calibration state poisoned"))?;
        let st = &mut *guard;
        let per_step = PER_LAYER * self.num_layers + 1;
        let idx = st.calls % per_step;
        st.calls += 1;
        let (layer, kind) = (idx / PER_LAYER, idx % PER_LAYER);
        if layer >= self.num_layers || !self.layers.contains(&layer) {
            return Ok(());
        }
        let id = x as *const Tensor as usize;
        let graph_changed = |what: &str| {
            tm_core::Error::invalid(format!(
                "calibration: layer {layer}: {what} (the model graph no longer runs q, k, v, o, gate, up, down in order)"
            ))
        };
        let stats = &mut st.stats[layer - self.layers.start];
        let target = match kind {
            0 | 4 => {
                let t = if kind == 0 { &mut stats.attn_in } else { &mut stats.mlp_in };
                st.shared_input = id;
                t
            }
            1 | 2 | 5 if id == st.shared_input => return Ok(()),
            1 | 2 | 5 => return Err(graph_changed("k, v or up read another input than q or gate")),
            3 => &mut stats.o_in,
            _ => &mut stats.down_in,
        };
        let rows = x.shape().first().copied().unwrap_or(0);
        if x.shape() != [rows, target.channels] {
            return Err(graph_changed(&format!(
                "a linear input of shape {:?}, expected [tokens, {}]",
                x.shape(),
                target.channels
            )));
        }
        target.add_rows(x.host::<f32>()?, rows)
    }
}

/// Runs the float model over `chunks` and returns the statistics of the layers `layers`.
pub fn collect(
    cpu: &CpuBackend,
    model: &LlamaModel,
    chunks: &[Vec<u32>],
    layers: Range<usize>,
) -> Result<Vec<LayerStats>> {
    let recorder = Recorder::new(cpu, &model.config, layers);
    let max_len = chunks.iter().map(Vec::len).max().unwrap_or(1);
    {
        let mut session = Session::new(model, &recorder, max_len, 16)?;
        for (i, chunk) in chunks.iter().enumerate() {
            session.truncate(0);
            session.append(chunk).with_context(|| format!("calibration sample {i} ({} tokens)", chunk.len()))?;
        }
    }
    recorder.finish()
}

impl Ops for Recorder<'_> {
    fn device(&self) -> Arc<dyn Device> {
        self.inner.device()
    }
    fn allocator(&self) -> &Arc<dyn Allocator> {
        self.inner.allocator()
    }
    fn activation_dtype(&self) -> DType {
        self.inner.activation_dtype()
    }
    fn weight_dtype(&self, src: DType) -> DType {
        self.inner.weight_dtype(src)
    }
    fn vector_dtype(&self, src: DType) -> DType {
        self.inner.vector_dtype(src)
    }
    fn run_step(&self, step: &mut (dyn FnMut() -> tm_core::Result<()> + Send)) -> tm_core::Result<()> {
        self.inner.run_step(step)
    }
    fn step_inputs_ready(&self, logit_rows: &[u32]) -> tm_core::Result<()> {
        self.inner.step_inputs_ready(logit_rows)
    }
    fn zeros(&self, desc: TensorDesc, phase: &str) -> tm_core::Result<Tensor> {
        self.inner.zeros(desc, phase)
    }
    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> tm_core::Result<()> {
        self.inner.upload(dst, src)
    }
    fn download(&self, src: &Tensor, dst: &mut [u8]) -> tm_core::Result<()> {
        self.inner.download(src, dst)
    }
    fn load_dense(&self, src_dtype: DType, shape: &[usize], src: &[u8], phase: &str) -> tm_core::Result<Tensor> {
        self.inner.load_dense(src_dtype, shape, src, phase)
    }
    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> tm_core::Result<()> {
        self.inner.embedding(table, ids, out)
    }
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> tm_core::Result<()> {
        self.inner.rms_norm(x, weight, eps, out)
    }
    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> tm_core::Result<()> {
        self.inner.add_rms_norm(x, residual, weight, eps, out)
    }
    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> tm_core::Result<()> {
        self.record(x)?;
        self.inner.matmul(x, w, bias, out)
    }
    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> tm_core::Result<()> {
        self.inner.rope(x, positions, freqs)
    }
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> tm_core::Result<()> {
        self.inner.silu_mul(gate, up, out)
    }
    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> tm_core::Result<()> {
        self.inner.add_in_place(x, y)
    }
    fn write_kv(
        &self,
        k: &Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        slot_mapping: &[u32],
    ) -> tm_core::Result<()> {
        self.inner.write_kv(k, v, k_cache, v_cache, slot_mapping)
    }
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
    ) -> tm_core::Result<()> {
        self.inner.rope_write_kv(q, k, v, k_cache, v_cache, positions, freqs, slot_mapping)
    }
    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        meta: &AttentionMeta<'_>,
        out: &mut Tensor,
    ) -> tm_core::Result<()> {
        self.inner.attention(q, k_cache, v_cache, meta, out)
    }
    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> tm_core::Result<()> {
        self.inner.gather_rows(x, rows, out)
    }
    fn sample(&self, logits: &Tensor, requests: &mut [SampleRequest<'_>]) -> tm_core::Result<Vec<u32>> {
        self.inner.sample(logits, requests)
    }
}
