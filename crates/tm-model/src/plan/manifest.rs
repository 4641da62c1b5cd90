//! Which tensors the Llama loader reads and how many bytes the backend will hold for each,
//! computed from the checkpoint's headers alone (no tensor data is read).
//!
//! This mirrors `llama::load` tensor for tensor; `tests/plan_weights.rs` checks that the total
//! equals [`crate::llama::LlamaModel::weight_bytes`] after a real load on every fixture.

use super::WeightPolicy;
use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::llama::shard::{Cut, ShardLayout};
use crate::weights::{Encoding, TensorRef, TensorSource};
use serde::Serialize;
use tm_core::DType;
use tm_quant::BLOCK;

/// Weights of one stored encoding that the backend holds in one layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WeightGroup {
    /// How the checkpoint stores them: a dtype (`bf16`, `f32`, ...), a GGUF block type (`Q4_1`, ...)
    /// or an AWQ/GPTQ packing with its group size (`AWQ g128`, `GPTQ g32`).
    pub stored: String,
    /// How the backend holds them: a dtype, or tm's `int4`/`int8` group layout.
    pub held: String,
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes in the checkpoint.
    pub stored_bytes: u64,
    /// Bytes the backend holds.
    pub held_bytes: u64,
}

/// The weights of a checkpoint as the backend will hold them.
#[derive(Clone, Debug, Default)]
pub(super) struct WeightSummary {
    /// Per (stored, held) pair, in order of first appearance.
    pub groups: Vec<WeightGroup>,
    /// Sum of `held_bytes`.
    pub held: u64,
    /// Sum of `stored_bytes`.
    pub stored: u64,
    /// The largest host buffer one tensor's conversion needs while loading (widening to f32,
    /// GGUF import, InternLM2's q/k/v split); zero when every tensor is copied as stored.
    pub staging: u64,
    /// Whether any matrix is int4/int8 (the CPU kernels then quantize activations to int8).
    pub any_quantized: bool,
    /// The most columns of a dense matrix held as f16/bf16 (the CPU backend widens panels of
    /// its rows as it multiplies); zero when there is none.
    pub half_matrix_cols: usize,
    /// Like `staging`, over the tensors that are not held exactly as stored (what a zero-copy
    /// backend still converts through host memory).
    pub staging_copied: u64,
    /// Held bytes of dense tensors held exactly as stored (what a zero-copy backend reads in
    /// place from the file pages).
    pub as_stored: u64,
}

impl WeightSummary {
    fn add(&mut self, stored: String, held: String, stored_bytes: u64, held_bytes: u64, staging: u64) {
        match self.groups.iter_mut().find(|g| g.stored == stored && g.held == held) {
            Some(g) => {
                g.tensors += 1;
                g.stored_bytes += stored_bytes;
                g.held_bytes += held_bytes;
            }
            None => self.groups.push(WeightGroup { stored, held, tensors: 1, stored_bytes, held_bytes }),
        }
        self.held += held_bytes;
        self.stored += stored_bytes;
        self.staging = self.staging.max(staging);
    }
}

/// Whether a checkpoint tensor is a matrix (`y = x Wᵀ`, may be quantized) or a float vector.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Matrix,
    Vector,
}

struct Walker<'a> {
    src: &'a dyn TensorSource,
    cfg: &'a ModelConfig,
    /// How matrices are held.
    policy: WeightPolicy,
    /// How vectors are held.
    vectors: WeightPolicy,
    /// The tensor-parallel rank planned for (the whole model when not split).
    layout: &'a ShardLayout,
    out: WeightSummary,
}

/// `part` of `whole`, rounded down (exact for the even splits sharding makes).
fn share(bytes: u64, (part, whole): (u64, u64)) -> u64 {
    (bytes as u128 * part as u128 / whole.max(1) as u128) as u64
}

/// `(stored label, held label, held bytes, staging bytes)` of a tensor.
type Sized = (String, String, u64, u64);

impl Walker<'_> {
    fn name(&self, hf: &str) -> String {
        match self.cfg.arch {
            Arch::InternLM2 => crate::llama::internlm2_name(hf),
            _ => hf.to_string(),
        }
    }

    fn has(&self, hf: &str) -> bool {
        self.src.contains(&self.name(hf))
    }

    fn size(&self, t: &TensorRef<'_>, kind: Kind) -> Result<Sized> {
        let (name, encoding, shape) = (&t.name, t.encoding, t.shape.as_slice());
        let loc = self.src.location();
        let numel: usize = shape.iter().product();
        match encoding {
            Encoding::Plain(d) if d.is_float() => {
                let held = if kind == Kind::Vector { self.vectors.dense(d) } else { self.policy.dense(d) };
                let bytes = held.storage_bytes(numel) as u64;
                let staging = if held == d { 0 } else { bytes };
                Ok((d.to_string(), held.to_string(), bytes, staging))
            }
            Encoding::Plain(d) => {
                Err(ModelError::format(loc, format!("tensor `{name}` has dtype {d}, expected a float type")))
            }
            q if kind == Kind::Vector => {
                Err(ModelError::format(loc, format!("tensor `{name}` must be a float vector, found {q:?}")))
            }
            Encoding::Awq | Encoding::Gptq => {
                let (Some(parts), &[rows, cols]) = (t.parts.as_deref(), shape) else {
                    return Err(ModelError::format(loc, format!("`{name}`: quantized tensor of shape {shape:?}")));
                };
                let bytes = crate::hf_quant::int4_bytes(rows, cols, parts.group_size);
                let stored =
                    format!("{} g{}", if encoding == Encoding::Awq { "AWQ" } else { "GPTQ" }, parts.group_size);
                // The repacking builds the tm layout in host memory, then uploads it.
                Ok((stored, "int4".to_string(), bytes, bytes))
            }
            q => {
                let [rows, cols] = *shape else {
                    return Err(ModelError::format(loc, format!("`{name}`: quantized tensor of shape {shape:?}")));
                };
                if !cols.is_multiple_of(BLOCK) {
                    return Err(ModelError::format(
                        loc,
                        format!("tensor `{name}`: {cols} columns is not a multiple of the {BLOCK}-value GGUF block"),
                    ));
                }
                let groups = (rows * (cols / BLOCK)) as u64;
                let (held, bytes) = match q {
                    Encoding::Q8_0 => ("int8", (rows * cols) as u64 + 2 * groups),
                    _ => ("int4", (rows * cols / 2) as u64 + 4 * groups),
                };
                // The import builds the tm layout in host memory, then uploads it.
                Ok((format!("{q:?}"), held.to_string(), bytes, bytes))
            }
        }
    }

    fn tensor(&mut self, hf: &str, expected: &[usize], kind: Kind) -> Result<()> {
        let t = self.src.tensor(&self.name(hf))?;
        if t.shape != expected {
            return Err(ModelError::TensorShape {
                name: t.name.clone(),
                path: t.file.to_path_buf(),
                expected: expected.to_vec(),
                got: t.shape.clone(),
                dtype: format!("{:?}", t.encoding),
            });
        }
        let (stored, held, bytes, staging) = self.size(&t, kind)?;
        self.out.any_quantized |= !matches!(t.encoding, Encoding::Plain(_));
        let cut = self.layout.cut_for(hf, self.cfg);
        if let (Kind::Matrix, Encoding::Plain(d)) = (kind, t.encoding) {
            if matches!(self.policy.dense(d), DType::F16 | DType::BF16) {
                let cols = cut.shape(&t.shape).last().copied().unwrap_or(0);
                self.out.half_matrix_cols = self.out.half_matrix_cols.max(cols);
            }
        }
        // Held as stored and not cut: the bytes of the file are the bytes the kernels read.
        let in_place = matches!(t.encoding, Encoding::Plain(_)) && stored == held && matches!(cut, Cut::Whole);
        if in_place {
            self.out.as_stored += bytes;
        }
        // A tensor-parallel rank holds its cut; a column cut is first copied out row by row.
        let whole: usize = t.shape.iter().product();
        let f = (cut.shape(&t.shape).iter().product::<usize>() as u64, whole as u64);
        let copied = if matches!(cut, Cut::Cols(_)) { share(t.stored_bytes(), f) } else { 0 };
        // AWQ/GPTQ matrices are repacked whole on the host before the cut.
        let staging = if matches!(t.encoding, Encoding::Awq | Encoding::Gptq) { staging } else { share(staging, f) };
        self.out.add(stored, held, share(t.stored_bytes(), f), share(bytes, f), staging + copied);
        if !in_place {
            self.out.staging_copied = self.out.staging_copied.max(staging + copied);
        }
        Ok(())
    }

    /// InternLM2's packed `wqkv`: split on the host into q, k and v, each loaded dense.
    fn wqkv(&mut self, i: usize) -> Result<()> {
        let c = self.cfg;
        let name = format!("model.layers.{i}.attention.wqkv.weight");
        let t = self.src.tensor(&name)?;
        let expected = [c.q_dim() + 2 * c.kv_dim(), c.hidden_size];
        if t.shape != expected {
            return Err(ModelError::TensorShape {
                name: t.name.clone(),
                path: t.file.to_path_buf(),
                expected: expected.to_vec(),
                got: t.shape.clone(),
                dtype: format!("{:?}", t.encoding),
            });
        }
        let Encoding::Plain(d) = t.encoding else {
            return Err(ModelError::format(t.file, format!("`{name}`: quantized wqkv is not supported")));
        };
        let (stored, held, bytes, _) = self.size(&t, Kind::Matrix)?;
        // Staging: the q, k and v row copies (the stored bytes), plus q widened while it loads.
        let held_dtype = self.policy.dense(d);
        let widened_q = if held_dtype == d { 0 } else { held_dtype.storage_bytes(c.q_dim() * c.hidden_size) as u64 };
        // A tensor-parallel rank keeps only its heads' rows.
        let l = self.layout;
        let f = ((l.q_dim() + 2 * l.kv_dim()) as u64, (c.q_dim() + 2 * c.kv_dim()) as u64);
        let stored_part = share(t.bytes.len() as u64, f);
        let staging = stored_part + share(widened_q, f);
        self.out.add(stored, held, stored_part, share(bytes, f), staging);
        self.out.staging_copied = self.out.staging_copied.max(staging);
        Ok(())
    }

    fn layer(&mut self, i: usize) -> Result<()> {
        let c = self.cfg;
        let p = format!("model.layers.{i}");
        let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        if c.arch == Arch::InternLM2 {
            self.wqkv(i)?;
        } else {
            self.tensor(&format!("{p}.self_attn.q_proj.weight"), &[q, h], Kind::Matrix)?;
            self.tensor(&format!("{p}.self_attn.k_proj.weight"), &[kv, h], Kind::Matrix)?;
            self.tensor(&format!("{p}.self_attn.v_proj.weight"), &[kv, h], Kind::Matrix)?;
        }
        if c.qkv_bias {
            self.tensor(&format!("{p}.self_attn.q_proj.bias"), &[q], Kind::Vector)?;
            self.tensor(&format!("{p}.self_attn.k_proj.bias"), &[kv], Kind::Vector)?;
            self.tensor(&format!("{p}.self_attn.v_proj.bias"), &[kv], Kind::Vector)?;
        }
        if c.qk_norm {
            self.tensor(&format!("{p}.self_attn.q_norm.weight"), &[c.head_dim], Kind::Vector)?;
            self.tensor(&format!("{p}.self_attn.k_norm.weight"), &[c.head_dim], Kind::Vector)?;
        }
        self.tensor(&format!("{p}.input_layernorm.weight"), &[h], Kind::Vector)?;
        self.tensor(&format!("{p}.self_attn.o_proj.weight"), &[h, q], Kind::Matrix)?;
        self.tensor(&format!("{p}.post_attention_layernorm.weight"), &[h], Kind::Vector)?;
        self.tensor(&format!("{p}.mlp.gate_proj.weight"), &[inter, h], Kind::Matrix)?;
        self.tensor(&format!("{p}.mlp.up_proj.weight"), &[inter, h], Kind::Matrix)?;
        self.tensor(&format!("{p}.mlp.down_proj.weight"), &[h, inter], Kind::Matrix)
    }
}

/// Walks every tensor the Llama loader would load and sizes it under `policy`, as the rank
/// `layout` describes holds it.
pub(super) fn summarize(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    (policy, vectors): (WeightPolicy, WeightPolicy),
    layout: &ShardLayout,
) -> Result<WeightSummary> {
    let mut w = Walker { src, cfg, policy, vectors, layout, out: WeightSummary::default() };
    let (vocab, h) = (cfg.vocab_size, cfg.hidden_size);
    w.tensor("model.embed_tokens.weight", &[vocab, h], Kind::Matrix)?;
    for i in 0..cfg.num_layers {
        w.layer(i)?;
    }
    w.tensor("model.norm.weight", &[h], Kind::Vector)?;
    if !cfg.tie_word_embeddings || w.has("lm_head.weight") {
        w.tensor("lm_head.weight", &[vocab, h], Kind::Matrix)?;
    }
    Ok(w.out)
}

/// The dtype a dense tensor stored as `stored` is held in under `policy`.
pub(super) fn dense_dtype(policy: WeightPolicy, stored: DType) -> DType {
    match policy {
        WeightPolicy::Stored => stored,
        WeightPolicy::Widen(to) => to,
        WeightPolicy::PerDtype { f32, f16, bf16 } => match stored {
            DType::F32 => f32,
            DType::F16 => f16,
            DType::BF16 => bf16,
            other => other,
        },
    }
}
