//! AWQ applied to one Llama-family decoder layer (Llama, Mistral, Qwen2, Qwen3 share the block).

use super::{apply_clip, search_clip, search_scales, AwqGemm, AwqParams, InputStats, Matrix};
use tm_core::{Error, Result};

/// The seven linear layers of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Linear {
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention output projection.
    O,
    /// MLP gate projection.
    Gate,
    /// MLP up projection.
    Up,
    /// MLP down projection.
    Down,
}

impl Linear {
    /// All seven, in the order the layer runs them.
    pub const ALL: [Linear; 7] = [Linear::Q, Linear::K, Linear::V, Linear::O, Linear::Gate, Linear::Up, Linear::Down];

    /// The module's Hugging Face name within a layer (`self_attn.q_proj`, ...).
    pub fn hf_name(self) -> &'static str {
        match self {
            Linear::Q => "self_attn.q_proj",
            Linear::K => "self_attn.k_proj",
            Linear::V => "self_attn.v_proj",
            Linear::O => "self_attn.o_proj",
            Linear::Gate => "mlp.gate_proj",
            Linear::Up => "mlp.up_proj",
            Linear::Down => "mlp.down_proj",
        }
    }
}

/// The float weights of one decoder layer (`[out, in]` matrices).
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderLayer {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection.
    pub q: Matrix,
    /// Key projection.
    pub k: Matrix,
    /// Value projection.
    pub v: Matrix,
    /// Query bias (Qwen2).
    pub q_bias: Option<Vec<f32>>,
    /// Key bias (Qwen2).
    pub k_bias: Option<Vec<f32>>,
    /// Value bias (Qwen2).
    pub v_bias: Option<Vec<f32>>,
    /// Attention output projection.
    pub o: Matrix,
    /// RMSNorm weight before the MLP.
    pub mlp_norm: Vec<f32>,
    /// MLP gate projection.
    pub gate: Matrix,
    /// MLP up projection.
    pub up: Matrix,
    /// MLP down projection.
    pub down: Matrix,
}

impl DecoderLayer {
    /// The weight of linear `l`.
    pub fn linear(&self, l: Linear) -> &Matrix {
        match l {
            Linear::Q => &self.q,
            Linear::K => &self.k,
            Linear::V => &self.v,
            Linear::O => &self.o,
            Linear::Gate => &self.gate,
            Linear::Up => &self.up,
            Linear::Down => &self.down,
        }
    }

    fn linear_mut(&mut self, l: Linear) -> &mut Matrix {
        match l {
            Linear::Q => &mut self.q,
            Linear::K => &mut self.k,
            Linear::V => &mut self.v,
            Linear::O => &mut self.o,
            Linear::Gate => &mut self.gate,
            Linear::Up => &mut self.up,
            Linear::Down => &mut self.down,
        }
    }

    /// Whether v's outputs are o's inputs one to one (no grouped-query attention), so that a
    /// scale of o's inputs can be folded into v.
    pub fn v_feeds_o(&self) -> bool {
        self.v.rows == self.o.cols
    }
}

/// Calibration statistics of the four distinct inputs of a layer's linears.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    /// The attention RMSNorm output (q, k, v read it).
    pub attn_in: InputStats,
    /// The attention output (o reads it).
    pub o_in: InputStats,
    /// The MLP RMSNorm output (gate and up read it).
    pub mlp_in: InputStats,
    /// `silu(gate) · up` (down reads it).
    pub down_in: InputStats,
}

impl LayerStats {
    /// The statistics of the input of linear `l`.
    pub fn input_of(&self, l: Linear) -> &InputStats {
        match l {
            Linear::Q | Linear::K | Linear::V => &self.attn_in,
            Linear::O => &self.o_in,
            Linear::Gate | Linear::Up => &self.mlp_in,
            Linear::Down => &self.down_in,
        }
    }
}

/// The per-channel scales of a layer's four input groups.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerScales {
    /// Of q, k, v's input (folded into the attention norm).
    pub attn_in: Vec<f32>,
    /// Of o's input (folded into v); `None` with grouped-query attention.
    pub o_in: Option<Vec<f32>>,
    /// Of gate and up's input (folded into the MLP norm).
    pub mlp_in: Vec<f32>,
    /// Of down's input (folded into up's rows).
    pub down_in: Vec<f32>,
}

/// Folds scales into the layer without changing what it computes: each group's weight columns
/// are multiplied by its scale and the producer of its input (norm weight, or v's and up's rows
/// and v's bias) divided by it.
pub fn apply_scales(layer: &mut DecoderLayer, s: &LayerScales) -> Result<()> {
    let check = |what: &str, want: usize, got: usize| {
        if want != got {
            Err(Error::shape(format!("{what} scales"), want, got))
        } else {
            Ok(())
        }
    };
    check("attention input", layer.attn_norm.len(), s.attn_in.len())?;
    check("MLP input", layer.mlp_norm.len(), s.mlp_in.len())?;
    check("down_proj input", layer.down.cols, s.down_in.len())?;
    let divide = |v: &mut [f32], s: &[f32]| v.iter_mut().zip(s).for_each(|(v, s)| *v /= s);
    divide(&mut layer.attn_norm, &s.attn_in);
    for w in [&mut layer.q, &mut layer.k, &mut layer.v] {
        w.mul_cols(&s.attn_in);
    }
    if let Some(so) = &s.o_in {
        if !layer.v_feeds_o() {
            return Err(Error::invalid("o_proj scales need v_proj outputs equal to o_proj inputs (no GQA)"));
        }
        check("o_proj input", layer.o.cols, so.len())?;
        layer.v.div_rows(so);
        if let Some(b) = &mut layer.v_bias {
            divide(b, so);
        }
        layer.o.mul_cols(so);
    }
    divide(&mut layer.mlp_norm, &s.mlp_in);
    layer.gate.mul_cols(&s.mlp_in);
    layer.up.mul_cols(&s.mlp_in);
    layer.up.div_rows(&s.down_in);
    layer.down.mul_cols(&s.down_in);
    Ok(())
}

/// The outcome of one group's scale search.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupReport {
    /// Which group: `qkv`, `o`, `gate_up` or `down`.
    pub name: &'static str,
    /// The chosen exponent (`None`: unscaled RTN won).
    pub alpha: Option<f32>,
    /// Output error with the chosen scales.
    pub loss: f64,
    /// Output error of plain round-to-nearest.
    pub rtn_loss: f64,
}

/// A quantized decoder layer: the (scaled) float tensors and the AutoAWQ GEMM linears.
#[derive(Clone, Debug)]
pub struct QuantizedLayer {
    /// The attention norm weight, divided by the q/k/v input scales.
    pub attn_norm: Vec<f32>,
    /// The MLP norm weight, divided by the gate/up input scales.
    pub mlp_norm: Vec<f32>,
    /// Query bias (unchanged).
    pub q_bias: Option<Vec<f32>>,
    /// Key bias (unchanged).
    pub k_bias: Option<Vec<f32>>,
    /// Value bias (divided by the o input scales, when those were folded into v).
    pub v_bias: Option<Vec<f32>>,
    /// The seven linears, in [`Linear::ALL`] order.
    pub linears: Vec<(Linear, AwqGemm)>,
    /// The scale searches (empty without them).
    pub groups: Vec<GroupReport>,
    /// Weight groups whose range the clipping search shrank.
    pub clipped_groups: usize,
}

/// Runs AWQ on one layer (see [`crate::awq_quantizer`]): scale search per group, folding,
/// clipping search, quantization. `prefix` (e.g. `model.layers.3`) names tensors in errors.
pub fn quantize_layer(
    mut layer: DecoderLayer,
    stats: &LayerStats,
    params: &AwqParams,
    prefix: &str,
) -> Result<QuantizedLayer> {
    let gs = params.group_size;
    let mut groups = Vec::new();
    let mut search = |name: &'static str, linears: &[&Matrix], st: &InputStats| -> Result<Vec<f32>> {
        let found = search_scales(linears, st, gs).map_err(|e| Error::invalid(format!("{prefix} {name}: {e}")))?;
        groups.push(GroupReport { name, alpha: found.alpha, loss: found.loss, rtn_loss: found.rtn_loss });
        Ok(found.scales)
    };
    let scales = if params.search_scales {
        let l = &layer;
        LayerScales {
            attn_in: search("qkv", &[&l.q, &l.k, &l.v], &stats.attn_in)?,
            o_in: if l.v_feeds_o() { Some(search("o", &[&l.o], &stats.o_in)?) } else { None },
            mlp_in: search("gate_up", &[&l.gate, &l.up], &stats.mlp_in)?,
            down_in: search("down", &[&l.down], &stats.down_in)?,
        }
    } else {
        let ones = |n: usize| vec![1.0f32; n];
        LayerScales {
            attn_in: ones(layer.attn_norm.len()),
            o_in: None,
            mlp_in: ones(layer.mlp_norm.len()),
            down_in: ones(layer.down.cols),
        }
    };
    apply_scales(&mut layer, &scales)?;
    let scaled = LayerStats {
        attn_in: stats.attn_in.scaled(&scales.attn_in),
        o_in: match &scales.o_in {
            Some(s) => stats.o_in.scaled(s),
            None => stats.o_in.clone(),
        },
        mlp_in: stats.mlp_in.scaled(&scales.mlp_in),
        down_in: stats.down_in.scaled(&scales.down_in),
    };
    let mut linears = Vec::with_capacity(7);
    let mut clipped_groups = 0;
    for l in Linear::ALL {
        let name = format!("{prefix}.{}", l.hf_name());
        if params.search_clip && !matches!(l, Linear::Q | Linear::K) {
            let w = layer.linear_mut(l);
            let max = search_clip(w, scaled.input_of(l), gs).map_err(|e| Error::invalid(format!("{name}: {e}")))?;
            clipped_groups += max
                .iter()
                .enumerate()
                .filter(|(i, m)| {
                    let (r, g) = (i / (w.cols / gs), i % (w.cols / gs));
                    w.row(r)[g * gs..(g + 1) * gs].iter().any(|v| v.abs() > **m)
                })
                .count();
            apply_clip(w, &max, gs);
        }
        linears.push((l, AwqGemm::quantize(layer.linear(l), gs, &name)?));
    }
    Ok(QuantizedLayer {
        attn_norm: layer.attn_norm,
        mlp_norm: layer.mlp_norm,
        q_bias: layer.q_bias,
        k_bias: layer.k_bias,
        v_bias: layer.v_bias,
        linears,
        groups,
        clipped_groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn mat(rows: usize, cols: usize, seed: u64) -> Matrix {
        Matrix::new(rows, cols, noise(rows * cols, seed)).unwrap()
    }

    fn layer(h: usize, kv: usize, inter: usize) -> DecoderLayer {
        DecoderLayer {
            attn_norm: noise(h, 1).iter().map(|v| 1.0 + 0.5 * v).collect(),
            q: mat(h, h, 2),
            k: mat(kv, h, 3),
            v: mat(kv, h, 4),
            q_bias: Some(noise(h, 5)),
            k_bias: None,
            v_bias: Some(noise(kv, 6)),
            o: mat(h, h, 7),
            mlp_norm: noise(h, 8).iter().map(|v| 1.0 + 0.5 * v).collect(),
            gate: mat(inter, h, 9),
            up: mat(inter, h, 10),
            down: mat(h, inter, 11),
        }
    }

    fn matvec(w: &Matrix, x: &[f32], bias: Option<&Vec<f32>>) -> Vec<f32> {
        (0..w.rows)
            .map(|o| w.row(o).iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + bias.map_or(0.0, |b| b[o]))
            .collect()
    }

    /// One token through the layer's linears (attention over a single token returns v):
    /// q, k, o(v) and down(silu(gate) · up), each after its RMSNorm.
    fn outputs(l: &DecoderLayer, x: &[f32]) -> Vec<Vec<f32>> {
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + 1e-6).sqrt();
        let h: Vec<f32> = x.iter().zip(&l.attn_norm).map(|(v, w)| v / rms * w).collect();
        let v = matvec(&l.v, &h, l.v_bias.as_ref());
        let h2: Vec<f32> = x.iter().zip(&l.mlp_norm).map(|(v, w)| v / rms * w).collect();
        let (g, u) = (matvec(&l.gate, &h2, None), matvec(&l.up, &h2, None));
        let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        vec![
            matvec(&l.q, &h, l.q_bias.as_ref()),
            matvec(&l.k, &h, l.k_bias.as_ref()),
            matvec(&l.o, &v, None),
            matvec(&l.down, &act, None),
        ]
    }

    #[test]
    fn folded_scales_leave_the_layer_unchanged() {
        let (h, inter) = (64, 96);
        let base = layer(h, h, inter);
        let pos = |n, seed| noise(n, seed).iter().map(|v| (1.5 * v).exp()).collect::<Vec<f32>>();
        let s =
            LayerScales { attn_in: pos(h, 20), o_in: Some(pos(h, 21)), mlp_in: pos(h, 22), down_in: pos(inter, 23) };
        let mut scaled = base.clone();
        apply_scales(&mut scaled, &s).unwrap();
        assert_ne!(scaled.q, base.q);
        let x = noise(h, 30);
        for (a, b) in outputs(&base, &x).iter().zip(outputs(&scaled, &x)) {
            for (a, b) in a.iter().zip(&b) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
        // With GQA, o's scales cannot be folded into v.
        let mut gqa = layer(h, 32, inter);
        assert!(apply_scales(&mut gqa, &s).is_err());
    }

    #[test]
    fn quantized_layer_has_every_linear_and_reports() {
        let (h, kv, inter) = (64, 32, 96);
        let l = layer(h, kv, inter);
        let stats_of = |c: usize, seed| {
            let mut st = InputStats::new(c);
            st.add_rows(&noise(40 * c, seed), 40).unwrap();
            st
        };
        let stats = LayerStats {
            attn_in: stats_of(h, 40),
            o_in: stats_of(h, 41),
            mlp_in: stats_of(h, 42),
            down_in: stats_of(inter, 43),
        };
        let q = quantize_layer(l.clone(), &stats, &AwqParams::awq(32), "model.layers.0").unwrap();
        assert_eq!(q.linears.iter().map(|(l, _)| *l).collect::<Vec<_>>(), Linear::ALL);
        // GQA: no o group.
        assert_eq!(q.groups.iter().map(|g| g.name).collect::<Vec<_>>(), ["qkv", "gate_up", "down"]);
        assert!(q.groups.iter().all(|g| g.loss <= g.rtn_loss));
        let rtn = quantize_layer(l.clone(), &stats, &AwqParams::rtn(32), "model.layers.0").unwrap();
        assert!(rtn.groups.is_empty() && rtn.clipped_groups == 0);
        assert_eq!((rtn.attn_norm, rtn.v_bias), (l.attn_norm.clone(), l.v_bias.clone()));
        let e = quantize_layer(l, &stats, &AwqParams::awq(64 + 32), "model.layers.0").unwrap_err().to_string();
        assert!(e.contains("model.layers.0") && e.contains("96"), "{e}");
    }
}
