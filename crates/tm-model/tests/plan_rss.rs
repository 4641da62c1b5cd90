//! Loading never holds a second full copy of the weights: while a bf16 checkpoint of about 40 MB
//! loads onto the CPU backend (which holds its matrices as stored), the process's anonymous
//! resident memory (`RssAnon`, sampled every millisecond) grows by at most the plan's weights plus
//! its load staging (and a small slack for the allocator and the loader's bookkeeping). `VmHWM`
//! (which also counts the checkpoint's page-cache pages mapped while reading them) stays under
//! plan + staging + the file.
//!
//! One test in its own binary, so no other test allocates while it measures.

mod plan_common;

use plan_common::{temp_dir, write_checkpoint, Spec};
use std::time::Duration;
use tm_cpu::CpuBackend;
use tm_model::llama::LlamaModel;
use tm_model::loader::Checkpoint;
use tm_model::plan::rss::{ProcStatus, RssSampler};
use tm_model::plan::{estimate, human, PlanRequest, PlanTarget};

const HIDDEN: usize = 512;
const INTER: usize = 1536;
const LAYERS: usize = 4;
const VOCAB: usize = 8192;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16"
    })
}

fn tensors() -> Vec<Spec> {
    let kv = 4 * HIDDEN / 8;
    let mut t: Vec<Spec> = vec![
        ("model.embed_tokens.weight".into(), "BF16", vec![VOCAB, HIDDEN]),
        ("lm_head.weight".into(), "BF16", vec![VOCAB, HIDDEN]),
        ("model.norm.weight".into(), "BF16", vec![HIDDEN]),
    ];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![HIDDEN]),
            ("post_attention_layernorm.weight", vec![HIDDEN]),
            ("self_attn.q_proj.weight", vec![HIDDEN, HIDDEN]),
            ("self_attn.k_proj.weight", vec![kv, HIDDEN]),
            ("self_attn.v_proj.weight", vec![kv, HIDDEN]),
            ("self_attn.o_proj.weight", vec![HIDDEN, HIDDEN]),
            ("mlp.gate_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.up_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.down_proj.weight", vec![HIDDEN, INTER]),
        ] {
            t.push((format!("{p}.{name}"), "BF16", shape));
        }
    }
    t
}

#[test]
fn peak_rss_during_load_stays_under_plan_plus_staging() {
    if ProcStatus::read().is_none_or(|s| s.rss_anon == 0) {
        eprintln!("skipped: /proc/self/status has no RssAnon here");
        return;
    }
    let dir = temp_dir("plan-rss");
    write_checkpoint(&dir, &config(), &tensors(), true);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let ops = CpuBackend::new();
    let req = PlanRequest { max_len: 256, max_batch_size: 4, max_batched_tokens: 64, ..PlanRequest::default() };
    let p = estimate(&ckpt, &PlanTarget::for_backend(&ops).unwrap(), &req).unwrap();
    // the matrices held as stored, the norm weights widened to f32
    let norms = ((2 * LAYERS + 1) * HIDDEN) as u64;
    assert_eq!(p.weights_total, p.weights_stored + 2 * norms, "bf16 matrices held as stored on the CPU");
    let file = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();

    let sampler = RssSampler::start(Duration::from_millis(1)).expect("sampler");
    let model = LlamaModel::load(&ops, ckpt.source.as_ref(), ckpt.config.clone(), &mut |_| {}).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let peaks = sampler.finish();
    assert_eq!(model.weight_bytes(), p.weights_total);

    let growth = peaks.anon_growth();
    // Allocator rounding, rayon's threads, the loader's own small structures.
    let slack = (8 << 20) + p.weights_total / 50;
    let bound = p.weights_total + p.load_staging + slack;
    eprintln!(
        "weights {} (file {}), load staging {}: peak anonymous growth during load {} (bound {}), peak RSS {} \
         from {} ({} samples)",
        human(p.weights_total),
        human(file),
        human(p.load_staging),
        human(growth),
        human(bound),
        human(peaks.rss),
        human(peaks.start.vm_rss),
        peaks.samples
    );
    assert!(peaks.samples >= 3, "{peaks:?}");
    // The measurement works: the weights themselves are there.
    assert!(growth >= p.weights_total * 9 / 10, "anonymous growth {growth} below the weights {}", p.weights_total);
    // And nothing like a second copy is: at most plan + staging.
    assert!(
        growth <= bound,
        "peak anonymous growth {} during load exceeds weights {} + staging {} + slack {}",
        human(growth),
        human(p.weights_total),
        human(p.load_staging),
        human(slack)
    );
    // Everything resident, page cache of the mapped file included.
    let rss_growth = peaks.rss.saturating_sub(peaks.start.vm_rss);
    assert!(
        rss_growth <= bound + file,
        "peak RSS growth {} > {} + file {}",
        human(rss_growth),
        human(bound),
        human(file)
    );
    drop(model);
    let _ = std::fs::remove_dir_all(&dir);
}
