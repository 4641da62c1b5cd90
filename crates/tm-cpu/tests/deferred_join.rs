//! `Ops::matmul_add_rms_norm_deferred` on the CPU backend that defers joins: the slot's row sums
//! and block sums (tm-core's `DeferredNorm::sums`) against sums of what the join wrote, the other
//! slots untouched, `finish_deferred_norm` against `add_rms_norm`, and slots too short for the
//! output as clear errors.

use tm_core::ops::{deferred_norm_slot, deferred_norm_slot_len, DeferredNorm, DEFERRED_NORM_BLOCK, DEFERRED_NORM_ROWS};
use tm_core::quant::Weight;
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;

/// Rows of the weight (the join's output width): two whole blocks and a partial one.
const ROWS: usize = 300;
const COLS: usize = 24;
const N: usize = 3;

fn tensor(ops: &CpuBackend, shape: &[usize], v: &[f32]) -> Tensor {
    let mut t = ops.zeros(TensorDesc::new(DType::F32, shape), "test").expect("zeros");
    ops.upload(&mut t, bytemuck::cast_slice(v)).expect("upload");
    t
}

/// Deterministic values in about `±1`, different for each `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32).map(|i| ((i * 37 + seed * 101) % 97) as f32 / 48.0 - 1.0).collect()
}

#[test]
fn a_deferred_join_fills_its_slots_row_and_block_sums() {
    let ops = CpuBackend::new().with_deferred_norms();
    let w = Weight::Dense(tensor(&ops, &[ROWS, COLS], &values(ROWS * COLS, 1)));
    let x = tensor(&ops, &[N, COLS], &values(N * COLS, 2));
    let r0 = values(N * ROWS, 3);
    let mut resid = tensor(&ops, &[N, ROWS], &r0);
    let norm = tensor(&ops, &[ROWS], &values(ROWS, 4));
    let mut out = tensor(&ops, &[N, ROWS], &vec![0.0; N * ROWS]);
    let len = deferred_norm_slot_len(ROWS);
    assert_eq!(len, 2 * DEFERRED_NORM_ROWS * (1 + 3));
    let mut sums = ops.zeros(TensorDesc::new(DType::F32, &[3, len]), "test").expect("zeros");
    assert!(ops.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, 1e-5, &mut out, &mut sums, 1).expect("join"));

    let all = sums.host::<f64>().expect("f64 view").to_vec();
    let slot = deferred_norm_slot(&sums, 1, ROWS).expect("slot 1");
    assert!(all[..slot.start].iter().chain(&all[slot.end..]).all(|&v| v == 0.0), "another slot was written");
    let (row_sums, blocks) = all[slot].split_at(DEFERRED_NORM_ROWS);
    let (r, o) = (ops.download_f32(&resid).expect("residual"), ops.download_f32(&out).expect("output"));
    for j in 0..DEFERRED_NORM_ROWS {
        let want: f64 =
            if j < N { r[j * ROWS..][..ROWS].iter().map(|&v| f64::from(v) * f64::from(v)).sum() } else { 0.0 };
        assert!((row_sums[j] - want).abs() <= 1e-12 * want.max(1.0), "row sum {j}: {} against {want}", row_sums[j]);
        for (b, block) in blocks.chunks(DEFERRED_NORM_ROWS).enumerate() {
            let cols = b * DEFERRED_NORM_BLOCK..ROWS.min((b + 1) * DEFERRED_NORM_BLOCK);
            let want: f64 = if j < N { o[j * ROWS..][cols].iter().map(|&v| f64::from(v)).sum() } else { 0.0 };
            assert!(
                (block[j] - want).abs() <= 1e-12 * want.abs().max(1.0),
                "block {b} row {j}: {} against {want}",
                block[j]
            );
        }
    }
    assert!(blocks[2 * DEFERRED_NORM_ROWS] != 0.0, "the partial last block has no sum");

    // finishing the norm gives add_rms_norm's output
    let d = DeferredNorm { sums: &sums, slot: 1, eps: 1e-5 };
    ops.finish_deferred_norm(&mut out, &d).expect("finish");
    let plain = CpuBackend::new();
    let mut delta = tensor(&plain, &[N, ROWS], &vec![0.0; N * ROWS]);
    plain.matmul(&x, &w, None, &mut delta).expect("matmul");
    let (mut resid2, mut normed) = (tensor(&plain, &[N, ROWS], &r0), tensor(&plain, &[N, ROWS], &vec![0.0; N * ROWS]));
    plain.add_rms_norm(&delta, &mut resid2, &norm, 1e-5, &mut normed).expect("add_rms_norm");
    let (got, want) = (ops.download_f32(&out).expect("finished"), plain.download_f32(&normed).expect("normed"));
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "finished {g} against add_rms_norm's {w}");
    }
}

#[test]
fn slots_too_short_for_the_output_are_errors() {
    let ops = CpuBackend::new().with_deferred_norms();
    let w = Weight::Dense(tensor(&ops, &[ROWS, COLS], &values(ROWS * COLS, 1)));
    let x = tensor(&ops, &[N, COLS], &values(N * COLS, 2));
    let mut resid = tensor(&ops, &[N, ROWS], &values(N * ROWS, 3));
    let norm = tensor(&ops, &[ROWS], &values(ROWS, 4));
    let mut out = tensor(&ops, &[N, ROWS], &vec![0.0; N * ROWS]);
    // the old layout: row sums only
    let mut sums = ops.zeros(TensorDesc::new(DType::F32, &[2, 2 * DEFERRED_NORM_ROWS]), "test").expect("zeros");
    let e = ops.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, 1e-5, &mut out, &mut sums, 0).unwrap_err();
    assert!(e.to_string().contains(&format!("needs {}", deferred_norm_slot_len(ROWS))), "{e}");
    let mut sums = ops.zeros(TensorDesc::new(DType::F32, &[2, deferred_norm_slot_len(ROWS)]), "test").expect("zeros");
    let e = ops.matmul_add_rms_norm_deferred(&x, &w, &mut resid, &norm, 1e-5, &mut out, &mut sums, 2).unwrap_err();
    assert!(e.to_string().contains("slot 2"), "{e}");
}
