//! Programmatic dependent launch (PDL, sm_90+): long chains of kernels, each reading what the one
//! before it wrote, give exactly what the CPU backend gives — eagerly and replayed from CUDA graphs.
//!
//! One round of the chain, on `a`, `b`, `c` (`[rows, cols]`, `a` and `c` shaped as KV caches
//! `[rows, 1, 1, cols]`) with a row permutation `perm`:
//! 1. `a += y` (`add`, grid-stride);
//! 2. `b = gather_rows(a, perm)` (one block per row);
//! 3. with `fp8`: `write_kv(b, b -> k8, v8, perm)` into FP8 caches (attention.cu's
//!    `write_kv_e4m3`, a module launched without PDL while its kernels do not all wait: this puts
//!    PDL / non-PDL transitions into the chain);
//! 4. `write_kv(b, b -> a, c, perm)`: `a[perm[t]] = b[t] = a[perm[t]]`, so `a` is back (and `c`
//!    a copy of it).
//!
//! So after `n` rounds `a = a0 + n * y` exactly: integers small enough to be exact in bf16. A
//! kernel that started reading before its predecessor finished would lose increments or copy
//! stale rows. Steps of `ROUNDS` rounds go through `Ops::run_step`; with CUDA graphs the third
//! and later steps are replays of a captured graph (programmatic edges between the nodes).
//!
//! Skips (printing why) without a CUDA device or below sm_90 (where PDL is never used). Run it
//! with PDL (the default on sm_90) and with `TM_PDL=0`: the same chain either way. `TM_CUDA_DEVICE` picks the device.

use half::{bf16, f16};
use tm_core::sampling::Rng;
use tm_core::{DType, Ops, Result, Tensor, TensorDesc};
use tm_cpu::CpuBackend;
use tm_cuda::{CudaBackend, CudaOptions};

/// Rounds per step.
const ROUNDS: usize = 40;
/// Steps per run: eager, eager + capture, then replays.
const STEPS: usize = 5;

/// The device to test, or `None` (after printing why) when the test should skip.
fn device(test: &str) -> Option<usize> {
    let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    match tm_cuda::probe() {
        Err(e) => println!("{test}: skipped: no CUDA device ({e})"),
        Ok(devices) => match devices.iter().find(|d| d.ordinal == ordinal) {
            None => println!("{test}: skipped: no CUDA device {ordinal}"),
            Some(d) if d.compute_capability.0 < 9 => {
                let (major, minor) = d.compute_capability;
                println!("{test}: skipped: device {ordinal} is sm_{major}{minor}; PDL needs sm_90 or newer");
            }
            Some(_) => return Some(ordinal),
        },
    }
    None
}

/// The chain's tensors on one backend.
struct Chain {
    a: Tensor,
    b: Tensor,
    c: Tensor,
    y: Tensor,
    k8: Tensor,
    v8: Tensor,
}

/// Allocates the chain's tensors on `ops` (activations in `ops`' dtype) and uploads `a0`, `y`.
fn chain_tensors(ops: &dyn Ops, rows: usize, cols: usize, a0: &[f32], y: &[f32]) -> Result<Chain> {
    let dtype = ops.activation_dtype();
    let cache = [rows, 1, 1, cols];
    let zeros = |dt: DType, shape: &[usize]| ops.zeros(TensorDesc::new(dt, shape), "test");
    let mut chain = Chain {
        a: zeros(dtype, &cache)?,
        b: zeros(dtype, &[rows, cols])?,
        c: zeros(dtype, &cache)?,
        y: zeros(dtype, &cache)?,
        k8: zeros(DType::F8E4M3, &cache)?,
        v8: zeros(DType::F8E4M3, &cache)?,
    };
    ops.upload(&mut chain.a, &to_bytes(a0, dtype))?;
    ops.upload(&mut chain.y, &to_bytes(y, dtype))?;
    Ok(chain)
}

/// One step: `ROUNDS` rounds of the chain (see the module docs).
fn step(ops: &dyn Ops, t: &mut Chain, perm: &[u32], fp8: bool) -> Result<()> {
    for _ in 0..ROUNDS {
        ops.add_in_place(&mut t.a, &t.y)?;
        ops.gather_rows(&t.a, perm, &mut t.b)?;
        if fp8 {
            ops.write_kv(&t.b, &t.b, &mut t.k8, &mut t.v8, perm)?;
        }
        ops.write_kv(&t.b, &t.b, &mut t.a, &mut t.c, perm)?;
    }
    Ok(())
}

/// Runs `STEPS` steps through `ops.run_step`.
fn run(ops: &dyn Ops, t: &mut Chain, perm: &[u32], fp8: bool) -> Result<()> {
    for _ in 0..STEPS {
        ops.run_step(&mut || step(ops, t, perm, fp8))?;
    }
    Ok(())
}

fn to_bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}

/// Downloads `t` as f32 values (FP8 codes as their byte values).
fn values(ops: &dyn Ops, t: &Tensor) -> Result<Vec<f32>> {
    let mut bytes = vec![0u8; t.desc().bytes()];
    ops.download(t, &mut bytes)?;
    Ok(match t.dtype() {
        DType::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F8E4M3 => bytes.iter().map(|&b| b as f32).collect(),
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    })
}

/// The first element where `got` and `want` differ, described.
fn first_difference(what: &str, got: &[f32], want: &[f32], cols: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{what}: {} values, expected {}", got.len(), want.len()));
    }
    let wrong = got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    let i = got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits())?;
    Some(format!(
        "{what}: {wrong} of {} elements differ; first at row {} col {}: {} instead of {}",
        got.len(),
        i / cols,
        i % cols,
        got[i],
        want[i]
    ))
}

/// One case: the chain on the GPU (dtype, graphs or not) against the CPU backend and the closed form.
fn case(
    ordinal: usize,
    dtype: DType,
    graphs: bool,
    rows: usize,
    cols: usize,
    fp8: bool,
) -> std::result::Result<String, String> {
    let label = format!("{dtype} {rows}x{cols} graphs={graphs} fp8={fp8}");
    let fail = |what: &str, e: tm_core::Error| format!("{label}: {what}: {e}");
    let mut rng = Rng::new(0x9d1 ^ (rows * cols) as u64);
    let a0: Vec<f32> = (0..rows * cols).map(|_| (rng.next_u64() % 33) as f32 - 16.0).collect();
    let y: Vec<f32> = (0..rows * cols).map(|_| (rng.next_u64() % 3) as f32 - 1.0).collect();
    // A permutation of the rows (Fisher-Yates).
    let mut perm: Vec<u32> = (0..rows as u32).collect();
    for i in (1..rows).rev() {
        perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }

    let opts = CudaOptions { ordinal, dtype, memory_cap: None, cuda_graphs: graphs, memory_model: Default::default() };
    let gpu = CudaBackend::open(opts).map_err(|e| fail("CudaBackend::open", e))?;
    let mut g = chain_tensors(&gpu, rows, cols, &a0, &y).map_err(|e| fail("GPU tensors", e))?;
    run(&gpu, &mut g, &perm, fp8).map_err(|e| fail("GPU chain", e))?;

    let cpu = CpuBackend::new();
    let mut c = chain_tensors(&cpu, rows, cols, &a0, &y).map_err(|e| fail("CPU tensors", e))?;
    run(&cpu, &mut c, &perm, fp8).map_err(|e| fail("CPU chain", e))?;

    let total = (STEPS * ROUNDS) as f32;
    let closed: Vec<f32> = a0.iter().zip(&y).map(|(a, y)| a + total * y).collect();
    let mut problems = Vec::new();
    let mut check = |what: &str, got: Vec<f32>, want: &[f32]| {
        if let Some(p) = first_difference(what, &got, want, cols) {
            problems.push(p);
        }
    };
    let cpu_a = values(&cpu, &c.a).map_err(|e| fail("CPU download", e))?;
    check("CPU a vs a0 + n*y (the test itself)", cpu_a.clone(), &closed);
    for (what, gt, ct) in [("a", &g.a, &c.a), ("b", &g.b, &c.b), ("c", &g.c, &c.c), ("k8", &g.k8, &c.k8)] {
        if what == "k8" && !fp8 {
            continue;
        }
        let got = values(&gpu, gt).map_err(|e| fail("GPU download", e))?;
        let want = values(&cpu, ct).map_err(|e| fail("CPU download", e))?;
        check(what, got, &want);
    }
    let stats = gpu.graph_stats();
    if graphs && !matches!(stats, Some((replayed, _, _)) if replayed > 0) {
        problems.push(format!("no step was replayed from a CUDA graph ({stats:?})"));
    }
    let pdl = gpu.gpu().pdl();
    if pdl != tm_cuda::pdl::enabled(gpu.gpu().info().compute_capability) {
        problems.push(format!("the GPU says PDL is {pdl}, tm_cuda::pdl::enabled disagrees"));
    }
    if problems.is_empty() {
        Ok(format!("{label}: ok (PDL {}, graph steps {stats:?})", if pdl { "on" } else { "off" }))
    } else {
        Err(format!("{label}: {}", problems.join("; ")))
    }
}

fn run_cases(test: &str, graphs: bool) {
    let Some(ordinal) = device(test) else { return };
    println!("{test}: programmatic dependent launch {}", {
        let info = tm_cuda::probe().ok().and_then(|d| d.into_iter().find(|d| d.ordinal == ordinal));
        info.map_or_else(String::new, |d| tm_cuda::pdl::describe(d.compute_capability))
    });
    let mut failures = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // Short kernels (launch-bound, the case PDL is for) and long ones (4M elements).
        for (rows, cols, fp8) in [(64, 256, false), (64, 256, true), (4096, 1024, false), (1024, 1024, true)] {
            match case(ordinal, dtype, graphs, rows, cols, fp8) {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    println!("FAIL {e}");
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{test}: {} case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

/// The chain itself, on the CPU alone (runs without a GPU): `a` ends at `a0 + n * y`, `b` and `c`
/// are its permuted copy and copy, and the FP8 caches hold its encoding.
#[test]
fn chain_on_cpu_matches_closed_form() {
    let (rows, cols) = (16, 32);
    let mut rng = Rng::new(7);
    let a0: Vec<f32> = (0..rows * cols).map(|_| (rng.next_u64() % 33) as f32 - 16.0).collect();
    let y: Vec<f32> = (0..rows * cols).map(|_| (rng.next_u64() % 3) as f32 - 1.0).collect();
    let perm: Vec<u32> = (0..rows as u32).rev().collect();
    let cpu = CpuBackend::new();
    let mut t = chain_tensors(&cpu, rows, cols, &a0, &y).expect("CPU tensors");
    run(&cpu, &mut t, &perm, true).expect("CPU chain");
    let n = (STEPS * ROUNDS) as f32;
    let want: Vec<f32> = a0.iter().zip(&y).map(|(a, y)| a + n * y).collect();
    let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max <= 256.0, "values up to {max} are not all exact in bf16");
    let got = |t: &Tensor| values(&cpu, t).expect("download");
    assert_eq!(got(&t.a), want);
    assert_eq!(got(&t.c), want);
    let b = got(&t.b);
    for (i, &p) in perm.iter().enumerate() {
        assert_eq!(b[i * cols..(i + 1) * cols], want[p as usize * cols..(p as usize + 1) * cols]);
    }
    let codes: Vec<f32> = want.iter().map(|&v| tm_core::fp8::encode(v) as f32).collect();
    assert_eq!(got(&t.k8), codes);
    assert_eq!(got(&t.v8), codes);
}

/// Eager launches: every step's kernels go straight to the stream.
#[test]
fn pdl_chain_eager_matches_cpu() {
    run_cases("pdl_chain_eager_matches_cpu", false);
}

/// CUDA graphs: the third and later steps replay a captured graph.
#[test]
fn pdl_chain_graphs_match_cpu() {
    run_cases("pdl_chain_graphs_match_cpu", true);
}
