//! Early replay of CUDA graphs (`tm_cuda`'s graph cache; `Ops::step_inputs_ready`): a step whose
//! signature up to the hint matches the last replayed graph's starts that graph before it has
//! finished recording, and the rest is checked afterwards.
//!
//! Each step, like a decode step, is idempotent given its per-step inputs: it writes the rows of
//! `src` into a cache at this step's slots (`write_kv`, the slot mapping uploaded as a per-step
//! input), says its inputs are ready (with this step's rows), then gathers this step's rows of the
//! cache into `out`. Slots and rows change every step, so a replay that read stale inputs (an
//! upload after the launch, or none) gives the wrong rows. One step adds `y` to `out` after the
//! hint: its signature differs from the predicted graph's only after the early launch, so the
//! backend must notice and run the step again. Every step's `out` is compared bit for bit with
//! the CPU backend's; the test also requires that early replays happened and that exactly the
//! odd step was rerun. Skips (printing why) without a CUDA device; `TM_CUDA_DEVICE` picks it.

use tm_core::sampling::Rng;
use tm_core::{DType, Ops, Result, Tensor, TensorDesc};
use tm_cpu::CpuBackend;
use tm_cuda::{CudaBackend, CudaOptions};

const ROWS: usize = 64;
const COLS: usize = 96;
const STEPS: usize = 12;
/// The step that adds `y` after the hint.
const ODD: usize = 8;

struct State {
    src: Tensor,
    y: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
}

fn state(ops: &dyn Ops, src: &[f32], y: &[f32]) -> Result<State> {
    let zeros = |shape: &[usize]| ops.zeros(TensorDesc::new(DType::F32, shape), "test");
    let mut s = State {
        src: zeros(&[ROWS, COLS])?,
        y: zeros(&[ROWS, COLS])?,
        k: zeros(&[ROWS, 1, 1, COLS])?,
        v: zeros(&[ROWS, 1, 1, COLS])?,
        out: zeros(&[ROWS, COLS])?,
    };
    ops.upload(&mut s.src, bytemuck::cast_slice(src))?;
    ops.upload(&mut s.y, bytemuck::cast_slice(y))?;
    Ok(s)
}

/// One step (see the module docs).
fn step(ops: &dyn Ops, s: &mut State, slots: &[u32], rows: &[u32], odd: bool) -> Result<()> {
    ops.write_kv(&s.src, &s.src, &mut s.k, &mut s.v, slots)?;
    ops.step_inputs_ready(rows)?;
    ops.gather_rows(&s.k, rows, &mut s.out)?;
    if odd {
        ops.add_in_place(&mut s.out, &s.y)?;
    }
    Ok(())
}

/// A random permutation of `0..n`.
fn permutation(rng: &mut Rng, n: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        p.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    p
}

fn download(ops: &dyn Ops, t: &Tensor) -> Result<Vec<f32>> {
    let mut bytes = vec![0u8; t.desc().bytes()];
    ops.download(t, &mut bytes)?;
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

#[test]
fn early_replays_give_the_eager_results_and_catch_a_mismatch() {
    let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    match tm_cuda::probe() {
        Ok(devices) if devices.iter().any(|d| d.ordinal == ordinal) => {}
        Ok(_) => return println!("early_replay: skipped: no CUDA device {ordinal}"),
        Err(e) => return println!("early_replay: skipped: no CUDA device ({e})"),
    }
    let mut rng = Rng::new(0xea71);
    let src: Vec<f32> = (0..ROWS * COLS).map(|_| (rng.next_u64() % 1000) as f32 - 500.0).collect();
    let y: Vec<f32> = (0..ROWS * COLS).map(|_| (rng.next_u64() % 7) as f32 + 1.0).collect();
    let opts = CudaOptions {
        ordinal,
        dtype: DType::F32,
        memory_cap: None,
        cuda_graphs: true,
        memory_model: Default::default(),
    };
    let gpu = CudaBackend::open(opts).expect("CudaBackend::open");
    let cpu = CpuBackend::new();
    let mut g = state(&gpu, &src, &y).expect("GPU tensors");
    let mut c = state(&cpu, &src, &y).expect("CPU tensors");
    for k in 0..STEPS {
        let (slots, rows) = (permutation(&mut rng, ROWS), permutation(&mut rng, ROWS));
        let odd = k == ODD;
        gpu.run_step(&mut || step(&gpu, &mut g, &slots, &rows, odd)).expect("GPU step");
        cpu.run_step(&mut || step(&cpu, &mut c, &slots, &rows, odd)).expect("CPU step");
        let (got, want) = (download(&gpu, &g.out).expect("GPU out"), download(&cpu, &c.out).expect("CPU out"));
        let wrong = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(wrong, 0, "step {k}: {wrong} of {} values differ from the CPU backend's", got.len());
    }
    let (held, rerun) = gpu.early_replay_stats().expect("graphs are on");
    let stats = gpu.graph_stats();
    println!("early_replay: {held} early replays held, {rerun} rerun; graph steps {stats:?}");
    if std::env::var("TM_EARLY_REPLAY").is_ok_and(|v| v.trim() == "0") {
        assert_eq!((held, rerun), (0, 0), "TM_EARLY_REPLAY=0 must turn early replays off");
        return;
    }
    // Steps 0 and 1 record and capture; 2.. replay early, but the odd step (rerun) and the one
    // after it (its prediction was dropped) do not hold.
    assert_eq!(rerun, 1, "exactly the odd step should have been rerun");
    assert!(held >= (STEPS - 4) as u64, "only {held} early replays held");
}
