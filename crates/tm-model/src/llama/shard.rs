//! Tensor-parallel sharding of the Llama graph: which part of every weight a rank holds, and
//! cutting that part out of a checkpoint tensor while loading.
//!
//! The split (Megatron-style, one all-reduce per attention and per MLP block):
//!
//! | weight | split | a rank holds |
//! |---|---|---|
//! | q_proj (+ bias) | column-parallel (output rows) | its query heads |
//! | k_proj, v_proj (+ biases) | column-parallel | the KV heads its query heads use |
//! | o_proj | row-parallel (input columns), then all-reduce | its query heads' columns |
//! | gate_proj, up_proj | column-parallel | `intermediate / world` rows |
//! | down_proj | row-parallel, then all-reduce | the same slice of columns |
//! | embed_tokens | vocab-parallel, then all-reduce | `vocab / world` rows; other ids give zeros |
//! | lm_head (or the tied embedding) | vocab-parallel, then all-gather | the same rows of logits |
//! | norms, q/k norm (per `head_dim`) | replicated | everything |
//!
//! Query heads are split evenly (`heads % world == 0`). When there are at least as many KV
//! heads as ranks they are split too (`kv_heads % world == 0`); when there are fewer, each KV
//! head is *replicated* on the `world / kv_heads` ranks whose query heads use it (`world %
//! kv_heads == 0`). When the vocabulary does not divide by the world, the embedding and LM head
//! are replicated instead of split (every rank computes all logits).
//!
//! Quantized matrices keep their groups whole: a column cut (o_proj, down_proj) must start and
//! end on group boundaries (32 columns for GGUF blocks), or loading fails naming the tensor and
//! the cut. Row cuts never split a group.
//!
//! Every cut is read straight from the checkpoint's memory map: a row cut is a sub-slice of the
//! tensor's bytes (no copy), a column cut copies only this rank's columns, row by row. No rank
//! ever materializes the whole tensor.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::{Encoding, TensorRef};
use std::ops::Range;
use tm_core::quant::Weight;
use tm_core::Ops;
use tm_quant::gguf::{import_gguf, GgufType};

/// Which rank of how many this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardSpec {
    /// This rank, in `0..world`.
    pub rank: usize,
    /// Number of ranks (the tensor-parallel degree, `--tp`).
    pub world: usize,
}

impl ShardSpec {
    /// The whole model on one rank.
    pub const SINGLE: ShardSpec = ShardSpec { rank: 0, world: 1 };

    /// Rank `rank` of `world`, checked.
    pub fn new(rank: usize, world: usize) -> Result<ShardSpec> {
        if world == 0 {
            return Err(ModelError::InvalidInput("--tp must be at least 1".into()));
        }
        if rank >= world {
            return Err(ModelError::InvalidInput(format!("rank {rank} is outside a world of {world} ranks")));
        }
        Ok(ShardSpec { rank, world })
    }
}

/// What one rank holds of a model (see the module docs). Ranges index the full model's heads,
/// MLP features and vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// The rank.
    pub spec: ShardSpec,
    /// Features per head.
    pub head_dim: usize,
    /// Residual width (never split).
    pub hidden: usize,
    /// This rank's query heads.
    pub heads: Range<usize>,
    /// The KV heads this rank holds (its query heads' KV heads).
    pub kv_heads: Range<usize>,
    /// This rank's MLP features.
    pub intermediate: Range<usize>,
    /// Vocabulary rows of the embedding and LM head on this rank (all of them when replicated).
    pub vocab: Range<usize>,
    /// The full vocabulary size.
    pub vocab_size: usize,
    /// Whether the embedding and LM head are split over the ranks (else replicated).
    pub vocab_parallel: bool,
}

impl ShardLayout {
    /// The layout of the whole model on one rank.
    pub fn single(cfg: &ModelConfig) -> ShardLayout {
        ShardLayout {
            spec: ShardSpec::SINGLE,
            head_dim: cfg.head_dim,
            hidden: cfg.hidden_size,
            heads: 0..cfg.num_heads,
            kv_heads: 0..cfg.num_kv_heads,
            intermediate: 0..cfg.intermediate_size,
            vocab: 0..cfg.vocab_size,
            vocab_size: cfg.vocab_size,
            vocab_parallel: false,
        }
    }

    /// The layout of rank `spec.rank` of `spec.world`, or an error saying why the model cannot be
    /// split that way and what `--tp` values can.
    pub fn new(cfg: &ModelConfig, spec: ShardSpec) -> Result<ShardLayout> {
        let spec = ShardSpec::new(spec.rank, spec.world)?;
        let w = spec.world;
        if w == 1 {
            return Ok(ShardLayout::single(cfg));
        }
        let (h, k, inter, vocab) = (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size);
        let bad = |m: String| Err(ModelError::InvalidInput(format!("--tp {w}: {m}")));
        if !h.is_multiple_of(w) {
            return bad(format!(
                "the model's {h} attention heads cannot be split evenly over {w} ranks (use a --tp that divides {h})"
            ));
        }
        if !k.is_multiple_of(w) && !w.is_multiple_of(k) {
            return bad(format!(
                "the model's {k} KV heads can be neither split evenly over {w} ranks nor replicated evenly on them \
                 (--tp must divide {k} or be a multiple of it)"
            ));
        }
        if !inter.is_multiple_of(w) {
            return bad(format!("the MLP width {inter} cannot be split evenly over {w} ranks"));
        }
        let r = spec.rank;
        let per = h / w;
        let heads = r * per..(r + 1) * per;
        let group = h / k; // query heads per KV head
        let kv_heads = if k >= w {
            r * (k / w)..(r + 1) * (k / w)
        } else {
            let j = heads.start / group;
            j..j + 1
        };
        let vocab_parallel = vocab.is_multiple_of(w);
        let vocab_rows = if vocab_parallel { r * (vocab / w)..(r + 1) * (vocab / w) } else { 0..vocab };
        if !vocab_parallel && r == 0 {
            tracing::info!(
                "--tp {w}: the vocabulary of {vocab} does not divide by {w}; the embedding and LM head are replicated"
            );
        }
        let per_inter = inter / w;
        Ok(ShardLayout {
            spec,
            head_dim: cfg.head_dim,
            hidden: cfg.hidden_size,
            heads,
            kv_heads,
            intermediate: r * per_inter..(r + 1) * per_inter,
            vocab: vocab_rows,
            vocab_size: vocab,
            vocab_parallel,
        })
    }

    /// The layouts of every rank of a world of `world`.
    pub fn all(cfg: &ModelConfig, world: usize) -> Result<Vec<ShardLayout>> {
        if world == 0 {
            return Err(ModelError::InvalidInput("--tp must be at least 1".into()));
        }
        (0..world).map(|rank| ShardLayout::new(cfg, ShardSpec { rank, world })).collect()
    }

    /// Whether the model is split over more than one rank.
    pub fn is_sharded(&self) -> bool {
        self.spec.world > 1
    }
    /// Width of this rank's q projection output.
    pub fn q_dim(&self) -> usize {
        self.heads.len() * self.head_dim
    }
    /// Width of this rank's k and v projection outputs.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads.len() * self.head_dim
    }
    /// This rank's MLP width.
    pub fn intermediate_size(&self) -> usize {
        self.intermediate.len()
    }
    /// Rows of this rank's embedding and LM head (its logits per token).
    pub fn vocab_rows(&self) -> usize {
        self.vocab.len()
    }
    /// Rows of q_proj (columns of o_proj) this rank holds.
    pub fn q_range(&self) -> Range<usize> {
        self.heads.start * self.head_dim..self.heads.end * self.head_dim
    }
    /// Rows of k_proj and v_proj this rank holds.
    pub fn kv_range(&self) -> Range<usize> {
        self.kv_heads.start * self.head_dim..self.kv_heads.end * self.head_dim
    }
    /// Whether the LM head's logits are gathered from every rank.
    pub fn gathers_logits(&self) -> bool {
        self.is_sharded() && self.vocab_parallel
    }

    /// The part of the checkpoint tensor with Hugging Face name `hf` this rank holds (the cuts
    /// the loader makes, by name; the memory plan sizes weights with it).
    pub(crate) fn cut_for(&self, hf: &str, cfg: &ModelConfig) -> Cut {
        let (q, kv, inter, vocab) = (cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size, cfg.vocab_size);
        let any = |names: &[&str]| names.iter().any(|n| hf.ends_with(n));
        if any(&["self_attn.q_proj.weight", "self_attn.q_proj.bias"]) {
            Cut::rows(self.q_range(), q)
        } else if any(&[
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
        ]) {
            Cut::rows(self.kv_range(), kv)
        } else if any(&["self_attn.o_proj.weight"]) {
            Cut::cols(self.q_range(), q)
        } else if any(&["mlp.gate_proj.weight", "mlp.up_proj.weight"]) {
            Cut::rows(self.intermediate.clone(), inter)
        } else if any(&["mlp.down_proj.weight"]) {
            Cut::cols(self.intermediate.clone(), inter)
        } else if any(&["model.embed_tokens.weight", "lm_head.weight"]) {
            Cut::rows(self.vocab.clone(), vocab)
        } else {
            Cut::Whole
        }
    }
}

/// Which part of a `[rows, cols]` checkpoint matrix (or a `[rows]` vector) to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// All of it.
    Whole,
    /// These rows (output features), every column.
    Rows(Range<usize>),
    /// These columns (input features), every row.
    Cols(Range<usize>),
}

impl Cut {
    /// `Rows(r)`, or `Whole` when `r` is every one of `n` rows.
    pub fn rows(r: Range<usize>, n: usize) -> Cut {
        if r == (0..n) {
            Cut::Whole
        } else {
            Cut::Rows(r)
        }
    }
    /// `Cols(c)`, or `Whole` when `c` is every one of `n` columns.
    pub fn cols(c: Range<usize>, n: usize) -> Cut {
        if c == (0..n) {
            Cut::Whole
        } else {
            Cut::Cols(c)
        }
    }
    /// The shape of the cut of a `shape` tensor.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            Cut::Whole => {}
            Cut::Rows(r) => {
                if let Some(first) = s.first_mut() {
                    *first = r.len();
                }
            }
            Cut::Cols(c) => {
                if let Some(last) = s.last_mut() {
                    *last = c.len();
                }
            }
        }
        s
    }
}

/// How a checkpoint matrix is cut.
enum Stored {
    /// Plain elements: rows and columns are byte ranges.
    Plain(tm_core::DType),
    /// GGUF blocks: rows are byte ranges, columns whole blocks.
    Gguf(GgufType),
    /// AWQ/GPTQ: repacked on the host into tm's int4 layout, then cut there.
    Repacked,
}

fn stored(t: &TensorRef<'_>) -> Result<Stored> {
    #[allow(unreachable_patterns)]
    match t.encoding {
        Encoding::Plain(d) => Ok(Stored::Plain(d)),
        Encoding::Q4_0 => Ok(Stored::Gguf(GgufType::Q4_0)),
        Encoding::Q4_1 => Ok(Stored::Gguf(GgufType::Q4_1)),
        Encoding::Q8_0 => Ok(Stored::Gguf(GgufType::Q8_0)),
        Encoding::Awq | Encoding::Gptq => Ok(Stored::Repacked),
        other => Err(ModelError::format(
            t.file,
            format!("tensor `{}`: tensor-parallel loading of {other:?} weights is not supported", t.name),
        )),
    }
}

/// The error for a column cut that would split quantization groups.
fn split_groups(t: &TensorRef<'_>, what: &str, group: usize, range: &Range<usize>) -> ModelError {
    ModelError::InvalidInput(format!(
        "tensor `{}` ({what}) cannot be split at columns {}..{}: quantization groups of {group} columns must stay \
         whole on a rank (choose a --tp for which each rank's share of heads × head_dim and of the MLP width is a \
         multiple of {group})",
        t.name, range.start, range.end
    ))
}

/// Rows or columns `range` of a host-side int4/int8 matrix; a column cut must keep its groups whole.
fn cut_host_quant(
    t: &TensorRef<'_>,
    q: &tm_quant::HostQuant,
    by_rows: bool,
    range: &Range<usize>,
) -> Result<tm_quant::HostQuant> {
    let int4 = q.mins.is_some();
    let row_bytes = if int4 { q.cols / 2 } else { q.cols };
    let groups = q.cols / q.group_size.max(1);
    let rows_of = |v: &[half::f16], width: usize| -> Vec<half::f16> {
        if by_rows {
            v[range.start * width..range.end * width].to_vec()
        } else {
            let (g0, g1) = (range.start / q.group_size, range.end / q.group_size);
            (0..q.rows).flat_map(|r| v[r * width + g0..r * width + g1].iter().copied()).collect()
        }
    };
    if by_rows {
        return Ok(tm_quant::HostQuant {
            rows: range.len(),
            cols: q.cols,
            group_size: q.group_size,
            packed: q.packed[range.start * row_bytes..range.end * row_bytes].to_vec(),
            scales: rows_of(&q.scales, groups),
            mins: q.mins.as_ref().map(|m| rows_of(m, groups)),
        });
    }
    if !range.start.is_multiple_of(q.group_size) || !range.len().is_multiple_of(q.group_size) {
        return Err(split_groups(t, &format!("{:?}", t.encoding), q.group_size, range));
    }
    // Groups are multiples of 32 columns, so an int4 column range is a byte range of each row.
    let (b0, b1) = if int4 { (range.start / 2, range.end / 2) } else { (range.start, range.end) };
    Ok(tm_quant::HostQuant {
        rows: q.rows,
        cols: range.len(),
        group_size: q.group_size,
        packed: copy_cols(&q.packed, q.rows, row_bytes, b0, b1 - b0),
        scales: rows_of(&q.scales, groups),
        mins: q.mins.as_ref().map(|m| rows_of(m, groups)),
    })
}

/// Copies bytes `start..start + len` of each of `rows` rows of `row_bytes` bytes.
fn copy_cols(bytes: &[u8], rows: usize, row_bytes: usize, start: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * len);
    for r in 0..rows {
        out.extend_from_slice(&bytes[r * row_bytes + start..r * row_bytes + start + len]);
    }
    out
}

/// The stored bytes a cut reads (for progress and the plan).
pub(crate) fn cut_stored_bytes(t: &TensorRef<'_>, cut: &Cut) -> u64 {
    let full: usize = t.shape.iter().product();
    let part: usize = cut.shape(&t.shape).iter().product();
    (t.stored_bytes() as u128 * part as u128 / full.max(1) as u128) as u64
}

/// Loads the `cut` of checkpoint matrix `t` (`[rows, cols]`) as a backend weight.
pub(crate) fn load_matrix_cut(ops: &dyn Ops, t: &TensorRef<'_>, cut: &Cut) -> Result<Weight> {
    let (by_rows, range) = match cut {
        Cut::Whole => return super::tensor_to_weight(ops, t),
        Cut::Rows(r) => (true, r.clone()),
        Cut::Cols(c) => (false, c.clone()),
    };
    let [rows, cols] = *t.shape.as_slice() else {
        return Err(ModelError::format(t.file, format!("`{}`: cannot cut a tensor of shape {:?}", t.name, t.shape)));
    };
    check_range(t, &range, if by_rows { rows } else { cols }, if by_rows { "rows" } else { "columns" })?;
    let out_shape = cut.shape(&t.shape);
    match stored(t)? {
        Stored::Repacked => {
            let host = crate::hf_quant::import_host(t)?;
            super::quant_load::upload_quant(ops, &cut_host_quant(t, &host, by_rows, &range)?)
        }
        Stored::Plain(d) => {
            if !d.is_float() {
                return Err(ModelError::format(t.file, format!("tensor `{}` is {d}, expected a float type", t.name)));
            }
            let row_bytes = d.storage_bytes(cols);
            let w = if by_rows {
                ops.load_dense(d, &out_shape, &t.bytes[range.start * row_bytes..range.end * row_bytes], "weights")?
            } else {
                let elem = d.storage_bytes(1);
                let host = copy_cols(t.bytes, rows, row_bytes, range.start * elem, range.len() * elem);
                ops.load_dense(d, &out_shape, &host, "weights")?
            };
            Ok(Weight::Dense(w))
        }
        Stored::Gguf(ty) => {
            let block = tm_quant::BLOCK;
            let row_bytes =
                ty.tensor_bytes(1, cols).map_err(|e| ModelError::format(t.file, format!("`{}`: {e}", t.name)))?;
            if t.bytes.len() != row_bytes * rows {
                return Err(ModelError::format(
                    t.file,
                    format!("`{}`: {} bytes for {rows} rows of {}", t.name, t.bytes.len(), ty.name()),
                ));
            }
            let host = if by_rows {
                import_gguf(ty, range.len(), cols, &t.bytes[range.start * row_bytes..range.end * row_bytes])
            } else {
                if !range.start.is_multiple_of(block) || !range.len().is_multiple_of(block) {
                    return Err(split_groups(t, ty.name(), block, &range));
                }
                let bb = ty.block_bytes();
                let staged = copy_cols(t.bytes, rows, row_bytes, range.start / block * bb, range.len() / block * bb);
                import_gguf(ty, rows, range.len(), &staged)
            }
            .map_err(|e| ModelError::format(t.file, format!("tensor `{}`: {e}", t.name)))?;
            super::quant_load::upload_quant(ops, &host)
        }
    }
}

/// Loads the rows `r` of a float vector (a bias).
pub(crate) fn load_vector_cut(ops: &dyn Ops, t: &TensorRef<'_>, r: &Range<usize>) -> Result<tm_core::Tensor> {
    let Encoding::Plain(d) = t.encoding else {
        return Err(ModelError::format(
            t.file,
            format!("tensor `{}` must be a float vector, found {:?}", t.name, t.encoding),
        ));
    };
    let len = t.shape.first().copied().unwrap_or(0);
    check_range(t, r, len, "rows")?;
    let e = d.storage_bytes(1);
    Ok(ops.load_dense(d, &[r.len()], &t.bytes[r.start * e..r.end * e], "weights")?)
}

fn check_range(t: &TensorRef<'_>, r: &Range<usize>, n: usize, what: &str) -> Result<()> {
    if r.start > r.end || r.end > n {
        return Err(ModelError::format(t.file, format!("`{}`: {what} {}..{} outside 0..{n}", t.name, r.start, r.end)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;
    use tm_core::rope::{RopeConfig, RopeScaling, RopeStyle};

    fn cfg(heads: usize, kv: usize, inter: usize, vocab: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            hidden_size: 64,
            intermediate_size: inter,
            num_layers: 1,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: 16,
            vocab_size: vocab,
            rms_norm_eps: 1e-5,
            rope: RopeConfig { dim: 16, base: 10000.0, scaling: RopeScaling::None, style: RopeStyle::Half },
            max_position_embeddings: 64,
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: None,
        }
    }

    #[test]
    fn kv_heads_split_or_replicated() {
        let c = cfg(8, 2, 128, 384);
        let l: Vec<_> = ShardLayout::all(&c, 4).unwrap();
        assert_eq!(l.iter().map(|l| l.heads.clone()).collect::<Vec<_>>(), [0..2, 2..4, 4..6, 6..8]);
        // 4 query heads per KV head: ranks 0-1 use KV head 0, ranks 2-3 KV head 1.
        assert_eq!(l.iter().map(|l| l.kv_heads.clone()).collect::<Vec<_>>(), [0..1, 0..1, 1..2, 1..2]);
        let l = ShardLayout::all(&c, 2).unwrap();
        assert_eq!(l[1].kv_heads, 1..2);
        assert_eq!(l[1].intermediate, 64..128);
        assert_eq!(l[1].vocab, 192..384);
        assert!(l[1].vocab_parallel);
        let l = ShardLayout::all(&cfg(8, 8, 128, 384), 8).unwrap();
        assert_eq!(l[5].kv_heads, 5..6);
    }

    #[test]
    fn impossible_splits_say_why() {
        let e = ShardLayout::new(&cfg(4, 2, 128, 384), ShardSpec { rank: 0, world: 3 }).unwrap_err().to_string();
        assert!(e.contains("--tp 3") && e.contains("4 attention heads"), "{e}");
        let e = ShardLayout::new(&cfg(12, 4, 120, 384), ShardSpec { rank: 0, world: 6 }).unwrap_err().to_string();
        assert!(e.contains("4 KV heads"), "{e}");
        let e = ShardLayout::new(&cfg(4, 4, 126, 384), ShardSpec { rank: 0, world: 4 }).unwrap_err().to_string();
        assert!(e.contains("MLP width 126"), "{e}");
        assert!(ShardSpec::new(2, 2).is_err() && ShardSpec::new(0, 0).is_err());
    }

    #[test]
    fn odd_vocab_is_replicated() {
        let l = ShardLayout::new(&cfg(4, 4, 128, 385), ShardSpec { rank: 1, world: 2 }).unwrap();
        assert!(!l.vocab_parallel && l.vocab == (0..385) && !l.gathers_logits());
    }
}
