//! How the CPU backend holds dense tensors: matrices as stored, vectors (norm weights, biases)
//! widened to f32 once at load, as the kernels read them.

use half::{bf16, f16};
use tm_core::{DType, Ops};
use tm_cpu::CpuBackend;

fn held(ops: &CpuBackend, dtype: DType, shape: &[usize], bytes: &[u8]) -> (DType, Vec<u8>) {
    let t = ops.load_dense(dtype, shape, bytes, "test").unwrap();
    let mut out = vec![0u8; t.desc().bytes()];
    ops.download(&t, &mut out).unwrap();
    (t.dtype(), out)
}

#[test]
fn vectors_are_widened_to_f32_and_matrices_kept() {
    let ops = CpuBackend::new();
    let values = [1.5f32, -0.25, 3.0e-3, 65504.0, -7.0, 0.0];
    let as_f16: Vec<u8> = values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
    let as_bf16: Vec<u8> = values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
    for (dtype, bytes, widen) in [
        (DType::F16, &as_f16, (|b: [u8; 2]| f16::from_le_bytes(b).to_f32()) as fn([u8; 2]) -> f32),
        (DType::BF16, &as_bf16, |b: [u8; 2]| bf16::from_le_bytes(b).to_f32()),
    ] {
        assert_eq!((ops.vector_dtype(dtype), ops.weight_dtype(dtype)), (DType::F32, dtype));
        let (d, got) = held(&ops, dtype, &[values.len()], bytes);
        let want: Vec<u8> = bytes.chunks_exact(2).flat_map(|c| widen([c[0], c[1]]).to_le_bytes()).collect();
        assert_eq!((d, got), (DType::F32, want), "{dtype} vector");
        let (d, got) = held(&ops, dtype, &[2, values.len() / 2], bytes);
        assert_eq!((d, &got), (dtype, bytes), "{dtype} matrix");
    }
    let f32s: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(held(&ops, DType::F32, &[values.len()], &f32s), (DType::F32, f32s.clone()));
    // a short buffer is an error, whatever the shape
    assert!(ops.load_dense(DType::BF16, &[values.len()], &as_bf16[1..], "test").is_err());
}
