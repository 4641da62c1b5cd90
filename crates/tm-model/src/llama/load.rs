//! Loading Llama-family weights from a [`TensorSource`] onto a backend.
//!
//! Hugging Face names are the canonical ones. InternLM2 checkpoints are mapped onto them:
//! `tok_embeddings` → `embed_tokens`, `attention.wo` → `self_attn.o_proj`, `feed_forward.w1/w3/w2`
//! → `mlp.gate/up/down_proj`, `attention_norm`/`ffn_norm` → `input/post_attention_layernorm`,
//! `output` → `lm_head`, and the packed `attention.wqkv` is split into q, k and v: its rows are
//! grouped per KV head, each group holding `heads/kv_heads` query heads, then one key head, then
//! one value head (`head_dim` rows each).
//!
//! A tensor-parallel rank loads only its part of each weight ([`super::shard`]).

use super::shard::{load_matrix_cut, load_vector_cut, Cut, ShardLayout};
use super::LayerWeights;
use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::weights::{Encoding, TensorRef, TensorSource};
use tm_core::quant::Weight;
use tm_core::{Ops, Tensor};

/// Loads tensors by their Hugging Face names, translating for the architecture.
pub(super) struct Loader<'a> {
    pub ops: &'a dyn Ops,
    pub src: &'a dyn TensorSource,
    pub cfg: &'a ModelConfig,
    /// The part of the model this rank holds.
    pub layout: &'a ShardLayout,
    /// Called with the bytes of each tensor loaded (for progress bars).
    pub on_tensor: &'a mut dyn FnMut(u64),
}

/// InternLM2's tensor name for a Hugging Face Llama name (see the module docs).
pub fn internlm2_name(hf: &str) -> String {
    hf.replace("model.embed_tokens", "model.tok_embeddings")
        .replace("self_attn.o_proj", "attention.wo")
        .replace("mlp.gate_proj", "feed_forward.w1")
        .replace("mlp.up_proj", "feed_forward.w3")
        .replace("mlp.down_proj", "feed_forward.w2")
        .replace("input_layernorm", "attention_norm")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("lm_head", "output")
}

impl<'a> Loader<'a> {
    fn get(&self, hf_name: &str) -> Result<TensorRef<'a>> {
        let src: &'a dyn TensorSource = self.src;
        match self.cfg.arch {
            Arch::InternLM2 => src.tensor(&internlm2_name(hf_name)),
            _ => src.tensor(hf_name),
        }
    }

    fn check_shape(t: &TensorRef<'_>, expected: &[usize]) -> Result<()> {
        if t.shape != expected {
            return Err(ModelError::TensorShape {
                name: t.name.clone(),
                path: t.file.to_path_buf(),
                expected: expected.to_vec(),
                got: t.shape.clone(),
                dtype: format!("{:?}", t.encoding),
            });
        }
        Ok(())
    }

    /// The part `cut` of a matrix `[rows, cols]`.
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize, cut: Cut) -> Result<Weight> {
        let t = self.get(name)?;
        Self::check_shape(&t, &[rows, cols])?;
        let w = load_matrix_cut(self.ops, &t, &cut)?;
        (self.on_tensor)(super::shard::cut_stored_bytes(&t, &cut));
        Ok(w)
    }

    /// Rows `range` of a vector of `len` (a bias), or all of it when `range` is `None`.
    pub fn vector_rows(&mut self, name: &str, len: usize, range: std::ops::Range<usize>) -> Result<Tensor> {
        if range == (0..len) {
            return self.vector(name, len);
        }
        let t = self.get(name)?;
        Self::check_shape(&t, &[len])?;
        let v = load_vector_cut(self.ops, &t, &range)?;
        (self.on_tensor)(super::shard::cut_stored_bytes(&t, &Cut::Rows(range)));
        Ok(v)
    }

    /// A vector of `len` (norm weights, biases), stored as the backend's activation dtype.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let t = self.get(name)?;
        Self::check_shape(&t, &[len])?;
        let Encoding::Plain(dtype) = t.encoding else {
            return Err(ModelError::format(
                t.file,
                format!("tensor `{name}` must be a float vector, found {:?}", t.encoding),
            ));
        };
        let v = self.ops.load_dense(dtype, &[len], t.bytes, "weights")?;
        (self.on_tensor)(t.bytes.len() as u64);
        Ok(v)
    }

    /// Whether a tensor exists (under the architecture's naming).
    pub fn has(&self, name: &str) -> bool {
        match self.cfg.arch {
            Arch::InternLM2 => self.src.contains(&internlm2_name(name)),
            _ => self.src.contains(name),
        }
    }

    /// q, k and v projections of layer `i`.
    fn qkv(&mut self, i: usize) -> Result<(Weight, Weight, Weight)> {
        let (c, l) = (self.cfg, self.layout);
        let p = format!("model.layers.{i}.self_attn");
        if c.arch != Arch::InternLM2 {
            let (q, kv) = (Cut::rows(l.q_range(), c.q_dim()), Cut::rows(l.kv_range(), c.kv_dim()));
            return Ok((
                self.matrix(&format!("{p}.q_proj.weight"), c.q_dim(), c.hidden_size, q)?,
                self.matrix(&format!("{p}.k_proj.weight"), c.kv_dim(), c.hidden_size, kv.clone())?,
                self.matrix(&format!("{p}.v_proj.weight"), c.kv_dim(), c.hidden_size, kv)?,
            ));
        }
        let name = format!("model.layers.{i}.attention.wqkv.weight");
        let src: &'a dyn TensorSource = self.src;
        let t = src.tensor(&name)?;
        Self::check_shape(&t, &[c.q_dim() + 2 * c.kv_dim(), c.hidden_size])?;
        let Encoding::Plain(dtype) = t.encoding else {
            return Err(ModelError::format(t.file, format!("`{name}`: quantized wqkv is not supported")));
        };
        let row_bytes = dtype.storage_bytes(c.hidden_size);
        let head_bytes = row_bytes * c.head_dim;
        let group = c.num_heads / c.num_kv_heads;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (g, chunk) in t.bytes.chunks(head_bytes * (group + 2)).enumerate() {
            if chunk.len() != head_bytes * (group + 2) {
                return Err(ModelError::format(t.file, format!("`{name}`: kv group {g} is truncated")));
            }
            if !l.kv_heads.contains(&g) {
                continue;
            }
            // This rank's query heads of KV group g.
            let heads = l.heads.start.max(g * group)..l.heads.end.min((g + 1) * group);
            q.extend_from_slice(&chunk[(heads.start - g * group) * head_bytes..(heads.end - g * group) * head_bytes]);
            k.extend_from_slice(&chunk[group * head_bytes..(group + 1) * head_bytes]);
            v.extend_from_slice(&chunk[(group + 1) * head_bytes..]);
        }
        let load = |bytes: &[u8], rows| self.ops.load_dense(dtype, &[rows, c.hidden_size], bytes, "weights");
        let out = (
            Weight::Dense(load(&q, l.q_dim())?),
            Weight::Dense(load(&k, l.kv_dim())?),
            Weight::Dense(load(&v, l.kv_dim())?),
        );
        (self.on_tensor)((q.len() + k.len() + v.len()) as u64);
        Ok(out)
    }

    /// Every weight of layer `i`.
    pub fn layer(&mut self, i: usize) -> Result<LayerWeights> {
        let (c, lay) = (self.cfg, self.layout);
        let p = format!("model.layers.{i}");
        let (q, k, v) = self.qkv(i)?;
        let bias = |l: &mut Self, n: &str, len, range| -> Result<Option<Tensor>> {
            if c.qkv_bias {
                Ok(Some(l.vector_rows(&format!("{p}.self_attn.{n}.bias"), len, range)?))
            } else {
                Ok(None)
            }
        };
        let qkv_bias = (
            bias(self, "q_proj", c.q_dim(), lay.q_range())?,
            bias(self, "k_proj", c.kv_dim(), lay.kv_range())?,
            bias(self, "v_proj", c.kv_dim(), lay.kv_range())?,
        );
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (mlp_rows, mlp_cols) =
            (Cut::rows(lay.intermediate.clone(), inter), Cut::cols(lay.intermediate.clone(), inter));
        let qk_norm = if c.qk_norm {
            Some((
                self.vector(&format!("{p}.self_attn.q_norm.weight"), c.head_dim)?,
                self.vector(&format!("{p}.self_attn.k_norm.weight"), c.head_dim)?,
            ))
        } else {
            None
        };
        let o =
            self.matrix(&format!("{p}.self_attn.o_proj.weight"), h, c.q_dim(), Cut::cols(lay.q_range(), c.q_dim()))?;
        let mlp_norm = self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?;
        let mut gate = self.matrix(&format!("{p}.mlp.gate_proj.weight"), inter, h, mlp_rows.clone())?;
        let mut up = self.matrix(&format!("{p}.mlp.up_proj.weight"), inter, h, mlp_rows)?;
        // The order the backend's gate/up/SiLU decode kernel reads fastest (in place).
        self.ops.prepare_gate_up(&mut gate, &mut up)?;
        Ok(LayerWeights {
            attn_norm: self.vector(&format!("{p}.input_layernorm.weight"), c.hidden_size)?,
            q,
            k,
            v,
            qkv_bias,
            qk_norm,
            o,
            mlp_norm,
            gate,
            up,
            down: self.matrix(&format!("{p}.mlp.down_proj.weight"), h, inter, mlp_cols)?,
        })
    }
}

/// Turns a checkpoint tensor into a backend weight: dense floats widened or kept as the backend
/// prefers, GGUF blocks imported into tm's int4/int8 layout without expanding, AWQ/GPTQ matrices
/// repacked into the int4 layout ([`crate::hf_quant`]).
pub fn tensor_to_weight(ops: &dyn Ops, t: &TensorRef<'_>) -> Result<Weight> {
    match t.encoding {
        Encoding::Plain(d) if d.is_float() => Ok(Weight::Dense(ops.load_dense(d, &t.shape, t.bytes, "weights")?)),
        Encoding::Plain(d) => {
            Err(ModelError::format(t.file, format!("tensor `{}` has dtype {d}, expected a float type", t.name)))
        }
        Encoding::Q4_0 | Encoding::Q4_1 | Encoding::Q8_0 => crate::llama::quant_load::import_gguf_weight(ops, t),
        Encoding::Awq | Encoding::Gptq => crate::hf_quant::import_matrix(ops, t),
    }
}
