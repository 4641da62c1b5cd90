//! `Ops::matmul_add_rms_norm_deferred` on the CPU backend that defers joins: the slot's row sums
//! (tm-core's `DeferredNorm::sums`) against the squares of the residual it wrote, the other slots
//! untouched, `finish_deferred_norm` against `matmul` then `add_rms_norm`, and a missing slot as a
//! clear error.

use tm_core::ops::{DeferredNorm, DEFERRED_NORM_ROWS};
use tm_core::quant::Weight;
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;

const ROWS: usize = 300;
const COLS: usize = 24;
const N: usize = 3;
const EPS: f32 = 1e-5;

fn tensor(ops: &CpuBackend, shape: &[usize], v: &[f32]) -> Tensor {
    let mut t = ops.zeros(TensorDesc::new(DType::F32, shape), "test").expect("zeros");
    ops.upload(&mut t, bytemuck::cast_slice(v)).expect("upload");
    t
}

/// Deterministic values in about `±1`, different for each `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i * 37 + seed * 101) % 97) as f32 / 48.0 - 1.0).collect()
}

/// A sums tensor of `slots` slots (f32 `[slots, 2 * DEFERRED_NORM_ROWS]`), zeroed.
fn sums(ops: &CpuBackend, slots: usize) -> Tensor {
    ops.zeros(TensorDesc::new(DType::F32, &[slots, 2 * DEFERRED_NORM_ROWS]), "test").expect("zeros")
}

#[test]
fn a_deferred_join_fills_its_slot_and_finishes_as_add_rms_norm() {
    let ops = CpuBackend::new().with_deferred_norms();
    let w = Weight::Dense(tensor(&ops, &[ROWS, COLS], &values(ROWS * COLS, 1)));
    let x = tensor(&ops, &[N, COLS], &values(N * COLS, 2));
    let r0 = values(N * ROWS, 3);
    let mut resid = tensor(&ops, &[N, ROWS], &r0);
    let norm = tensor(&ops, &[ROWS], &values(ROWS, 4));
    let mut out = tensor(&ops, &[N, ROWS], &vec![0.0; N * ROWS]);
    let mut s = sums(&ops, 3);
    assert!(ops.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, EPS, &mut out, &mut s, 1).expect("join"));
    assert_eq!(ops.deferred_joins(), 1);

    let all = s.host::<f64>().expect("f64 view").to_vec();
    let slot = DEFERRED_NORM_ROWS..2 * DEFERRED_NORM_ROWS;
    assert!(all[..slot.start].iter().chain(&all[slot.end..]).all(|&v| v == 0.0), "another slot was written");
    let r = ops.download_f32(&resid).expect("residual");
    for (j, &got) in all[slot].iter().enumerate() {
        let want: f64 =
            if j < N { r[j * ROWS..][..ROWS].iter().map(|&v| f64::from(v) * f64::from(v)).sum() } else { 0.0 };
        assert!((got - want).abs() <= 1e-12 * want.max(1.0), "row sum {j}: {got} against {want}");
    }

    let d = DeferredNorm { sums: &s, slot: 1, eps: EPS };
    ops.finish_deferred_norm(&mut out, &d).expect("finish");
    let plain = CpuBackend::new();
    let mut delta = tensor(&plain, &[N, ROWS], &vec![0.0; N * ROWS]);
    plain.matmul(&x, &w, None, &mut delta).expect("matmul");
    let (mut resid2, mut normed) = (tensor(&plain, &[N, ROWS], &r0), tensor(&plain, &[N, ROWS], &vec![0.0; N * ROWS]));
    plain.add_rms_norm(&delta, &mut resid2, &norm, EPS, &mut normed).expect("add_rms_norm");
    let (got, want) = (ops.download_f32(&out).expect("finished"), plain.download_f32(&normed).expect("normed"));
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "finished {g} against add_rms_norm's {w}");
    }
    assert_eq!(r, plain.download_f32(&resid2).expect("residual"), "the residuals differ");
}

#[test]
fn a_missing_slot_is_an_error_and_a_plain_backend_defers_nothing() {
    let ops = CpuBackend::new().with_deferred_norms();
    let w = Weight::Dense(tensor(&ops, &[ROWS, COLS], &values(ROWS * COLS, 1)));
    let x = tensor(&ops, &[N, COLS], &values(N * COLS, 2));
    let mut resid = tensor(&ops, &[N, ROWS], &values(N * ROWS, 3));
    let norm = tensor(&ops, &[ROWS], &values(ROWS, 4));
    let mut out = tensor(&ops, &[N, ROWS], &vec![0.0; N * ROWS]);
    let mut s = sums(&ops, 2);
    let e = ops.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, EPS, &mut out, &mut s, 2).unwrap_err();
    assert!(e.to_string().contains("slot 2"), "{e}");
    assert_eq!(
        ops.download_f32(&resid).expect("residual"),
        values(N * ROWS, 3),
        "the failed join changed the residual"
    );
    let plain = CpuBackend::new();
    assert!(!plain.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, EPS, &mut out, &mut s, 0).expect("plain"));
    assert_eq!(plain.deferred_joins(), 0);
}
