//! Issue 10's plan tests: Qwen2.5-7B-Instruct-AWQ (its config.json from the public model card;
//! the weights are a sparse file, only the headers matter) planned for a 32768-token session on
//! device profiles, Jetson boards and discrete cards. Run with `--nocapture` to see the tables.

mod plan_common;

use plan_common::{temp_dir, write_checkpoint, Spec};
use tm_model::hf_quant::int4_bytes;
use tm_model::loader::Checkpoint;
use tm_model::plan::{
    estimate, human, plan, DeviceProfile, MemoryPlan, PlanRequest, CUDA_HOST_BUFFERS, CUDA_RUNTIME_RESERVE,
    DEFAULT_HOST_RESERVE,
};

const HIDDEN: usize = 3584;
const INTER: usize = 18944;
const LAYERS: usize = 28;
const HEADS: usize = 28;
const KV_HEADS: usize = 4;
const VOCAB: usize = 152064;
const GROUP: usize = 128;
const SESSION: usize = 32768;

/// The config.json of Qwen/Qwen2.5-7B-Instruct-AWQ.
fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "quantization_config": {"bits": 4, "group_size": GROUP, "modules_to_not_convert": null,
                                "quant_method": "awq", "version": "gemm", "zero_point": true},
        "rms_norm_eps": 1e-06,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": false,
        "torch_dtype": "float16",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": VOCAB
    })
}

/// AutoAWQ GEMM tensors of a `rows × cols` (out × in) matrix.
fn awq(p: &str, rows: usize, cols: usize, out: &mut Vec<Spec>) {
    out.push((format!("{p}.qweight"), "I32", vec![cols, rows / 8]));
    out.push((format!("{p}.qzeros"), "I32", vec![cols / GROUP, rows / 8]));
    out.push((format!("{p}.scales"), "F16", vec![cols / GROUP, rows]));
}

fn tensors() -> Vec<Spec> {
    let kv = KV_HEADS * HIDDEN / HEADS;
    let mut t: Vec<Spec> = vec![
        ("model.embed_tokens.weight".into(), "F16", vec![VOCAB, HIDDEN]),
        ("lm_head.weight".into(), "F16", vec![VOCAB, HIDDEN]),
        ("model.norm.weight".into(), "F16", vec![HIDDEN]),
    ];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), "F16", vec![HIDDEN]));
        t.push((format!("{p}.post_attention_layernorm.weight"), "F16", vec![HIDDEN]));
        for (m, rows) in [("q_proj", HIDDEN), ("k_proj", kv), ("v_proj", kv)] {
            awq(&format!("{p}.self_attn.{m}"), rows, HIDDEN, &mut t);
            t.push((format!("{p}.self_attn.{m}.bias"), "F16", vec![rows]));
        }
        awq(&format!("{p}.self_attn.o_proj"), HIDDEN, HIDDEN, &mut t);
        awq(&format!("{p}.mlp.gate_proj"), INTER, HIDDEN, &mut t);
        awq(&format!("{p}.mlp.up_proj"), INTER, HIDDEN, &mut t);
        awq(&format!("{p}.mlp.down_proj"), HIDDEN, INTER, &mut t);
    }
    t
}

fn checkpoint(tag: &str) -> (std::path::PathBuf, Checkpoint) {
    let dir = temp_dir(&format!("qwen25-7b-awq-{tag}")).join("Qwen2.5-7B-Instruct-AWQ");
    write_checkpoint(&dir, &config(), &tensors(), false);
    let ckpt = Checkpoint::open(&dir).unwrap();
    (dir, ckpt)
}

/// A Jetson-sized serving request: one long session at a time.
fn request() -> PlanRequest {
    PlanRequest {
        max_len: SESSION,
        max_batch_size: 8,
        max_batched_tokens: 2048,
        block_size: 64,
        memory_fraction: 0.9,
        kv_cache_bytes: None,
        kv_cache_dtype: Default::default(),
        tp: 1,
    }
}

fn on(profile: &str, ckpt: &Checkpoint, req: &PlanRequest) -> MemoryPlan {
    let p = DeviceProfile::find(profile).unwrap();
    let p = estimate(ckpt, &p.target(DEFAULT_HOST_RESERVE), req).unwrap();
    eprintln!("{}", p.table());
    p
}

/// Weight bytes computed by hand from the shapes: int4 matrices (4 bits a value, an f16 scale
/// and min per 128-group) and f16 embeddings, LM head, norms and biases.
fn expected_weights() -> (u64, u64) {
    let kv = KV_HEADS * HIDDEN / HEADS;
    let per_layer_int4 = int4_bytes(HIDDEN, HIDDEN, GROUP) * 2
        + int4_bytes(kv, HIDDEN, GROUP) * 2
        + int4_bytes(INTER, HIDDEN, GROUP) * 2
        + int4_bytes(HIDDEN, INTER, GROUP);
    let per_layer_f16 = (2 * HIDDEN + HIDDEN + 2 * kv) as u64 * 2;
    let f16 = LAYERS as u64 * per_layer_f16 + 2 * (VOCAB * HIDDEN * 2) as u64 + HIDDEN as u64 * 2;
    (LAYERS as u64 * per_layer_int4 + f16, f16)
}

#[test]
fn qwen25_7b_awq_32k_session_fits_on_orin_nx_16gb() {
    let (dir, ckpt) = checkpoint("nx");
    let req = request();
    let p = on("orin-nx-16gb", &ckpt, &req);
    let (weights, f16) = expected_weights();
    assert_eq!(weights, 5_647_215_616, "the hand count itself");
    assert_eq!(p.weights_total, weights);
    assert_eq!(p.weights_in_place, f16, "f16 embeddings, LM head, norms and biases are read in place");
    assert!(p.shared_with_host && p.staging_counted && p.host_buffers_counted);
    assert_eq!(p.host_buffers, CUDA_HOST_BUFFERS);
    assert_eq!(p.runtime_reserve, CUDA_RUNTIME_RESERVE);
    // Staging: only the largest AWQ repack (gate/up/down: 18944 × 3584 int4), not the 1 GiB f16
    // embedding, which is read in place.
    assert_eq!(p.load_staging, int4_bytes(INTER, HIDDEN, GROUP));
    // 16 GiB less the 1.5 GiB host reserve, times 0.9.
    assert_eq!(p.usable_memory, (16 << 30) - DEFAULT_HOST_RESERVE);
    assert_eq!(p.budget, ((16u64 << 30) - DEFAULT_HOST_RESERVE) * 9 / 10);
    // f16 KV: 28 layers × (K and V) × 64 tokens × 512 values × 2 bytes = 3.5 MiB a block.
    assert_eq!(p.kv_bytes_per_block, 28 * 2 * 64 * 512 * 2);
    let peak_parts = p.weights_total
        + p.runtime_reserve
        + p.host_buffers
        + p.load_staging.max(p.workspace + p.kernel_scratch.total)
        + p.kv_bytes;
    assert_eq!(p.peak, peak_parts);
    assert!(p.fits, "{:?}", p.problems);
    assert_eq!(p.max_len, SESSION, "the full 32768-token session: {:?}", p.warnings);
    // The stated KV capacity: 1996 blocks of 64 tokens, 3.90 sessions of 32768 tokens (with the
    // 64 MiB int4 slab buffer of large-batch products charged as kernel scratch).
    assert_eq!(p.num_blocks, 1996, "{}", p.table());
    assert_eq!(p.kv_tokens, 127_744);
    assert!(p.peak <= p.budget && p.budget - p.peak < p.kv_bytes_per_block);
    eprintln!(
        "orin-nx-16gb: KV capacity {} tokens ({} sessions of {SESSION}) in {}",
        p.kv_tokens,
        p.kv_tokens / SESSION,
        human(p.kv_bytes)
    );
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn qwen25_7b_awq_32k_session_on_rtx3060ti_8gb() {
    let (dir, ckpt) = checkpoint("3060");
    // At --memory-fraction 0.9 the cache holds 293 blocks = 18752 tokens: it runs, but the
    // session is capped, and the warning says by how much and what to lower.
    let p = on("rtx3060ti-8gb", &ckpt, &request());
    assert!(!p.shared_with_host && !p.staging_counted && !p.host_buffers_counted);
    assert_eq!(p.weights_in_place, 0, "a discrete card copies every weight");
    assert_eq!(p.budget, (8u64 << 30) * 9 / 10);
    assert!(p.fits);
    assert_eq!(p.num_blocks, 293, "{}", p.table());
    assert_eq!(p.max_len, 293 * 64);
    let w = p.warnings.join("\n");
    assert!(w.contains("less than one --max-len 32768 sequence") && w.contains("max_len capped to 18752"), "{w}");
    assert!(w.contains("--max-batched-tokens") && w.contains("--memory-fraction"), "{w}");

    // One session at a time with the whole card: the full 32768 tokens fit.
    let one = PlanRequest { max_batch_size: 1, max_batched_tokens: 512, memory_fraction: 1.0, ..request() };
    let p = on("rtx3060ti-8gb", &ckpt, &one);
    assert!(p.fits && p.max_len == SESSION, "{}", p.table());
    assert!(p.kv_tokens >= SESSION);
    assert_eq!(p.num_blocks, 512, "one session's worth (--max-batch-size 1 caps the cache)");
    eprintln!("rtx3060ti-8gb: KV capacity {} tokens in {}", p.kv_tokens, human(p.kv_bytes));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn cases_that_cannot_fit_fail_with_numbers_and_the_flag_to_lower() {
    let (dir, ckpt) = checkpoint("fail");
    // Orin Nano 8GB: 6.5 GiB usable, the weights alone take 5.26 GiB plus the runtime.
    let nano = DeviceProfile::find("orin-nano-8gb").unwrap().target(DEFAULT_HOST_RESERVE);
    let err = plan(&ckpt, &nano, &request()).unwrap_err().to_string();
    eprintln!("{err}");
    assert!(err.contains("does not fit on orin-nano-8gb"), "{err}");
    assert!(err.contains(&human(5_647_215_616)), "the weights in numbers: {err}");
    assert!(err.contains("short by"), "{err}");
    assert!(err.contains("smaller or more quantized model"), "{err}");

    // Orin NX with a KV cache asked for that the budget cannot hold: the flag to lower, with a
    // value that fits.
    let nx = DeviceProfile::find("orin-nx-16gb").unwrap().target(DEFAULT_HOST_RESERVE);
    let big = PlanRequest { kv_cache_bytes: Some(8 << 30), ..request() };
    let err = plan(&ckpt, &nx, &big).unwrap_err().to_string();
    eprintln!("{err}");
    assert!(err.contains("KV cache 8.00 GiB (--kv-cache-bytes 8589934592)"), "{err}");
    let at = err.rfind("--kv-cache-bytes ").unwrap() + "--kv-cache-bytes ".len();
    let room: u64 = err[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap();
    assert!(room < 8 << 30);
    assert!(plan(&ckpt, &nx, &PlanRequest { kv_cache_bytes: Some(room), ..request() }).is_ok());

    // A bigger --host-reserve on the NX leaves less: with 10 GiB reserved it no longer fits.
    let reserved = DeviceProfile::find("orin-nx-16gb").unwrap().target(10 << 30);
    let err = plan(&ckpt, &reserved, &request()).unwrap_err().to_string();
    assert!(err.contains("does not fit") && err.contains(&human((6u64 << 30) * 9 / 10)), "{err}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn plan_tables_for_every_profile() {
    let (dir, ckpt) = checkpoint("all");
    let req = PlanRequest { max_batch_size: 8, max_batched_tokens: 2048, ..request() };
    for profile in tm_model::plan::DEVICE_PROFILES {
        let p = estimate(&ckpt, &profile.target(DEFAULT_HOST_RESERVE), &req).unwrap();
        eprintln!(
            "{:<14} fits {:<5} budget {:>10}  weights {:>10}  peak {:>10}  KV {:>6} tokens  max_len {}",
            profile.name,
            p.fits,
            human(p.budget),
            human(p.weights_total),
            human(p.peak),
            p.kv_tokens,
            p.max_len
        );
        assert_eq!(p.weights_total, expected_weights().0);
        assert_eq!(p.weights_in_place > 0, profile.integrated, "{}", profile.name);
        assert!(p.table().contains(profile.name));
        if p.fits {
            assert!(p.peak <= p.budget);
        } else {
            assert!(!p.problems.is_empty());
        }
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}
