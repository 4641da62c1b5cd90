//! Every wgpu op against the CPU reference backend on random inputs of model-like shapes, and
//! the `fixtures/llama` checkpoint end to end (same greedy tokens as on the CPU).
//!
//! The tests need a wgpu adapter; a software one (Mesa lavapipe) counts only with
//! `TM_WGPU_ALLOW_CPU=1`. Without one they print `skipped: no wgpu adapter (...)` and pass.

use half::f16;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;
use tm_core::ops::{AttentionMeta, SeqAttention};
use tm_core::quant::{QuantWeight, Weight};
use tm_core::rope::{RopeFreqs, RopeStyle};
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;
use tm_model::config::ModelConfig;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::weights::SafetensorsCheckpoint;
use tm_wgpu::{WgpuBackend, WgpuOptions};

/// A backend of its own with `tweak` applied to the environment's options.
fn own_gpu(tweak: impl FnOnce(&mut WgpuOptions)) -> Option<WgpuBackend> {
    let mut opts = WgpuOptions::from_env();
    tweak(&mut opts);
    match WgpuBackend::open(opts) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: no wgpu adapter ({e})");
            None
        }
    }
}

fn gpu() -> Option<&'static WgpuBackend> {
    static GPU: OnceLock<Result<WgpuBackend, String>> = OnceLock::new();
    match GPU.get_or_init(|| WgpuBackend::open(WgpuOptions::from_env()).map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: no wgpu adapter ({e})");
            None
        }
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn tensor(ops: &dyn Ops, dtype: DType, shape: &[usize], bytes: &[u8]) -> Tensor {
    let mut t = ops.zeros(TensorDesc::new(dtype, shape), "test").unwrap();
    ops.upload(&mut t, bytes).unwrap();
    t
}

fn f32t(ops: &dyn Ops, shape: &[usize], v: &[f32]) -> Tensor {
    tensor(ops, DType::F32, shape, bytemuck::cast_slice(v))
}

/// A pair of identical tensors, one per backend.
fn pair(g: &WgpuBackend, c: &CpuBackend, shape: &[usize], v: &[f32]) -> (Tensor, Tensor) {
    (f32t(g, shape, v), f32t(c, shape, v))
}

#[track_caller]
fn close(what: &str, g: &WgpuBackend, gt: &Tensor, c: &CpuBackend, ct: &Tensor) {
    let (a, b) = (g.download_f32(gt).unwrap(), c.download_f32(ct).unwrap());
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let rms = (b.iter().map(|v| v * v).sum::<f32>() / b.len().max(1) as f32).sqrt();
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let tol = 1e-4 * (y.abs() + rms + 1e-6);
        assert!((x - y).abs() <= tol, "{what}: element {i}: wgpu {x} vs cpu {y} (tol {tol})");
    }
}

/// A weight on both backends: dense f32, int4 or int8 (random packed values and f16 scales).
fn weights(g: &WgpuBackend, c: &CpuBackend, kind: &str, rows: usize, cols: usize, rng: &mut Rng) -> (Weight, Weight) {
    grouped_weights(g, c, kind, rows, cols, 32, rng)
}

/// [`weights`] with quantization groups of `group` columns.
fn grouped_weights(
    g: &WgpuBackend,
    c: &CpuBackend,
    kind: &str,
    rows: usize,
    cols: usize,
    group: usize,
    rng: &mut Rng,
) -> (Weight, Weight) {
    let groups = rows * cols / group;
    let scales: Vec<f16> = (0..groups).map(|_| f16::from_f32(rng.f() * 0.1)).collect();
    let mins: Vec<f16> = (0..groups).map(|_| f16::from_f32(rng.f() * 0.1)).collect();
    let make = |ops: &dyn Ops, packed: &[u8]| -> Weight {
        let q = |dtype, shape: &[usize]| QuantWeight {
            rows,
            cols,
            group_size: group,
            packed: tensor(ops, dtype, shape, packed),
            scales: tensor(ops, DType::F16, &[rows, cols / group], bytemuck::cast_slice(&scales)),
            mins: (dtype == DType::U8)
                .then(|| tensor(ops, DType::F16, &[rows, cols / group], bytemuck::cast_slice(&mins))),
            layout: Default::default(),
        };
        match kind {
            "int4" => Weight::Int4(q(DType::U8, &[rows, cols / 2])),
            "int8" => Weight::Int8(q(DType::I8, &[rows, cols])),
            _ => Weight::Dense(tensor(ops, DType::F32, &[rows, cols], packed)),
        }
    };
    let packed = match kind {
        "int4" => rng.bytes(rows * cols / 2),
        "int8" => rng.bytes(rows * cols),
        _ => bytemuck::cast_slice(&rng.floats(rows * cols)).to_vec(),
    };
    (make(g, &packed), make(c, &packed))
}

#[test]
fn elementwise_norm_rope_gather() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(7);
    let start = Instant::now();
    for (tokens, hidden) in [(1, 64), (7, 128), (5, 96)] {
        let n = tokens * hidden;
        let (x, y, w) = (rng.floats(n), rng.floats(n), rng.floats(hidden));
        let (gx, cx) = pair(g, &c, &[tokens, hidden], &x);
        let (gy, cy) = pair(g, &c, &[tokens, hidden], &y);
        let (gw, cw) = pair(g, &c, &[hidden], &w);
        let (mut go, mut co) = pair(g, &c, &[tokens, hidden], &vec![0.0; n]);

        g.rms_norm(&gx, &gw, 1e-5, &mut go).unwrap();
        c.rms_norm(&cx, &cw, 1e-5, &mut co).unwrap();
        close("rms_norm", g, &go, &c, &co);

        let (mut gr, mut cr) = pair(g, &c, &[tokens, hidden], &y);
        g.add_rms_norm(&gx, &mut gr, &gw, 1e-6, &mut go).unwrap();
        c.add_rms_norm(&cx, &mut cr, &cw, 1e-6, &mut co).unwrap();
        close("add_rms_norm out", g, &go, &c, &co);
        close("add_rms_norm residual", g, &gr, &c, &cr);

        g.silu_mul(&gx, &gy, &mut go).unwrap();
        c.silu_mul(&cx, &cy, &mut co).unwrap();
        close("silu_mul", g, &go, &c, &co);

        let (mut ga, mut ca) = pair(g, &c, &[tokens, hidden], &x);
        g.add_in_place(&mut ga, &gy).unwrap();
        c.add_in_place(&mut ca, &cy).unwrap();
        close("add_in_place", g, &ga, &c, &ca);

        let rows: Vec<u32> = (0..3).map(|_| rng.below(tokens) as u32).collect();
        let (mut gg, mut cg) = pair(g, &c, &[3, hidden], &vec![0.0; 3 * hidden]);
        g.gather_rows(&gx, &rows, &mut gg).unwrap();
        c.gather_rows(&cx, &rows, &mut cg).unwrap();
        close("gather_rows", g, &gg, &c, &cg);

        for (head_dim, style) in [(32, RopeStyle::Half), (32, RopeStyle::Interleaved), (hidden, RopeStyle::Half)] {
            let freqs = RopeFreqs {
                inv_freq: (0..head_dim / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / head_dim as f32)).collect(),
                attention_factor: 1.0 + rng.f().abs() * 0.1,
                style,
            };
            let positions: Vec<u32> = (0..tokens).map(|_| rng.below(200) as u32).collect();
            let (mut gq, mut cq) = pair(g, &c, &[tokens, hidden], &x);
            g.rope(&mut gq, &positions, &freqs).unwrap();
            c.rope(&mut cq, &positions, &freqs).unwrap();
            close(&format!("rope {style:?} head_dim {head_dim}"), g, &gq, &c, &cq);
        }
    }
    println!("elementwise_norm_rope_gather: {:?}", start.elapsed());
}

#[test]
fn adapters_listed_and_every_kernel_compiles() {
    for a in tm_wgpu::list_adapters() {
        println!("wgpu adapter: {a}");
    }
    let Some(g) = gpu() else { return };
    println!("using {}", g.device().name());
    g.warm_up().unwrap();
}

#[test]
fn embedding_all_layouts() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(11);
    for kind in ["dense", "int4", "int8"] {
        let (vocab, hidden) = (300, 128);
        let (gt, ct) = weights(g, &c, kind, vocab, hidden, &mut rng);
        let ids: Vec<u32> = (0..9).map(|_| rng.below(vocab) as u32).collect();
        let (mut go, mut co) = pair(g, &c, &[ids.len(), hidden], &vec![0.0; ids.len() * hidden]);
        g.embedding(&gt, &ids, &mut go).unwrap();
        c.embedding(&ct, &ids, &mut co).unwrap();
        close(&format!("embedding {kind}"), g, &go, &c, &co);
        assert!(g.embedding(&gt, &[vocab as u32], &mut go).is_err(), "out-of-vocab id must fail");
    }
}

#[test]
fn matmul_dense_and_quantized() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(13);
    let start = Instant::now();
    for kind in ["dense", "int4", "int8"] {
        for (n, rows, cols, bias) in [(1, 96, 64, false), (7, 352, 128, true), (17, 130, 96, false), (70, 72, 64, true)]
        {
            let (gw, cw) = weights(g, &c, kind, rows, cols, &mut rng);
            let x = rng.floats(n * cols);
            let (gx, cx) = pair(g, &c, &[n, cols], &x);
            let b = rng.floats(rows);
            let (gb, cb) = pair(g, &c, &[rows], &b);
            let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
            g.matmul(&gx, &gw, bias.then_some(&gb), &mut go).unwrap();
            c.matmul(&cx, &cw, bias.then_some(&cb), &mut co).unwrap();
            close(&format!("matmul {kind} n={n} {rows}x{cols} bias={bias}"), g, &go, &c, &co);
        }
    }
    println!("matmul_dense_and_quantized: {:?}", start.elapsed());
}

#[test]
fn write_kv_and_paged_attention() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(17);
    let start = Instant::now();
    for (heads, kv_heads, head_dim, window) in [(4, 2, 32, None), (4, 4, 64, Some(8)), (6, 2, 128, None)] {
        let (blocks, bs) = (8, 16);
        let width = kv_heads * head_dim;
        let cache = rng.floats(blocks * bs * width);
        let shape = [blocks, bs, kv_heads, head_dim];
        let (mut gk, mut ck) = pair(g, &c, &shape, &cache);
        let cache_v = rng.floats(blocks * bs * width);
        let (mut gv, mut cv) = pair(g, &c, &shape, &cache_v);
        // Sequence A: a prefill chunk of 5 ending at position 36 (blocks 5, 2, 7); sequence B:
        // one decode token at position 19 (blocks 0, 3).
        let (table_a, table_b) = ([5u32, 2, 7], [0u32, 3]);
        let slot = |table: &[u32], pos: usize| table[pos / bs] * bs as u32 + (pos % bs) as u32;
        let mut slots: Vec<u32> = (32..37).map(|p| slot(&table_a, p)).collect();
        slots.push(slot(&table_b, 19));
        let tokens = slots.len();
        let (k, v) = (rng.floats(tokens * width), rng.floats(tokens * width));
        let (gkn, ckn) = pair(g, &c, &[tokens, width], &k);
        let (gvn, cvn) = pair(g, &c, &[tokens, width], &v);
        g.write_kv(&gkn, &gvn, &mut gk, &mut gv, &slots).unwrap();
        c.write_kv(&ckn, &cvn, &mut ck, &mut cv, &slots).unwrap();
        close("write_kv k", g, &gk, &c, &ck);
        close("write_kv v", g, &gv, &c, &cv);

        let seqs = [
            SeqAttention { query_start: 0, query_len: 5, context_len: 37, block_table: &table_a },
            SeqAttention { query_start: 5, query_len: 1, context_len: 20, block_table: &table_b },
        ];
        let meta = AttentionMeta {
            seqs: &seqs,
            block_size: bs,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
        };
        let q = rng.floats(tokens * heads * head_dim);
        let (gq, cq) = pair(g, &c, &[tokens, heads * head_dim], &q);
        let (mut go, mut co) = pair(g, &c, &[tokens, heads * head_dim], &vec![0.0; q.len()]);
        g.attention(&gq, &gk, &gv, &meta, &mut go).unwrap();
        c.attention(&cq, &ck, &cv, &meta, &mut co).unwrap();
        close(&format!("attention {heads}/{kv_heads} heads, head_dim {head_dim}, window {window:?}"), g, &go, &c, &co);
    }
    println!("write_kv_and_paged_attention: {:?}", start.elapsed());
}

/// Decoding at long contexts splits each token's positions over several workgroups whose
/// partial states are merged (on one binding, and with the cache bound in windows too).
#[test]
fn long_context_attention_split_over_positions_matches_cpu() {
    let Some(g) = gpu() else { return };
    let Some(small) = own_gpu(|o| o.max_binding = Some(256 << 10)) else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(43);
    let (heads, kv_heads, head_dim, bs) = (4, 2, 64, 16);
    let width = kv_heads * head_dim;
    let blocks = 96;
    // Sequence A decodes at position 1200 (76 blocks); B at 700 (44 blocks), C is a prefill
    // chunk of 3 ending at position 530 (34 blocks): 20 (token, head) pairs.
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let (ta, tb, tc) = (order[..76].to_vec(), order[..44].to_vec(), order[20..54].to_vec());
    let cache_k = rng.floats(blocks * bs * width);
    let cache_v = rng.floats(blocks * bs * width);
    for window in [None, Some(300)] {
        let seqs = [
            SeqAttention { query_start: 0, query_len: 1, context_len: 1201, block_table: &ta },
            SeqAttention { query_start: 1, query_len: 1, context_len: 701, block_table: &tb },
            SeqAttention { query_start: 2, query_len: 3, context_len: 531, block_table: &tc },
        ];
        let meta = AttentionMeta {
            seqs: &seqs,
            block_size: bs,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: window,
        };
        let tokens = 5;
        let q = rng.floats(tokens * heads * head_dim);
        let (ck, cv) = (
            f32t(&c, &[blocks, bs, kv_heads, head_dim], &cache_k),
            f32t(&c, &[blocks, bs, kv_heads, head_dim], &cache_v),
        );
        let cq = f32t(&c, &[tokens, heads * head_dim], &q);
        let mut co = f32t(&c, &[tokens, heads * head_dim], &vec![0.0; q.len()]);
        c.attention(&cq, &ck, &cv, &meta, &mut co).unwrap();
        for b in [g, &small] {
            let gk = f32t(b, &[blocks, bs, kv_heads, head_dim], &cache_k);
            let gv = f32t(b, &[blocks, bs, kv_heads, head_dim], &cache_v);
            let gq = f32t(b, &[tokens, heads * head_dim], &q);
            let mut go = f32t(b, &[tokens, heads * head_dim], &vec![0.0; q.len()]);
            b.attention(&gq, &gk, &gv, &meta, &mut go).unwrap();
            let what = format!("long-context attention, window {window:?}, binding limit {}", b.gpu().max_binding());
            close(&what, b, &go, &c, &co);
        }
    }
}

/// The fused RoPE + KV-cache write gives the unfused ops' bytes (q, k and both caches) and the
/// CPU's values, in both pair layouts, with GQA.
#[test]
fn fused_rope_write_kv_matches_unfused_and_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(47);
    let (tokens, heads, kv_heads, head_dim, blocks, bs) = (5, 8, 2, 64, 6, 16);
    let width = kv_heads * head_dim;
    let shape = [blocks, bs, kv_heads, head_dim];
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let freqs = RopeFreqs {
            inv_freq: (0..head_dim / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / head_dim as f32)).collect(),
            attention_factor: 1.0 + rng.f().abs() * 0.1,
            style,
        };
        let positions: Vec<u32> = (0..tokens).map(|_| rng.below(300) as u32).collect();
        let slots: Vec<u32> = [7u32, 40, 41, 90, 3].to_vec();
        let (q, k, v) = (rng.floats(tokens * heads * head_dim), rng.floats(tokens * width), rng.floats(tokens * width));
        let cache = rng.floats(blocks * bs * width);
        let run = |ops: &dyn Ops, fused: bool| -> Vec<Vec<f32>> {
            let (mut tq, mut tk, tv) = (
                f32t(ops, &[tokens, heads * head_dim], &q),
                f32t(ops, &[tokens, width], &k),
                f32t(ops, &[tokens, width], &v),
            );
            let (mut kc, mut vc) = (f32t(ops, &shape, &cache), f32t(ops, &shape, &cache));
            if fused {
                ops.rope_write_kv(&mut tq, &mut tk, &tv, &mut kc, &mut vc, &positions, &freqs, &slots).unwrap();
            } else {
                tm_core::ops::rope_write_kv_unfused(
                    ops, &mut tq, &mut tk, &tv, &mut kc, &mut vc, &positions, &freqs, &slots,
                )
                .unwrap();
            }
            [tq, tk, kc, vc].iter().map(|t| ops.download_f32(t).unwrap()).collect()
        };
        let (fused, unfused, cpu) = (run(g, true), run(g, false), run(&c, false));
        for (i, what) in ["q", "k", "k cache", "v cache"].iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused[i]), bits(&unfused[i]), "{what} ({style:?}): fused and unfused differ");
            for (j, (a, b)) in fused[i].iter().zip(&cpu[i]).enumerate() {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{what} ({style:?}) element {j}: wgpu {a} vs cpu {b}");
            }
        }
    }
}

#[test]
fn allocator_stats_limits_and_copy() {
    // Its own backend: the shared one's counters move with the other tests.
    let g = match WgpuBackend::open(WgpuOptions::from_env()) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no wgpu adapter ({e})");
            return;
        }
    };
    let g = &g;
    let a = g.allocator();
    let before = a.stats().in_use;
    {
        let mut t = f32t(g, &[3], &[1.0, 2.0, 3.0]);
        assert!(a.stats().in_use >= before + 12);
        t.buffer_mut().grow(64, "test").unwrap();
        assert_eq!(g.download_f32(&t).unwrap(), vec![1.0, 2.0, 3.0]);
        // Odd byte counts round-trip too.
        let b = tensor(g, DType::U8, &[5], &[1, 2, 3, 4, 5]);
        let mut back = [0u8; 5];
        g.download(&b, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4, 5]);
    }
    assert_eq!(a.stats().in_use, before, "buffers free on drop");
    let limit = g.gpu().max_tensor();
    let err = g.zeros(TensorDesc::new(DType::U8, &[limit as usize + 4]), "huge weight").unwrap_err().to_string();
    assert!(err.contains("huge weight") && err.contains("max_buffer_size"), "{err}");
}

/// Greedy-decodes `steps` tokens after `prompt` on both backends; asserts the same tokens and
/// logits within 1e-3 of their range.
fn greedy_matches(
    what: &str,
    cpu: (&LlamaModel, &dyn Ops),
    gpu: (&LlamaModel, &dyn Ops),
    prompt: &[u32],
    steps: usize,
) {
    let mut runs = Vec::new();
    for (model, ops) in [cpu, gpu] {
        let mut session = Session::new(model, ops, 256, 16).unwrap();
        let mut logits = session.append(prompt).unwrap();
        let (mut out, mut all) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let t = tm_core::sampling::argmax(&logits);
            out.push(t);
            all.extend_from_slice(&logits);
            if step + 1 < steps {
                logits = session.append(&[t]).unwrap();
            }
        }
        runs.push((out, all));
    }
    let (c, g) = (&runs[0], &runs[1]);
    let (lo, hi) = c.1.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    let max_diff = c.1.iter().zip(&g.1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max_diff <= 1e-3 * (hi - lo), "{what}: max |logit diff| {max_diff} over a range of {}", hi - lo);
    assert_eq!(g.0, c.0, "{what}: greedy tokens differ");
}

/// An HF fixture (f32/bf16 safetensors) on both backends, every reference prompt.
fn hf_fixture_matches_cpu(name: &str) {
    let Some(g) = gpu() else { return };
    let start = Instant::now();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let c = CpuBackend::new();
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let cpu_model = LlamaModel::load(&c, &ckpt, ModelConfig::from_dir(&dir).unwrap(), &mut |_| {}).unwrap();
    let gpu_model = LlamaModel::load(g, &ckpt, ModelConfig::from_dir(&dir).unwrap(), &mut |_| {}).unwrap();
    for prompt in reference["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = prompt["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let steps = prompt["greedy_ids"].as_array().unwrap().len();
        greedy_matches(name, (&cpu_model, &c), (&gpu_model, g), &ids, steps);
    }
    println!("{name} fixture: {:?}", start.elapsed());
}

#[test]
fn llama_fixture_greedy_matches_cpu() {
    hf_fixture_matches_cpu("llama");
}

#[test]
fn other_hf_fixtures_greedy_match_cpu() {
    for name in ["llama3_rope", "llama_yarn_rope", "mistral", "qwen2", "qwen3", "internlm2"] {
        hf_fixture_matches_cpu(name);
    }
}

/// The default GGUF model (SmolLM2-135M Q4_1 with Q8_0 tensors): the int4/int8 embedding and
/// matrix kernels on real weights. Skips, saying so, when the model is not available.
#[test]
fn default_gguf_model_greedy_matches_cpu() {
    let Some(g) = gpu() else { return };
    let path = match tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        Ok(p) => p,
        Err(e) => {
            println!("skipped: default model not available ({e})");
            return;
        }
    };
    let start = Instant::now();
    let c = CpuBackend::new();
    let cpu_model = tm_model::loader::load(&path, &c, &mut |_, _| {}).unwrap();
    let gpu_model = tm_model::loader::load(&path, g, &mut |_, _| {}).unwrap();
    println!("default gguf model loaded on both backends: {:?}", start.elapsed());
    let prompt = cpu_model.tokenizer.encode("The capital of France is", true).unwrap();
    greedy_matches("default gguf model", (&cpu_model.model, &c), (&gpu_model.model, g), &prompt, 4);
    println!("default_gguf_model_greedy_matches_cpu: {:?}", start.elapsed());
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let x = f32t(g, &[2, 8], &[0.5; 16]);
    let w = Weight::Dense(f32t(g, &[4, 8], &[0.5; 32]));
    let mut wrong = f32t(g, &[2, 5], &[0.0; 10]);
    assert!(g.matmul(&x, &w, None, &mut wrong).is_err(), "matmul output shape");
    let foreign = f32t(&c, &[2, 8], &[0.5; 16]);
    let mut out = f32t(g, &[2, 4], &[0.0; 8]);
    assert!(g.matmul(&foreign, &w, None, &mut out).is_err(), "a CPU tensor on the wgpu backend");
    let mut kc = f32t(g, &[2, 4, 1, 8], &[0.0; 64]);
    let mut vc = f32t(g, &[2, 4, 1, 8], &[0.0; 64]);
    assert!(g.write_kv(&x, &x, &mut kc, &mut vc, &[0, 8]).is_err(), "slot outside the cache");
    let seqs = [SeqAttention { query_start: 0, query_len: 2, context_len: 2, block_table: &[5] }];
    let meta = AttentionMeta { seqs: &seqs, block_size: 4, scale: 1.0, sliding_window: None };
    let mut ao = f32t(g, &[2, 8], &[0.0; 16]);
    assert!(g.attention(&x, &kc, &vc, &meta, &mut ao).is_err(), "block outside the cache");
    let mut short = vec![0u8; 3];
    assert!(g.download(&x, &mut short).is_err(), "download into a buffer of the wrong size");
}

/// Matrix products, embeddings, `write_kv` and attention with storage bindings capped at 64 KiB:
/// weights split by rows, activations by tokens, the KV cache by blocks (attention merging the
/// windows' partial softmax states).
#[test]
fn windowed_bindings_match_cpu() {
    let Some(g) = own_gpu(|o| o.max_binding = Some(64 << 10)) else { return };
    let g = &g;
    let c = CpuBackend::new();
    let mut rng = Rng(23);
    let start = Instant::now();
    println!("binding cap {} bytes, storage alignment {}", g.gpu().max_binding(), g.gpu().storage_align());
    for kind in ["dense", "int4", "int8"] {
        // 1000 x 256: 1 MB dense, 128 KB int4: several windows each; n = 80 splits x and out.
        for (n, rows, cols, bias) in [(3, 1000, 256, true), (80, 1000, 256, false)] {
            let (gw, cw) = weights(g, &c, kind, rows, cols, &mut rng);
            let x = rng.floats(n * cols);
            let (gx, cx) = pair(g, &c, &[n, cols], &x);
            let (gb, cb) = pair(g, &c, &[rows], &rng.floats(rows));
            let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
            g.matmul(&gx, &gw, bias.then_some(&gb), &mut go).unwrap();
            c.matmul(&cx, &cw, bias.then_some(&cb), &mut co).unwrap();
            close(&format!("windowed matmul {kind} n={n} {rows}x{cols}"), g, &go, &c, &co);
        }
        let (gt, ct) = weights(g, &c, kind, 1000, 256, &mut rng);
        let ids: Vec<u32> = (0..12).map(|i| if i < 2 { 999 * i } else { rng.below(1000) as u32 }).collect();
        let (mut go, mut co) = pair(g, &c, &[ids.len(), 256], &vec![0.0; ids.len() * 256]);
        g.embedding(&gt, &ids, &mut go).unwrap();
        c.embedding(&ct, &ids, &mut co).unwrap();
        close(&format!("windowed embedding {kind}"), g, &go, &c, &co);
    }
    // KV cache of 64 blocks x 8 KB: 8 windows.
    let (heads, kv_heads, head_dim, blocks, bs) = (4, 2, 64, 64, 16);
    let width = kv_heads * head_dim;
    let shape = [blocks, bs, kv_heads, head_dim];
    let (mut gk, mut ck) = pair(g, &c, &shape, &rng.floats(blocks * bs * width));
    let (mut gv, mut cv) = pair(g, &c, &shape, &rng.floats(blocks * bs * width));
    let table_a: Vec<u32> = (0..20).map(|i| (i * 37 % 64) as u32).collect();
    let table_b = [63u32, 0, 8];
    let slot = |table: &[u32], pos: usize| table[pos / bs] * bs as u32 + (pos % bs) as u32;
    let mut slots: Vec<u32> = (300..305).map(|p| slot(&table_a, p)).collect();
    slots.push(slot(&table_b, 40));
    let tokens = slots.len();
    let (gkn, ckn) = pair(g, &c, &[tokens, width], &rng.floats(tokens * width));
    let (gvn, cvn) = pair(g, &c, &[tokens, width], &rng.floats(tokens * width));
    g.write_kv(&gkn, &gvn, &mut gk, &mut gv, &slots).unwrap();
    c.write_kv(&ckn, &cvn, &mut ck, &mut cv, &slots).unwrap();
    close("windowed write_kv k", g, &gk, &c, &ck);
    close("windowed write_kv v", g, &gv, &c, &cv);
    for window in [None, Some(100)] {
        let seqs = [
            SeqAttention { query_start: 0, query_len: 5, context_len: 305, block_table: &table_a },
            SeqAttention { query_start: 5, query_len: 1, context_len: 41, block_table: &table_b },
        ];
        let meta = AttentionMeta { seqs: &seqs, block_size: bs, scale: 0.125, sliding_window: window };
        let q = rng.floats(tokens * heads * head_dim);
        let (gq, cq) = pair(g, &c, &[tokens, heads * head_dim], &q);
        let (mut go, mut co) = pair(g, &c, &[tokens, heads * head_dim], &vec![0.0; q.len()]);
        g.attention(&gq, &gk, &gv, &meta, &mut go).unwrap();
        c.attention(&cq, &ck, &cv, &meta, &mut co).unwrap();
        close(&format!("windowed attention, window {window:?}"), g, &go, &c, &co);
    }
    println!("windowed_bindings_match_cpu: {:?}", start.elapsed());
}

/// f16 dense weights (matrix and embedding) against the CPU on the same f16-rounded values.
#[test]
fn f16_weights_match_cpu_on_rounded_weights() {
    let Some(g) = own_gpu(|o| o.f16_weights = true) else { return };
    let g = &g;
    let c = CpuBackend::new();
    let mut rng = Rng(29);
    for (n, rows, cols) in [(1, 96, 64), (5, 130, 96), (17, 70, 128), (2, 50, 36)] {
        let w = rng.floats(rows * cols);
        let rounded: Vec<f32> = w.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        let gw = Weight::Dense(g.load_dense(DType::F32, &[rows, cols], bytemuck::cast_slice(&w), "test").unwrap());
        assert_eq!(gw.dims(), (rows, cols));
        if let Weight::Dense(t) = &gw {
            assert_eq!(t.dtype(), DType::F16, "f16 weights are stored as f16");
        }
        let cw = Weight::Dense(f32t(&c, &[rows, cols], &rounded));
        let (gx, cx) = pair(g, &c, &[n, cols], &rng.floats(n * cols));
        let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
        g.matmul(&gx, &gw, None, &mut go).unwrap();
        c.matmul(&cx, &cw, None, &mut co).unwrap();
        close(&format!("f16 matmul n={n} {rows}x{cols}"), g, &go, &c, &co);
        let ids: Vec<u32> = (0..7).map(|_| rng.below(rows) as u32).collect();
        let (mut ge, mut ce) = pair(g, &c, &[ids.len(), cols], &vec![0.0; ids.len() * cols]);
        g.embedding(&gw, &ids, &mut ge).unwrap();
        c.embedding(&cw, &ids, &mut ce).unwrap();
        close("f16 embedding", g, &ge, &c, &ce);
    }
    // Vectors (norm weights, biases) stay f32.
    let v = g.load_dense(DType::F32, &[8], bytemuck::cast_slice(&[0.5f32; 8]), "test").unwrap();
    assert_eq!(v.dtype(), DType::F32);
}

/// The matrix-vector kernels with the shared-memory reduction (the subgroup one is what the
/// shared backend uses where the adapter has subgroups).
#[test]
fn gemv_without_subgroups_matches_cpu() {
    let Some(g) = own_gpu(|o| o.no_subgroups = true) else { return };
    let g = &g;
    println!("shared backend uses subgroups: {}", gpu().is_some_and(|s| s.uses_subgroups()));
    assert!(!g.uses_subgroups());
    let c = CpuBackend::new();
    let mut rng = Rng(31);
    for kind in ["dense", "int4", "int8"] {
        for (n, rows, cols) in [(1, 96, 64), (8, 200, 160)] {
            let (gw, cw) = weights(g, &c, kind, rows, cols, &mut rng);
            let (gx, cx) = pair(g, &c, &[n, cols], &rng.floats(n * cols));
            let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
            g.matmul(&gx, &gw, None, &mut go).unwrap();
            c.matmul(&cx, &cw, None, &mut co).unwrap();
            close(&format!("gemv (no subgroups) {kind} n={n}"), g, &go, &c, &co);
        }
    }
    // Dense rows whose length is not a multiple of 8 take the scalar kernel, on both backends.
    for b in [g, gpu().unwrap_or(g)] {
        let (n, rows, cols) = (3, 40, 36);
        let w = rng.floats(rows * cols);
        let (gw, cw) = pair(b, &c, &[rows, cols], &w);
        let (gx, cx) = pair(b, &c, &[n, cols], &rng.floats(n * cols));
        let (mut go, mut co) = pair(b, &c, &[n, rows], &vec![0.0; n * rows]);
        b.matmul(&gx, &Weight::Dense(gw), None, &mut go).unwrap();
        c.matmul(&cx, &Weight::Dense(cw), None, &mut co).unwrap();
        close(&format!("gemv dense cols {cols}, subgroups {}", b.uses_subgroups()), b, &go, &c, &co);
    }
}

/// The matrix-vector kernels with the token count fixed per pipeline (the default) and read
/// from the parameters (`dynamic_gemv_tokens`), for every count they take; quantized weights in
/// groups of 64 and 128 columns (the other tests use 32).
#[test]
fn gemv_token_counts_fixed_and_dynamic_match_cpu() {
    let Some(fixed) = gpu() else { return };
    let Some(dynamic) = own_gpu(|o| o.dynamic_gemv_tokens = true) else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(37);
    for g in [fixed, &dynamic] {
        for (kind, group) in [("dense", 32), ("int4", 64), ("int8", 128), ("int4", 128)] {
            // Rows not a multiple of the int4/int8 kernels' four per workgroup; a bias on odd counts.
            let (rows, cols) = (42, 384);
            let (gw, cw) = grouped_weights(g, &c, kind, rows, cols, group, &mut rng);
            let (gb, cb) = pair(g, &c, &[rows], &rng.floats(rows));
            for n in 1..=tm_kernels::wgsl::GEMV_MAX_TOKENS {
                let (gx, cx) = pair(g, &c, &[n, cols], &rng.floats(n * cols));
                let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
                let bias = n % 2 == 1;
                g.matmul(&gx, &gw, bias.then_some(&gb), &mut go).unwrap();
                c.matmul(&cx, &cw, bias.then_some(&cb), &mut co).unwrap();
                let what = format!("gemv {kind}/{group} n={n}, dynamic {}", std::ptr::eq(g, &dynamic));
                close(&what, g, &go, &c, &co);
            }
        }
    }
}

/// The int4/int8 matrix-vector kernels in other shapes (`gemv_rows`, `gemv_workgroup`; the dense
/// ones keep theirs), with and without subgroups, against the CPU.
#[test]
fn gemv_workgroup_shapes_match_cpu() {
    let c = CpuBackend::new();
    let mut rng = Rng(53);
    for (rows_per, wg, no_sg) in [(1, 32, false), (3, 128, false), (2, 256, true), (4, 32, true)] {
        let Some(g) = own_gpu(|o| {
            o.gemv_rows = Some(rows_per);
            o.gemv_workgroup = Some(wg);
            o.no_subgroups = no_sg;
        }) else {
            return;
        };
        for kind in ["dense", "int4", "int8"] {
            let (rows, cols) = (43, 512);
            let (gw, cw) = weights(&g, &c, kind, rows, cols, &mut rng);
            let (gb, cb) = pair(&g, &c, &[rows], &rng.floats(rows));
            for n in [1, 3] {
                let (gx, cx) = pair(&g, &c, &[n, cols], &rng.floats(n * cols));
                let (mut go, mut co) = pair(&g, &c, &[n, rows], &vec![0.0; n * rows]);
                g.matmul(&gx, &gw, Some(&gb), &mut go).unwrap();
                c.matmul(&cx, &cw, Some(&cb), &mut co).unwrap();
                close(&format!("gemv {kind} n={n}, {rows_per} rows x {wg}, subgroups {}", !no_sg), &g, &go, &c, &co);
            }
        }
    }
}

/// KV-cache copy-on-write as device copies, in order (a chunk copied earlier may be copied on).
#[test]
fn copy_chunks_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng(37);
    let v = rng.floats(8 * 32);
    let (mut gt, mut ct) = pair(g, &c, &[8, 32], &v);
    let pairs = [(1, 5), (5, 2), (7, 0)];
    g.copy_chunks(&mut gt, 32 * 4, &pairs).unwrap();
    c.copy_chunks(&mut ct, 32 * 4, &pairs).unwrap();
    close("copy_chunks", g, &gt, &c, &ct);
    assert!(g.copy_chunks(&mut gt, 32 * 4, &[(8, 0)]).is_err(), "chunk outside the tensor");
}

/// A weight larger than the adapter's real storage binding limit (lavapipe: 128 MiB), uploaded
/// in pieces and multiplied in windows; skipped where the limit is larger than 160 MiB.
#[test]
fn weight_over_the_adapter_binding_limit() {
    let Some(g) = gpu() else { return };
    let limit = g.gpu().max_binding();
    if limit > 160 << 20 {
        println!("skipped: the binding limit is {} MiB", limit >> 20);
        return;
    }
    let c = CpuBackend::new();
    let mut rng = Rng(41);
    let cols = 1024;
    let rows = (limit as usize / (cols * 4)) + 3000;
    let start = Instant::now();
    let w = rng.floats(rows * cols);
    let (gw, cw) = pair(g, &c, &[rows, cols], &w);
    drop(w);
    let (gw, cw) = (Weight::Dense(gw), Weight::Dense(cw));
    for n in [1, 3] {
        let (gx, cx) = pair(g, &c, &[n, cols], &rng.floats(n * cols));
        let (mut go, mut co) = pair(g, &c, &[n, rows], &vec![0.0; n * rows]);
        g.matmul(&gx, &gw, None, &mut go).unwrap();
        c.matmul(&cx, &cw, None, &mut co).unwrap();
        close(&format!("matmul over the binding limit, {rows}x{cols}, n={n}"), g, &go, &c, &co);
    }
    println!(
        "weight of {} MiB over a binding limit of {} MiB: {:?}",
        (rows * cols * 4) >> 20,
        limit >> 20,
        start.elapsed()
    );
}

/// `TM_WGPU_PROFILE`: every launch is timed under its kernel's name, once, and the results are
/// the same as without profiling.
#[test]
fn profiling_times_every_launch_by_kernel() {
    let Some(g) = own_gpu(|o| o.profile = true) else { return };
    let Some(before) = g.gpu().profile() else {
        println!("skipped: {} has no timestamp queries", g.gpu().summary.name);
        return;
    };
    assert_eq!(before.submissions, 0);
    let c = CpuBackend::new();
    let mut rng = Rng(41);
    let (rows, cols) = (64, 96);
    let (gw, cw) = weights(&g, &c, "int4", rows, cols, &mut rng);
    let (gx, cx) = pair(&g, &c, &[1, cols], &rng.floats(cols));
    let (gn, cn) = pair(&g, &c, &[cols], &rng.floats(cols));
    let (mut gy, mut cy) = pair(&g, &c, &[1, cols], &[0.0; 96]);
    let (mut go, mut co) = pair(&g, &c, &[1, rows], &[0.0; 64]);
    for _ in 0..3 {
        g.rms_norm(&gx, &gn, 1e-5, &mut gy).unwrap();
        g.matmul(&gy, &gw, None, &mut go).unwrap();
    }
    c.rms_norm(&cx, &cn, 1e-5, &mut cy).unwrap();
    c.matmul(&cy, &cw, None, &mut co).unwrap();
    close("profiled matmul", &g, &go, &c, &co);
    let p = g.gpu().profile().unwrap();
    assert!(p.submissions >= 1, "{p:?}");
    let gemv = if g.uses_subgroups() { "gemv_vec_q4_sg" } else { "gemv_vec_q4" };
    for (name, launches) in [("rms_norm", 3), (gemv, 3)] {
        let k = p.kernels.get(name).unwrap_or_else(|| panic!("{name} missing from {p:?}"));
        assert_eq!(k.launches, launches, "{name}");
        assert!(k.ns > 0.0, "{name}: no GPU time");
    }
    assert_eq!(p.kernels.values().map(|k| k.launches).sum::<u64>(), 6, "{}", p.report());
    assert!(p.gpu_span_ns >= p.kernel_ns() * 0.999, "{}", p.report());
    println!("{}", p.report());
}
