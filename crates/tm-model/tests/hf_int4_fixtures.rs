//! AWQ and GPTQ int4 checkpoints (fixtures/llama-awq and fixtures/llama-gptq, made by
//! scripts/make_quant_fixtures.py): tm's CPU logits against transformers run on the dequantized
//! weights, and the loader's errors for checkpoints tm cannot load.
//!
//! # Tolerance
//! The reference is transformers with the projections' weights replaced by `(q - z) * s` in f32.
//! tm differs from it in two separable ways:
//! 1. **The layout.** tm's int4 layout holds `q * s + min` with `min = f16(-z * s)`, which moves
//!    every weight of a group by the same amount, at most `s / 128` (1/128 of a quantization
//!    step; see `tm_quant::zero_point`). The generator measures what this alone does to the
//!    logits, in transformers: `f16_min_logit_change` per prompt (4.8e-3 and 7.4e-3 here, 0.08%
//!    and 0.13% of the logit range: the offsets are coherent across a group, so they add up).
//! 2. **The kernel.** The CPU int4 matmul quantizes activations to int16 per block of 32
//!    (error bound `8.6e-5 * |x| * |w|` per output, `tm_cpu::quant_matmul::ACT_QUANT_REL_ERROR`),
//!    plus f32 summation order and the reference's 6 significant digits. Checked directly
//!    against `last_logits_f16_min` (transformers run on exactly the weights tm holds) with the
//!    float fixtures' tolerance, [`KERNEL_TOL`] of the logit range; measured up to 1.8e-4, 3e-5
//!    of the range.
//!
//! So the logits at every position must be within `f16_min_logit_change + KERNEL_TOL * range` of
//! the dequantized-weight reference (measured: 7.4e-3 against 1.3e-2), and the kernel part is
//! also asserted to use at most a tenth of its budget, so that a regression cannot hide in it.
//! Greedy tokens are compared while transformers' top1-top2 margin exceeds twice the tolerance;
//! from the first near-tie on (margins of 0.002-0.005 at steps 5 and 10 here) either token is a
//! correct answer and the sequences may part, so the rest is not compared.

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tm_core::sampling::argmax;
use tm_cpu::CpuBackend;
use tm_model::config::ModelConfig;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::loader::Checkpoint;
use tm_model::plan::{estimate, PlanRequest, PlanTarget};
use tm_model::weights::{Encoding, SafetensorsCheckpoint, TensorSource};

/// Allowed kernel error (int16 activations, summation order), as a fraction of the prompt's
/// logit range: the float fixtures' tolerance.
const KERNEL_TOL: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// The worst errors seen on one fixture, as fractions of the logit range.
struct Measured {
    /// Against the dequantized-weight reference, all positions.
    exact: f32,
    /// Against transformers on the weights as tm holds them (last position).
    kernel: f32,
}

/// Checks a quantized fixture against its reference.
fn check_fixture(name: &str) -> Measured {
    let dir = fixture(name);
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let ops = CpuBackend::new();
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let model = LlamaModel::load(&ops, &ckpt, cfg, &mut |_| {}).unwrap();
    let vocab = model.config.vocab_size;
    let mut worst = Measured { exact: 0.0, kernel: 0.0 };
    for (pi, prompt) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt_ids = ids(&prompt["ids"]);
        let mut session = Session::new(&model, &ops, 256, 4).unwrap();
        let got = session.prompt_logits(&prompt_ids).unwrap();
        let want: Vec<Vec<f32>> = prompt["logits"].as_array().unwrap().iter().map(floats).collect();
        assert_eq!(got.len(), want.len() * vocab);
        let (mut lo, mut hi, mut max_diff) = (f32::MAX, f32::MIN, 0f32);
        for (pos, row) in want.iter().enumerate() {
            for (j, &w) in row.iter().enumerate() {
                lo = lo.min(w);
                hi = hi.max(w);
                max_diff = max_diff.max((got[pos * vocab + j] - w).abs());
            }
        }
        let range = hi - lo;
        let kernel_tol = KERNEL_TOL * range;
        let layout = prompt["f16_min_logit_change"].as_f64().unwrap() as f32;
        let tol = layout + kernel_tol;

        // The kernel alone: the last position against transformers on tm's own weights.
        let as_tm = floats(&prompt["last_logits_f16_min"]);
        let last = &got[(want.len() - 1) * vocab..];
        let kernel_diff = last.iter().zip(&as_tm).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!(
            "{name} prompt {pi}: logit range {range:.3}; max |logit diff| vs dequantized weights {max_diff:.3e} \
             (tolerance {tol:.3e} = f16-min layout {layout:.3e} + kernel {kernel_tol:.3e}); \
             vs tm's own weights {kernel_diff:.3e}"
        );
        assert!(kernel_diff <= kernel_tol, "{name}: kernel error {kernel_diff} > {kernel_tol}");
        assert!(max_diff <= tol, "{name}: max |logit diff| {max_diff} > {tol} (layout {layout} + kernel {kernel_tol})");
        worst.exact = worst.exact.max(max_diff / range);
        worst.kernel = worst.kernel.max(kernel_diff / range);

        // Greedy continuation through the KV cache, while transformers' choice is clear.
        let want_ids = ids(&prompt["greedy_ids"]);
        let want_top = floats(&prompt["greedy_top_logits"]);
        let margins = floats(&prompt["greedy_margins"]);
        session.truncate(0);
        let mut logits = session.append(&prompt_ids).unwrap();
        let mut compared = 0;
        for step in 0..want_ids.len() {
            if margins[step] <= 2.0 * tol {
                break;
            }
            let t = argmax(&logits);
            assert_eq!(t, want_ids[step], "{name}: greedy step {step} (margin {})", margins[step]);
            assert!(
                (logits[t as usize] - want_top[step]).abs() <= tol,
                "{name}: step {step}: top logit {} vs transformers {}",
                logits[t as usize],
                want_top[step]
            );
            compared += 1;
            logits = session.append(&[t]).unwrap();
        }
        assert!(compared >= 5, "{name}: only {compared} greedy steps compared");
    }
    assert!(worst.kernel <= KERNEL_TOL / 10.0, "{name}: kernel error {:.2e} of the range", worst.kernel);
    worst
}

#[test]
fn awq_gemm_logits_match_dequantized_transformers() {
    let m = check_fixture("llama-awq");
    eprintln!("llama-awq: worst {:.2e} (dequantized) and {:.2e} (tm's weights) of the range", m.exact, m.kernel);
}

/// The Llama loop's deferred residual joins (the CUDA backend's int4 decode path: o's and down's
/// joins left unscaled, slots 2i and 2i + 1 of the step's sums, the next ops finishing the norm),
/// run on the CPU backend's emulation of them: every decode step's logits as the plain path's, up
/// to f32 rounding (the row scale is applied after `residual * weight` instead of before).
#[test]
fn deferred_joins_give_the_plain_paths_logits() {
    let dir = fixture("llama-awq");
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let (plain_ops, deferring_ops) = (CpuBackend::new(), CpuBackend::new().with_deferred_norms());
    let plain = LlamaModel::load(&plain_ops, &ckpt, ModelConfig::from_dir(&dir).unwrap(), &mut |_| {}).unwrap();
    let deferring = LlamaModel::load(&deferring_ops, &ckpt, ModelConfig::from_dir(&dir).unwrap(), &mut |_| {}).unwrap();
    let layers = plain.config.num_layers;
    assert!(layers >= 2, "the fixture needs a join into a later layer");
    let mut a = Session::new(&plain, &plain_ops, 256, 4).unwrap();
    let mut b = Session::new(&deferring, &deferring_ops, 256, 4).unwrap();
    // A 12-token prompt (a prefill step of more than DEFERRED_NORM_ROWS tokens: not deferred),
    // then decode steps of one token, and one step of three (deferred, n > 1).
    let prompt: Vec<u32> = (0..12).map(|i| 3 + 7 * i).collect();
    let (mut la, mut lb) = (a.append(&prompt).unwrap(), b.append(&prompt).unwrap());
    let mut worst = 0f32;
    for step in 0..10 {
        let range = la.iter().fold(f32::MIN, |m, &v| m.max(v)) - la.iter().fold(f32::MAX, |m, &v| m.min(v));
        let diff = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        worst = worst.max(diff / range);
        assert!(diff <= 1e-4 * range, "step {step}: max |logit diff| {diff} of a range {range}");
        let next = if step == 5 { vec![argmax(&la), 11, 13] } else { vec![argmax(&la)] };
        let vocab = plain.config.vocab_size;
        la = a.append(&next).unwrap();
        lb = b.append(&next).unwrap();
        // Only the last position's logits are compared after a multi-token step.
        la.drain(..la.len() - vocab);
        lb.drain(..lb.len() - vocab);
    }
    // Two joins per layer and decode step, but the last layer's down: 2 L - 1 per step.
    assert_eq!(deferring_ops.deferred_joins(), 10 * (2 * layers - 1), "the deferred path did not run");
    assert_eq!(plain_ops.deferred_joins(), 0);
    eprintln!("deferred joins: worst logit difference {worst:.2e} of the range");
}

#[test]
fn gptq_logits_match_dequantized_transformers() {
    let m = check_fixture("llama-gptq");
    eprintln!("llama-gptq: worst {:.2e} (dequantized) and {:.2e} (tm's weights) of the range", m.exact, m.kernel);
}

#[test]
fn quantized_matrices_present_as_weights() {
    let dir = fixture("llama-gptq");
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let q = ckpt.quantization().unwrap();
    assert_eq!(q.group_size, Some(32));
    let t = ckpt.tensor("model.layers.1.mlp.down_proj.weight").unwrap();
    assert_eq!((t.encoding, t.shape.as_slice()), (Encoding::Gptq, &[64usize, 128][..]));
    let parts = t.parts.as_deref().unwrap();
    assert_eq!(parts.qweight.shape, [16, 64]);
    assert_eq!(parts.g_idx.as_ref().unwrap().shape, [128]);
    // qweight + qzeros + scales + g_idx
    assert_eq!(t.stored_bytes(), (16 * 64 * 4 + 4 * 8 * 4 + 4 * 64 * 2 + 128 * 4) as u64);
    assert!(ckpt.contains("model.layers.1.mlp.down_proj.weight"));
    assert!(!ckpt.contains("model.layers.1.mlp.down_proj.bias"));
    // Unquantized tensors are as stored.
    assert_eq!(ckpt.tensor("lm_head.weight").unwrap().encoding, Encoding::Plain(tm_core::DType::F16));
    let awq = SafetensorsCheckpoint::open(&fixture("llama-awq")).unwrap();
    let t = awq.tensor("model.layers.0.self_attn.k_proj.weight").unwrap();
    assert_eq!((t.encoding, t.shape.as_slice()), (Encoding::Awq, &[32usize, 64][..]));
    assert_eq!(t.parts.as_deref().unwrap().qweight.shape, [64, 4]);
}

#[test]
fn plan_counts_int4_bytes() {
    for (name, label) in [("llama-awq", "AWQ g32"), ("llama-gptq", "GPTQ g32")] {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let req = PlanRequest { max_len: 256, ..Default::default() };
        let p = estimate(&ckpt, &PlanTarget::for_backend(&CpuBackend::new()).unwrap(), &req).unwrap();
        let g = p.weights_by_dtype.iter().find(|g| g.stored == label).unwrap_or_else(|| panic!("{name}: {p:?}"));
        assert_eq!((g.held.as_str(), g.tensors), ("int4", 14), "{name}");
        // Per layer: q, o [64, 64]; k, v [32, 64]; gate, up [128, 64]; down [64, 128]: 36864 weights,
        // half a byte each plus an f16 scale and min per 32.
        assert_eq!(g.held_bytes, 2 * (36864 / 2 + 36864 / 32 * 4), "{name}");
        // Every stored byte is accounted for (the parts of the quantized matrices included).
        assert_eq!(p.weights_stored, p.checkpoint_bytes, "{name}");
        // Loading takes exactly what the plan says.
        let ops = CpuBackend::new();
        let mut loaded = 0;
        let model = LlamaModel::load(&ops, ckpt.source.as_ref(), ckpt.config.clone(), &mut |b| loaded += b).unwrap();
        assert_eq!(model.weight_bytes(), p.weights_total, "{name}");
        // Load progress counts every part (progress bars end at 100%).
        assert_eq!(loaded, ckpt.source.total_bytes(), "{name}");
    }
}

/// A copy of a quantized fixture with its config and tensors edited, in a temporary directory.
fn variant(
    name: &str,
    tag: &str,
    edit_config: impl Fn(&mut Value),
    edit_tensors: impl Fn(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let src = fixture(name);
    let dir = std::env::temp_dir().join(format!("tm-int4-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit_config(&mut config);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect();
    edit_tensors(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    dir
}

/// The error of opening and loading `dir` on the CPU (whichever step fails first).
fn load_error(dir: &Path) -> String {
    let err = match SafetensorsCheckpoint::open(dir) {
        Err(e) => e,
        Ok(ckpt) => {
            let cfg = ModelConfig::from_dir(dir).unwrap();
            LlamaModel::load(&CpuBackend::new(), &ckpt, cfg, &mut |_| {}).expect_err("loading must fail")
        }
    };
    let _ = std::fs::remove_dir_all(dir);
    eprintln!("{}: {err}", dir.display());
    err.to_string()
}

#[test]
fn eight_bit_checkpoints_are_refused() {
    let dir = variant("llama-gptq", "bits8", |c| c["quantization_config"]["bits"] = 8.into(), |_| {});
    let e = load_error(&dir);
    assert!(e.contains("quantization_config.bits") && e.contains("8-bit") && e.contains("config.json"), "{e}");
}

#[test]
fn act_order_permutation_is_refused_naming_g_idx() {
    let name = "model.layers.0.self_attn.q_proj.g_idx";
    let permute = |t: &mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>| {
        let g = &mut t.get_mut(name).unwrap().2;
        // Swap the group index of inputs 3 (group 0) and 40 (group 1).
        for k in 0..4 {
            g.swap(3 * 4 + k, 40 * 4 + k);
        }
    };
    let dir = variant("llama-gptq", "descact", |c| c["quantization_config"]["desc_act"] = true.into(), permute);
    let e = load_error(&dir);
    assert!(e.contains(name) && e.contains("g_idx[3] = 1") && e.contains("desc_act"), "{e}");

    // desc_act with trivial g_idx everywhere loads (e.g. static_groups).
    let dir = variant("llama-gptq", "descact-trivial", |c| c["quantization_config"]["desc_act"] = true.into(), |_| {});
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    LlamaModel::load(&CpuBackend::new(), &ckpt, ModelConfig::from_dir(&dir).unwrap(), &mut |_| {}).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    // ... but without g_idx the order is unknown.
    let drop_g_idx = |t: &mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>| {
        t.remove(name);
    };
    let dir =
        variant("llama-gptq", "descact-no-gidx", |c| c["quantization_config"]["desc_act"] = true.into(), drop_g_idx);
    let e = load_error(&dir);
    assert!(e.contains(name) && e.contains("missing"), "{e}");
}

#[test]
fn missing_qzeros_is_named() {
    for fixture_name in ["llama-awq", "llama-gptq"] {
        let name = "model.layers.1.mlp.down_proj.qzeros";
        let dir = variant(
            fixture_name,
            &format!("noqzeros-{fixture_name}"),
            |_| {},
            |t| {
                t.remove(name);
            },
        );
        let e = load_error(&dir);
        assert!(e.contains(name) && e.contains("missing"), "{fixture_name}: {e}");
    }
}

#[test]
fn other_unsupported_variants_are_errors() {
    type Edit = fn(&mut Value);
    let cases: [(&str, Edit, &str); 4] = [
        ("gemv", |c| c["quantization_config"]["version"] = "gemv".into(), "GEMM"),
        ("noconfig", |c| c["quantization_config"] = Value::Null, "quantization_config"),
        ("method", |c| c["quantization_config"]["quant_method"] = "bitsandbytes".into(), "bitsandbytes"),
        ("group64", |c| c["quantization_config"]["group_size"] = 64.into(), "model.layers.0.self_attn.q_proj.qzeros"),
    ];
    for (tag, edit, needle) in cases {
        let dir = variant("llama-awq", tag, edit, |_| {});
        let e = load_error(&dir);
        assert!(e.contains(needle), "{tag}: {e}");
    }
    // A scale tensor of the wrong dtype is named.
    let name = "model.layers.0.mlp.up_proj.scales";
    let dir = variant(
        "llama-awq",
        "scales-i32",
        |_| {},
        |t| {
            let (d, s, _) = t.get_mut(name).unwrap();
            *d = Dtype::I32;
            s[1] /= 2;
        },
    );
    let e = load_error(&dir);
    assert!(e.contains(name) && e.contains("f16"), "{e}");
}
