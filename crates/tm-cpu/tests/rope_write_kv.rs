//! `Ops::rope_write_kv` on the CPU backend (tm-core's default composition): the same q, k and
//! caches as `rope`, `rope`, `write_kv` called one by one, with the *rotated* k in the cache, for
//! caches in f32 and in FP8 E4M3; and bad slots are errors.

use tm_core::rope::{RopeConfig, RopeScaling, RopeStyle};
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const KV_DIM: usize = KV_HEADS * HEAD_DIM;
const BLOCKS: usize = 3;
const BLOCK: usize = 4;

fn tensor(ops: &CpuBackend, dtype: DType, shape: &[usize], bytes: &[u8]) -> Tensor {
    let mut t = ops.zeros(TensorDesc::new(dtype, shape), "test").expect("zeros");
    ops.upload(&mut t, bytes).expect("upload");
    t
}

/// Deterministic values in about `±1`, different for each `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i * 37 + seed * 101) % 97) as f32 / 48.0 - 1.0).collect()
}

/// q, k, v and the two caches (junk-filled) of `tokens` tokens.
fn inputs(ops: &CpuBackend, cache: DType, tokens: usize) -> [Tensor; 5] {
    let f32s = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    let cache_len = BLOCKS * BLOCK * KV_DIM;
    let junk = match cache {
        DType::F8E4M3 => vec![tm_core::fp8::encode(0.5); cache_len],
        _ => f32s(&vec![0.5; cache_len]),
    };
    let cache_shape = [BLOCKS, BLOCK, KV_HEADS, HEAD_DIM];
    [
        tensor(ops, DType::F32, &[tokens, HEADS * HEAD_DIM], &f32s(&values(tokens * HEADS * HEAD_DIM, 1))),
        tensor(ops, DType::F32, &[tokens, KV_DIM], &f32s(&values(tokens * KV_DIM, 2))),
        tensor(ops, DType::F32, &[tokens, KV_DIM], &f32s(&values(tokens * KV_DIM, 3))),
        tensor(ops, cache, &cache_shape, &junk),
        tensor(ops, cache, &cache_shape, &junk),
    ]
}

#[test]
fn equals_rope_rope_write_kv_with_the_rotated_k_cached() {
    let ops = CpuBackend::new();
    let cfg = RopeConfig { dim: HEAD_DIM, base: 1e4, scaling: RopeScaling::None, style: RopeStyle::Half };
    let freqs = cfg.freqs(64);
    let positions = [9u32, 10, 11];
    let slots = [5u32, 6, 11];
    for cache in [DType::F32, DType::F8E4M3] {
        let [mut q, mut k, v, mut kc, mut vc] = inputs(&ops, cache, 3);
        let k_in = ops.download_f32(&k).unwrap();
        ops.rope_write_kv(&mut q, &mut k, &v, &mut kc, &mut vc, &positions, &freqs, &slots).unwrap();

        let [mut q2, mut k2, v2, mut kc2, mut vc2] = inputs(&ops, cache, 3);
        ops.rope(&mut q2, &positions, &freqs).unwrap();
        ops.rope(&mut k2, &positions, &freqs).unwrap();
        ops.write_kv(&k2, &v2, &mut kc2, &mut vc2, &slots).unwrap();
        for (what, a, b) in [("q", &q, &q2), ("k", &k, &k2), ("k cache", &kc, &kc2), ("v cache", &vc, &vc2)] {
            assert_eq!(ops.download_f32(a).unwrap(), ops.download_f32(b).unwrap(), "{what} ({cache} cache)");
        }

        // The cache rows are the rotated k (its codes for fp8), not the k that came in.
        let (k_out, kc_out) = (ops.download_f32(&k).unwrap(), ops.download_f32(&kc).unwrap());
        assert_ne!(k_out, k_in, "k was rotated");
        for (t, &s) in slots.iter().enumerate() {
            let row: Vec<f32> = k_out[t * KV_DIM..][..KV_DIM]
                .iter()
                .map(|&x| if cache == DType::F8E4M3 { tm_core::fp8::decode(tm_core::fp8::encode(x)) } else { x })
                .collect();
            assert_eq!(&kc_out[s as usize * KV_DIM..][..KV_DIM], &row[..], "slot {s} ({cache} cache)");
        }
    }
}

#[test]
fn bad_slots_are_errors() {
    let ops = CpuBackend::new();
    let freqs = RopeConfig { dim: HEAD_DIM, base: 1e4, scaling: RopeScaling::None, style: RopeStyle::Half }.freqs(64);
    let [mut q, mut k, v, mut kc, mut vc] = inputs(&ops, DType::F32, 2);
    let past = (BLOCKS * BLOCK) as u32;
    let r = ops.rope_write_kv(&mut q, &mut k, &v, &mut kc, &mut vc, &[0, 1], &freqs, &[0, past]);
    let e = r.expect_err("a slot past the cache").to_string();
    assert!(e.contains(&past.to_string()), "{e}");
    let r = ops.rope_write_kv(&mut q, &mut k, &v, &mut kc, &mut vc, &[0, 1], &freqs, &[0]);
    assert!(r.is_err(), "one slot for two tokens");
}
