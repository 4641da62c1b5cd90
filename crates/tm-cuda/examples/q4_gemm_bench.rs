//! Times the w4a16 prefill GEMM (`q4_gemm.cu`) against cuBLASLt on the same shapes.
//!
//! For f16 and bf16, the Llama-3-8B projection shapes (`rows × cols` = 4096 × 4096 (q, o),
//! 6144 × 4096 (fused q/k/v), 14336 × 4096 (gate, up), 4096 × 14336 (down)) and batches
//! `M` = 512, 2048, 8192 tokens: `out[M, rows] = x[M, cols] · Wᵀ` through
//! - cuBLASLt with a dense `W` of the same dtype (tm-cuda's `Blas`, what dense models run),
//! - `matmul_q4` with its automatic choice (int4 group 128, the AWQ default),
//! - the int4 GEMM with each tile shape forced (`l`, `m`, `s`, `t`, and on sm_90 the wgmma shapes
//!   `w`, `x`, `v`; elsewhere forcing those times the automatic choice), and the older tiled kernel
//!   (`TM_Q4_GEMM=off`),
//! - the large-batch slab path (`tm_cuda::kernels::q4_slab`: dequantize a slab of rows into a
//!   `--slab-mib` scratch buffer, default `tm_core::q4_slab::SLAB_BYTES`, then cuBLASLt into the
//!   output's columns, slab after slab), and its dequantization alone (`deq us`),
//!
//! each timed with CUDA events over `--iters` launches after warm-up (cuBLAS and the automatic
//! choice in three alternating rounds, their medians), printing µs, TFLOP/s and the
//! int4/cuBLAS throughput ratio (`ratio` = cuBLAS time / int4 time) for the automatic choice, for
//! the fastest tile and for the slab path (`slab %`). The backend takes the slab path from
//! `TM_Q4_SLAB_MIN_M` tokens (default 512): compare `slab %` with `best %` per `M` to place it.
//! Asserts nothing. Without a CUDA device it says so and exits 0.
//!
//! ```text
//! cargo build --release -p tm-cuda --examples
//! target/release/examples/q4_gemm_bench [--iters 20] [--dtype f16|bf16|both] [--m 512,2048,8192] [--group 128] [--slab-mib 64]
//! ```

mod common;

use std::process::ExitCode;
use std::sync::Arc;

use common::Rng;

use cudarc::driver::sys;
use tm_core::q4_slab::slabs;
use tm_core::{Allocator, Buffer, DType, Device, Result};
use tm_cuda::allocator::CudaAllocator;
use tm_cuda::blas::{self, Blas};
use tm_cuda::kernels::q4_gemm::{self, Policy, Tile};
use tm_cuda::kernels::q4_slab::{matmul_q4_slabs, rows_per_slab, Int4Matrix};
use tm_cuda::kernels::quant;
use tm_cuda::runtime::Gpu;
use tm_cuda::staging::{Staging, DEFAULT_STAGING_BYTES};
use tm_cuda::CudaDevice;

/// Llama-3-8B projection shapes: (name, rows, cols).
const SHAPES: [(&str, usize, usize); 4] =
    [("q/o", 4096, 4096), ("qkv", 6144, 4096), ("gate/up", 14336, 4096), ("down", 4096, 14336)];

struct Args {
    iters: usize,
    dtypes: Vec<DType>,
    ms: Vec<usize>,
    group: usize,
    slab_bytes: usize,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        iters: 20,
        dtypes: vec![DType::F16, DType::BF16],
        ms: vec![512, 2048, 8192],
        group: 128,
        slab_bytes: tm_core::q4_slab::SLAB_BYTES,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--group" => a.group = val()?.parse().map_err(|e| format!("--group: {e}"))?,
            "--slab-mib" => {
                let mib: usize = val()?.parse().map_err(|e| format!("--slab-mib: {e}"))?;
                if mib == 0 || mib > 4096 {
                    return Err(format!("--slab-mib {mib}: expected 1..=4096"));
                }
                a.slab_bytes = mib << 20;
            }
            "--dtype" => {
                a.dtypes = match val()?.as_str() {
                    "f16" => vec![DType::F16],
                    "bf16" => vec![DType::BF16],
                    "both" => vec![DType::F16, DType::BF16],
                    other => return Err(format!("--dtype {other}: expected f16, bf16 or both")),
                }
            }
            "--m" => {
                a.ms = val()?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().map_err(|e| format!("--m {s}: {e}")))
                    .collect::<std::result::Result<_, _>>()?
            }
            "-h" | "--help" => {
                println!(
                    "q4_gemm_bench [--iters N] [--dtype f16|bf16|both] [--m 512,2048,8192] [--group 128] [--slab-mib 64]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (try --help)")),
        }
    }
    if a.iters == 0 || a.ms.contains(&0) {
        return Err("--iters and every --m must be positive".into());
    }
    Ok(a)
}

/// `count` values `scale * unit()` encoded as `dt`.
fn random_values(rng: &mut Rng, dt: DType, count: usize, scale: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * 2);
    for _ in 0..count {
        let v = scale * common::unit(rng);
        let b = match dt {
            DType::BF16 => half::bf16::from_f32(v).to_le_bytes(),
            _ => half::f16::from_f32(v).to_le_bytes(),
        };
        out.extend_from_slice(&b);
    }
    out
}

/// A device buffer holding `bytes`.
fn upload(alloc: &Arc<dyn Allocator>, staging: &Staging, bytes: &[u8]) -> Result<Buffer> {
    let b = Buffer::new(alloc, bytes.len().max(1), "bench")?;
    staging.upload(b.addr(), bytes)?;
    Ok(b)
}

/// Mean µs per call of `f` over `iters` calls (after 3 warm-up calls), timed with CUDA events.
fn time_us(gpu: &Gpu, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let err = |what: &'static str| {
        move |e: cudarc::driver::DriverError| tm_core::Error::Backend {
            backend: "cuda".into(),
            message: format!("{what}: {e:?}"),
        }
    };
    for _ in 0..3 {
        f()?;
    }
    let ctx = gpu.stream().context();
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags).map_err(err("cuEventCreate"))?;
    let end = ctx.new_event(flags).map_err(err("cuEventCreate"))?;
    start.record(gpu.stream()).map_err(err("cuEventRecord"))?;
    for _ in 0..iters {
        f()?;
    }
    end.record(gpu.stream()).map_err(err("cuEventRecord"))?;
    end.synchronize().map_err(err("cuEventSynchronize"))?;
    let ms = start.elapsed_ms(&end).map_err(err("cuEventElapsedTime"))?;
    Ok(ms as f64 * 1e3 / iters as f64)
}

/// Rounds of alternating cuBLAS / automatic-choice timings whose medians are reported.
const ROUNDS: usize = 3;

/// The median of `v` (not empty), sorting it.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn tflops(m: usize, rows: usize, cols: usize, us: f64) -> f64 {
    2.0 * (m * rows * cols) as f64 / (us * 1e-6) / 1e12
}

fn main() -> ExitCode {
    common::run("q4_gemm_bench", parse_args, run)
}

fn run(args: &Args) -> Result<()> {
    let gpu = Gpu::open(0)?;
    let device: Arc<dyn Device> = Arc::new(
        CudaDevice::new(0).map_err(|e| tm_core::Error::Backend { backend: "cuda".into(), message: e.to_string() })?,
    );
    let alloc: Arc<dyn Allocator> = CudaAllocator::new(gpu.clone(), device, 16 << 30);
    if !blas::available() {
        println!("q4_gemm_bench: cuBLASLt not found; nothing to compare against");
        return Ok(());
    }
    let blas = Blas::new(gpu.clone(), &alloc)?;
    let staging = Staging::new(gpu.clone(), DEFAULT_STAGING_BYTES)?;
    let slab = Buffer::new(&alloc, args.slab_bytes, "bench")?;
    let info = gpu.info();
    println!(
        "{} (sm_{}, {} SMs), kernels from {}; int4 group {}, {} timed iterations; slab scratch {} MiB; TM_Q4_GEMM={}",
        info.name,
        gpu.sm(),
        info.multiprocessors,
        gpu.kernel_source(),
        args.group,
        args.iters,
        args.slab_bytes >> 20,
        std::env::var("TM_Q4_GEMM").unwrap_or_else(|_| "(unset)".into())
    );
    println!(
        "{:<5} {:<8} {:>5} {:>6} {:>6} | {:>9} {:>7} | {:>9} {:>7} {:>6} {:>4} | {:>4} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} \
         {:>8} {:>8} | {:>8} {:>7} {:>6} {:>5} {:>7}",
        "dtype",
        "shape",
        "M",
        "N",
        "K",
        "cuBLAS us",
        "TFLOP/s",
        "int4 us",
        "TFLOP/s",
        "ratio",
        "tile",
        "best",
        "ratio",
        "l us",
        "m us",
        "s us",
        "t us",
        "w us",
        "x us",
        "v us",
        "tiled us",
        "slab us",
        "TFLOP/s",
        "slab %",
        "slabs",
        "deq us"
    );
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let sms = info.multiprocessors as usize;
    for &dt in &args.dtypes {
        for (name, rows, cols) in SHAPES {
            if !cols.is_multiple_of(args.group) {
                println!("skipping {name}: group {} does not divide cols = {cols}", args.group);
                continue;
            }
            let groups = cols / args.group;
            // Weights: dense for cuBLAS, int4 (random nibbles, scales about 1/64, mins -8 scales).
            let dense = upload(&alloc, &staging, &random_values(&mut rng, dt, rows * cols, 0.03))?;
            let packed_host: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
            let packed = upload(&alloc, &staging, &packed_host)?;
            // Random nibbles: the order the backend would store them in (what the kernels read).
            let layout = tm_cuda::kernels::q4_gemv::preferred_layout(dt, rows, cols, args.group);
            let scale_host: Vec<u8> = (0..rows * groups)
                .flat_map(|_| half::f16::from_f32(0.004 + 0.001 * common::unit(&mut rng)).to_le_bytes())
                .collect();
            let min_host: Vec<u8> = (0..rows * groups)
                .flat_map(|_| half::f16::from_f32(-0.032 + 0.004 * common::unit(&mut rng)).to_le_bytes())
                .collect();
            let scales = upload(&alloc, &staging, &scale_host)?;
            let mins = upload(&alloc, &staging, &min_host)?;
            for &m in &args.ms {
                let x = upload(&alloc, &staging, &random_values(&mut rng, dt, m * cols, 1.0))?;
                let out = Buffer::new(&alloc, m * rows * 2, "bench")?;
                // Split-K scratch, as large as the engine's (the int4 slab buffer).
                let partials = Buffer::new(&alloc, tm_core::q4_slab::SLAB_BYTES, "bench")?;
                let q4 = |p: Option<Policy>| {
                    q4_gemm::set_policy(p);
                    let r = quant::matmul_q4(
                        &gpu,
                        Some((partials.addr(), partials.len())),
                        dt,
                        out.addr(),
                        x.addr(),
                        packed.addr(),
                        scales.addr(),
                        mins.addr(),
                        m,
                        rows,
                        cols,
                        args.group,
                        layout,
                    );
                    q4_gemm::set_policy(None);
                    r
                };
                // cuBLAS and the automatic choice alternate for ROUNDS rounds and each keeps its
                // median: long products lower the clocks (power), and timing one right after the
                // other gave the second 5-15% less on the 8192-token shapes.
                let (mut blas_us, mut auto_us) = (Vec::new(), Vec::new());
                for _ in 0..ROUNDS {
                    blas_us.push(time_us(&gpu, args.iters, || {
                        blas.gemm(dt, m, rows, cols, x.addr(), dense.addr(), out.addr())
                    })?);
                    auto_us.push(time_us(&gpu, args.iters, || q4(Some(Policy::Auto)))?);
                }
                let (t_blas, t_auto) = (median(&mut blas_us), median(&mut auto_us));
                let mut per_tile = Vec::new();
                for tile in Tile::ALL {
                    per_tile.push(time_us(&gpu, args.iters, || q4(Some(Policy::Force(tile))))?);
                }
                let t_tiled = time_us(&gpu, args.iters, || q4(Some(Policy::Off)))?;
                let w = Int4Matrix {
                    packed: packed.addr(),
                    scales: scales.addr(),
                    mins: mins.addr(),
                    rows,
                    cols,
                    group: args.group,
                    layout,
                };
                let slab_cells = match rows_per_slab(dt, &w, slab.len()) {
                    Some(per) => {
                        let mut count = 0;
                        let t = time_us(&gpu, args.iters, || {
                            count =
                                matmul_q4_slabs(&gpu, &blas, dt, out.addr(), x.addr(), &w, m, slab.addr(), slab.len())?;
                            Ok(())
                        })?;
                        let t_deq = time_us(&gpu, args.iters, || {
                            for (r0, len) in slabs(rows, per) {
                                quant::dequant_q4_rows(
                                    &gpu,
                                    dt,
                                    slab.addr(),
                                    w.packed,
                                    w.scales,
                                    w.mins,
                                    r0,
                                    len,
                                    rows,
                                    cols,
                                    args.group,
                                    layout,
                                )?;
                            }
                            Ok(())
                        })?;
                        format!(
                            "{t:>8.1} {:>7.1} {:>5.0}% {count:>5} {t_deq:>7.1}",
                            tflops(m, rows, cols, t),
                            100.0 * t_blas / t
                        )
                    }
                    None => format!("{:>8} {:>7} {:>6} {:>5} {:>7}", "-", "-", "-", "-", "-"),
                };
                let auto_tile =
                    q4_gemm::choose(Policy::Auto, m, rows, cols, args.group, sms, q4_gemm::wgmma_available(&gpu))
                        .unwrap_or(Tile::Large);
                let (best, t_best) = Tile::ALL
                    .iter()
                    .zip(&per_tile)
                    .fold((auto_tile, f64::INFINITY), |acc, (&t, &us)| if us < acc.1 { (t, us) } else { acc });
                let cells: Vec<String> = per_tile.iter().chain([&t_tiled]).map(|us| format!("{us:>8.1}")).collect();
                println!(
                    "{:<5} {:<8} {:>5} {:>6} {:>6} | {:>9.1} {:>7.1} | {:>9.1} {:>7.1} {:>5.0}% {:>4} | {:>4} {:>5.0}% | {} | {}",
                    dt.to_string(),
                    name,
                    m,
                    rows,
                    cols,
                    t_blas,
                    tflops(m, rows, cols, t_blas),
                    t_auto,
                    tflops(m, rows, cols, t_auto),
                    100.0 * t_blas / t_auto,
                    auto_tile.tag(),
                    best.tag(),
                    100.0 * t_blas / t_best,
                    cells.join(" "),
                    slab_cells
                );
            }
        }
    }
    gpu.synchronize()?;
    Ok(())
}
