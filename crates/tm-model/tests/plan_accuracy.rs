//! The memory plan against what loading and allocating really take on the CPU backend: weight
//! bytes, workspace and KV cache, byte for byte, on every fixture and on the default model.

use std::path::{Path, PathBuf};
use tm_core::Ops;
use tm_cpu::CpuBackend;
use tm_model::kv_cache::KvCache;
use tm_model::llama::{LlamaModel, Workspace};
use tm_model::loader::Checkpoint;
use tm_model::plan::{estimate, plan, PlanRequest, PlanTarget, WeightPolicy};

const FIXTURES: [&str; 11] = [
    "llama",
    "llama-awq",
    "llama-gptq",
    "llama3_rope",
    "llama_linear_rope",
    "llama_dynamic_rope",
    "llama_yarn_rope",
    "mistral",
    "qwen2",
    "qwen3",
    "internlm2",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn default_model() -> Option<PathBuf> {
    match tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("skipping the default model: not available ({e})");
            None
        }
    }
}

fn request() -> PlanRequest {
    PlanRequest {
        max_len: 256,
        max_batch_size: 8,
        max_batched_tokens: 96,
        block_size: 16,
        memory_fraction: 1.0,
        kv_cache_bytes: None,
        kv_cache_dtype: Default::default(),
        tp: 1,
    }
}

/// Plans with a budget that leaves room for `blocks + 0.5` KV blocks, then loads the
/// model and allocates the cache and workspace, comparing every figure with the allocator.
fn check_against_allocations(path: &Path, blocks: u64) {
    let name = path.display();
    let ckpt = Checkpoint::open(path).unwrap();
    let ops = CpuBackend::new();
    let mut target = PlanTarget::for_backend(&ops).unwrap();
    assert_eq!(target.weights, WeightPolicy::Stored);
    let req = request();
    target.memory.usable = 1 << 50;
    let roomy = estimate(&ckpt, &target, &req).unwrap();
    let fixed = roomy.peak - roomy.kv_bytes;
    target.memory.usable = fixed + roomy.kv_bytes_per_block * (2 * blocks + 1) / 2;
    let p = plan(&ckpt, &target, &req).unwrap();
    assert_eq!(p.num_blocks as u64, blocks, "{name}");
    assert_eq!(p.kv_bytes, blocks * p.kv_bytes_per_block, "{name}");
    assert!(p.peak <= p.budget && p.budget - p.peak < p.kv_bytes_per_block, "{name}: {p:?}");

    let alloc = ops.allocator();
    assert_eq!(alloc.stats().in_use, 0);
    let model = LlamaModel::load(&ops, ckpt.source.as_ref(), ckpt.config.clone(), &mut |_| {}).unwrap();
    assert_eq!(p.weights_total, model.weight_bytes(), "{name}: predicted weights vs weight_bytes()");
    assert_eq!(p.weights_total, alloc.stats().in_use, "{name}: predicted weights vs allocator");
    let groups: u64 = p.weights_by_dtype.iter().map(|g| g.held_bytes).sum();
    assert_eq!(groups, p.weights_total, "{name}");

    let before = alloc.stats().in_use;
    let kv = KvCache::new(&ops, &ckpt.config, p.num_blocks, p.block_size).unwrap();
    assert_eq!(alloc.stats().in_use - before, p.kv_bytes, "{name}: predicted KV capacity vs allocation");
    assert_eq!(
        KvCache::bytes_per_block(&ckpt.config, ops.activation_dtype(), p.block_size),
        p.kv_bytes_per_block,
        "{name}"
    );

    let before = alloc.stats().in_use;
    let ws = Workspace::new(&ops, &ckpt.config, p.workspace_tokens, p.workspace_logit_rows).unwrap();
    assert_eq!(alloc.stats().in_use - before, p.workspace, "{name}: predicted workspace vs allocation");
    assert_eq!(
        p.workspace,
        p.workspace_tokens as u64 * p.workspace_per_token + p.workspace_logit_rows as u64 * p.workspace_per_logit_row,
        "{name}"
    );

    // Everything tm allocated stays within the plan's peak.
    assert!(alloc.stats().peak <= p.peak, "{name}: allocator peak {} > plan {}", alloc.stats().peak, p.peak);
    drop((kv, ws, model));
}

#[test]
fn fixtures_weights_workspace_and_kv_match_allocations() {
    for f in FIXTURES {
        check_against_allocations(&fixture(f), 20);
    }
}

#[test]
fn default_model_weights_workspace_and_kv_match_allocations() {
    let Some(path) = default_model() else { return };
    check_against_allocations(&path, 7);
    let p =
        estimate(&Checkpoint::open(&path).unwrap(), &PlanTarget::for_backend(&CpuBackend::new()).unwrap(), &request())
            .unwrap();
    let held: Vec<&str> = p.weights_by_dtype.iter().map(|g| g.held.as_str()).collect();
    assert!(held.contains(&"int4"), "{held:?}");
    // GGUF Q4_1/Q8_0 import into tm's layouts is byte-for-byte the size of the file's blocks.
    for g in &p.weights_by_dtype {
        assert_eq!(g.stored_bytes, g.held_bytes, "{g:?}");
    }
}

#[test]
fn the_cpu_holds_float_weights_as_stored() {
    // f16/bf16 (qwen2, llama3_rope) and f32 (llama) fixtures: matrices held at their stored size,
    // copied straight from the mapping; only the vectors (norm weights, biases) are widened to
    // f32, through a buffer of the largest one
    for (f, dtype) in [("qwen2", "f16"), ("llama3_rope", "bf16"), ("llama", "f32")] {
        let ckpt = Checkpoint::open(&fixture(f)).unwrap();
        let target = PlanTarget::for_backend(&CpuBackend::new()).unwrap();
        let p = estimate(&ckpt, &target, &request()).unwrap();
        let c = &ckpt.config;
        // per layer: two norms (qwen2: and the q/k/v biases); the final norm
        let biases = if f == "qwen2" { c.q_dim() + 2 * c.kv_dim() } else { 0 };
        let vector_values = (c.num_layers * (2 * c.hidden_size + biases) + c.hidden_size) as u64;
        let (matrices, vectors): (Vec<_>, Vec<_>) = p.weights_by_dtype.iter().partition(|g| g.held == dtype);
        assert!(matrices.iter().all(|g| g.stored == dtype), "{f}: {:?}", p.weights_by_dtype);
        if dtype == "f32" {
            assert!(vectors.is_empty(), "{f}: {:?}", p.weights_by_dtype);
            assert_eq!(p.weights_total, p.weights_stored, "{f}");
            assert_eq!(p.load_staging, 0, "{f}: weights are copied straight from the mapping");
        } else {
            let [v] = vectors.as_slice() else { panic!("{f}: {:?}", p.weights_by_dtype) };
            assert_eq!((v.stored.as_str(), v.held.as_str()), (dtype, "f32"), "{f}");
            assert_eq!((v.stored_bytes, v.held_bytes), (2 * vector_values, 4 * vector_values), "{f}");
            assert_eq!(p.weights_total, p.weights_stored + 2 * vector_values, "{f}");
            let widest_vector = c.hidden_size.max(c.q_dim()) as u64;
            assert_eq!(p.load_staging, 4 * widest_vector, "{f}: the widening buffer of the widest vector");
        }
        // 16-bit matrices are widened in per-thread panels for steps of more than a few tokens:
        // the widest matrix (down_proj's intermediate columns, or o_proj's query width) sizes them
        let widest = c.hidden_size.max(c.intermediate_size).max(c.q_dim());
        let panels = if dtype == "f32" { 0 } else { tm_cpu::matmul_16bit::panel_scratch_bytes(widest) };
        assert!(request().max_batched_tokens > tm_cpu::matmul_16bit::FUSED_MAX_ROWS);
        assert_eq!(p.kernel_scratch.dense_panels, panels, "{f}");
        let decode_only = PlanRequest { max_batched_tokens: 4, max_batch_size: 4, ..request() };
        let p = estimate(&ckpt, &PlanTarget::for_backend(&CpuBackend::new()).unwrap(), &decode_only).unwrap();
        assert_eq!(p.kernel_scratch.dense_panels, 0, "{f}: only the fused kernel runs");
    }
}

#[test]
fn plan_loads_nothing() {
    // Planning allocates nothing from the backend.
    let ops = CpuBackend::new();
    let ckpt = Checkpoint::open(&fixture("qwen3")).unwrap();
    let target = PlanTarget::for_backend(&ops).unwrap();
    plan(&ckpt, &target, &request()).unwrap();
    assert_eq!(ops.allocator().stats().peak, 0);
}
