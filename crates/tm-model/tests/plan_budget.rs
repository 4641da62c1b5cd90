//! The memory plan's decisions: budgets too small fail with numbers and the flag to lower, a cache
//! shorter than `max_len` caps it with a warning, bad requests are refused, device profiles plan
//! for devices that are not present.

use std::path::{Path, PathBuf};
use tm_core::DType;
use tm_cpu::CpuBackend;
use tm_model::kv_cache::{KvCache, KvCacheDtype};
use tm_model::loader::Checkpoint;
use tm_model::plan::{
    estimate, human, plan, DeviceProfile, MemoryPlan, PlanRequest, PlanTarget, WeightPolicy, CUDA_RUNTIME_RESERVE,
    DEFAULT_HOST_RESERVE, DEVICE_PROFILES,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn request() -> PlanRequest {
    PlanRequest {
        max_len: 256,
        max_batch_size: 32,
        max_batched_tokens: 2048,
        block_size: 16,
        memory_fraction: 1.0,
        kv_cache_bytes: None,
        tp: 1,
        kv_cache_dtype: KvCacheDtype::Auto,
    }
}

fn cpu_target() -> PlanTarget {
    PlanTarget::for_backend(&CpuBackend::new()).unwrap()
}

/// The plan of the llama fixture with `usable` bytes of memory.
fn with_usable(usable: u64, req: &PlanRequest) -> (Checkpoint, PlanTarget, MemoryPlan) {
    let ckpt = Checkpoint::open(&fixture("llama")).unwrap();
    let mut target = cpu_target();
    target.memory.usable = usable;
    let p = estimate(&ckpt, &target, req).unwrap();
    (ckpt, target, p)
}

/// Everything but the KV cache, for `req`.
fn fixed(req: &PlanRequest) -> (u64, u64) {
    let (_, _, p) = with_usable(1 << 50, req);
    (p.peak - p.kv_bytes, p.kv_bytes_per_block)
}

/// The value following the last `flag` in the suggestions of `text` (after "lower a flag:").
fn value_after(text: &str, flag: &str) -> Option<String> {
    let text = &text[text.find("lower a flag:")?..];
    let i = text.rfind(&format!("{flag} "))? + flag.len() + 1;
    Some(text[i..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect())
}

#[test]
fn too_small_a_budget_names_the_numbers_and_the_flag_to_lower() {
    let req = request();
    let (fixed, bpb) = fixed(&req);
    // Room for half a block: nothing fits.
    let (ckpt, target, p) = with_usable(fixed + bpb / 2, &req);
    assert!(!p.fits);
    assert_eq!(p.num_blocks, 0);
    let err = plan(&ckpt, &target, &req).unwrap_err().to_string();
    assert!(err.contains("does not fit"), "{err}");
    assert!(err.contains(&human(p.budget)), "budget in numbers: {err}");
    assert!(err.contains(&human(p.weights_total)) && err.contains(&human(p.workspace)), "components: {err}");
    assert!(err.contains(&format!("at least one block of {}", human(bpb))), "{err}");
    assert!(err.contains("short by 4.00 KiB (4096 bytes)"), "{err}");
    assert!(err.contains("--max-batched-tokens"), "{err}");

    // The suggested --max-batched-tokens does fit, with room for one full sequence.
    let tokens: usize = value_after(&err, "--max-batched-tokens").unwrap().parse().unwrap();
    assert!(tokens < req.max_batched_tokens);
    let smaller =
        PlanRequest { max_batched_tokens: tokens, max_batch_size: req.max_batch_size.min(tokens), ..request() };
    let ok = plan(&ckpt, &target, &smaller).unwrap();
    assert!(ok.num_blocks >= 256 / 16, "{ok:?}");
    assert!(ok.warnings.is_empty(), "{:?}", ok.warnings);
    // And one more token would not have (the suggestion is the largest).
    let more = PlanRequest { max_batched_tokens: tokens + 1, ..smaller };
    assert!(estimate(&ckpt, &target, &more).unwrap().num_blocks < 256 / 16);
}

#[test]
fn many_logit_rows_suggest_a_smaller_batch() {
    let req = PlanRequest { max_batch_size: 2048, max_batched_tokens: 2048, ..request() };
    let (fixed, bpb) = fixed(&req);
    // One full sequence's cache, less 1 MiB.
    let (ckpt, target, p) = with_usable(fixed + 16 * bpb - (1 << 20), &req);
    assert!(!p.fits || p.max_len < 256);
    let err = match plan(&ckpt, &target, &req) {
        Err(e) => e.to_string(),
        Ok(p) => panic!("expected no fit, got {p:?}"),
    };
    let rows: usize = value_after(&err, "--max-batch-size").unwrap().parse().unwrap();
    assert!(rows < 2048 && rows > 1000, "{err}");
    let ok = plan(&ckpt, &target, &PlanRequest { max_batch_size: rows, ..req.clone() }).unwrap();
    assert!(ok.num_blocks >= 256 / 16, "{ok:?}");
    assert!(estimate(&ckpt, &target, &PlanRequest { max_batch_size: rows + 1, ..req }).unwrap().num_blocks < 16);
}

#[test]
fn memory_fraction_is_suggested_when_the_memory_is_there() {
    let (fixed, bpb) = fixed(&request());
    let usable = 4 * (fixed + 16 * bpb);
    let req = PlanRequest { memory_fraction: 0.2, ..request() };
    let (ckpt, target, p) = with_usable(usable, &req);
    assert!(!p.fits);
    let err = plan(&ckpt, &target, &req).unwrap_err().to_string();
    let f: f64 = value_after(&err, "--memory-fraction").unwrap().parse().unwrap();
    assert!(f > 0.2 && f <= 0.3, "{err}");
    plan(&ckpt, &target, &PlanRequest { memory_fraction: f, ..req }).unwrap();
}

#[test]
fn weights_that_cannot_fit_ask_for_a_smaller_model() {
    let req = request();
    let (ckpt, target, p) = with_usable(1000, &req);
    assert!(!p.fits);
    let err = plan(&ckpt, &target, &req).unwrap_err().to_string();
    assert!(err.contains("weights alone") && err.contains("smaller or more quantized model"), "{err}");
    assert!(err.contains(&human(p.weights_total)), "{err}");
}

#[test]
fn a_cache_shorter_than_max_len_caps_it_with_a_warning() {
    let req = request();
    let (fixed, bpb) = fixed(&req);
    let (ckpt, target, p) = with_usable(fixed + 3 * bpb + bpb / 2, &req);
    assert!(p.fits);
    assert_eq!(p.num_blocks, 3);
    assert_eq!(p.max_len, 48, "capped to 3 blocks of 16 tokens");
    assert_eq!(p.request.max_len, 256, "the request is kept as asked");
    let w = p.warnings.join("\n");
    assert!(w.contains("capped to 48") && w.contains("--max-len 256") && w.contains("3 blocks"), "{w}");
    assert!(w.contains(&human(16 * bpb)), "one full sequence in bytes: {w}");
    assert!(p.table().contains("warning: the KV cache holds 3 blocks"), "{}", p.table());
    // plan() succeeds: capping is not an error.
    assert_eq!(plan(&ckpt, &target, &req).unwrap().max_len, 48);
}

#[test]
fn max_len_beyond_the_model_context_is_capped() {
    // The llama fixture has max_position_embeddings 256.
    let req = PlanRequest { max_len: 100_000, ..request() };
    let (_, _, p) = with_usable(1 << 40, &req);
    assert_eq!(p.max_len, 256);
    assert!(p.warnings.iter().any(|w| w.contains("context of 256")), "{:?}", p.warnings);
}

#[test]
fn kv_cache_bytes_sizes_the_cache_alone() {
    let (_, bpb) = fixed(&request());
    let req = PlanRequest { kv_cache_bytes: Some(10 * bpb + bpb / 3), ..request() };
    let (ckpt, target, p) = with_usable(1 << 40, &req);
    assert!(p.fits);
    assert_eq!(p.num_blocks, 10, "whole blocks within --kv-cache-bytes");
    assert_eq!(p.kv_bytes, 10 * bpb);
    assert!(p.notes.is_empty(), "no batch cap on an explicit size: {:?}", p.notes);

    // Less than one block.
    let tiny = PlanRequest { kv_cache_bytes: Some(bpb - 1), ..request() };
    let err = plan(&ckpt, &target, &tiny).unwrap_err().to_string();
    assert!(err.contains("--kv-cache-bytes") && err.contains("less than one KV block"), "{err}");
    assert!(err.contains(&bpb.to_string()), "{err}");

    // More than the budget: the error gives the size that fits.
    let (fixed, _) = fixed(&request());
    let mut small = target.clone();
    small.memory.usable = fixed + 20 * bpb;
    let huge = PlanRequest { kv_cache_bytes: Some(1 << 40), ..request() };
    let err = plan(&ckpt, &small, &huge).unwrap_err().to_string();
    let n: u64 = value_after(&err, "--kv-cache-bytes").unwrap().parse().unwrap();
    assert_eq!(n, 20 * bpb, "{err}");
    assert_eq!(plan(&ckpt, &small, &PlanRequest { kv_cache_bytes: Some(n), ..huge }).unwrap().num_blocks, 20);
}

#[test]
fn a_roomy_budget_allocates_only_what_can_be_used() {
    let req = request();
    let (_, _, p) = with_usable(1 << 45, &req);
    let per_seq = 256 / 16;
    assert_eq!(p.num_blocks, req.max_batch_size * per_seq);
    assert!(p.kv_blocks_fit > p.num_blocks as u64);
    assert!(p.notes.iter().any(|n| n.contains("--max-batch-size 32")), "{:?}", p.notes);
}

#[test]
fn bad_requests_name_the_flag() {
    let ckpt = Checkpoint::open(&fixture("llama")).unwrap();
    let target = cpu_target();
    let cases = [
        (PlanRequest { block_size: 0, ..request() }, "--block-size"),
        (PlanRequest { max_len: 0, ..request() }, "--max-len"),
        (PlanRequest { max_batch_size: 0, ..request() }, "--max-batch-size"),
        (PlanRequest { max_batched_tokens: 8, max_batch_size: 16, ..request() }, "--max-batched-tokens"),
        (PlanRequest { max_batched_tokens: usize::MAX, ..request() }, "--max-batched-tokens"),
        (PlanRequest { memory_fraction: 0.0, ..request() }, "--memory-fraction"),
        (PlanRequest { memory_fraction: 1.5, ..request() }, "--memory-fraction"),
        (PlanRequest { memory_fraction: f64::NAN, ..request() }, "--memory-fraction"),
    ];
    for (req, flag) in cases {
        let err = estimate(&ckpt, &target, &req).unwrap_err().to_string();
        assert!(err.contains(flag), "{req:?}: {err}");
    }
}

#[test]
fn device_profiles_plan_with_gpu_dtypes() {
    assert!(DEVICE_PROFILES.len() >= 6);
    for name in ["orin-nx-16gb", "orin-nano-8gb", "agx-orin-64gb", "rtx3060ti-8gb", "rtx4090-24gb", "h200-141gb"] {
        assert!(DeviceProfile::find(name).is_some(), "{name}");
    }
    assert!(DeviceProfile::find("ORIN-NX-16GB").is_some());
    assert!(DeviceProfile::find("tpu").is_none());

    let ckpt = Checkpoint::open(&fixture("qwen2")).unwrap(); // f16 weights
    let req = PlanRequest { memory_fraction: 0.9, ..request() };
    let orin = DeviceProfile::find("orin-nx-16gb").unwrap();
    let target = orin.target(DEFAULT_HOST_RESERVE);
    assert_eq!(target.weights, WeightPolicy::Stored);
    assert_eq!(target.activation_dtype, DType::F16);
    assert!(target.memory.shared_with_host);
    assert_eq!(target.memory.usable, (16 << 30) - DEFAULT_HOST_RESERVE);
    let p = plan(&ckpt, &target, &req).unwrap();
    assert_eq!(p.weights_total, p.weights_stored, "weights kept as stored (f16)");
    assert_eq!(p.kv_bytes_per_block, KvCache::bytes_per_block(&ckpt.config, DType::F16, 16));
    assert_eq!(p.runtime_reserve, CUDA_RUNTIME_RESERVE);
    assert!(p.staging_counted);
    assert!(p.table().contains("orin-nx-16gb"));

    let rtx = DeviceProfile::find("rtx3060ti-8gb").unwrap().target(DEFAULT_HOST_RESERVE);
    assert!(!rtx.memory.shared_with_host);
    assert_eq!(rtx.memory.usable, rtx.memory.total, "no host reserve on a discrete card");
    let p = plan(&ckpt, &rtx, &req).unwrap();
    assert!(!p.staging_counted, "host staging is not charged to a discrete GPU");
}

#[test]
fn the_plan_serializes_and_tabulates() {
    let (_, _, p) = with_usable(1 << 40, &request());
    let v: serde_json::Value = serde_json::from_str(&p.to_json().unwrap()).unwrap();
    assert_eq!(v["num_blocks"].as_u64(), Some(p.num_blocks as u64));
    assert_eq!(v["weights_total"].as_u64(), Some(p.weights_total));
    assert_eq!(v["request"]["max_len"].as_u64(), Some(256));
    assert_eq!(v["activation_dtype"].as_str(), Some("F32"));
    let t = p.table();
    for needle in ["weights", "f32 -> f32", "workspace", "kernel scratch", "KV cache", "peak", "headroom", "fits:"] {
        assert!(t.contains(needle), "{needle} missing from\n{t}");
    }
}

#[test]
fn an_fp8_kv_cache_halves_the_block_and_doubles_the_blocks() {
    // A 16-bit target (an Orin NX profile: f16 activations) and a fixed KV budget.
    let ckpt = Checkpoint::open(&fixture("qwen2")).unwrap();
    let target = DeviceProfile::find("orin-nx-16gb").unwrap().target(DEFAULT_HOST_RESERVE);
    let bytes = 64 << 20;
    let auto = plan(&ckpt, &target, &PlanRequest { kv_cache_bytes: Some(bytes), ..request() }).unwrap();
    let fp8 = PlanRequest { kv_cache_bytes: Some(bytes), kv_cache_dtype: KvCacheDtype::Fp8, ..request() };
    let fp8 = plan(&ckpt, &target, &fp8).unwrap();
    assert_eq!(auto.kv_dtype, DType::F16);
    assert_eq!(fp8.kv_dtype, DType::F8E4M3);
    assert_eq!(2 * fp8.kv_bytes_per_block, auto.kv_bytes_per_block);
    assert_eq!(fp8.kv_bytes_per_block, KvCache::bytes_per_block(&ckpt.config, DType::F8E4M3, 16));
    assert_eq!(fp8.num_blocks, 2 * auto.num_blocks, "{} vs {}", fp8.num_blocks, auto.num_blocks);
    assert!(fp8.table().contains("f8e4m3"), "{}", fp8.table());
    // On the CPU (f32 activations) an fp8 block is a quarter of an f32 one.
    let cpu = plan(&ckpt, &cpu_target(), &PlanRequest { kv_cache_dtype: KvCacheDtype::Fp8, ..request() }).unwrap();
    assert_eq!(4 * cpu.kv_bytes_per_block, KvCache::bytes_per_block(&ckpt.config, DType::F32, 16));
}

/// The CUDA int4 slab buffer (`tm_core::q4_slab`) is charged for a quantized model whose steps
/// reach the slab path, and not for a dense one (the backend reserves it only for int4 weights).
#[test]
fn the_int4_slab_buffer_is_planned_only_for_quantized_models() {
    let target = DeviceProfile::find("h200-141gb").unwrap().target(DEFAULT_HOST_RESERVE);
    assert!(matches!(target.activation_dtype, DType::F16 | DType::BF16), "{:?}", target.activation_dtype);
    let req = request();
    let dense = estimate(&Checkpoint::open(&fixture("llama")).unwrap(), &target, &req).unwrap();
    assert_eq!(dense.kernel_scratch.q4_slab, 0, "{}", dense.table());
    let awq = estimate(&Checkpoint::open(&fixture("llama-awq")).unwrap(), &target, &req).unwrap();
    assert_eq!(awq.kernel_scratch.q4_slab, tm_core::q4_slab::SLAB_BYTES as u64, "{}", awq.table());
    // below the slab path's batch size nothing is reserved either
    let small = PlanRequest { max_batched_tokens: 256, max_batch_size: 8, ..req };
    let awq_small = estimate(&Checkpoint::open(&fixture("llama-awq")).unwrap(), &target, &small).unwrap();
    assert_eq!(awq_small.kernel_scratch.q4_slab, 0);
}
