//! Times the int4 decode products (w4a16) on the GPU with CUDA events, for the Llama-3-8B shapes:
//! q/k/v fused (4096 + 1024 + 1024 rows × 4096), o (4096 × 4096), gate/up/SiLU fused
//! (2 × 14336 × 4096) and down (4096 × 14336), at n = 1, 4 and 8 activation rows.
//!
//! ```text
//! cargo build --release -p tm-cuda --examples
//! target/release/examples/q4_gemv_bench [--dtype f16|bf16] [--group 128] [--iters 200]
//!     [--variants u2,ln,...] [--n 1,4,8] [--hot]
//! ```
//!
//! Each line gives the time per call, the weight bytes streamed per second (packed nibbles +
//! scales + mins; activations are not counted) and that as a fraction of the device-to-device copy
//! bandwidth, measured first on the same GPU (`common::copy_bandwidth`). Enough copies of each
//! weight set are cycled through that they do not stay in L2. No assertions; without a CUDA
//! device it says so and exits successfully.
//!
//! `--hot` times one copy of each set instead, kept in L2 (gate/up with 7168 rows a weight, so
//! that its 31 MB fit the H100's 50 MB L2 as q/k/v's, o's and down's do): the products without
//! DRAM, i.e. the rate their loops' instructions and latencies allow. Meant as an H100 stand-in
//! for the H200, whose bandwidth outruns the loops (scripts/gpu/q4_decode_chain.cu): the cold
//! products on an H100 are bound by bytes and hide changes that cut instructions, which the H200
//! rewards. Checked in session 28: the timing-only ablations (q4_gemv.cu's TM_Q4_ABLATE_*) save
//! the same microseconds per product hot on an H100 as cold on the H200, within ~0.1-0.3 us
//! (figures in that file, "Session 28"). It does not predict changes of the order in which a
//! kernel reads DRAM: session 33's tile-ordered scales for o and down saved 0.3-1.8 us a product
//! hot, cost 0.4-0.6 us cold (down) and 45-52 us a step in the engine (H100; that file, "Session
//! 33"), so time such changes cold and in the engine. Compare only runs with PDL on: the header
//! line says where the kernels came from, and a `TM_KERNELS_DIR` whose manifest names other
//! sources loses PDL (session 29's runs, ~1 us a product slower).
//!
//! What is timed (CUDA events around `--iters` calls, after warm-up):
//! - `ops`: what the model calls (`Ops::matmul_many`, `Ops::gate_up_silu`, the latter on gate
//!   and up weights passed through `Ops::prepare_gate_up` as the loader does: the tensor-core
//!   `q4_gemv.cu` kernels with the automatic variant unless `TM_Q4_GEMV=0`), launched one by one
//!   from the host;
//! - `u2`, `n16`, `ln`, `ln4` (`n16`: plain products only; the lean `ln`, `ln4` where the shape
//!   fits them): each variant of those kernels launched directly, one by one from the host
//!   ("stream"). A call that takes
//!   less GPU time than the host needs to launch it is timed at the host's launch rate, so for
//!   the small products these lines measure launch gaps as much as the kernel;
//! - `<variant> graph`: the same `--iters` calls captured once into a CUDA graph and the graph
//!   replayed: no host in the loop, only the GPU's gaps between dependent kernels (what a decode
//!   step replayed from a graph sees);
//! - `<variant> chain`: a graph of `--iters` pairs "RMSNorm writes x, then the product reads x"
//!   (a decode step's dependency pattern), its time per pair minus that of a graph of the
//!   RMSNorms alone (`norm only`). With programmatic dependent launch (sm_90, unless
//!   `TM_PDL=0`) each product is scheduled while the RMSNorm before it ends, so this share can
//!   drop below the product's own `graph` time; `TM_PDL=0` gives the serialized figure;
//! - `cuda-core`: the previous path, one `matmul_q4` CUDA-core GEMV launch per weight (plus
//!   `silu_mul` for the MLP), from the host.
//!
//! `--variants ln,n16` limits the variants timed (default: all kernels).

mod common;

use std::process::ExitCode;

use common::Rng;

use cudarc::driver::sys;
use tm_core::quant::Weight;
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cuda::kernels::q4_gemv::{self, Q4Slot, Unroll};
use tm_cuda::kernels::{elementwise, quant};
use tm_cuda::runtime::LaunchMode;
use tm_cuda::CudaBackend;
use tm_quant::HostQuant;

/// Bytes of weights cycled through per measurement (well past the 50 MB L2).
const CYCLE_BYTES: usize = 512 << 20;

/// Options from the command line.
struct Opts {
    dtype: DType,
    group: usize,
    iters: usize,
    variants: Vec<Unroll>,
    /// Activation rows timed (`--n`).
    batch: Vec<usize>,
    /// One L2-resident copy of each weight set (`--hot`).
    hot: bool,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        dtype: DType::F16,
        group: 128,
        iters: 200,
        variants: Unroll::ALL.to_vec(),
        batch: vec![1, 4, 8],
        hot: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| format!("{what} needs a value"));
        match a.as_str() {
            "--dtype" => {
                o.dtype = match value("--dtype")?.as_str() {
                    "f16" => DType::F16,
                    "bf16" => DType::BF16,
                    other => return Err(format!("--dtype {other}: expected f16 or bf16")),
                }
            }
            "--group" => {
                let v = value("--group")?;
                o.group = v
                    .parse()
                    .ok()
                    .filter(|&g: &usize| g > 0 && g.is_multiple_of(32) && 4096 % g == 0 && 14336 % g == 0)
                    .ok_or_else(|| {
                        format!("--group {v}: expected a multiple of 32 dividing 4096 and 14336 (32, 64, 128)")
                    })?;
            }
            "--iters" => {
                let v = value("--iters")?;
                o.iters =
                    v.parse().ok().filter(|&i: &usize| i > 0).ok_or_else(|| format!("--iters {v}: expected > 0"))?;
            }
            "--variants" => {
                let v = value("--variants")?;
                o.variants = v
                    .split(',')
                    .map(|name| {
                        Unroll::parse(name)
                            .filter(|&u| u != Unroll::Auto)
                            .ok_or_else(|| format!("--variants: `{name}` is not a variant (u2, n16, ln, ln4)"))
                    })
                    .collect::<Result<_, String>>()?;
            }
            "--n" => {
                let v = value("--n")?;
                o.batch = v
                    .split(',')
                    .map(|n| n.parse().ok().filter(|n| (1..=8).contains(n)))
                    .collect::<Option<_>>()
                    .ok_or_else(|| format!("--n {v}: expected a list of activation rows from 1 to 8 (1,4,8)"))?;
            }
            "--hot" => o.hot = true,
            "-h" | "--help" => {
                println!(
                    "usage: q4_gemv_bench [--dtype f16|bf16] [--group 128] [--iters 200] [--variants u2,ln,...] [--n \
                     1,4,8] [--hot]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(o)
}

/// A random int4 weight `[rows, cols]` (weights of about ±0.03, like a trained model's).
fn random_q4(ops: &dyn Ops, rng: &mut Rng, rows: usize, cols: usize, group: usize) -> Result<Weight, String> {
    let mut packed = vec![0u8; rows * cols / 2];
    for chunk in packed.chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let groups = rows * (cols / group);
    let scales = (0..groups).map(|i| half::f16::from_f32(0.002 + 0.002 * ((i % 7) as f32 / 7.0))).collect();
    let mins = (0..groups).map(|i| half::f16::from_f32(-0.024 - 0.002 * ((i % 5) as f32))).collect();
    let q = HostQuant { rows, cols, group_size: group, packed, scales, mins: Some(mins) };
    tm_model::llama::quant_load::upload_quant(ops, &q)
        .map_err(|e| format!("uploading a [{rows}, {cols}] int4 weight: {e}"))
}

/// A `[n, cols]` activation tensor of small random values.
fn activations(ops: &dyn Ops, rng: &mut Rng, dtype: DType, n: usize, cols: usize) -> tm_core::Result<Tensor> {
    let mut t = ops.zeros(TensorDesc::new(dtype, &[n, cols]), "bench")?;
    let bytes: Vec<u8> = (0..n * cols)
        .flat_map(|_| {
            let v = (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0;
            match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                _ => half::f16::from_f32(v).to_le_bytes(),
            }
        })
        .collect();
    ops.upload(&mut t, &bytes)?;
    Ok(t)
}

/// A `[cols]` tensor of ones (the chain's RMSNorm weight).
fn ones(ops: &dyn Ops, dtype: DType, cols: usize) -> tm_core::Result<Tensor> {
    let mut t = ops.zeros(TensorDesc::new(dtype, &[cols]), "bench")?;
    let one = match dtype {
        DType::BF16 => half::bf16::ONE.to_le_bytes(),
        _ => half::f16::ONE.to_le_bytes(),
    };
    ops.upload(&mut t, &one.repeat(cols))?;
    Ok(t)
}

/// The device addresses of an int4 weight and its output.
fn slot(w: &Weight, out: &Tensor) -> Result<Q4Slot, String> {
    match w {
        Weight::Int4(q) => {
            let mins = q.mins.as_ref().ok_or("int4 weight without mins")?;
            Ok(Q4Slot {
                packed: q.packed.buffer().addr(),
                scales: q.scales.buffer().addr(),
                mins: mins.buffer().addr(),
                bias: 0,
                out: out.buffer().addr(),
                rows: q.rows,
                layout: q.layout,
            })
        }
        _ => Err("not an int4 weight".into()),
    }
}

/// Milliseconds per call of `f` (given the call's index) when `iters` calls are captured once into
/// a CUDA graph and the graph is replayed (one warm-up replay, then `REPLAYS` timed ones).
fn graph_ms(b: &CudaBackend, iters: usize, mut f: impl FnMut(usize) -> tm_core::Result<()>) -> Result<f64, String> {
    const REPLAYS: usize = 5;
    let gpu = b.gpu();
    let stream = gpu.stream();
    let err = |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e}");
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| err("cuStreamBeginCapture", &format!("{e:?}")))?;
    gpu.set_mode(LaunchMode::Capture);
    let ran = (0..iters).try_for_each(&mut f);
    gpu.set_mode(LaunchMode::Eager);
    // The capture must end whatever happened, or the stream stays in capture mode.
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran.map_err(|e| err("capturing the calls", &e))?;
    let graph =
        graph.map_err(|e| err("cuStreamEndCapture", &format!("{e:?}")))?.ok_or("the captured graph is empty")?;
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let ev = |e: cudarc::driver::DriverError| format!("{e:?}");
    graph.launch().map_err(ev)?;
    let start = stream.record_event(timed).map_err(ev)?;
    for _ in 0..REPLAYS {
        graph.launch().map_err(ev)?;
    }
    let end = stream.record_event(timed).map_err(ev)?;
    end.synchronize().map_err(ev)?;
    Ok(start.elapsed_ms(&end).map_err(ev)? as f64 / (REPLAYS * iters) as f64)
}

/// One product family of the 8B layer.
#[derive(Clone, Copy)]
enum Shape {
    Qkv,
    O,
    GateUp,
    Down,
}

impl Shape {
    fn name(self, hot: bool) -> &'static str {
        match self {
            Shape::Qkv => "q/k/v 6144x4096",
            Shape::O => "o     4096x4096",
            Shape::GateUp if hot => "gate/up 2x7168x4096",
            Shape::GateUp => "gate/up 2x14336x4096",
            Shape::Down => "down  4096x14336",
        }
    }
    /// `(rows, cols)` of each weight (`hot`: gate/up at half its rows, to fit L2).
    fn weights(self, hot: bool) -> Vec<(usize, usize)> {
        match self {
            Shape::Qkv => vec![(4096, 4096), (1024, 4096), (1024, 4096)],
            Shape::O => vec![(4096, 4096)],
            Shape::GateUp if hot => vec![(7168, 4096), (7168, 4096)],
            Shape::GateUp => vec![(14336, 4096), (14336, 4096)],
            Shape::Down => vec![(4096, 14336)],
        }
    }
}

fn bench(o: &Opts) -> Result<(), String> {
    let b = common::open_backend(o.dtype)?;
    let copy_bw = common::copy_bandwidth(&b)?;
    let ops: &dyn Ops = &b;
    let mut rng = Rng::new(0x51_0E_6E_4D);
    println!(
        "int4 decode products, {} activations, group {}, {} iterations, weights {}; GB/s of packed weights + scales + \
         mins, % of {:.3} TB/s",
        o.dtype,
        o.group,
        o.iters,
        if o.hot { "hot in L2 (one copy)" } else { "cycled through copies past L2" },
        copy_bw / 1e12
    );
    // Where the kernels came from and whether they get PDL: a `TM_KERNELS_DIR` built from other
    // sources loses it, which moves every figure (session 29's --hot runs).
    println!(
        "kernels from {}; PDL {} on this device",
        b.gpu().kernel_source(),
        if b.gpu().pdl() { "on" } else { "off" }
    );
    let e = |e: tm_core::Error| e.to_string();
    for shape in [Shape::Qkv, Shape::O, Shape::GateUp, Shape::Down] {
        let dims = shape.weights(o.hot);
        let set_bytes: usize = dims.iter().map(|&(r, c)| r * c / 2 + 2 * 2 * r * (c / o.group)).sum();
        let copies = if o.hot { 1 } else { CYCLE_BYTES.div_ceil(set_bytes).max(2) };
        let mut make_sets = || -> Result<Vec<Vec<Weight>>, String> {
            (0..copies).map(|_| dims.iter().map(|&(r, c)| random_q4(ops, &mut rng, r, c, o.group)).collect()).collect()
        };
        let sets = make_sets()?;
        // `ops` times gate/up as the model loader leaves it: a second set of weights passed through
        // `prepare_gate_up` (tile-ordered scales on CUDA, which only `silu_lnts` reads: on them
        // every variant below would time that one kernel).
        let prepared = match shape {
            Shape::GateUp => {
                let mut p = make_sets()?;
                for set in &mut p {
                    if let [gate, up] = &mut set[..] {
                        ops.prepare_gate_up(gate, up).map_err(e)?;
                    }
                }
                Some(p)
            }
            _ => None,
        };
        let op_sets = prepared.as_ref().unwrap_or(&sets);
        let cols = dims[0].1;
        for &n in &o.batch {
            let x = activations(ops, &mut rng, o.dtype, n, cols).map_err(e)?;
            let mut outs: Vec<Tensor> = dims
                .iter()
                .map(|&(r, _)| ops.zeros(TensorDesc::new(o.dtype, &[n, r]), "bench"))
                .collect::<tm_core::Result<_>>()
                .map_err(e)?;
            let mut act = ops.zeros(TensorDesc::new(o.dtype, &[n, dims[0].0]), "bench").map_err(e)?;
            let ops_ms = common::time_ms(&b, o.iters, |i| {
                let set = &op_sets[i % copies];
                match shape {
                    Shape::GateUp => {
                        let (g, u) = outs.split_at_mut(1);
                        ops.gate_up_silu(&x, &set[0], &set[1], &mut g[0], &mut u[0], &mut act)
                    }
                    _ => {
                        let ws: Vec<&Weight> = set.iter().collect();
                        let mut os: Vec<&mut Tensor> = outs.iter_mut().collect();
                        ops.matmul_many(&x, &ws, &vec![None; ws.len()], &mut os)
                    }
                }
            })?;
            let slots: Vec<Vec<Q4Slot>> = sets
                .iter()
                .map(|set| set.iter().zip(&outs).map(|(w, out)| slot(w, out)).collect())
                .collect::<Result<_, String>>()?;
            let (xa, aa) = (x.buffer().addr(), act.buffer().addr());
            let group = o.group;
            let launch = |unroll: Unroll, i: usize| {
                let ss = &slots[i % copies];
                match shape {
                    Shape::GateUp => {
                        q4_gemv::q4_gemv_silu(b.gpu(), o.dtype, aa, &ss[0], &ss[1], xa, n, cols, group, unroll, None)
                    }
                    _ => q4_gemv::q4_gemv(b.gpu(), o.dtype, xa, n, cols, group, ss, unroll),
                }
            };
            // The chain's RMSNorm: x = rmsnorm(x_in) * ones, which the product then reads.
            let x_in = activations(ops, &mut rng, o.dtype, n, cols).map_err(e)?;
            let ones = ones(ops, o.dtype, cols).map_err(e)?;
            let (xin, wa) = (x_in.buffer().addr(), ones.buffer().addr());
            let norm = || elementwise::rms_norm(b.gpu(), o.dtype, xa, xin, wa, 1e-5, n, cols);
            // A graph that fails to capture or run is reported and left out (the stream lines
            // stand on their own).
            let graphed = |what: &str, r: Result<f64, String>| {
                r.map_err(|err| eprintln!("{} n={n} {what}: CUDA graph timing failed: {err}", shape.name(o.hot))).ok()
            };
            let norm_ms = graphed("norm only", graph_ms(&b, o.iters, |_| norm()));
            let mut rows: Vec<(String, f64)> = vec![("ops".into(), ops_ms)];
            // SiLU kernels exist for u2, ln and ln4 only; n16 would time u2 again.
            let variants = o.variants.iter().filter(|u| !matches!(shape, Shape::GateUp) || u.has_silu_form());
            for &u in variants {
                rows.push((u.name().into(), common::time_ms(&b, o.iters, |i| launch(u, i))?));
                let what = format!("{} graph", u.name());
                if let Some(ms) = graphed(&what, graph_ms(&b, o.iters, |i| launch(u, i))) {
                    rows.push((what, ms));
                }
                let what = format!("{} chain", u.name());
                let pair = graphed(
                    &what,
                    graph_ms(&b, o.iters, |i| {
                        norm()?;
                        launch(u, i)
                    }),
                );
                if let (Some(pair), Some(norm)) = (pair, norm_ms) {
                    rows.push((what, pair - norm));
                }
            }
            let old = common::time_ms(&b, o.iters, |i| {
                for s in &slots[i % copies] {
                    quant::matmul_q4(
                        b.gpu(),
                        None,
                        o.dtype,
                        s.out,
                        xa,
                        s.packed,
                        s.scales,
                        s.mins,
                        n,
                        s.rows,
                        cols,
                        group,
                        s.layout,
                    )?;
                }
                if let Shape::GateUp = shape {
                    let (g, u) = (slots[0][0].out, slots[0][1].out);
                    elementwise::silu_mul(b.gpu(), o.dtype, aa, g, u, n * dims[0].0)?;
                }
                Ok(())
            })?;
            rows.push(("cuda-core".into(), old));
            if let Some(norm) = norm_ms {
                println!(
                    "{:<22} n={n}  {:<12} {:>8.1} us  (a graph of RMSNorms alone: subtracted from the chains)",
                    shape.name(o.hot),
                    "norm only",
                    norm * 1e3
                );
            }
            for (what, ms) in rows {
                let gbs = set_bytes as f64 / (ms * 1e-3) / 1e9;
                println!(
                    "{:<22} n={n}  {what:<12} {:>8.1} us  {:>7.0} GB/s  {:>5.1}% of copy bandwidth",
                    shape.name(o.hot),
                    ms * 1e3,
                    gbs,
                    100.0 * gbs * 1e9 / copy_bw
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    common::run("q4_gemv_bench", parse, bench)
}
