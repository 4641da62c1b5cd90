//! Op-by-op conformance of the CUDA backend with the CPU reference backend.
//!
//! For each activation dtype (f32, f16, bf16) every [`Ops`] method runs on a [`CudaBackend`] and a
//! [`CpuBackend`] with the same random inputs, over the shapes of the supported models (hidden
//! 576/896/2048/4096, head_dim 64/128, GQA ratios 1/3/4/7/8, vocabularies up to 128256, 1 to 256
//! tokens), and the outputs are compared. Every case prints one line (`ok` with its worst error as
//! a fraction of the tolerance, or `FAIL` with the op, shapes, dtype, seed, the worst element and
//! by how much it missed); a test fails at its end with every failing case listed, so one run shows
//! everything that is wrong. Backend errors and panics are reported the same way, per case.
//!
//! Without a CUDA driver or device every test prints `skipped: no CUDA device (<reason>)` and
//! passes.
//!
//! # Inputs
//! Random inputs are generated in f32 and rounded to the dtype under test before either backend
//! sees them, so both compute from identical values: the CPU (which works in f32) gets the rounded
//! values, the GPU gets them in its dtype. A case's seed is a hash of the base seed and the case's
//! label, so the same case sees the same raw numbers for every dtype and in any order. Output
//! buffers on the GPU start as NaN, so elements a kernel never writes show up as non-finite.
//!
//! # Tolerance
//! An element passes when `|gpu - cpu| <= tol * (rms(row) + |cpu|)`, where `row` is the natural
//! unit of the op (a head for attention and RoPE, an output row for matmul and norms): relative to
//! the value, but judged on the row's scale where the value itself is near zero (a relative error
//! of a near-cancelled sum means nothing). `tol` per dtype, from its unit roundoff `u`:
//! - f32: `1e-4`. The kernels compute in f32 like the CPU; what differs is summation order
//!   (about `sqrt(K) * u` = 7e-6 relative for K = 14336) and CUDA's transcendental functions
//!   (within 2 ulp). TF32 tensor cores (`u` = 4.9e-4) or fast-math `__sinf` at positions near 32k
//!   exceed it, as they should.
//! - f16: `2e-3` (`u` = 4.9e-4): the output is rounded to f16, and so are a few intermediates the
//!   GPU keeps in f16 (the residual sum of `add_rms_norm`, dequantized weights and attention
//!   probabilities fed to tensor cores); each adds up to `u`, so about four roundings' worth.
//! - bf16: `2e-2` (`u` = 3.9e-3): the same argument, five roundings' worth.
//!
//! Copies (`write_kv`, `gather_rows`, `load_dense`) must be exact; greedy sampling must pick the
//! CPU's token exactly (the first of equal maxima); random sampling must only pick tokens the CPU
//! sampler could pick, and for well-conditioned rows its frequencies must pass a loose chi-square
//! test against the CPU sampler's probabilities.
//!
//! Quantized matmuls are checked against the exact host product (`x · dequantize(W)ᵀ` with f32
//! activations, `tm_cpu::quant_matmul::matmul_int*_exact`) rather than the CPU backend's default
//! path, which rounds activations to int16 (up to ~1e-4 relative) and would blur the f32 check.
//!
//! # Environment
//! - `TM_TEST_SEED`: base seed (decimal or `0x` hex; default fixed, printed on failure).
//! - `TM_CONFORMANCE_DTYPES`: comma-separated dtypes to run (`f32,f16,bf16`).
//! - `TM_CONFORMANCE_CASE`: run only cases whose label contains this text.
//! - `TM_CUDA_DEVICE`: device ordinal (default 0).

use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use half::{bf16, f16};
use rayon::prelude::*;
use tm_core::ops::{AttentionMeta, DeferredNorm, SampleRequest, SeqAttention};
use tm_core::quant::Weight;
use tm_core::rope::{RopeConfig, RopeScaling, RopeStyle};
use tm_core::sampling::{apply_penalties, Rng, SamplingParams};
use tm_core::{DType, Ops, Tensor, TensorDesc};
use tm_cpu::CpuBackend;
use tm_cuda::{CudaBackend, CudaOptions};
use tm_quant::HostQuant;

// ---------------------------------------------------------------------------------------------
// Harness: backends, seeds, cases, comparisons.
// ---------------------------------------------------------------------------------------------

/// Every dtype the CUDA backend supports for activations.
const ALL_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Base seed when `TM_TEST_SEED` is not set.
const DEFAULT_SEED: u64 = 0x7E57_5EED;

/// The tolerance of a dtype (see the module docs).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        DType::BF16 => 2e-2,
        _ => 1e-4,
    }
}

/// Turns any error into the `String` a case reports, naming what failed.
trait Ctx<T> {
    /// `Err(e)` becomes `"{what} failed: {e}"`.
    fn ctx(self, what: impl Display) -> Result<T, String>;
}

impl<T, E: Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl Display) -> Result<T, String> {
        self.map_err(|e| format!("{what} failed: {e}"))
    }
}

/// The text of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// `true` (after printing why) when there is no usable CUDA device.
fn no_gpu(test: &str) -> bool {
    match tm_cuda::probe() {
        Ok(_) => false,
        Err(e) => {
            println!("{test}: skipped: no CUDA device ({e})");
            true
        }
    }
}

/// The CUDA backend for `dtype`, opened once per process and shared by the tests.
fn cuda(dtype: DType) -> Result<Arc<dyn Ops>, String> {
    type Opened = Vec<(DType, Result<Arc<dyn Ops>, String>)>;
    static OPENED: OnceLock<Mutex<Opened>> = OnceLock::new();
    let mut opened = OPENED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, b)) = opened.iter().find(|(d, _)| *d == dtype) {
        return b.clone();
    }
    let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let opts = CudaOptions { ordinal, dtype, memory_cap: None, cuda_graphs: false, memory_model: Default::default() };
    let b = match catch_unwind(|| CudaBackend::open(opts)) {
        Ok(Ok(b)) => Ok(Arc::new(b) as Arc<dyn Ops>),
        Ok(Err(e)) => Err(format!("CudaBackend::open(device {ordinal}, {dtype}) failed: {e}")),
        Err(p) => Err(format!("CudaBackend::open(device {ordinal}, {dtype}) panicked: {}", panic_message(&*p))),
    };
    opened.push((dtype, b.clone()));
    b
}

/// `TM_TEST_SEED` or the default.
fn base_seed() -> u64 {
    let Ok(v) = std::env::var("TM_TEST_SEED") else { return DEFAULT_SEED };
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    parsed.unwrap_or_else(|_| panic!("TM_TEST_SEED={v} is not a number"))
}

/// The dtypes to run: `TM_CONFORMANCE_DTYPES` intersected with `wanted`.
fn dtypes(wanted: &[DType]) -> Vec<DType> {
    let Ok(list) = std::env::var("TM_CONFORMANCE_DTYPES") else { return wanted.to_vec() };
    let names: Vec<String> = list.split(',').map(|s| s.trim().to_ascii_lowercase()).collect();
    wanted.iter().copied().filter(|d| names.contains(&d.to_string())).collect()
}

/// FNV-1a of a label, mixed into the base seed.
fn case_seed(base: u64, label: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ base;
    for b in label.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// One dtype's run of a test: the backends and the failures so far.
struct Suite {
    dtype: DType,
    gpu: Arc<dyn Ops>,
    cpu: CpuBackend,
    seed: u64,
    filter: Option<String>,
    failures: Vec<String>,
    cases: usize,
    /// Put before every case label (e.g. the kernel variant a test forced), or empty.
    tag: String,
}

/// Runs `body` once per dtype of `wanted` (restricted by `TM_CONFORMANCE_DTYPES`) and fails the
/// test at the end if any case failed, listing them all.
fn run(test: &str, wanted: &[DType], body: impl Fn(&mut Suite)) {
    if no_gpu(test) {
        return;
    }
    let started = Instant::now();
    let seed = base_seed();
    let filter = std::env::var("TM_CONFORMANCE_CASE").ok().filter(|f| !f.is_empty());
    let (mut failures, mut cases) = (Vec::new(), 0);
    let dts = dtypes(wanted);
    for &dtype in &dts {
        let gpu = match cuda(dtype) {
            Ok(g) => g,
            Err(e) => {
                println!("FAIL [{dtype}] {e}");
                failures.push(format!("[{dtype}] {e}"));
                continue;
            }
        };
        if gpu.activation_dtype() != dtype {
            let m =
                format!("[{dtype}] the backend opened for {dtype} reports activation dtype {}", gpu.activation_dtype());
            println!("FAIL {m}");
            failures.push(m);
            continue;
        }
        let mut s = Suite {
            dtype,
            gpu,
            cpu: CpuBackend::new(),
            seed,
            filter: filter.clone(),
            failures: Vec::new(),
            cases: 0,
            tag: String::new(),
        };
        body(&mut s);
        failures.append(&mut s.failures);
        cases += s.cases;
    }
    let secs = started.elapsed().as_secs_f64();
    println!("{test}: {cases} cases over {dts:?} in {secs:.1} s, {} failure(s), base seed {seed:#x}", failures.len());
    if !failures.is_empty() {
        panic!(
            "{test}: {} failure(s). Rerun with TM_TEST_SEED={seed:#x} for the same inputs, TM_CONFORMANCE_DTYPES=<dtype> \
             and TM_CONFORMANCE_CASE=<part of a label> to narrow it down.\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

impl Suite {
    /// Runs one case: `f` gets fresh random inputs seeded from the label; its errors, panics and
    /// failed comparisons are reported with the label, dtype and seed.
    fn case(&mut self, label: impl Into<String>, f: impl FnOnce(&mut Case<'_>) -> Result<(), String>) {
        let label = format!("{}{}", self.tag, label.into());
        if self.filter.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
            return;
        }
        let seed = case_seed(self.seed, &label);
        let started = Instant::now();
        let mut c = Case {
            gpu: self.gpu.as_ref(),
            cpu: &self.cpu,
            dtype: self.dtype,
            gen: Gen::new(seed),
            problems: Vec::new(),
            notes: Vec::new(),
        };
        match catch_unwind(AssertUnwindSafe(|| f(&mut c))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => c.problems.push(e),
            Err(p) => c.problems.push(format!("panicked: {}", panic_message(&*p))),
        }
        self.cases += 1;
        let head = format!("[{}] {label} (case seed {seed:#x})", self.dtype);
        let ms = started.elapsed().as_millis();
        if c.problems.is_empty() {
            println!("ok   {head}: {} ({ms} ms)", c.notes.join("; "));
        }
        for p in c.problems {
            println!("FAIL {head}: {p} ({ms} ms)");
            self.failures.push(format!("{head}: {p}"));
        }
    }
}

/// Random numbers for one case (SplitMix64 from tm-core).
struct Gen {
    rng: Rng,
    spare: Option<f32>,
}

impl Gen {
    fn new(seed: u64) -> Gen {
        Gen { rng: Rng::new(seed), spare: None }
    }
    fn u64(&mut self) -> u64 {
        self.rng.next_u64()
    }
    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f32 {
        (self.u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f32 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let u1 = ((self.u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.u64() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
        self.spare = Some((r * s) as f32);
        (r * c) as f32
    }
    /// A random permutation of `0..n`.
    fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
    /// Log-uniform integer in `1..=max`.
    fn log_uniform(&mut self, max: usize) -> usize {
        ((self.unit() as f64 * (max as f64).ln()).exp().round() as usize).clamp(1, max)
    }
}

/// `v` rounded to `dtype` (round to nearest even, as `half` and the GPU convert).
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Host bytes of `v` in `dtype`.
fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    let size = dtype.storage_bytes(1);
    let mut out = vec![0u8; v.len() * size];
    out.par_chunks_mut(CHUNK * size).zip(v.par_chunks(CHUNK)).for_each(|(o, v)| {
        for (o, &x) in o.chunks_exact_mut(size).zip(v) {
            match dtype {
                DType::F16 => o.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
                DType::BF16 => o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                _ => o.copy_from_slice(&x.to_le_bytes()),
            }
        }
    });
    out
}

/// Elements per parallel chunk of generated data (each chunk has its own random stream, so the
/// values do not depend on the number of threads).
const CHUNK: usize = 1 << 16;

/// `n` values of `f(gen)` rounded to `dtype`, generated in parallel from streams derived from
/// `seed`.
fn generate(n: usize, seed: u64, dtype: DType, f: impl Fn(&mut Gen) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut g = Gen::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for v in chunk {
            *v = round_to(dtype, f(&mut g));
        }
    });
    out
}

/// The same tensor on both backends: the GPU's in its dtype, the CPU's in f32.
struct Pair {
    gpu: Tensor,
    cpu: Tensor,
}

/// The same weight on both backends.
struct WeightPair {
    gpu: Weight,
    cpu: Weight,
    /// The host form when quantized (the exact reference product needs it).
    quant: Option<HostQuant>,
}

/// How a matrix is stored.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Dense,
    /// int8 with this group size.
    Int8(usize),
    /// int4 with this group size.
    Int4(usize),
}

impl Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Dense => write!(f, "dense"),
            Kind::Int8(g) => write!(f, "int8 g{g}"),
            Kind::Int4(g) => write!(f, "int4 g{g}"),
        }
    }
}

/// Quantizes `[rows, cols]` weights with tm-quant, in parallel over blocks of rows (the layout
/// is row-major in every part, so the blocks' parts concatenate).
fn quantize(kind: Kind, data: &[f32], rows: usize, cols: usize) -> tm_core::Result<HostQuant> {
    const ROWS: usize = 256;
    let parts: Vec<HostQuant> = data
        .par_chunks(ROWS * cols)
        .map(|block| {
            let r = block.len() / cols;
            match kind {
                Kind::Int4(g) => tm_quant::quantize_int4(block, r, cols, g),
                Kind::Int8(g) => tm_quant::quantize_int8(block, r, cols, g),
                Kind::Dense => Err(tm_core::Error::invalid("dense is not quantized")),
            }
        })
        .collect::<tm_core::Result<_>>()?;
    let mut parts = parts.into_iter();
    let mut q = parts.next().ok_or_else(|| tm_core::Error::invalid("no rows"))?;
    for p in parts {
        q.packed.extend_from_slice(&p.packed);
        q.scales.extend_from_slice(&p.scales);
        if let (Some(m), Some(pm)) = (q.mins.as_mut(), p.mins.as_ref()) {
            m.extend_from_slice(pm);
        }
    }
    q.rows = rows;
    q.validate()?;
    Ok(q)
}

/// How far the worst element of a comparison is off.
struct Stats {
    /// Largest `|got - want| / (rms(row) + |want|)`, infinite for a non-finite mismatch.
    max_ratio: f64,
    worst: usize,
    bad: usize,
    nonfinite: usize,
    mean_abs: f64,
    worst_rms: f64,
}

/// Compares `got` with `want` row by row (see the module docs for the measure), in parallel over
/// blocks of rows.
fn compare(got: &[f32], want: &[f32], row: usize, tol: f64) -> Stats {
    let row = row.max(1);
    let block = row * CHUNK.div_ceil(row);
    let part = |(b, (g, w)): (usize, (&[f32], &[f32]))| {
        let mut s = Stats { max_ratio: 0.0, worst: 0, bad: 0, nonfinite: 0, mean_abs: 0.0, worst_rms: 0.0 };
        for (r, (g, w)) in g.chunks(row).zip(w.chunks(row)).enumerate() {
            let rms = (w.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / w.len() as f64).sqrt();
            for (i, (&gi, &wi)) in g.iter().zip(w).enumerate() {
                let ratio = if gi.is_finite() != wi.is_finite() {
                    s.nonfinite += 1;
                    f64::INFINITY
                } else if !wi.is_finite() {
                    if gi.to_bits() == wi.to_bits() || (gi.is_nan() && wi.is_nan()) {
                        0.0
                    } else {
                        f64::INFINITY
                    }
                } else {
                    let d = (gi as f64 - wi as f64).abs();
                    s.mean_abs += d;
                    d / (rms + (wi as f64).abs()).max(f64::MIN_POSITIVE)
                };
                if ratio > tol {
                    s.bad += 1;
                }
                if ratio > s.max_ratio {
                    s.max_ratio = ratio;
                    s.worst = b * block + r * row + i;
                    s.worst_rms = rms;
                }
            }
        }
        s
    };
    let parts: Vec<Stats> = got.par_chunks(block).zip(want.par_chunks(block)).enumerate().map(part).collect();
    let mut total = Stats { max_ratio: 0.0, worst: 0, bad: 0, nonfinite: 0, mean_abs: 0.0, worst_rms: 0.0 };
    for p in parts {
        if p.max_ratio > total.max_ratio {
            (total.max_ratio, total.worst, total.worst_rms) = (p.max_ratio, p.worst, p.worst_rms);
        }
        total.bad += p.bad;
        total.nonfinite += p.nonfinite;
        total.mean_abs += p.mean_abs;
    }
    total.mean_abs /= got.len().max(1) as f64;
    total
}

/// Multi-dimensional index of flat element `i` of `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        idx[d] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// One case: the backends, its random stream, and what it found.
struct Case<'a> {
    gpu: &'a dyn Ops,
    cpu: &'a CpuBackend,
    dtype: DType,
    gen: Gen,
    problems: Vec<String>,
    notes: Vec<String>,
}

impl Case<'_> {
    fn round(&self, v: f32) -> f32 {
        round_to(self.dtype, v)
    }

    /// `n` uniform values in `[lo, hi)`, rounded to the dtype.
    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        generate(n, self.gen.u64(), self.dtype, |g| lo + (hi - lo) * g.unit())
    }

    /// `n` normal values of standard deviation `std`, rounded to the dtype.
    fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        generate(n, self.gen.u64(), self.dtype, |g| g.normal() * std)
    }

    /// Activation-like values: normal, with one element in 256 an outlier 16 times larger.
    fn activations(&mut self, n: usize, std: f32) -> Vec<f32> {
        generate(n, self.gen.u64(), self.dtype, |g| {
            let scale = if g.below(256) == 0 { 16.0 } else { 1.0 };
            g.normal() * std * scale
        })
    }

    /// An activation tensor holding `data` on both backends.
    fn act(&self, shape: &[usize], data: &[f32]) -> Result<Pair, String> {
        let desc = TensorDesc::new(self.gpu.activation_dtype(), shape);
        assert_eq!(desc.numel(), data.len(), "test bug: data for {shape:?}");
        let mut gpu = self.gpu.zeros(desc.clone(), "test").ctx(format!("cuda zeros {shape:?}"))?;
        self.gpu.upload(&mut gpu, &encode(desc.dtype, data)).ctx(format!("cuda upload {shape:?}"))?;
        let mut cpu = self.cpu.zeros(TensorDesc::new(DType::F32, shape), "test").ctx("cpu zeros")?;
        self.cpu.upload(&mut cpu, bytemuck::cast_slice(data)).ctx("cpu upload")?;
        Ok(Pair { gpu, cpu })
    }

    /// An FP8 E4M3 KV-cache tensor holding the codes of `data` on both backends.
    fn fp8_cache(&self, shape: &[usize], data: &[f32]) -> Result<Pair, String> {
        let desc = TensorDesc::new(DType::F8E4M3, shape);
        assert_eq!(desc.numel(), data.len(), "test bug: data for {shape:?}");
        let codes: Vec<u8> = data.iter().map(|&x| tm_core::fp8::encode(x)).collect();
        let mut gpu = self.gpu.zeros(desc.clone(), "test").ctx(format!("cuda zeros fp8 {shape:?}"))?;
        self.gpu.upload(&mut gpu, &codes).ctx(format!("cuda upload fp8 {shape:?}"))?;
        let mut cpu = self.cpu.zeros(desc, "test").ctx("cpu zeros fp8")?;
        self.cpu.upload(&mut cpu, &codes).ctx("cpu upload fp8")?;
        Ok(Pair { gpu, cpu })
    }

    /// An output tensor: NaN on the GPU (so unwritten elements show), zeros on the CPU.
    fn output(&self, shape: &[usize]) -> Result<Pair, String> {
        let n = shape.iter().product();
        let desc = TensorDesc::new(self.gpu.activation_dtype(), shape);
        let mut gpu = self.gpu.zeros(desc.clone(), "test").ctx(format!("cuda zeros {shape:?}"))?;
        self.gpu.upload(&mut gpu, &encode(desc.dtype, &vec![f32::NAN; n])).ctx(format!("cuda upload {shape:?}"))?;
        let cpu = self.cpu.zeros(TensorDesc::new(DType::F32, shape), "test").ctx("cpu zeros")?;
        Ok(Pair { gpu, cpu })
    }

    /// A dense weight (or norm weight, bias) loaded with `load_dense` from the dtype under test.
    fn dense(&self, shape: &[usize], data: &[f32]) -> Result<Pair, String> {
        let gpu = self
            .gpu
            .load_dense(self.dtype, shape, &encode(self.dtype, data), "test")
            .ctx(format!("cuda load_dense {shape:?}"))?;
        let cpu = self.cpu.load_dense(DType::F32, shape, bytemuck::cast_slice(data), "test").ctx("cpu load_dense")?;
        Ok(Pair { gpu, cpu })
    }

    /// A `[rows, cols]` weight of `kind` with values uniform in `±scale`.
    fn weight(&mut self, kind: Kind, rows: usize, cols: usize, scale: f32) -> Result<WeightPair, String> {
        if let Kind::Dense = kind {
            let data = self.uniform(rows * cols, -scale, scale);
            let p = self.dense(&[rows, cols], &data)?;
            return Ok(WeightPair { gpu: Weight::Dense(p.gpu), cpu: Weight::Dense(p.cpu), quant: None });
        }
        let data = generate(rows * cols, self.gen.u64(), DType::F32, |g| scale * (2.0 * g.unit() - 1.0));
        let q = quantize(kind, &data, rows, cols).ctx("quantizing the test weight")?;
        let upload = tm_model::llama::quant_load::upload_quant;
        let gpu = upload(self.gpu, &q).ctx(format!("cuda upload of a {kind} [{rows}, {cols}] weight"))?;
        let cpu = upload(self.cpu, &q).ctx("cpu upload of the quantized weight")?;
        Ok(WeightPair { gpu, cpu, quant: Some(q) })
    }

    /// Compares GPU tensor `got` with `want` (tolerance `mult` times the dtype's), recording a
    /// problem if it is off and a note with the worst error otherwise.
    fn check(&mut self, what: &str, got: &Tensor, want: &[f32], row: usize, mult: f64) -> Result<(), String> {
        let g = self.gpu.download_f32(got).ctx(format!("cuda download of {what}"))?;
        let shape = got.shape().to_vec();
        if g.len() != want.len() {
            self.problems.push(format!("{what}: {} elements from the GPU, {} expected", g.len(), want.len()));
            return Ok(());
        }
        let tol = tolerance(self.dtype) * mult;
        let s = compare(&g, want, row, tol);
        if s.bad == 0 {
            self.notes.push(format!("{what} {:.2}×tol", s.max_ratio / tol));
            return Ok(());
        }
        let (gw, ww) = (g[s.worst], want[s.worst]);
        self.problems.push(format!(
            "{what} {shape:?}: {} of {} elements off{}; worst at {:?}: got {gw:e}, want {ww:e} (|diff| {:.3e}, row rms \
             {:.3e}; {:.3}× the tolerance {tol:e} × (row rms + |want|)); mean |diff| {:.3e}",
            s.bad,
            g.len(),
            if s.nonfinite > 0 { format!(" ({} non-finite where the CPU is finite)", s.nonfinite) } else { String::new() },
            unravel(s.worst, &shape),
            (gw - ww).abs(),
            s.worst_rms,
            s.max_ratio / tol,
            s.mean_abs,
        ));
        Ok(())
    }

    /// [`Case::check`] of a pair's GPU tensor against its CPU tensor.
    fn check_pair(&mut self, what: &str, p: &Pair, row: usize) -> Result<(), String> {
        let want = self.cpu.download_f32(&p.cpu).ctx("cpu download")?;
        self.check(what, &p.gpu, &want, row, 1.0)
    }

    /// Requires two GPU tensors to hold the same bytes (the fused and the unfused path of an op).
    fn check_same_bytes(&mut self, what: &str, got: &Tensor, want: &Tensor) -> Result<(), String> {
        let bytes = |t: &Tensor| -> Result<Vec<u8>, String> {
            let mut b = vec![0u8; t.desc().bytes()];
            self.gpu.download(t, &mut b).ctx(format!("cuda download of {what}"))?;
            Ok(b)
        };
        let (g, w) = (bytes(got)?, bytes(want)?);
        let size = got.dtype().storage_bytes(1).max(1);
        match g.chunks(size).zip(w.chunks(size)).position(|(a, b)| a != b) {
            _ if g.len() != w.len() => {
                self.problems.push(format!("{what}: {} bytes, the unfused path {} bytes", g.len(), w.len()))
            }
            Some(i) => self.problems.push(format!(
                "{what} {:?}: element {:?} differs from the unfused path (must be bit-identical): {:02x?} vs {:02x?}",
                got.shape(),
                unravel(i, got.shape()),
                &g[i * size..][..size],
                &w[i * size..][..size]
            )),
            None => self.notes.push(format!("{what} = unfused")),
        }
        Ok(())
    }

    /// Requires the GPU tensor to hold exactly `want` (read back as f32; NaN equals NaN).
    fn check_values(&mut self, what: &str, got: &Tensor, want: &[f32]) -> Result<(), String> {
        let g = self.gpu.download_f32(got).ctx(format!("cuda download of {what}"))?;
        match (0..g.len().min(want.len())).find(|&i| g[i] != want[i] && !(g[i].is_nan() && want[i].is_nan())) {
            _ if g.len() != want.len() => {
                self.problems.push(format!("{what}: {} elements from the GPU, {} expected", g.len(), want.len()))
            }
            Some(i) => self.problems.push(format!(
                "{what} {:?}: element {:?} is {:e}, want {:e} (must be exact)",
                got.shape(),
                unravel(i, got.shape()),
                g[i],
                want[i]
            )),
            None => self.notes.push(format!("{what} exact")),
        }
        Ok(())
    }

    /// Requires the GPU tensor to equal the CPU's exactly (copies).
    fn check_exact(&mut self, what: &str, p: &Pair) -> Result<(), String> {
        let g = self.gpu.download_f32(&p.gpu).ctx(format!("cuda download of {what}"))?;
        let w = self.cpu.download_f32(&p.cpu).ctx("cpu download")?;
        let shape = p.cpu.shape();
        let diff: Vec<usize> = (0..g.len().min(w.len()))
            .into_par_iter()
            .filter(|&i| g[i] != w[i] && !(g[i].is_nan() && w[i].is_nan()))
            .collect();
        if g.len() != w.len() {
            self.problems.push(format!("{what}: {} elements from the GPU, {} expected", g.len(), w.len()));
        } else if let Some(&i) = diff.first() {
            self.problems.push(format!(
                "{what} {shape:?}: {} of {} elements differ (must be exact); first at {:?}: got {:e}, want {:e}",
                diff.len(),
                g.len(),
                unravel(i, shape),
                g[i],
                w[i]
            ));
        } else {
            self.notes.push(format!("{what} exact"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Op cases: one function per op, one call per shape.
// ---------------------------------------------------------------------------------------------

/// `load_dense` from `src` into the backend's weight dtype, then `download_f32`: must equal the
/// values rounded to that dtype.
fn load_dense_case(s: &mut Suite, src: DType, rows: usize, cols: usize) {
    s.case(format!("load_dense from {src} [{rows}, {cols}]"), |c| {
        let raw: Vec<f32> = (0..rows * cols).map(|_| round_to(src, c.gen.normal() * 3.0)).collect();
        let t = c.gpu.load_dense(src, &[rows, cols], &encode(src, &raw), "test").ctx("cuda load_dense")?;
        let held = c.gpu.weight_dtype(src);
        if t.dtype() != held {
            c.problems.push(format!("load_dense gave a {} tensor; weight_dtype({src}) says {held}", t.dtype()));
        }
        let got = c.gpu.download_f32(&t).ctx("cuda download_f32")?;
        let want: Vec<f32> = raw.iter().map(|&v| round_to(t.dtype(), v)).collect();
        match (0..want.len()).find(|&i| got.get(i) != Some(&want[i])) {
            Some(i) => c.problems.push(format!(
                "element {:?}: got {:?}, want {:e} (from {src} value {:e})",
                unravel(i, &[rows, cols]),
                got.get(i),
                want[i],
                raw[i]
            )),
            None => c.notes.push(format!("exact, held as {held}")),
        }
        Ok(())
    });
}

/// Embedding lookups of `ns` ids each (one table, one lookup per count) into `[vocab, hidden]`;
/// the ids include the last and first rows and a repeat.
fn embedding(s: &mut Suite, kind: Kind, vocab: usize, hidden: usize, ns: &[usize]) {
    s.case(format!("embedding {kind} table [{vocab}, {hidden}], {ns:?} ids"), |c| {
        let w = c.weight(kind, vocab, hidden, 1.0)?;
        for &n in ns {
            let mut ids: Vec<u32> = (0..n).map(|_| c.gen.below(vocab) as u32).collect();
            ids[0] = vocab as u32 - 1;
            if n > 2 {
                ids[1] = 0;
                ids[2] = ids[0];
            }
            let mut out = c.output(&[n, hidden])?;
            c.gpu.embedding(&w.gpu, &ids, &mut out.gpu).ctx(format!("cuda embedding of {n} ids"))?;
            c.cpu.embedding(&w.cpu, &ids, &mut out.cpu).ctx("cpu embedding")?;
            c.check_pair(&format!("out[{n}]"), &out, hidden)?;
            // The table as one rank's slice of a vocabulary starting at `first`: ids below and
            // past the slice give zero rows (on the device, over rows that held other values).
            let first = 1000u32;
            let global: Vec<u32> = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| match i % 3 {
                    0 => id + first,
                    1 => id + first + vocab as u32,
                    _ => id % first,
                })
                .collect();
            let mut sliced = c.output(&[n, hidden])?;
            c.gpu.embedding(&w.gpu, &ids, &mut sliced.gpu).ctx("cuda embedding")?;
            c.cpu.embedding(&w.cpu, &ids, &mut sliced.cpu).ctx("cpu embedding")?;
            c.gpu
                .embedding_slice(&w.gpu, &global, first, &mut sliced.gpu)
                .ctx(format!("cuda embedding_slice of {n} ids"))?;
            c.cpu.embedding_slice(&w.cpu, &global, first, &mut sliced.cpu).ctx("cpu embedding_slice")?;
            c.check_pair(&format!("slice out[{n}]"), &sliced, hidden)?;
        }
        Ok(())
    });
}

/// RMSNorm of `[rows, cols]` over groups of `width` features (`width < cols`: per-head q/k norm).
fn rms_norm(s: &mut Suite, rows: usize, cols: usize, width: usize, eps: f32) {
    s.case(format!("rms_norm x[{rows}, {cols}] weight [{width}] eps {eps:e}"), |c| {
        let x = c.activations(rows * cols, 1.0);
        let w: Vec<f32> = c.normal(width, 0.1).into_iter().map(|v| c.round(1.0 + v)).collect();
        let (x, w) = (c.act(&[rows, cols], &x)?, c.dense(&[width], &w)?);
        let mut out = c.output(&[rows, cols])?;
        c.gpu.rms_norm(&x.gpu, &w.gpu, eps, &mut out.gpu).ctx("cuda rms_norm")?;
        c.cpu.rms_norm(&x.cpu, &w.cpu, eps, &mut out.cpu).ctx("cpu rms_norm")?;
        c.check_pair("out", &out, width)
    });
}

fn add_rms_norm(s: &mut Suite, rows: usize, cols: usize, eps: f32) {
    s.case(format!("add_rms_norm x, residual [{rows}, {cols}] eps {eps:e}"), |c| {
        let (x, r) = (c.activations(rows * cols, 1.0), c.activations(rows * cols, 2.0));
        let w: Vec<f32> = c.normal(cols, 0.1).into_iter().map(|v| c.round(1.0 + v)).collect();
        let (x, mut r, w) = (c.act(&[rows, cols], &x)?, c.act(&[rows, cols], &r)?, c.dense(&[cols], &w)?);
        let mut out = c.output(&[rows, cols])?;
        c.gpu.add_rms_norm(&x.gpu, &mut r.gpu, &w.gpu, eps, &mut out.gpu).ctx("cuda add_rms_norm")?;
        c.cpu.add_rms_norm(&x.cpu, &mut r.cpu, &w.cpu, eps, &mut out.cpu).ctx("cpu add_rms_norm")?;
        c.check_pair("out", &out, cols)?;
        c.check_pair("residual", &r, cols)
    });
}

fn matmul(s: &mut Suite, kind: Kind, n: usize, rows: usize, cols: usize, bias: bool) {
    let b = if bias { " + bias" } else { "" };
    s.case(format!("matmul {kind} x[{n}, {cols}] · W[{rows}, {cols}]ᵀ{b}"), |c| {
        let xs = c.activations(n * cols, 1.0);
        // Uniform in ±sqrt(3 / cols): outputs of about unit size.
        let w = c.weight(kind, rows, cols, (3.0 / cols as f32).sqrt())?;
        let bias = if bias {
            let v = c.normal(rows, 0.5);
            Some((c.dense(&[rows], &v)?, v))
        } else {
            None
        };
        let x = c.act(&[n, cols], &xs)?;
        let mut out = c.output(&[n, rows])?;
        c.gpu.matmul(&x.gpu, &w.gpu, bias.as_ref().map(|b| &b.0.gpu), &mut out.gpu).ctx("cuda matmul")?;
        let want = match &w.quant {
            None => {
                c.cpu.matmul(&x.cpu, &w.cpu, bias.as_ref().map(|b| &b.0.cpu), &mut out.cpu).ctx("cpu matmul")?;
                c.cpu.download_f32(&out.cpu).ctx("cpu download")?
            }
            Some(q) => {
                let mut want = vec![0f32; n * rows];
                let exact = match kind {
                    Kind::Int4(_) => tm_cpu::quant_matmul::matmul_int4_exact,
                    _ => tm_cpu::quant_matmul::matmul_int8_exact,
                };
                exact(&xs, n, &q.view(), &mut want).ctx("host exact quantized matmul")?;
                if let Some((_, bv)) = &bias {
                    for row in want.chunks_mut(rows) {
                        row.iter_mut().zip(bv).for_each(|(o, b)| *o += b);
                    }
                }
                want
            }
        };
        c.check("out", &out.gpu, &want, rows, 1.0)
    });
}

/// `matmul_many`: one input times several weights (q/k/v: one launch on CUDA for decode
/// batches), against the CPU's separate products.
fn matmul_many(s: &mut Suite, kind: Kind, n: usize, rows: &[usize], cols: usize, bias: bool) {
    let b = if bias { " + biases" } else { "" };
    s.case(format!("matmul_many {kind} x[{n}, {cols}] · W{rows:?}ᵀ{b}"), |c| {
        let xs = c.activations(n * cols, 1.0);
        let x = c.act(&[n, cols], &xs)?;
        let mut ws = Vec::new();
        let mut biases = Vec::new();
        let mut outs = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            ws.push(c.weight(kind, r, cols, (3.0 / cols as f32).sqrt())?);
            // Biases on every other weight, so present and absent ones mix in one launch.
            let b = if bias && i % 2 == 0 { Some(c.normal(r, 0.5)) } else { None };
            biases.push(b.map(|v| c.dense(&[r], &v)).transpose()?);
            outs.push(c.output(&[n, r])?);
        }
        {
            let gw: Vec<&Weight> = ws.iter().map(|w| &w.gpu).collect();
            let gb: Vec<Option<&Tensor>> = biases.iter().map(|b| b.as_ref().map(|b| &b.gpu)).collect();
            let mut go: Vec<&mut Tensor> = outs.iter_mut().map(|o| &mut o.gpu).collect();
            c.gpu.matmul_many(&x.gpu, &gw, &gb, &mut go).ctx("cuda matmul_many")?;
        }
        for ((w, b), out) in ws.iter().zip(&biases).zip(outs.iter_mut()) {
            c.cpu.matmul(&x.cpu, &w.cpu, b.as_ref().map(|b| &b.cpu), &mut out.cpu).ctx("cpu matmul")?;
        }
        for (i, out) in outs.iter().enumerate() {
            c.check_pair(&format!("out {i}"), out, rows[i])?;
        }
        Ok(())
    });
}

/// `gate_up_silu` (one launch on CUDA for dense decode batches) against the CPU's two products
/// and `silu_mul`.
fn gate_up_silu(s: &mut Suite, kind: Kind, n: usize, rows: usize, cols: usize) {
    s.case(format!("gate_up_silu {kind} x[{n}, {cols}] · G, U[{rows}, {cols}]ᵀ"), |c| {
        let xs = c.activations(n * cols, 1.0);
        let x = c.act(&[n, cols], &xs)?;
        // Gates of a few units, so silu's both sides are exercised.
        let g = c.weight(kind, rows, cols, 3.0 * (3.0 / cols as f32).sqrt())?;
        let u = c.weight(kind, rows, cols, (3.0 / cols as f32).sqrt())?;
        let (mut gs, mut us, mut out) = (c.output(&[n, rows])?, c.output(&[n, rows])?, c.output(&[n, rows])?);
        c.gpu.gate_up_silu(&x.gpu, &g.gpu, &u.gpu, &mut gs.gpu, &mut us.gpu, &mut out.gpu).ctx("cuda gate_up_silu")?;
        c.cpu.matmul(&x.cpu, &g.cpu, None, &mut gs.cpu).ctx("cpu gate")?;
        c.cpu.matmul(&x.cpu, &u.cpu, None, &mut us.cpu).ctx("cpu up")?;
        c.cpu.silu_mul(&gs.cpu, &us.cpu, &mut out.cpu).ctx("cpu silu_mul")?;
        let want = c.cpu.download_f32(&out.cpu).ctx("cpu download")?;
        // The fused kernel rounds the gate and up products to the dtype, as separate products
        // would; the CPU keeps them in f32: twice the tolerance.
        c.check("out", &out.gpu, &want, rows, 2.0)
    });
}

/// A RoPE configuration with a name for the label.
struct Rope {
    name: &'static str,
    cfg: RopeConfig,
}

fn rope_configs(head_dim: usize) -> Vec<Rope> {
    let cfg = |base, scaling, style| RopeConfig { dim: head_dim, base, scaling, style };
    vec![
        Rope { name: "plain θ=1e4 half", cfg: cfg(1e4, RopeScaling::None, RopeStyle::Half) },
        Rope { name: "plain θ=1e6 interleaved", cfg: cfg(1e6, RopeScaling::None, RopeStyle::Interleaved) },
        Rope {
            name: "llama3 ×8 θ=5e5 interleaved",
            cfg: cfg(
                5e5,
                RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max: 8192 },
                RopeStyle::Interleaved,
            ),
        },
        Rope {
            name: "yarn ×4 (attention factor 1.139) half",
            cfg: cfg(
                1e6,
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_max: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    attention_factor: None,
                    mscale: None,
                    mscale_all_dim: None,
                    truncate: true,
                },
                RopeStyle::Half,
            ),
        },
        Rope {
            name: "yarn ×8 attention factor 0.75 interleaved",
            cfg: cfg(
                1e4,
                RopeScaling::Yarn {
                    factor: 8.0,
                    original_max: 2048,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    attention_factor: Some(0.75),
                    mscale: None,
                    mscale_all_dim: None,
                    truncate: false,
                },
                RopeStyle::Interleaved,
            ),
        },
        Rope { name: "linear ×2 half", cfg: cfg(1e4, RopeScaling::Linear { factor: 2.0 }, RopeStyle::Half) },
        Rope {
            name: "dynamic ×2 half",
            cfg: cfg(1e4, RopeScaling::Dynamic { factor: 2.0, original_max: 2048 }, RopeStyle::Half),
        },
    ]
}

/// RoPE on `[tokens, heads * head_dim]` with random positions up to `max_pos` (including it and 0).
fn rope(s: &mut Suite, r: &Rope, tokens: usize, heads: usize, head_dim: usize, max_pos: u32) {
    let cfg = r.cfg.clone();
    s.case(format!("rope {} x[{tokens}, {heads}×{head_dim}] positions ≤ {max_pos}", r.name), |c| {
        let freqs = cfg.freqs(max_pos as usize);
        let mut positions: Vec<u32> = (0..tokens).map(|_| c.gen.below(max_pos as usize + 1) as u32).collect();
        positions[0] = max_pos;
        if tokens > 1 {
            positions[1] = 0;
        }
        let x = c.normal(tokens * heads * head_dim, 1.0);
        let mut x = c.act(&[tokens, heads * head_dim], &x)?;
        c.gpu.rope(&mut x.gpu, &positions, &freqs).ctx("cuda rope")?;
        c.cpu.rope(&mut x.cpu, &positions, &freqs).ctx("cpu rope")?;
        c.notes.push(format!("attention factor {}", freqs.attention_factor));
        c.check_pair("x", &x, head_dim)
    });
}

/// The shapes of a fused RoPE + KV-cache write case.
struct RopeKv {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    tokens: usize,
    /// The first token's position (the others follow it).
    first: u32,
    /// The caches hold FP8 E4M3 codes.
    fp8: bool,
}

/// `rope_write_kv` of `tokens` consecutive positions from `first` into caches whose blocks are a
/// random permutation (junk in every other slot), three ways: the CUDA op (one fused launch),
/// the CPU backend's default composition (`rope`, `rope`, `write_kv`), and
/// `tm_core::ops::rope_write_kv_unfused` on the CUDA backend (its separate `rope` and `write_kv`
/// kernels). The fused result must equal the unfused one bit for bit (q, k, both caches), q and k
/// must match the CPU within the RoPE tolerance, the k cache must hold exactly the rotated k (its
/// E4M3 codes for an fp8 cache) in the token slots and junk elsewhere, and the v cache must equal
/// the CPU's exactly.
fn rope_write_kv(s: &mut Suite, r: &Rope, a: RopeKv) {
    let RopeKv { heads, kv_heads, head_dim: hd, block_size: bs, tokens, first, fp8 } = a;
    let cfg = r.cfg.clone();
    let label = format!(
        "rope_write_kv {}{}: {heads}/{kv_heads} heads × {hd}, {tokens} tokens from position {first}, block {bs}",
        r.name,
        if fp8 { " fp8 cache" } else { "" },
    );
    s.case(label, |c| {
        let freqs = cfg.freqs(first as usize + tokens);
        let positions: Vec<u32> = (first..).take(tokens).collect();
        // Position p sits at offset p % bs of logical block p / bs, as in the engine.
        let start = first as usize % bs;
        let blocks = (start + tokens).div_ceil(bs) + 2;
        let perm = c.gen.permutation(blocks);
        let slots: Vec<u32> = (start..start + tokens).map(|o| perm[o / bs] * bs as u32 + (o % bs) as u32).collect();
        let kv_dim = kv_heads * hd;
        let shape = [blocks, bs, kv_heads, hd];
        let (k_img, v_img) = (vec![JUNK_K; blocks * bs * kv_dim], vec![JUNK_V; blocks * bs * kv_dim]);
        let cache = |c: &Case<'_>, img: &[f32]| if fp8 { c.fp8_cache(&shape, img) } else { c.act(&shape, img) };
        let (mut kc, mut vc) = (cache(c, &k_img)?, cache(c, &v_img)?);
        let (mut kc2, mut vc2) = (cache(c, &k_img)?, cache(c, &v_img)?);
        let (qd, kd, vd) =
            (c.normal(tokens * heads * hd, 1.0), c.normal(tokens * kv_dim, 1.0), c.normal(tokens * kv_dim, 1.0));
        let (mut q, mut k, v) =
            (c.act(&[tokens, heads * hd], &qd)?, c.act(&[tokens, kv_dim], &kd)?, c.act(&[tokens, kv_dim], &vd)?);
        let (mut q2, mut k2) = (c.act(&[tokens, heads * hd], &qd)?, c.act(&[tokens, kv_dim], &kd)?);

        c.gpu
            .rope_write_kv(&mut q.gpu, &mut k.gpu, &v.gpu, &mut kc.gpu, &mut vc.gpu, &positions, &freqs, &slots)
            .ctx("cuda rope_write_kv")?;
        c.cpu
            .rope_write_kv(&mut q.cpu, &mut k.cpu, &v.cpu, &mut kc.cpu, &mut vc.cpu, &positions, &freqs, &slots)
            .ctx("cpu rope_write_kv")?;
        let (gq, gk) = (&mut q2.gpu, &mut k2.gpu);
        tm_core::ops::rope_write_kv_unfused(
            c.gpu,
            gq,
            gk,
            &v.gpu,
            &mut kc2.gpu,
            &mut vc2.gpu,
            &positions,
            &freqs,
            &slots,
        )
        .ctx("cuda rope, rope, write_kv")?;

        c.check_pair("q", &q, hd)?;
        c.check_pair("k", &k, hd)?;
        for (what, fused, unfused) in [
            ("q", &q.gpu, &q2.gpu),
            ("k", &k.gpu, &k2.gpu),
            ("k cache", &kc.gpu, &kc2.gpu),
            ("v cache", &vc.gpu, &vc2.gpu),
        ] {
            c.check_same_bytes(what, fused, unfused)?;
        }
        // The k cache: the GPU's rotated k in the token slots (as E4M3 codes for fp8), junk elsewhere.
        let rotated = c.gpu.download_f32(&k.gpu).ctx("cuda download of k")?;
        let mut want = k_img;
        for (t, &slot) in slots.iter().enumerate() {
            let row = &mut want[slot as usize * kv_dim..][..kv_dim];
            row.copy_from_slice(&rotated[t * kv_dim..][..kv_dim]);
        }
        if fp8 {
            want.iter_mut().for_each(|x| *x = tm_core::fp8::decode(tm_core::fp8::encode(*x)));
        }
        c.check_values("k cache", &kc.gpu, &want)?;
        c.check_exact("v cache", &vc)?;
        c.notes.push(format!("attention factor {}", freqs.attention_factor));
        Ok(())
    });
}

/// The shapes of a q/k/v + RoPE + KV-cache write case ([`qkv_rope_write_kv`]).
struct QkvRope {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    cols: usize,
    group: usize,
    /// Decode tokens (one per sequence, at random positions up to 20000).
    n: usize,
    bias: bool,
    /// Whether the CUDA backend should fuse it (`q4_gemv_ln_rope`).
    fused: bool,
}

/// `qkv_rope_write_kv` with int4 q/k/v weights, three ways: the CUDA op (for decode shapes that
/// fit, the products with RoPE and the cache write in their epilogue), its default composition
/// on the CUDA backend (`matmul_many`, then `rope_write_kv`) and the CPU backend. The fused
/// result must equal the composition bit for bit (q, k, v and both caches, junk slots included)
/// and match the CPU within tolerance; the fused kernel must have run exactly when expected.
fn qkv_rope_write_kv(s: &mut Suite, r: &Rope, a: QkvRope) {
    let QkvRope { heads, kv_heads, head_dim: hd, cols, group, n, bias, fused } = a;
    let cfg = r.cfg.clone();
    let b = if bias { " + biases" } else { "" };
    let label =
        format!("qkv_rope_write_kv int4 g{group} {} x[{n}, {cols}], {heads}/{kv_heads} heads × {hd}{b}", r.name);
    s.case(label, |c| {
        let freqs = cfg.freqs(20_000);
        let positions: Vec<u32> = (0..n).map(|_| c.gen.below(20_001) as u32).collect();
        let bs = 16;
        let blocks = n + 2;
        let perm = c.gen.permutation(blocks * bs);
        let slots: Vec<u32> = perm[..n].to_vec();
        let kv_dim = kv_heads * hd;
        let shape = [blocks, bs, kv_heads, hd];
        let (k_img, v_img) = (vec![JUNK_K; blocks * bs * kv_dim], vec![JUNK_V; blocks * bs * kv_dim]);
        let (mut kc, mut vc) = (c.act(&shape, &k_img)?, c.act(&shape, &v_img)?);
        let (mut kc2, mut vc2) = (c.act(&shape, &k_img)?, c.act(&shape, &v_img)?);
        let xs = c.activations(n * cols, 1.0);
        let x = c.act(&[n, cols], &xs)?;
        let rows = [heads * hd, kv_dim, kv_dim];
        let mut ws = Vec::new();
        let mut biases = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            ws.push(c.weight(Kind::Int4(group), r, cols, (3.0 / cols as f32).sqrt())?);
            let b = if bias && i != 1 { Some(c.normal(r, 0.5)) } else { None };
            biases.push(b.map(|v| c.dense(&[r], &v)).transpose()?);
        }
        let mut outs = Vec::new();
        let mut outs2 = Vec::new();
        for &r in &rows {
            outs.push(c.output(&[n, r])?);
            outs2.push(c.output(&[n, r])?);
        }
        let gw = [&ws[0].gpu, &ws[1].gpu, &ws[2].gpu];
        let gb = [0, 1, 2].map(|i| biases[i].as_ref().map(|b| &b.gpu));
        let before = tm_cuda::kernels::q4_gemv::rope_launches();
        {
            let [o0, o1, o2] = &mut outs[..] else { unreachable!() };
            let qkv = [&mut o0.gpu, &mut o1.gpu, &mut o2.gpu];
            c.gpu
                .qkv_rope_write_kv(&x.gpu, gw, gb, qkv, &mut kc.gpu, &mut vc.gpu, &positions, &freqs, &slots)
                .ctx("cuda qkv_rope_write_kv")?;
        }
        let ran = tm_cuda::kernels::q4_gemv::rope_launches() - before;
        {
            let [o0, o1, o2] = &mut outs2[..] else { unreachable!() };
            let qkv = [&mut o0.gpu, &mut o1.gpu, &mut o2.gpu];
            tm_core::ops::qkv_rope_write_kv_unfused(
                c.gpu,
                &x.gpu,
                gw,
                gb,
                qkv,
                &mut kc2.gpu,
                &mut vc2.gpu,
                &positions,
                &freqs,
                &slots,
            )
            .ctx("cuda matmul_many, rope_write_kv")?;
            let [o0, o1, o2] = &mut outs[..] else { unreachable!() };
            let qkv = [&mut o0.cpu, &mut o1.cpu, &mut o2.cpu];
            let cw = [&ws[0].cpu, &ws[1].cpu, &ws[2].cpu];
            let cb = [0, 1, 2].map(|i| biases[i].as_ref().map(|b| &b.cpu));
            c.cpu
                .qkv_rope_write_kv(&x.cpu, cw, cb, qkv, &mut kc.cpu, &mut vc.cpu, &positions, &freqs, &slots)
                .ctx("cpu qkv_rope_write_kv")?;
        }
        let want_fused = fused && c.dtype != DType::F32;
        if (ran > 0) != want_fused {
            c.problems.push(format!(
                "q4_gemv_ln_rope launched {ran} time(s); expected it {}",
                if want_fused { "once" } else { "not at all" }
            ));
        }
        c.notes.push(if ran > 0 { "fused".to_string() } else { "unfused".to_string() });
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            c.check_same_bytes(what, &outs[i].gpu, &outs2[i].gpu)?;
        }
        c.check_same_bytes("k cache", &kc.gpu, &kc2.gpu)?;
        c.check_same_bytes("v cache", &vc.gpu, &vc2.gpu)?;
        // The products are rounded to the dtype before RoPE on the GPU, not on the CPU: twice the
        // tolerance (as for gate_up_silu).
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            let want = c.cpu.download_f32(&outs[i].cpu).ctx("cpu download")?;
            c.check(what, &outs[i].gpu, &want, hd, 2.0)?;
        }
        for (what, p) in [("k cache", &kc), ("v cache", &vc)] {
            let want = c.cpu.download_f32(&p.cpu).ctx("cpu download")?;
            c.check(what, &p.gpu, &want, hd, 2.0)?;
        }
        Ok(())
    });
}

fn silu_mul(s: &mut Suite, rows: usize, cols: usize) {
    s.case(format!("silu_mul [{rows}, {cols}]"), |c| {
        // Gates up to about ±20, so both tails of the sigmoid are exercised.
        let (g, u) = (c.normal(rows * cols, 5.0), c.activations(rows * cols, 1.0));
        let (g, u) = (c.act(&[rows, cols], &g)?, c.act(&[rows, cols], &u)?);
        let mut out = c.output(&[rows, cols])?;
        c.gpu.silu_mul(&g.gpu, &u.gpu, &mut out.gpu).ctx("cuda silu_mul")?;
        c.cpu.silu_mul(&g.cpu, &u.cpu, &mut out.cpu).ctx("cpu silu_mul")?;
        c.check_pair("out", &out, cols)
    });
}

fn add_in_place(s: &mut Suite, rows: usize, cols: usize) {
    s.case(format!("add_in_place [{rows}, {cols}]"), |c| {
        let (x, y) = (c.activations(rows * cols, 1.0), c.activations(rows * cols, 1.0));
        let (mut x, y) = (c.act(&[rows, cols], &x)?, c.act(&[rows, cols], &y)?);
        c.gpu.add_in_place(&mut x.gpu, &y.gpu).ctx("cuda add_in_place")?;
        c.cpu.add_in_place(&mut x.cpu, &y.cpu).ctx("cpu add_in_place")?;
        c.check_pair("x", &x, cols)
    });
}

fn gather_rows(s: &mut Suite, rows: usize, cols: usize, picks: usize) {
    s.case(format!("gather_rows x[{rows}, {cols}] → {picks} rows"), |c| {
        let x = c.normal(rows * cols, 1.0);
        let x = c.act(&[rows, cols], &x)?;
        let mut idx: Vec<u32> = (0..picks).map(|_| c.gen.below(rows) as u32).collect();
        idx[0] = rows as u32 - 1;
        if picks > 2 {
            idx[1] = 0;
            idx[2] = idx[0];
        }
        let mut out = c.output(&[picks, cols])?;
        c.gpu.gather_rows(&x.gpu, &idx, &mut out.gpu).ctx("cuda gather_rows")?;
        c.cpu.gather_rows(&x.cpu, &idx, &mut out.cpu).ctx("cpu gather_rows")?;
        c.check_exact("out", &out)
    });
}

/// A batch for paged attention: `(query_len, context_len)` per sequence.
struct Attn {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    seqs: Vec<(usize, usize)>,
    /// The caches hold FP8 E4M3 codes (`--kv-cache-dtype fp8`) instead of the activation dtype.
    fp8: bool,
    /// Run the GPU attention twice (into two outputs, both checked): a second call must not be
    /// disturbed by state the first left behind (the fused combine's split counters).
    twice: bool,
}

/// Key and value filling every cache slot no sequence owns: a kernel that reads one (through a
/// wrong block, or past a context's end) gets a value that moves the output far off.
const JUNK_K: f32 = 0.5;
const JUNK_V: f32 = 64.0;

/// `write_kv` of each sequence's new tokens into a cache already holding its earlier tokens, with
/// random non-contiguous block tables, then `attention`; checks both caches (exactly) and the
/// output.
fn attention(s: &mut Suite, what: &str, a: Attn) {
    let tokens: usize = a.seqs.iter().map(|q| q.0).sum();
    let max_ctx = a.seqs.iter().map(|q| q.1).max().unwrap_or(0);
    let min_ctx = a.seqs.iter().map(|q| q.1).min().unwrap_or(0);
    let label = format!(
        "attention {what}{}: {}/{} heads × {}, block {}, window {:?}, {} seqs, {tokens} query tokens, context {min_ctx}..={max_ctx}",
        if a.fp8 { " fp8 cache" } else { "" },
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.block_size,
        a.window,
        a.seqs.len()
    );
    s.case(label, |c| {
        let Attn { heads, kv_heads, head_dim: hd, block_size: bs, window, ref seqs, fp8, twice } = a;
        let kv_dim = kv_heads * hd;
        let needed: usize = seqs.iter().map(|q| q.1.div_ceil(bs)).sum();
        let num_blocks = needed + needed / 4 + 2;
        let perm = c.gen.permutation(num_blocks);
        let mut tables = Vec::new();
        let mut next = 0;
        for &(_, ctx) in seqs {
            let n = ctx.div_ceil(bs);
            tables.push(perm[next..next + n].to_vec());
            next += n;
        }
        let slot = |s: usize, p: usize| tables[s][p / bs] as usize * bs + p % bs;
        // The cache before this step: junk everywhere, each sequence's cached prefix in its slots.
        let cache_len = num_blocks * bs * kv_dim;
        let (mut k_img, mut v_img) = (vec![JUNK_K; cache_len], vec![JUNK_V; cache_len]);
        // Keys and values uniform with unit variance (as good as normal here, and faster).
        let prefix: usize = seqs.iter().map(|&(q, ctx)| ctx - q).sum();
        let a3 = 3f32.sqrt();
        let (pk, pv) = (c.uniform(prefix * kv_dim, -a3, a3), c.uniform(prefix * kv_dim, -a3, a3));
        let mut rows = pk.chunks_exact(kv_dim).zip(pv.chunks_exact(kv_dim));
        for (i, &(q, ctx)) in seqs.iter().enumerate() {
            for p in 0..ctx - q {
                let at = slot(i, p) * kv_dim;
                let (k, v) = rows.next().expect("one generated row per cached position");
                k_img[at..at + kv_dim].copy_from_slice(k);
                v_img[at..at + kv_dim].copy_from_slice(v);
            }
        }
        drop((pk, pv));
        let cache_shape = [num_blocks, bs, kv_heads, hd];
        let (mut kc, mut vc) = if fp8 {
            (c.fp8_cache(&cache_shape, &k_img)?, c.fp8_cache(&cache_shape, &v_img)?)
        } else {
            (c.act(&cache_shape, &k_img)?, c.act(&cache_shape, &v_img)?)
        };
        drop((k_img, v_img));
        let mut slots = Vec::with_capacity(tokens);
        for (i, &(q, ctx)) in seqs.iter().enumerate() {
            slots.extend((ctx - q..ctx).map(|p| slot(i, p) as u32));
        }
        let (k, v) = (c.normal(tokens * kv_dim, 1.0), c.normal(tokens * kv_dim, 1.0));
        let (k, v) = (c.act(&[tokens, kv_dim], &k)?, c.act(&[tokens, kv_dim], &v)?);
        c.gpu.write_kv(&k.gpu, &v.gpu, &mut kc.gpu, &mut vc.gpu, &slots).ctx("cuda write_kv")?;
        c.cpu.write_kv(&k.cpu, &v.cpu, &mut kc.cpu, &mut vc.cpu, &slots).ctx("cpu write_kv")?;
        c.check_exact("k cache", &kc)?;
        c.check_exact("v cache", &vc)?;

        let q = c.normal(tokens * heads * hd, 1.5);
        let q = c.act(&[tokens, heads * hd], &q)?;
        let mut start = 0;
        let metas: Vec<SeqAttention<'_>> = seqs
            .iter()
            .zip(&tables)
            .map(|(&(q, ctx), t)| {
                let m = SeqAttention { query_start: start, query_len: q, context_len: ctx, block_table: t };
                start += q;
                m
            })
            .collect();
        let meta =
            AttentionMeta { seqs: &metas, block_size: bs, scale: 1.0 / (hd as f32).sqrt(), sliding_window: window };
        let mut out = c.output(&[tokens, heads * hd])?;
        c.gpu.attention(&q.gpu, &kc.gpu, &vc.gpu, &meta, &mut out.gpu).ctx("cuda attention")?;
        c.cpu.attention(&q.cpu, &kc.cpu, &vc.cpu, &meta, &mut out.cpu).ctx("cpu attention")?;
        c.check_pair("out", &out, hd)?;
        if twice {
            let mut again = c.output(&[tokens, heads * hd])?;
            c.gpu.attention(&q.gpu, &kc.gpu, &vc.gpu, &meta, &mut again.gpu).ctx("cuda attention, second call")?;
            again.cpu = out.cpu;
            c.check_pair("out of the second call", &again, hd)?;
        }
        Ok(())
    });
}

/// `n` decode sequences (one query token each) with log-uniform context lengths up to `max_ctx`
/// (the first is exactly `max_ctx`, the second 1).
fn decode_seqs(seed: u64, n: usize, max_ctx: usize) -> Vec<(usize, usize)> {
    let mut g = Gen::new(seed);
    (0..n)
        .map(|i| match i {
            0 => (1, max_ctx),
            1 => (1, 1),
            _ => (1, g.log_uniform(max_ctx)),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Sampling helpers: what the CPU sampler may pick, and with which probabilities.
// ---------------------------------------------------------------------------------------------

/// Slack on the top-p and min-p boundaries for the allowed set (f32 sums in a different order).
const BOUNDARY_SLACK: f64 = 1e-3;

/// Which tokens the CPU sampler could draw from `logits` (penalties already applied), loosened at
/// the boundaries: ties at the k-th logit are all allowed, and top-p/min-p cuts get
/// [`BOUNDARY_SLACK`].
fn allowed_tokens(logits: &[f32], p: &SamplingParams) -> Vec<bool> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if p.temperature == 0.0 {
        return logits.iter().map(|&l| l == max).collect();
    }
    let z: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let mut allowed = vec![true; z.len()];
    if p.top_k > 0 && p.top_k < z.len() {
        let kth = z[order[p.top_k - 1]];
        for (a, &zi) in allowed.iter_mut().zip(&z) {
            *a = zi >= kth;
        }
    }
    let zmax = z[order[0]] as f64;
    let w: Vec<f64> = z.iter().zip(&allowed).map(|(&zi, &a)| if a { (zi as f64 - zmax).exp() } else { 0.0 }).collect();
    let sum: f64 = w.iter().sum();
    let prob: Vec<f64> = w.iter().map(|x| x / sum).collect();
    if p.top_p < 1.0 {
        // A token survives when the mass strictly above it is below top_p.
        let mut above = 0.0;
        let mut i = 0;
        while i < order.len() {
            let mut j = i;
            let mut group = 0.0;
            while j < order.len() && z[order[j]] == z[order[i]] {
                group += prob[order[j]];
                j += 1;
            }
            for &t in &order[i..j] {
                allowed[t] &= above < p.top_p as f64 + BOUNDARY_SLACK;
            }
            above += group;
            i = j;
        }
    }
    if p.min_p > 0.0 {
        let pmax = prob[order[0]];
        for (a, &pi) in allowed.iter_mut().zip(&prob) {
            *a &= pi >= pmax * p.min_p as f64 * (1.0 - BOUNDARY_SLACK);
        }
    }
    allowed
}

/// The CPU sampler's exact probabilities for `logits` (no ties assumed), in f64: temperature,
/// top-k, softmax, top-p (keep through the first token whose cumulative mass reaches p), min-p,
/// renormalise. Also returns how close the top-p cut is to ambiguous.
fn cpu_probabilities(logits: &[f32], p: &SamplingParams) -> (Vec<f64>, f64) {
    let z: Vec<f64> = logits.iter().map(|&l| (l / p.temperature) as f64).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    if p.top_k > 0 && p.top_k < order.len() {
        order.truncate(p.top_k);
    }
    let m = z[order[0]];
    let sum: f64 = order.iter().map(|&t| (z[t] - m).exp()).sum();
    let mut kept: Vec<(usize, f64)> = order.iter().map(|&t| (t, (z[t] - m).exp() / sum)).collect();
    let mut margin = f64::INFINITY;
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = kept.len();
        for (i, &(_, pi)) in kept.iter().enumerate() {
            acc += pi;
            margin = margin.min((acc - p.top_p as f64).abs());
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        kept.truncate(keep);
    }
    if p.min_p > 0.0 {
        let threshold = kept[0].1 * p.min_p as f64;
        for &(_, pi) in &kept {
            margin = margin.min((pi - threshold).abs() / kept[0].1);
        }
        kept.retain(|&(_, pi)| pi >= threshold);
    }
    let total: f64 = kept.iter().map(|k| k.1).sum();
    let mut probs = vec![0.0; logits.len()];
    for (t, pi) in kept {
        probs[t] = pi / total;
    }
    (probs, margin)
}

/// Pearson's chi-square of `counts` against `probs` (bins with an expected count under 5 pooled)
/// and its degrees of freedom.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e >= 5.0 {
            bins.push((o as f64, e));
        } else {
            pooled_e += e;
            pooled_o += o as f64;
        }
    }
    if pooled_e >= 5.0 || bins.is_empty() {
        bins.push((pooled_o, pooled_e.max(1e-9)));
    } else if let Some(smallest) = bins.iter_mut().min_by(|a, b| a.1.total_cmp(&b.1)) {
        smallest.0 += pooled_o;
        smallest.1 += pooled_e;
    }
    let chi = bins.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    (chi, bins.len().saturating_sub(1).max(1))
}

/// A loose bound for a chi-square with `df` degrees of freedom (about 6 standard deviations
/// above the mean): only a wrong distribution exceeds it.
fn chi_square_bound(df: usize) -> f64 {
    df as f64 + 6.0 * (2.0 * df as f64).sqrt() + 10.0
}

/// One sampling request's inputs, owned.
struct Req {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
}

/// Runs `sample` on `backend` for `logits` with one request per row, each with a fresh random
/// stream seeded `seed + row`.
fn sample_with(backend: &dyn Ops, logits: &Tensor, reqs: &[Req], seed: u64) -> tm_core::Result<Vec<u32>> {
    let mut rngs: Vec<Rng> = (0..reqs.len()).map(|i| Rng::new(seed.wrapping_add(i as u64))).collect();
    let mut requests: Vec<SampleRequest<'_>> = reqs
        .iter()
        .zip(rngs.iter_mut())
        .map(|(r, rng)| SampleRequest { params: &r.params, prompt: &r.prompt, output: &r.output, rng })
        .collect();
    backend.sample(logits, &mut requests)
}

/// Row `i` of `logits` with its request's penalties applied, as the CPU sampler sees it.
fn penalized(logits: &[f32], vocab: usize, i: usize, r: &Req) -> Vec<f32> {
    let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
    apply_penalties(&mut row, &r.params, &r.prompt, &r.output);
    row
}

/// Greedy sampling of `[n, vocab]` random logits, with rows holding ties (the first maximum
/// wins), all-equal values, the maximum at the last index, all-negative values, a NaN logit 0 and
/// a run of NaNs after it; must equal the CPU's choice exactly.
fn sample_greedy(s: &mut Suite, n: usize, vocab: usize) {
    s.case(format!("sample greedy logits [{n}, {vocab}] (ties: first index)"), |c| {
        let mut l = c.normal(n * vocab, 3.0);
        let row = |i: usize| i * vocab..(i + 1) * vocab;
        if n > 0 {
            let (a, b) = (c.gen.below(vocab / 2), vocab - 1 - c.gen.below(vocab / 2));
            let top = l[row(0)].iter().copied().fold(f32::MIN, f32::max) + 1.0;
            l[a] = c.round(top);
            l[b] = l[a];
        }
        if n > 1 {
            l[row(1)].fill(0.25);
        }
        if n > 2 {
            l[3 * vocab - 1] = 100.0;
        }
        if n > 3 {
            for v in &mut l[row(3)] {
                *v = c.round(*v - 60.0);
            }
        }
        if n > 4 {
            l[4 * vocab] = f32::NAN; // logit 0 NaN: token 0, as on the host
        }
        if n > 5 {
            // NaNs after logit 0 are skipped, here a whole split-argmax block of them.
            let end = (5 * vocab + 9000).min(6 * vocab);
            l[5 * vocab + 1..end].fill(f32::NAN);
        }
        let logits = c.act(&[n, vocab], &l)?;
        let reqs: Vec<Req> =
            (0..n).map(|_| Req { params: SamplingParams::greedy(), prompt: vec![], output: vec![] }).collect();
        let got = sample_with(c.gpu, &logits.gpu, &reqs, 1).ctx("cuda sample")?;
        let want = sample_with(c.cpu, &logits.cpu, &reqs, 1).ctx("cpu sample")?;
        let wrong: Vec<String> = (0..n)
            .filter(|&i| got.get(i) != want.get(i))
            .take(5)
            .map(|i| {
                let g = got.get(i).map_or("nothing".into(), |&g| format!("{g} (logit {})", l[i * vocab + g as usize]));
                format!("row {i}: cuda {g}, cpu {} (logit {})", want[i], l[i * vocab + want[i] as usize])
            })
            .collect();
        if got.len() != n || !wrong.is_empty() {
            c.problems.push(format!("{} tokens for {n} rows; differing rows: {}", got.len(), wrong.join(", ")));
        } else {
            c.notes.push("all rows equal".into());
        }
        Ok(())
    });
}

/// Greedy with repetition, presence and frequency penalties on tokens near the top, so the
/// penalties change the winner; must be the penalised argmax (up to 1e-6 relative near-ties).
fn sample_penalties(s: &mut Suite, n: usize, vocab: usize) {
    s.case(format!("sample greedy with penalties logits [{n}, {vocab}]"), |c| {
        let l = c.normal(n * vocab, 2.0);
        let mut reqs = Vec::new();
        for i in 0..n {
            let row = &l[i * vocab..(i + 1) * vocab];
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            let params = SamplingParams {
                repetition_penalty: [1.0, 1.1, 1.3, 2.0][i % 4],
                presence_penalty: [0.0, 0.5, -0.3, 1.0][(i / 4) % 4],
                frequency_penalty: [0.0, 0.25, 0.7][i % 3],
                ..SamplingParams::greedy()
            };
            let prompt = vec![order[0], order[2], order[0], c.gen.below(vocab) as u32];
            let output = vec![order[1], order[1], order[0], order[3], order[1]];
            reqs.push(Req { params, prompt, output });
        }
        let logits = c.act(&[n, vocab], &l)?;
        let got = sample_with(c.gpu, &logits.gpu, &reqs, 7).ctx("cuda sample")?;
        if got.len() != n {
            c.problems.push(format!("{} tokens for {n} rows", got.len()));
            return Ok(());
        }
        let mut wrong = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            let row = penalized(&l, vocab, i, r);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let g = got[i] as usize;
            let ok = row.get(g).is_some_and(|&v| v >= max - 1e-6 * max.abs().max(1.0));
            if !ok {
                let best = tm_core::sampling::argmax(&row);
                wrong.push(format!(
                    "row {i} ({:?}): cuda {g} (penalised logit {:?}), best {best} ({max})",
                    r.params,
                    row.get(g)
                ));
            }
        }
        if wrong.is_empty() {
            c.notes.push("all rows the penalised argmax".into());
        } else {
            c.problems.push(format!("{} of {n} rows wrong: {}", wrong.len(), wrong.join("; ")));
        }
        Ok(())
    });
}

/// The parameter sets the stochastic cases cycle through.
fn stochastic_params(i: usize) -> SamplingParams {
    let base = SamplingParams { temperature: 1.0, seed: i as u64, ..Default::default() };
    match i % 10 {
        0 => base,
        1 => SamplingParams { temperature: 0.7, top_k: 50, ..base },
        2 => SamplingParams { temperature: 1.2, top_p: 0.9, ..base },
        3 => SamplingParams { min_p: 0.1, ..base },
        4 => SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..base },
        5 => SamplingParams { top_k: 1, ..base },
        6 => SamplingParams { temperature: 1.5, top_p: 0.5, ..base },
        7 => SamplingParams { temperature: 0.3, top_k: 5, ..base },
        8 => SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            top_p: 0.8,
            ..base
        },
        _ => SamplingParams { temperature: 2.0, top_k: 1000, min_p: 0.02, ..base },
    }
}

/// Random sampling with the parameter sets of [`stochastic_params`]: every draw must be a token
/// the CPU sampler could draw, and the same seeds must give the same tokens.
fn sample_stochastic(s: &mut Suite, n: usize, vocab: usize) {
    s.case(format!("sample temperature/top-k/top-p/min-p/penalties logits [{n}, {vocab}]: allowed sets"), |c| {
        let l = c.normal(n * vocab, 3.0);
        let reqs: Vec<Req> = (0..n)
            .map(|i| {
                let top = (0..vocab).max_by(|&a, &b| l[i * vocab + a].total_cmp(&l[i * vocab + b])).unwrap_or(0);
                Req { params: stochastic_params(i), prompt: vec![top as u32], output: vec![top as u32, 3] }
            })
            .collect();
        let allowed: Vec<Vec<bool>> =
            reqs.iter().enumerate().map(|(i, r)| allowed_tokens(&penalized(&l, vocab, i, r), &r.params)).collect();
        let logits = c.act(&[n, vocab], &l)?;
        let mut wrong = Vec::new();
        let mut first = Vec::new();
        for round in 0..4u64 {
            let got = sample_with(c.gpu, &logits.gpu, &reqs, 1000 * round).ctx("cuda sample")?;
            if got.len() != n {
                c.problems.push(format!("{} tokens for {n} rows", got.len()));
                return Ok(());
            }
            for (i, &t) in got.iter().enumerate() {
                if !allowed[i].get(t as usize).copied().unwrap_or(false) {
                    let size = allowed[i].iter().filter(|&&a| a).count();
                    wrong.push(format!(
                        "round {round} row {i} ({:?}): token {t} is not among the {size} the CPU allows",
                        reqs[i].params
                    ));
                }
            }
            if round == 0 {
                first = got;
            }
        }
        let again = sample_with(c.gpu, &logits.gpu, &reqs, 0).ctx("cuda sample")?;
        if again != first {
            let i = (0..n).find(|&i| again.get(i) != first.get(i)).unwrap_or(0);
            c.problems.push(format!(
                "not reproducible: the same seeds gave row {i} token {:?}, then {:?}",
                first.get(i),
                again.get(i)
            ));
        }
        if wrong.is_empty() {
            c.notes.push(format!("{} draws allowed, reproducible", 4 * n));
        } else {
            let shown: Vec<String> = wrong.iter().take(6).cloned().collect();
            c.problems.push(format!(
                "{} of {} draws outside the allowed set: {}",
                wrong.len(),
                4 * n,
                shown.join("; ")
            ));
        }
        Ok(())
    });
}

/// A well-conditioned row sampled `calls × rows` times (one uploaded `[rows, vocab]` tensor of
/// identical rows, sampled repeatedly with fresh seeds): the frequencies must match the CPU
/// sampler's probabilities (chi-square), and the CPU's own draws must too (a check of this test).
/// The row: its top 40 tokens a clear ladder of logits `4 - 0.3 rank`, the rest a noisy tail of
/// mean `tail`, at random positions.
fn sample_distribution(s: &mut Suite, name: &str, vocab: usize, tail: f32, params: SamplingParams, calls: usize) {
    let rows = 256;
    s.case(format!("sample distribution {name} vocab {vocab}: {} draws, {params:?}", calls * rows), |c| {
        let perm = c.gen.permutation(vocab);
        let mut row = vec![0f32; vocab];
        for (rank, &t) in perm.iter().enumerate() {
            let v = if rank < 40 { 4.0 - 0.3 * rank as f32 } else { tail + c.gen.normal() };
            row[t as usize] = c.round(v);
        }
        let (probs, margin) = cpu_probabilities(&row, &params);
        let allowed = allowed_tokens(&row, &params);
        let data: Vec<f32> = (0..rows).flat_map(|_| row.iter().copied()).collect();
        let logits = c.act(&[rows, vocab], &data)?;
        let reqs: Vec<Req> =
            (0..rows).map(|_| Req { params: params.clone(), prompt: vec![], output: vec![] }).collect();
        let draw = |b: &dyn Ops, t: &Tensor, salt: u64| -> Result<Vec<usize>, String> {
            let mut counts = vec![0usize; vocab];
            for call in 0..calls {
                let got = sample_with(b, t, &reqs, salt + (call * rows) as u64).ctx("sample")?;
                for tok in got {
                    *counts.get_mut(tok as usize).ok_or(format!("token {tok} outside the vocabulary"))? += 1;
                }
            }
            Ok(counts)
        };
        let counts = draw(c.gpu, &logits.gpu, 0x5eed_0000).map_err(|e| format!("cuda {e}"))?;
        let outside: usize = counts.iter().zip(&allowed).filter(|(_, &a)| !a).map(|(n, _)| n).sum();
        let (chi, df) = chi_square(&counts, &probs);
        let bound = chi_square_bound(df);
        // The CPU's own draws check this test itself (skipped for large vocabularies: slow).
        let cpu_chi = if vocab <= 4096 {
            let cpu_counts = draw(c.cpu, &logits.cpu, 0x5eed_0000).map_err(|e| format!("cpu {e}"))?;
            let (cpu_chi, cpu_df) = chi_square(&cpu_counts, &probs);
            if cpu_chi > chi_square_bound(cpu_df) {
                c.problems.push(format!("test bug: the CPU sampler's own χ² is {cpu_chi:.1} (df {cpu_df})"));
            }
            format!("{cpu_chi:.1}")
        } else {
            "not run".to_string()
        };
        c.notes.push(format!(
            "cuda χ² {chi:.1}, cpu χ² {cpu_chi} (df {df}, bound {bound:.1}); boundary margin {margin:.2e}"
        ));
        if outside > 0 {
            c.problems.push(format!("{outside} draws of tokens the CPU sampler never draws"));
        }
        if chi > bound {
            let mut top: Vec<usize> = (0..vocab).collect();
            top.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
            let n = (calls * rows) as f64;
            let shown: Vec<String> = top
                .iter()
                .take(6)
                .map(|&t| format!("token {t}: {} drawn, {:.1} expected", counts[t], probs[t] * n))
                .collect();
            c.problems.push(format!("χ² {chi:.1} > {bound:.1} (df {df}); {}", shown.join(", ")));
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// The tests. With `--test-threads=1` they run in name order; the invalid-input test runs last
// because a GPU backend that does not check its inputs may fault and poison the context.
// ---------------------------------------------------------------------------------------------

#[test]
fn attention_decode() {
    run("attention_decode", &ALL_DTYPES, |s| {
        let a = |heads, kv_heads, head_dim, block_size, window, seqs| Attn {
            heads,
            kv_heads,
            head_dim,
            block_size,
            window,
            seqs,
            fp8: false,
            twice: false,
        };
        // Qwen2-0.5B (GQA 7): 256 sequences decoding at once.
        attention(s, "decode", a(14, 2, 64, 16, None, decode_seqs(1, 256, 4000)));
        // Llama 3 8B (GQA 4).
        attention(s, "decode", a(32, 8, 128, 32, None, decode_seqs(2, 32, 4000)));
        // GQA 8 with a sliding window shorter than most contexts.
        attention(s, "decode", a(32, 4, 128, 64, Some(1000), decode_seqs(3, 12, 4000)));
        // SmolLM2 (GQA 3); contexts at and around block boundaries.
        let edges = [1, 15, 16, 17, 31, 32, 33, 64, 65, 300].iter().map(|&c| (1, c)).collect();
        attention(s, "decode at block edges", a(9, 3, 64, 16, None, edges));
        // Llama 2 7B (GQA 1), Mistral-style window.
        attention(s, "decode", a(32, 32, 128, 16, Some(256), decode_seqs(4, 8, 2000)));
    });
}

#[test]
fn attention_prefill_and_mixed() {
    run("attention_prefill_and_mixed", &ALL_DTYPES, |s| {
        let a = |heads, kv_heads, head_dim, block_size, window, seqs| Attn {
            heads,
            kv_heads,
            head_dim,
            block_size,
            window,
            seqs,
            fp8: false,
            twice: false,
        };
        attention(s, "prefill", a(9, 3, 64, 16, None, vec![(256, 256)]));
        attention(s, "prefill", a(28, 4, 128, 32, None, vec![(100, 100), (37, 37), (1, 1)]));
        // Chunks after a cached prefix (query_len < context_len).
        attention(s, "prefill chunks", a(32, 8, 128, 16, None, vec![(17, 300), (64, 1000), (100, 2047)]));
        attention(s, "prefill chunks windowed", a(32, 8, 128, 64, Some(256), vec![(64, 700), (128, 128), (5, 3000)]));
        // Decodes and prefill chunks in one batch.
        let mixed = vec![(1, 37), (1, 1), (1, 4000), (200, 200), (31, 531), (1, 65), (64, 128)];
        attention(s, "mixed", a(32, 32, 128, 32, None, mixed.clone()));
        attention(s, "mixed windowed", a(16, 4, 64, 64, Some(64), mixed));
        // The tiny fixtures' shapes (head_dim 16 and 32).
        attention(s, "mixed fixture-sized", a(4, 2, 16, 16, None, vec![(1, 40), (22, 22), (5, 37)]));
        attention(s, "mixed fixture-sized", a(4, 2, 32, 16, Some(8), vec![(1, 40), (22, 22), (5, 37)]));
    });
}

/// `write_kv` into FP8 E4M3 caches of values spread over the whole E4M3 range: magnitudes from
/// 2^-12 (below the smallest subnormal) to 2^11 (past the ±448 saturation), so rounding (nearest
/// even; bf16 inputs hit exact ties often), subnormals and saturation must agree with the CPU's
/// `tm_core::fp8::encode` code for code, in slots scattered over the cache.
fn write_kv_fp8(s: &mut Suite, tokens: usize, kv_dim: usize) {
    s.case(format!("write_kv fp8 cache: {tokens} tokens × {kv_dim}, exponents -12..11"), |c| {
        let blocks = tokens.div_ceil(16) + 3;
        let shape = [blocks, 16, 1, kv_dim];
        let junk = vec![JUNK_V; blocks * 16 * kv_dim];
        let (mut kc, mut vc) = (c.fp8_cache(&shape, &junk)?, c.fp8_cache(&shape, &junk)?);
        let wide = |c: &mut Case<'_>| {
            let n = tokens * kv_dim;
            let signs = c.uniform(n, -1.0, 1.0);
            let exps = c.uniform(n, -12.0, 11.0);
            signs.iter().zip(&exps).map(|(s, e)| c.round(s.signum() * e.exp2())).collect::<Vec<f32>>()
        };
        let (k, v) = (wide(c), wide(c));
        let (k, v) = (c.act(&[tokens, kv_dim], &k)?, c.act(&[tokens, kv_dim], &v)?);
        let slots: Vec<u32> = c.gen.permutation(blocks * 16)[..tokens].to_vec();
        c.gpu.write_kv(&k.gpu, &v.gpu, &mut kc.gpu, &mut vc.gpu, &slots).ctx("cuda write_kv")?;
        c.cpu.write_kv(&k.cpu, &v.cpu, &mut kc.cpu, &mut vc.cpu, &slots).ctx("cpu write_kv")?;
        c.check_exact("k cache", &kc)?;
        c.check_exact("v cache", &vc)
    });
}

/// The attention cases of [`attention_decode`] and [`attention_prefill_and_mixed`] over FP8 E4M3
/// caches: `write_kv` must encode exactly as the CPU does, and attention (decode split-K and
/// prefill on tensor cores for f16/bf16, the CUDA-core kernel for f32 and the fixture head sizes)
/// must match the CPU reading the same codes. Both read the same exact values, so the tolerance
/// is the dtype's usual one. GQA 1, 3, 4, 7 and 8; block tables are random permutations with
/// unowned junk blocks between them.
#[test]
fn attention_fp8_cache() {
    run("attention_fp8_cache", &ALL_DTYPES, |s| {
        let a = |heads, kv_heads, head_dim, block_size, window, seqs| Attn {
            heads,
            kv_heads,
            head_dim,
            block_size,
            window,
            seqs,
            fp8: true,
            twice: false,
        };
        write_kv_fp8(s, 37, 1024);
        // 72 is not a multiple of 16: the scalar path
        write_kv_fp8(s, 5, 72);
        // decode: Llama 3 8B (GQA 4) at batch 256 with long contexts, Qwen2 (GQA 7), GQA 8
        // windowed, GQA 1, block edges (GQA 3)
        attention(s, "decode", a(32, 8, 128, 64, None, decode_seqs(5, 256, 1500)));
        attention(s, "decode", a(14, 2, 64, 16, None, decode_seqs(1, 64, 4000)));
        attention(s, "decode", a(32, 4, 128, 64, Some(1000), decode_seqs(3, 12, 4000)));
        attention(s, "decode", a(32, 32, 128, 16, None, decode_seqs(4, 8, 2000)));
        let edges = [1, 15, 16, 17, 31, 32, 33, 64, 65, 300].iter().map(|&c| (1, c)).collect();
        attention(s, "decode at block edges", a(9, 3, 64, 16, None, edges));
        // head_dim 128 with groups of at most 8 take the transposed kernel (attn_decode_gqa): Qwen2.5
        // 7B (GQA 7), split edges at GQA 4; GQA 16 keeps the 16-row kernel
        attention(s, "decode GQA 7", a(28, 4, 128, 16, None, decode_seqs(6, 48, 3000)));
        let edges = [1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000].iter().map(|&c| (1, c)).collect();
        attention(s, "decode GQA 4 at tile edges", a(32, 8, 128, 16, None, edges));
        attention(s, "decode GQA 16", a(32, 2, 128, 16, None, decode_seqs(7, 16, 2000)));
        // prefill, chunks after a cached prefix, mixed batches
        attention(s, "prefill", a(32, 8, 128, 16, None, vec![(256, 256), (37, 37)]));
        attention(s, "prefill chunks", a(32, 8, 128, 16, None, vec![(17, 300), (64, 1000), (100, 2047)]));
        attention(s, "prefill chunks windowed", a(32, 4, 128, 64, Some(256), vec![(64, 700), (128, 128), (5, 3000)]));
        let mixed = vec![(1, 37), (1, 1), (1, 4000), (200, 200), (31, 531), (1, 65), (64, 128)];
        attention(s, "mixed", a(32, 32, 128, 32, None, mixed.clone()));
        attention(s, "mixed windowed", a(16, 4, 64, 64, Some(64), mixed));
        attention(s, "mixed head_dim 256", a(8, 1, 256, 16, None, vec![(1, 300), (40, 90)]));
        attention(s, "mixed head_dim 80", a(8, 8, 80, 16, None, vec![(1, 300), (40, 90)]));
        attention(s, "mixed fixture-sized", a(4, 2, 16, 16, None, vec![(1, 40), (22, 22), (5, 37)]));
    });
}

/// The decode kernels' split count for a batch of `(query_len, context_len)` sequences (the
/// launcher's plan; the device pointers do not matter for it).
fn decode_splits(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    seqs: &[(usize, usize)],
) -> usize {
    use tm_cuda::kernels::attention::{AttentionBatch, AttentionShape};
    let shape = AttentionShape { heads, kv_heads, head_dim, block_size: 16, scale: 1.0, window: window.unwrap_or(0) };
    let batch = AttentionBatch {
        num_seqs: seqs.len(),
        total_q: seqs.iter().map(|s| s.0).sum(),
        max_q_len: seqs.iter().map(|s| s.0).max().unwrap_or(0),
        max_ctx_len: seqs.iter().map(|s| s.1).max().unwrap_or(0),
        all_decode: seqs.iter().all(|s| s.0 == 1),
        q_start: 0,
        q_len: 0,
        ctx_len: 0,
        bt_start: 0,
        block_tables: 0,
    };
    tm_cuda::kernels::attention::decode_splits(&shape, &batch)
}

/// Split-K decode merged both ways, forced in turn with `set_fused_combine` (labels start with
/// `[fused]` or `[launch]`): the fused combine, where the last split CTA of each (sequence, head
/// group) merges the partials and zeroes its counter, and the two-launch path (`attn_combine`).
/// Batch-1 Llama 3 8B (GQA 4) at 2, 9 and 64 splits, GQA 8 (plain and windowed), GQA 16 (the
/// 16-row kernel with an fp8 cache too), 32 heads on one KV head (two head sub-groups per KV
/// head: two counters per sequence and KV head), head_dim 64 with GQA 7, a batch whose sequences
/// take different split counts (one direct), and a decode + prefill batch; each with the
/// activation-dtype cache and the fp8 cache (the transposed kernel for head_dim 128 and groups
/// up to 8). Each case calls attention twice, and the cases share the backend's counters, so a
/// counter left non-zero breaks the next call. The override is process-wide: other tests
/// running meanwhile may take either path (both are correct).
#[test]
fn attention_decode_split_merge() {
    use tm_cuda::kernels::attention::set_fused_combine;
    // (what, heads, kv_heads, head_dim, window, seqs, splits the default plan makes)
    type SplitCase = (&'static str, usize, usize, usize, Option<usize>, Vec<(usize, usize)>, Option<usize>);
    let batch1 = |ctx| vec![(1, ctx)];
    let cases: Vec<SplitCase> = vec![
        ("GQA 4", 32, 8, 128, None, batch1(100), Some(2)),
        ("GQA 4", 32, 8, 128, None, batch1(550), Some(9)),
        ("GQA 4", 32, 8, 128, None, batch1(4096), Some(64)),
        ("GQA 8", 32, 4, 128, None, batch1(550), Some(9)),
        ("GQA 8", 32, 4, 128, None, batch1(4096), Some(64)),
        ("GQA 8 windowed", 32, 4, 128, Some(1000), batch1(3000), Some(16)),
        ("GQA 16", 32, 2, 128, None, batch1(2000), None),
        ("GQA 32 (two sub-groups)", 32, 1, 64, None, vec![(1, 1500), (1, 700)], None),
        ("GQA 7 head_dim 64", 14, 2, 64, None, batch1(3000), None),
        ("GQA 4 uneven splits", 32, 8, 128, None, vec![(1, 3000), (1, 1), (1, 200), (1, 1300)], None),
        ("GQA 4 decode + prefill", 32, 8, 128, None, vec![(1, 37), (1, 4000), (40, 90), (1, 650)], None),
    ];
    // the expected counts hold for the default plan (TM_ATTN_MIN_PARTITION / _TARGET_CTAS unset)
    let tuned = ["TM_ATTN_MIN_PARTITION", "TM_ATTN_TARGET_CTAS"].iter().any(|v| std::env::var(v).is_ok());
    run("attention_decode_split_merge", &[DType::F16, DType::BF16], |s| {
        for fused in [true, false] {
            set_fused_combine(Some(fused));
            s.tag = if fused { "[fused] ".into() } else { "[launch] ".into() };
            for (what, heads, kv_heads, hd, window, seqs, want) in &cases {
                let splits = decode_splits(*heads, *kv_heads, *hd, *window, seqs);
                if want.is_some_and(|w| w != splits) && !tuned {
                    s.failures.push(format!("[{}] {what}: {splits} splits planned, {want:?} expected", s.dtype));
                }
                if splits < 2 {
                    s.failures.push(format!("[{}] {what}: {splits} split(s): the case tests no merge", s.dtype));
                }
                for fp8 in [false, true] {
                    let a = Attn {
                        heads: *heads,
                        kv_heads: *kv_heads,
                        head_dim: *hd,
                        block_size: 16,
                        window: *window,
                        seqs: seqs.clone(),
                        fp8,
                        twice: true,
                    };
                    attention(s, &format!("decode {what}, {splits} splits"), a);
                }
            }
        }
        set_fused_combine(None);
        s.tag.clear();
    });
}

#[test]
fn elementwise() {
    run("elementwise", &ALL_DTYPES, |s| {
        for src in ALL_DTYPES {
            load_dense_case(s, src, 300, 576);
        }
        for (rows, cols, eps) in [(1, 576, 1e-5), (7, 896, 1e-6), (256, 2048, 1e-5), (3, 4096, 1e-5), (2, 64, 1e-5)] {
            rms_norm(s, rows, cols, cols, eps);
        }
        // Qwen3's per-head q/k norm: one weight of head_dim over every head.
        rms_norm(s, 64, 32 * 128, 128, 1e-6);
        rms_norm(s, 17, 9 * 64, 64, 1e-6);
        for (rows, cols) in [(1, 576), (17, 896), (256, 4096), (5, 2048)] {
            add_rms_norm(s, rows, cols, 1e-5);
        }
        for (rows, cols) in [(1, 1536), (17, 4864), (256, 8192), (3, 14336)] {
            silu_mul(s, rows, cols);
        }
        for (rows, cols) in [(1, 576), (256, 4096), (7, 14336)] {
            add_in_place(s, rows, cols);
        }
        for (rows, cols, picks) in [(256, 576, 17), (64, 4096, 4), (8, 49152, 2), (1, 896, 1)] {
            gather_rows(s, rows, cols, picks);
        }
    });
}

#[test]
fn embedding_lookup() {
    run("embedding_lookup", &ALL_DTYPES, |s| {
        for kind in [Kind::Dense, Kind::Int8(32), Kind::Int4(32)] {
            embedding(s, kind, 49152, 576, &[1, 17, 256]);
        }
        for kind in [Kind::Dense, Kind::Int8(32), Kind::Int4(128)] {
            embedding(s, kind, 8192, 4096, &[64]);
        }
        embedding(s, Kind::Int4(64), 16384, 896, &[7]);
    });
}

#[test]
fn matmul_dense() {
    run("matmul_dense", &ALL_DTYPES, |s| {
        let d = Kind::Dense;
        for (n, rows, cols, bias) in [
            (1, 576, 576, false),
            (3, 192, 576, false),
            (17, 1536, 576, false),
            (256, 576, 1536, false),
            (8, 896, 896, true),
            (64, 128, 896, true),
            (1, 4864, 896, false),
            (17, 896, 4864, false),
            (256, 2048, 2048, false),
            (1, 4096, 4096, false),
            (3, 1024, 4096, true),
            (8, 14336, 4096, false),
            (1, 4096, 14336, false),
            (17, 49152, 576, false),
        ] {
            matmul(s, d, n, rows, cols, bias);
        }
    });
}

#[test]
fn matmul_fused() {
    run("matmul_fused", &ALL_DTYPES, |s| {
        // q/k/v shapes (Llama-3-8B, Qwen2-0.5B, SmolLM2) at decode and prefill sizes.
        for (n, rows, cols, bias) in [
            (1, vec![4096, 1024, 1024], 4096, false),
            (3, vec![896, 128, 128], 896, true),
            (8, vec![576, 192, 192], 576, false),
            (5, vec![200, 72], 104, true),
            (17, vec![512, 128, 128], 512, true),
        ] {
            matmul_many(s, Kind::Dense, n, &rows, cols, bias);
        }
        matmul_many(s, Kind::Int4(32), 1, &[256, 64, 64], 256, false);
        for (n, rows, cols) in [(1, 14336, 4096), (2, 4864, 896), (8, 1536, 576), (6, 100, 64), (17, 1536, 576)] {
            gate_up_silu(s, Kind::Dense, n, rows, cols);
        }
        gate_up_silu(s, Kind::Int4(32), 1, 512, 256);
    });
}

#[test]
fn matmul_int4() {
    run("matmul_int4", &ALL_DTYPES, |s| {
        for (n, rows, cols, g, bias) in [
            (1, 576, 576, 32, false),
            (17, 1536, 576, 32, false),
            (256, 576, 1536, 64, false),
            (3, 896, 896, 128, true),
            (8, 4864, 896, 32, false),
            (64, 2048, 2048, 128, false),
            (1, 4096, 4096, 32, false),
            (17, 1024, 4096, 128, false),
            (3, 14336, 4096, 64, false),
            (1, 4096, 14336, 128, false),
            (8, 49152, 576, 32, false),
        ] {
            matmul(s, Kind::Int4(g), n, rows, cols, bias);
        }
    });
}

/// The int4 decode kernels (`q4_gemv.cu`, tensor cores, f16/bf16 only; f32 keeps the CUDA-core
/// GEMV): every batch size 1..=8, group sizes 32/64/128, rows that are not a multiple of the
/// 32-row CTA tile (nor of 16), Llama-3-8B column counts and small odd multiples of 32 columns
/// (a partial last 128-column step), single products with and without bias, q/k/v-like
/// `matmul_many` with three weights, and the fused gate/up/SiLU.
#[test]
fn matmul_int4_decode() {
    run("matmul_int4_decode", &[DType::F16, DType::BF16], |s| {
        for (n, rows, cols, g, bias) in [
            (1, 4096, 4096, 128, false),
            (1, 4096, 14336, 128, false),
            (1, 100, 96, 32, true),
            (2, 1000, 160, 32, false),
            (2, 4096, 4096, 64, false),
            (3, 1024, 4096, 32, true),
            (3, 47, 224, 32, false),
            (4, 4097, 4096, 64, false),
            (4, 16, 32, 32, false),
            (5, 77, 320, 64, true),
            (5, 1024, 14336, 128, false),
            (6, 33, 384, 128, false),
            (6, 2000, 4096, 128, false),
            (7, 33, 640, 128, false),
            (7, 15, 1056, 32, true),
            (8, 4096, 14336, 128, false),
            (8, 31, 224, 32, false),
            (8, 14336, 4096, 128, false),
        ] {
            matmul(s, Kind::Int4(g), n, rows, cols, bias);
        }
        for (n, rows, cols, g, bias) in [
            (1, vec![4096, 1024, 1024], 4096, 128, false),
            (4, vec![4096, 1024, 1024], 4096, 128, false),
            (8, vec![4096, 1024, 1024], 4096, 128, false),
            (3, vec![200, 72, 40], 192, 64, true),
            (8, vec![96, 32, 33], 96, 32, true),
            (2, vec![17, 300], 640, 128, false),
            (5, vec![256], 384, 128, true),
        ] {
            matmul_many(s, Kind::Int4(g), n, &rows, cols, bias);
        }
        for (n, rows, cols, g) in [
            (1, 14336, 4096, 128),
            (2, 33, 192, 64),
            (3, 1000, 640, 128),
            (4, 100, 224, 32),
            (6, 17, 96, 32),
            (8, 14336, 4096, 128),
            (8, 1000, 640, 128),
        ] {
            gate_up_silu(s, Kind::Int4(g), n, rows, cols);
        }
    });
}

/// Every variant of the int4 decode kernels forced in turn (`q4_gemv::set_unroll`; the labels
/// start with the variant's name): the 8B q/k/v, o, down and gate/up shapes at n = 1 and 8 and
/// tp = 2 halves (which the lean kernels take; they fall back on the others), and odd shapes (row tails, partial steps, group 32/64, three weights with biases, K long enough
/// for the step ring to wrap). Twice: weights row-major, then as the backend stores them (the
/// lean shapes tile-major, which every variant then reads with the lean kernels).
#[test]
fn matmul_int4_decode_variants() {
    use tm_cuda::kernels::q4_gemv::{set_tiling, set_unroll, Unroll};
    let _serial = decode_variant_lock();
    run("matmul_int4_decode_variants", &[DType::F16, DType::BF16], |s| {
        for (u, tiling) in [false, true].into_iter().flat_map(|t| Unroll::ALL.map(|u| (u, t))) {
            set_unroll(Some(u));
            set_tiling(Some(tiling));
            s.tag = format!("[{}{}] ", u.name(), if tiling { " tiles" } else { "" });
            for (n, rows, cols, g, bias) in [
                (1, 4096, 4096, 128, false),
                (8, 4096, 14336, 128, false),
                (1, 4096, 14336, 64, true),
                (2, 4096, 7168, 128, true),
                (3, 47, 224, 32, false),
                (5, 77, 4416, 64, true),
                (7, 15, 1056, 32, true),
            ] {
                matmul(s, Kind::Int4(g), n, rows, cols, bias);
            }
            for (n, rows, cols, g, bias) in [
                (1, vec![4096, 1024, 1024], 4096, 128, false),
                (8, vec![4096, 1024, 1024], 4096, 128, true),
                (3, vec![200, 72, 40], 192, 64, true),
            ] {
                matmul_many(s, Kind::Int4(g), n, &rows, cols, bias);
            }
            // SiLU kernels exist for u2, u4, pf, ln and ln4 only (the others launch one of those).
            if u.has_silu_form() {
                for (n, rows, cols, g) in
                    [(1, 14336, 4096, 128), (4, 7168, 4096, 128), (8, 1000, 640, 128), (2, 33, 4480, 32)]
                {
                    gate_up_silu(s, Kind::Int4(g), n, rows, cols);
                }
            }
        }
        set_unroll(None);
        set_tiling(None);
        s.tag.clear();
    });
}

/// An int4 matmul through each prefill kernel in turn: the w4a16 GEMM with every tile shape
/// forced (`q4_gemm::set_policy`), its automatic choice, and the older tiled kernel, each
/// against one exact host product. Shapes the GEMM refuses (f32, `cols % 64 != 0`,
/// `rows % 8 != 0`) take the tiled kernel under every policy, so this also checks the fallback.
fn matmul_q4_policies(s: &mut Suite, n: usize, rows: usize, cols: usize, group: usize) {
    use tm_cuda::kernels::q4_gemm::{set_policy, Policy, Tile};
    let _serial = prefill_policy_lock();
    s.case(format!("matmul_q4 prefill kernels x[{n}, {cols}] · W[{rows}, {cols}]ᵀ g{group}"), |c| {
        let xs = c.activations(n * cols, 1.0);
        let w = c.weight(Kind::Int4(group), rows, cols, (3.0 / cols as f32).sqrt())?;
        let x = c.act(&[n, cols], &xs)?;
        let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
        let mut want = vec![0f32; n * rows];
        tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host exact int4 matmul")?;
        // Every tile forced, then the automatic choice and the older kernel.
        for p in Tile::ALL.map(Policy::Force).into_iter().chain([Policy::Auto, Policy::Off]) {
            let mut out = c.output(&[n, rows])?;
            set_policy(Some(p));
            let ran = c.gpu.matmul(&x.gpu, &w.gpu, None, &mut out.gpu);
            set_policy(None);
            ran.ctx(format!("cuda matmul ({p:?})"))?;
            c.check(&format!("out {p:?}"), &out.gpu, &want, rows, 1.0)?;
        }
        Ok(())
    });
}

/// The w4a16 prefill GEMM (`q4_gemm.cu`) on Llama-3-8B-like and odd shapes: partial tiles in
/// both `n` and `rows`, k-loops shorter than the pipeline, groups 32/64/96/128; and shapes it
/// refuses, which must fall back to the tiled kernel.
#[test]
fn matmul_int4_gemm() {
    run("matmul_int4_gemm", &ALL_DTYPES, |s| {
        for (n, rows, cols, g) in [
            (9, 4096, 4096, 128),
            (9, 14336, 4096, 32),
            (16, 4096, 14336, 128),
            (64, 1024, 4096, 64),
            (127, 1032, 576, 64),
            (256, 2048, 2048, 128),
            (1000, 520, 896, 32),
            (300, 4104, 192, 64),
            (33, 256, 64, 32),
            (200, 384, 128, 128),
            (129, 264, 320, 32),
            (48, 512, 192, 96),
            // Refused by the GEMM: cols % 64 != 0, rows % 8 != 0.
            (100, 1000, 4064, 32),
            (40, 1001, 512, 128),
            (9, 100, 96, 32),
        ] {
            matmul_q4_policies(s, n, rows, cols, g);
        }
    });
}

/// Every int4 decode variant right after a kernel that writes its input, under programmatic
/// dependent launch (sm_90): `add_rms_norm`, which lets its dependents launch first thing, writes
/// x, then the product reads it; 32 rounds, each from its own residual and delta, queued without a
/// sync. A kernel that loaded x above its `pdl_wait` could read an earlier round's x: ptxas had
/// hoisted the `__ldg` x loads of q4_gemv.cu's u2 and x-prefetching kernels there (they are `__ldca`
/// now). On the H200 this test passed with those kernels too (the norm is done before the product's
/// first blocks run), so the guard against the hoisting itself is `scripts/check_pdl_order.py` on
/// the SASS; this test checks the variants' results behind a kernel-written input.
#[test]
fn matmul_int4_reads_x_after_the_wait() {
    use tm_cuda::kernels::q4_gemv::{set_unroll, Unroll};
    let _serial = decode_variant_lock();
    run("matmul_int4_reads_x_after_the_wait", &[DType::F16, DType::BF16], |s| {
        for u in Unroll::ALL {
            set_unroll(Some(u));
            s.tag = format!("[{}] ", u.name());
            for (rows, cols, silu) in [(4096, 4096, false), (1024, 4096, true), (200, 640, false), (1000, 640, true)] {
                if !silu || u.has_silu_form() {
                    product_after_norm(s, rows, cols, silu);
                }
            }
        }
        set_unroll(None);
        s.tag.clear();
    });
}

/// One case of [`matmul_int4_reads_x_after_the_wait`]: `add_rms_norm` then the int4 product (or
/// `gate_up_silu` of two int4 weights) of its output, round after round, against the CPU.
fn product_after_norm(s: &mut Suite, rows: usize, cols: usize, silu: bool) {
    const ROUNDS: usize = 32;
    let what = if silu { "gate_up_silu" } else { "matmul" };
    s.case(format!("{what} of add_rms_norm's output, {ROUNDS} rounds, W[{rows}, {cols}]"), |c| {
        let scale = (3.0 / cols as f32).sqrt();
        let g = c.weight(Kind::Int4(128), rows, cols, scale)?;
        let u = c.weight(Kind::Int4(128), rows, cols, scale)?;
        let nw = c.activations(cols, 1.0);
        let norm = c.dense(&[cols], &nw)?;
        let mut x = c.output(&[1, cols])?;
        let (mut gs, mut us) = (c.output(&[1, rows])?, c.output(&[1, rows])?);
        let mut rounds = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let (r, d) = (c.activations(cols, 1.0), c.activations(cols, 1.0));
            rounds.push((c.act(&[1, cols], &r)?, c.act(&[1, cols], &d)?, c.output(&[1, rows])?));
        }
        for (resid, delta, out) in &mut rounds {
            c.gpu.add_rms_norm(&delta.gpu, &mut resid.gpu, &norm.gpu, 1e-5, &mut x.gpu).ctx("cuda add_rms_norm")?;
            c.cpu.add_rms_norm(&delta.cpu, &mut resid.cpu, &norm.cpu, 1e-5, &mut x.cpu).ctx("cpu add_rms_norm")?;
            if silu {
                c.gpu.gate_up_silu(&x.gpu, &g.gpu, &u.gpu, &mut gs.gpu, &mut us.gpu, &mut out.gpu).ctx("cuda silu")?;
                c.cpu.matmul(&x.cpu, &g.cpu, None, &mut gs.cpu).ctx("cpu gate")?;
                c.cpu.matmul(&x.cpu, &u.cpu, None, &mut us.cpu).ctx("cpu up")?;
                c.cpu.silu_mul(&gs.cpu, &us.cpu, &mut out.cpu).ctx("cpu silu_mul")?;
            } else {
                c.gpu.matmul(&x.gpu, &g.gpu, None, &mut out.gpu).ctx("cuda matmul")?;
                c.cpu.matmul(&x.cpu, &g.cpu, None, &mut out.cpu).ctx("cpu matmul")?;
            }
        }
        for (i, (_, _, out)) in rounds.iter().enumerate() {
            let want = c.cpu.download_f32(&out.cpu).ctx("cpu download")?;
            // x is rounded to the dtype on the GPU only; the SiLU form rounds its two products too.
            c.check(&format!("round {i}"), &out.gpu, &want, rows, if silu { 3.0 } else { 2.0 })?;
        }
        Ok(())
    });
}

/// Deferred residual joins (`matmul_add_rms_norm_deferred` and the ops that fold the row scale),
/// against the CPU's product, `add_rms_norm` and plain ops: o (int4) with its join into
/// gate/up/SiLU (int4 weights: the scale folded into the kernel; dense ones: the norm finished in
/// place first, after which the join's output must equal the CPU's `add_rms_norm`), and down with
/// its join into q/k/v with RoPE and the cache write (folded). The CUDA backend must defer both
/// joins and fold into the fused q/k/v kernel (int4 decode shapes).
#[test]
fn deferred_rms_norm() {
    let _serial = decode_variant_lock(); // the automatic kernel choice (fused q/k/v + RoPE)
    run("deferred_rms_norm", &[DType::F16, DType::BF16], |s| {
        for n in [1, 3, 8] {
            deferred_joins(s, n);
        }
    });
}

/// One case of [`deferred_rms_norm`] with `n` decode rows.
fn deferred_joins(s: &mut Suite, n: usize) {
    const EPS: f32 = 1e-5;
    let (hidden, inter, heads, kv_heads, hd) = (1024, 2048, 8, 2, 128);
    s.case(format!("deferred joins x[{n}, {hidden}]: o -> gate/up/SiLU, down -> q/k/v + RoPE"), |c| {
        let sc = |cols: usize| (3.0 / cols as f32).sqrt();
        let o = c.weight(Kind::Int4(128), hidden, hidden, sc(hidden))?;
        let down = c.weight(Kind::Int4(128), hidden, inter, sc(inter))?;
        let g = c.weight(Kind::Int4(128), inter, hidden, 3.0 * sc(hidden))?;
        let u = c.weight(Kind::Int4(128), inter, hidden, sc(hidden))?;
        let gd = c.weight(Kind::Dense, inter, hidden, 3.0 * sc(hidden))?;
        let ud = c.weight(Kind::Dense, inter, hidden, sc(hidden))?;
        let rows = [heads * hd, kv_heads * hd, kv_heads * hd];
        let mut qkv_w = Vec::new();
        for &r in &rows {
            qkv_w.push(c.weight(Kind::Int4(128), r, hidden, sc(hidden))?);
        }
        let (nm, na) = (c.activations(hidden, 1.0), c.activations(hidden, 1.0));
        let (mlp_norm, attn_norm) = (c.dense(&[hidden], &nm)?, c.dense(&[hidden], &na)?);
        let (r0, x_o, x_d) =
            (c.activations(n * hidden, 1.0), c.activations(n * hidden, 1.0), c.activations(n * inter, 1.0));
        let mut resid = c.act(&[n, hidden], &r0)?;
        let (x_o, x_d) = (c.act(&[n, hidden], &x_o)?, c.act(&[n, inter], &x_d)?);
        let (mut normed, mut normed2, mut delta) =
            (c.output(&[n, hidden])?, c.output(&[n, hidden])?, c.output(&[n, hidden])?);
        let mut sums = c.gpu.zeros(TensorDesc::new(DType::F32, &[2, 16]), "test").ctx("cuda zeros")?;
        c.gpu.fill_zero(&mut sums).ctx("cuda fill_zero")?;

        // o and its join into the MLP (slot 0).
        let deferred = c
            .gpu
            .matmul_add_rms_norm_deferred(
                &x_o.gpu,
                &o.gpu,
                &mut resid.gpu,
                &mlp_norm.gpu,
                EPS,
                &mut normed.gpu,
                &mut sums,
                0,
            )
            .ctx("cuda deferred join (o)")?;
        c.cpu.matmul(&x_o.cpu, &o.cpu, None, &mut delta.cpu).ctx("cpu o")?;
        c.cpu.add_rms_norm(&delta.cpu, &mut resid.cpu, &mlp_norm.cpu, EPS, &mut normed.cpu).ctx("cpu join")?;
        if !deferred {
            c.problems.push("the CUDA backend did not defer o's join".into());
            return Ok(());
        }
        let want = c.cpu.download_f32(&resid.cpu).ctx("cpu download")?;
        c.check("residual after o's join", &resid.gpu, &want, hidden, 2.0)?;
        let (mut gs, mut us) = (c.output(&[n, inter])?, c.output(&[n, inter])?);
        let (mut act, mut act_d) = (c.output(&[n, inter])?, c.output(&[n, inter])?);
        {
            let d = DeferredNorm { sums: &sums, slot: 0, eps: EPS };
            c.gpu
                .gate_up_silu_deferred(&mut normed.gpu, &d, &g.gpu, &u.gpu, &mut gs.gpu, &mut us.gpu, &mut act.gpu)
                .ctx("cuda gate/up (int4, folded)")?;
            c.gpu
                .gate_up_silu_deferred(&mut normed.gpu, &d, &gd.gpu, &ud.gpu, &mut gs.gpu, &mut us.gpu, &mut act_d.gpu)
                .ctx("cuda gate/up (dense: finished first)")?;
        }
        for (w_g, w_u, out, what) in
            [(&g, &u, &mut act, "gate/up/SiLU int4 (folded)"), (&gd, &ud, &mut act_d, "gate/up/SiLU dense")]
        {
            c.cpu.matmul(&normed.cpu, &w_g.cpu, None, &mut gs.cpu).ctx("cpu gate")?;
            c.cpu.matmul(&normed.cpu, &w_u.cpu, None, &mut us.cpu).ctx("cpu up")?;
            c.cpu.silu_mul(&gs.cpu, &us.cpu, &mut out.cpu).ctx("cpu silu_mul")?;
            let want = c.cpu.download_f32(&out.cpu).ctx("cpu download")?;
            c.check(what, &out.gpu, &want, inter, 3.0)?;
        }
        let want = c.cpu.download_f32(&normed.cpu).ctx("cpu download")?;
        c.check("the join's output finished in place", &normed.gpu, &want, hidden, 2.0)?;

        // down and its join into the next layer's attention (slot 1), then q/k/v with RoPE.
        let deferred = c
            .gpu
            .matmul_add_rms_norm_deferred(
                &x_d.gpu,
                &down.gpu,
                &mut resid.gpu,
                &attn_norm.gpu,
                EPS,
                &mut normed2.gpu,
                &mut sums,
                1,
            )
            .ctx("cuda deferred join (down)")?;
        c.cpu.matmul(&x_d.cpu, &down.cpu, None, &mut delta.cpu).ctx("cpu down")?;
        c.cpu.add_rms_norm(&delta.cpu, &mut resid.cpu, &attn_norm.cpu, EPS, &mut normed2.cpu).ctx("cpu join")?;
        if !deferred {
            c.problems.push("the CUDA backend did not defer down's join".into());
            return Ok(());
        }
        let freqs = rope_configs(hd)[0].cfg.freqs(20_000);
        let positions: Vec<u32> = (0..n).map(|_| c.gen.below(20_001) as u32).collect();
        let (bs, blocks) = (16, n + 2);
        let slots: Vec<u32> = c.gen.permutation(blocks * bs)[..n].to_vec();
        let kv_dim = kv_heads * hd;
        let shape = [blocks, bs, kv_heads, hd];
        let (k_img, v_img) = (vec![JUNK_K; blocks * bs * kv_dim], vec![JUNK_V; blocks * bs * kv_dim]);
        let (mut kc, mut vc) = (c.act(&shape, &k_img)?, c.act(&shape, &v_img)?);
        let mut outs = Vec::new();
        for &r in &rows {
            outs.push(c.output(&[n, r])?);
        }
        let before = tm_cuda::kernels::q4_gemv::rope_launches();
        {
            let d = DeferredNorm { sums: &sums, slot: 1, eps: EPS };
            let gw = [&qkv_w[0].gpu, &qkv_w[1].gpu, &qkv_w[2].gpu];
            let [o0, o1, o2] = &mut outs[..] else { unreachable!() };
            let qkv = [&mut o0.gpu, &mut o1.gpu, &mut o2.gpu];
            c.gpu
                .qkv_rope_write_kv_deferred(
                    &mut normed2.gpu,
                    &d,
                    gw,
                    [None; 3],
                    qkv,
                    &mut kc.gpu,
                    &mut vc.gpu,
                    &positions,
                    &freqs,
                    &slots,
                )
                .ctx("cuda q/k/v + RoPE (folded)")?;
            let cw = [&qkv_w[0].cpu, &qkv_w[1].cpu, &qkv_w[2].cpu];
            let qkv = [&mut o0.cpu, &mut o1.cpu, &mut o2.cpu];
            c.cpu
                .qkv_rope_write_kv(
                    &normed2.cpu,
                    cw,
                    [None; 3],
                    qkv,
                    &mut kc.cpu,
                    &mut vc.cpu,
                    &positions,
                    &freqs,
                    &slots,
                )
                .ctx("cpu qkv_rope_write_kv")?;
        }
        if tm_cuda::kernels::q4_gemv::rope_launches() == before {
            c.problems.push("the q/k/v of a deferred join did not run the fused RoPE kernel".into());
        }
        for (i, what) in ["q", "k", "v"].iter().enumerate() {
            let want = c.cpu.download_f32(&outs[i].cpu).ctx("cpu download")?;
            c.check(what, &outs[i].gpu, &want, hd, 3.0)?;
        }
        let want = c.cpu.download_f32(&kc.cpu).ctx("cpu download")?;
        c.check("k cache", &kc.gpu, &want, hd, 3.0)?;
        let want = c.cpu.download_f32(&vc.cpu).ctx("cpu download")?;
        c.check("v cache", &vc.gpu, &want, hd, 3.0)
    });
}

/// Held while a test forces an int4 decode kernel (`q4_gemv::set_unroll`, process-wide) and by
/// tests that expect the automatic choice.
fn decode_variant_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the device the tests run on (`TM_CUDA_DEVICE`, default 0) is an sm_90 one, where the
/// wgmma prefill kernels (split-K, grouped launches) must have run.
fn on_sm90() -> bool {
    let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0usize);
    tm_cuda::probe()
        .map(|ds| ds.iter().any(|d| d.ordinal == ordinal && d.compute_capability == (9, 0)))
        .unwrap_or(false)
}

/// Held while a test forces a prefill kernel (`q4_gemm::set_policy`, `tm_cuda::set_slab_policy`:
/// process-wide switches), so tests running in parallel do not switch each other's kernels.
fn prefill_policy_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// An int4 matmul through the large-batch slab path (dequantize a slab of rows, cuBLASLt into
/// the output's columns; `tm_core::q4_slab`) forced with a slab budget of `budget` bytes, so
/// small budgets give several slabs and a short last one; and through the fused kernels with
/// the slab path off. Both against one exact host product. The process-wide slab counter must
/// move for the slab run, so a silent fallback cannot pass for the slab path.
fn matmul_q4_slab(s: &mut Suite, n: usize, rows: usize, cols: usize, group: usize, budget: usize, bias: bool) {
    use tm_core::q4_slab::{slab_rows, SlabPolicy};
    let b = if bias { " + bias" } else { "" };
    let per = slab_rows(rows, cols, 2, budget.min(tm_core::q4_slab::SLAB_BYTES)).unwrap_or(0);
    let label = format!("matmul_q4 slabs of {per} rows x[{n}, {cols}] · W[{rows}, {cols}]ᵀ g{group}{b}");
    s.case(label, |c| {
        let xs = c.activations(n * cols, 1.0);
        let w = c.weight(Kind::Int4(group), rows, cols, (3.0 / cols as f32).sqrt())?;
        let x = c.act(&[n, cols], &xs)?;
        let bias = if bias {
            let v = c.normal(rows, 0.5);
            Some((c.dense(&[rows], &v)?, v))
        } else {
            None
        };
        let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
        let mut want = vec![0f32; n * rows];
        tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host exact int4 matmul")?;
        if let Some((_, bv)) = &bias {
            for row in want.chunks_mut(rows) {
                row.iter_mut().zip(bv).for_each(|(o, b)| *o += b);
            }
        }
        let on = SlabPolicy { enabled: true, min_tokens: 1 };
        let off = SlabPolicy { enabled: false, min_tokens: 1 };
        let _serial = prefill_policy_lock();
        for (name, policy) in [("slabs", on), ("fused", off)] {
            tm_cuda::set_slab_policy(Some((policy, budget)));
            let before = tm_cuda::slab_products();
            let ran = c.gpu.reserve_matmul_scratch(n).and_then(|_| {
                let mut out = c.output(&[n, rows]).map_err(tm_core::Error::invalid)?;
                c.gpu.matmul(&x.gpu, &w.gpu, bias.as_ref().map(|b| &b.0.gpu), &mut out.gpu)?;
                Ok(out)
            });
            let after = tm_cuda::slab_products();
            tm_cuda::set_slab_policy(None);
            let out = ran.ctx(format!("cuda matmul ({name})"))?;
            if name == "slabs" && after == before {
                c.problems.push("the slab path was forced but did not run".into());
            }
            c.check(&format!("out {name}"), &out.gpu, &want, rows, 1.0)?;
        }
        Ok(())
    });
}

/// Int4 slab products queued from several threads at once on one backend (as these tests share
/// one per dtype, and as a library user may): every thread's output must match its own exact host
/// product. The slabs of one product share the backend's one slab buffer, so products from two
/// threads must not interleave on the stream (before the fix, ~5% of the outputs were wrong).
fn matmul_q4_slab_threads(s: &mut Suite, threads: usize, n: usize, rows: usize, cols: usize) {
    const REPEATS: usize = 4;
    let label = format!("matmul_q4 slabs from {threads} threads at once, {REPEATS} products each: x[{n}, {cols}] · W[{rows}, {cols}]ᵀ g128");
    s.case(label, |c| {
        let w = c.weight(Kind::Int4(128), rows, cols, (3.0 / cols as f32).sqrt())?;
        let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
        let mut inputs = Vec::new();
        for _ in 0..threads {
            let xs = c.activations(n * cols, 1.0);
            let mut want = vec![0f32; n * rows];
            tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host exact int4 matmul")?;
            inputs.push((c.act(&[n, cols], &xs)?, c.output(&[n, rows])?, want));
        }
        let on = tm_core::q4_slab::SlabPolicy { enabled: true, min_tokens: 1 };
        let _serial = prefill_policy_lock();
        // a small budget: several slabs per product, so interleaved products would overwrite
        // each other's slab between its dequantization and its product
        tm_cuda::set_slab_policy(Some((on, 1 << 20)));
        let before = tm_cuda::slab_products();
        let gpu = c.gpu;
        let ran: Vec<tm_core::Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = inputs
                .iter_mut()
                .map(|(x, out, _)| {
                    let (x, out, w) = (&x.gpu, &mut out.gpu, &w.gpu);
                    scope.spawn(move || {
                        gpu.reserve_matmul_scratch(n)?;
                        (0..REPEATS).try_for_each(|_| gpu.matmul(x, w, None, out))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(tm_core::Error::invalid("thread panicked"))))
                .collect()
        });
        let products = tm_cuda::slab_products() - before;
        tm_cuda::set_slab_policy(None);
        for r in ran {
            r.ctx("cuda matmul from a thread")?;
        }
        if products < (threads * REPEATS) as u64 {
            c.problems.push(format!("{products} slab products counted, {} expected", threads * REPEATS));
        }
        for (t, (_, out, want)) in inputs.iter().enumerate() {
            c.check(&format!("out of thread {t}"), &out.gpu, want, rows, 1.0)?;
        }
        Ok(())
    });
}

/// The large-batch int4 slab path (f16/bf16; f32 never takes it): 512, 1500 and 2048 tokens,
/// groups 64/128, one whole-matrix slab, Llama-3-8B's down projection in two default-budget
/// slabs, and small budgets whose row counts do not divide the matrix (short last slab, a
/// matrix of fewer rows than a slab); then q/k/v-like `matmul_many` and the gate/up/SiLU with
/// the path forced (their fallbacks run one product at a time through it).
#[test]
fn matmul_int4_slab() {
    run("matmul_int4_slab", &[DType::F16, DType::BF16], |s| {
        for (n, rows, cols, g, budget, bias) in [
            (512, 4096, 4096, 128, 64 << 20, false),
            (512, 4096, 14336, 128, 64 << 20, false),
            (1500, 1000, 1024, 64, 256 << 10, true),
            (1500, 300, 640, 64, 160 << 10, false),
            (1500, 100, 640, 128, 64 << 20, false),
            (2048, 4104, 4096, 128, 2 << 20, false),
            (2048, 6144, 4096, 64, 16 << 20, false),
        ] {
            matmul_q4_slab(s, n, rows, cols, g, budget, bias);
        }
        let on = tm_core::q4_slab::SlabPolicy { enabled: true, min_tokens: 1 };
        let serial = prefill_policy_lock();
        tm_cuda::set_slab_policy(Some((on, 1 << 20)));
        let reserved = s.gpu.reserve_matmul_scratch(512);
        if let Err(e) = reserved {
            s.failures.push(format!("[{}] reserve_matmul_scratch(512): {e}", s.dtype));
        }
        matmul_many(s, Kind::Int4(64), 600, &[1024, 256, 200], 1024, true);
        gate_up_silu(s, Kind::Int4(128), 512, 1000, 1024);
        tm_cuda::set_slab_policy(None);
        drop(serial);
        matmul_q4_slab_threads(s, 4, 512, 2048, 4096);
    });
}

/// The sm_90a prefill GEMM's split-K (`q4_gemm::split_k`): products whose grids fill at most
/// half of the SMs cut K into slices whose f32 partial sums, kept in the int4 slab buffer
/// (reserved here), `matmul_q4_gemm_reduce` adds up. k/v-, q/o- and down-like shapes at 16 to 100
/// tokens, slices starting inside a group (group 96) and a short last slice (640 columns), each
/// wgmma tile forced and the automatic choice, against the exact host product. On an sm_90
/// device the split counter must move for every product, so a silent fallback cannot pass.
#[test]
fn matmul_int4_split_k() {
    use tm_cuda::kernels::q4_gemm::{set_policy, split_products, Policy, Tile};
    let hopper = on_sm90();
    let _serial = prefill_policy_lock();
    run("matmul_int4_split_k", &[DType::F16, DType::BF16], |s| {
        if let Err(e) = s.gpu.reserve_matmul_scratch(tm_core::q4_slab::DEFAULT_MIN_TOKENS) {
            s.failures.push(format!("[{}] reserve_matmul_scratch: {e}", s.dtype));
            return;
        }
        for (n, rows, cols, g) in [
            (64, 1024, 4096, 128),
            (16, 4096, 14336, 128),
            (64, 512, 1536, 96),
            (40, 2048, 4096, 32),
            (100, 1032, 4096, 64),
            (9, 256, 640, 128),
        ] {
            s.case(format!("split-K x[{n}, {cols}] · W[{rows}, {cols}]ᵀ g{g}"), |c| {
                let xs = c.activations(n * cols, 1.0);
                let w = c.weight(Kind::Int4(g), rows, cols, (3.0 / cols as f32).sqrt())?;
                let x = c.act(&[n, cols], &xs)?;
                let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
                let mut want = vec![0f32; n * rows];
                tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host exact int4 matmul")?;
                let k128 = g % 128 == 0;
                // The automatic choice, then every wgmma tile forced.
                let wgmma = Tile::ALL.into_iter().filter(|t| t.wgmma()).map(Policy::Force);
                for p in std::iter::once(Policy::Auto).chain(wgmma) {
                    let mut out = c.output(&[n, rows])?;
                    let before = split_products();
                    set_policy(Some(p));
                    let ran = c.gpu.matmul(&x.gpu, &w.gpu, None, &mut out.gpu);
                    set_policy(None);
                    ran.ctx(format!("cuda matmul ({p:?})"))?;
                    if hopper && split_products() == before && (k128 || p != Policy::Force(Tile::WgmmaK128)) {
                        c.problems.push(format!("{p:?}: the product did not run split"));
                    }
                    c.check(&format!("out {p:?}"), &out.gpu, &want, rows, 1.0)?;
                }
                Ok(())
            });
        }
    });
}

/// Decode batches above the GEMV's (9 to 64 tokens): q/k/v-like `matmul_many` and gate/up as one
/// launch of the sm_90a prefill GEMM each (`quant::matmul_q4_grouped`), against the CPU's
/// separate products: the 8B shapes, odd ones with biases, group 128 (the 128-column k-tile
/// shape) and 64 / 32 (the others), without and then with the slab buffer reserved (split-K over
/// all the launch's weights); 65 tokens stay per weight. On an sm_90 device the grouped-launch
/// counter must move for every call up to 64 tokens, so a silent fallback cannot pass.
#[test]
fn matmul_int4_grouped() {
    use tm_cuda::kernels::q4_gemm::grouped_launches;
    let hopper = on_sm90();
    let _serial = prefill_policy_lock();
    run("matmul_int4_grouped", &[DType::F16, DType::BF16], |s| {
        for reserved in [false, true] {
            if reserved {
                if let Err(e) = s.gpu.reserve_matmul_scratch(tm_core::q4_slab::DEFAULT_MIN_TOKENS) {
                    s.failures.push(format!("[{}] reserve_matmul_scratch: {e}", s.dtype));
                    return;
                }
            }
            s.tag = if reserved { "[split] ".into() } else { String::new() };
            let expect = |s: &mut Suite, n: usize, what: &str, before: u64| {
                if hopper && n <= 64 && grouped_launches() == before {
                    s.failures.push(format!("[{}] {what} at n = {n} did not run as one launch", s.dtype));
                }
            };
            for (n, rows, cols, g, bias) in [
                (9, vec![4096, 1024, 1024], 4096, 128, true),
                (64, vec![4096, 1024, 1024], 4096, 128, false),
                (40, vec![1000, 256, 256], 640, 64, true),
                (16, vec![512, 128], 1024, 32, false),
                (33, vec![136, 8, 1032], 384, 128, true),
                (65, vec![1024, 256, 256], 1024, 128, false),
            ] {
                let before = grouped_launches();
                matmul_many(s, Kind::Int4(g), n, &rows, cols, bias);
                expect(s, n, "matmul_many", before);
            }
            for (n, rows, cols, g) in [(64, 14336, 4096, 128), (33, 1000, 640, 128), (17, 2048, 1024, 64)] {
                let before = grouped_launches();
                gate_up_silu(s, Kind::Int4(g), n, rows, cols);
                expect(s, n, "gate_up_silu", before);
            }
        }
        s.tag.clear();
    });
}

#[test]
fn matmul_int8() {
    run("matmul_int8", &ALL_DTYPES, |s| {
        for (n, rows, cols, g, bias) in [
            (1, 576, 576, 32, false),
            (17, 49152, 576, 32, false),
            (64, 896, 896, 32, true),
            (256, 2048, 2048, 32, false),
            (3, 4096, 4096, 32, false),
            (8, 14336, 4096, 128, false),
            (1, 4096, 14336, 32, false),
        ] {
            matmul(s, Kind::Int8(g), n, rows, cols, bias);
        }
    });
}

#[test]
fn rope_rotations() {
    run("rope_rotations", &ALL_DTYPES, |s| {
        for r in rope_configs(128) {
            rope(s, &r, 17, 32, 128, 32767);
            rope(s, &r, 1, 8, 128, 131071);
        }
        for r in rope_configs(64) {
            rope(s, &r, 256, 9, 64, 8191);
        }
        let fixture = rope_configs(16);
        rope(s, &fixture[0], 5, 4, 16, 100);
        let qwen3 = rope_configs(32);
        rope(s, &qwen3[1], 5, 2, 32, 100);
    });
}

/// The fused RoPE + KV-cache write (`rope_write_kv`) against the CPU's `rope`, `rope`,
/// `write_kv` and, bit for bit, against the CUDA backend's own separate kernels: decode (1 token)
/// and short chunks (7 tokens), GQA 1/4/7, block sizes 16 and 64, positions away from 0 and
/// across block edges, both pair layouts, a scaled attention factor, caches in the activation
/// dtype and in FP8 E4M3; 130 tokens for the prefill grid (one block per token).
#[test]
fn rope_write_kv_fused() {
    run("rope_write_kv_fused", &ALL_DTYPES, |s| {
        let a = |heads, kv_heads, head_dim, block_size, tokens, first, fp8| RopeKv {
            heads,
            kv_heads,
            head_dim,
            block_size,
            tokens,
            first,
            fp8,
        };
        let r128 = rope_configs(128);
        let r64 = rope_configs(64);
        for fp8 in [false, true] {
            // Llama 3 8B: GQA 4, interleaved llama3 scaling / rotate-half plain.
            rope_write_kv(s, &r128[2], a(32, 8, 128, 16, 1, 1000, fp8));
            rope_write_kv(s, &r128[2], a(32, 8, 128, 64, 7, 61, fp8));
            rope_write_kv(s, &r128[0], a(32, 8, 128, 16, 7, 13, fp8));
            // Qwen2 0.5B (GQA 7), yarn with an attention factor.
            rope_write_kv(s, &r64[3], a(14, 2, 64, 64, 1, 4095, fp8));
            rope_write_kv(s, &r64[4], a(14, 2, 64, 16, 7, 30000, fp8));
            // No GQA; a long position.
            rope_write_kv(s, &r128[1], a(8, 8, 128, 16, 7, 131_000, fp8));
            // The fixtures' head sizes (16 and 32); head_dim 40 (rows that are not a multiple of
            // 16 elements, a block holding both query and key heads).
            rope_write_kv(s, &rope_configs(16)[0], a(4, 2, 16, 16, 7, 5, fp8));
            rope_write_kv(s, &rope_configs(32)[1], a(4, 1, 32, 64, 1, 100, fp8));
            rope_write_kv(s, &rope_configs(40)[5], a(5, 5, 40, 16, 7, 33, fp8));
            // A prefill chunk: one block per token.
            rope_write_kv(s, &r64[0], a(9, 3, 64, 64, 130, 200, fp8));
        }
    });
}

#[test]
fn qkv_rope_write_kv_fused() {
    let _serial = decode_variant_lock();
    // The fused kernel reads row-major weights; tile-major ones take the composition (last case).
    tm_cuda::kernels::q4_gemv::set_tiling(Some(false));
    run("qkv_rope_write_kv_fused", &ALL_DTYPES, |s| {
        let a = |heads, kv_heads, head_dim, cols, n, bias, fused| QkvRope {
            heads,
            kv_heads,
            head_dim,
            cols,
            group: 128,
            n,
            bias,
            fused,
        };
        let (r128, r64) = (rope_configs(128), rope_configs(64));
        // Llama-3-8B decode: rotate-half, and interleaved with llama3 scaling.
        qkv_rope_write_kv(s, &r128[0], a(32, 8, 128, 4096, 1, false, true));
        qkv_rope_write_kv(s, &r128[2], a(32, 8, 128, 4096, 1, false, true));
        // Decode batches with biases; yarn with an attention factor.
        qkv_rope_write_kv(s, &r64[3], a(14, 2, 64, 1024, 5, true, true));
        qkv_rope_write_kv(s, &r64[4], a(8, 8, 64, 2048, 8, true, true));
        // Head size 16 (the smallest the fused kernel takes).
        qkv_rope_write_kv(s, &rope_configs(16)[1], a(4, 2, 16, 1024, 3, false, true));
        // Not fused: columns not a multiple of 1024, head size 40, more than 8 tokens.
        qkv_rope_write_kv(s, &r128[0], a(8, 2, 128, 1152, 2, false, false));
        qkv_rope_write_kv(s, &rope_configs(40)[5], a(4, 2, 40, 1024, 1, true, false));
        qkv_rope_write_kv(s, &r64[0], a(4, 2, 64, 1024, 12, false, false));
        // Tile-major weights (`q4_gemv_lnt_rope`): rotate-half with head_dim % 32 fused, the
        // interleaved convention and head size 16 not.
        tm_cuda::kernels::q4_gemv::set_tiling(Some(true));
        qkv_rope_write_kv(s, &r128[0], a(32, 8, 128, 4096, 1, false, true));
        qkv_rope_write_kv(s, &r64[3], a(14, 2, 64, 1024, 5, true, true));
        qkv_rope_write_kv(s, &r64[0], a(8, 8, 64, 2048, 8, true, true));
        qkv_rope_write_kv(s, &r64[4], a(8, 8, 64, 2048, 8, true, false));
        qkv_rope_write_kv(s, &r128[2], a(32, 8, 128, 4096, 1, false, false));
        qkv_rope_write_kv(s, &rope_configs(16)[1], a(4, 2, 16, 1024, 3, false, false));
        tm_cuda::kernels::q4_gemv::set_tiling(Some(false));
    });
    tm_cuda::kernels::q4_gemv::set_tiling(None);
}

/// The slab path (a 1 MiB budget: several slabs) on two `[rows, cols]` int4 weights holding the
/// same values in different layouts: the same bytes out for 64 activation rows.
fn slabs_same_bytes(
    c: &mut Case<'_>,
    a_w: &tm_core::quant::Weight,
    b_w: &tm_core::quant::Weight,
    rows: usize,
    cols: usize,
) -> Result<(), String> {
    let on = tm_core::q4_slab::SlabPolicy { enabled: true, min_tokens: 1 };
    tm_cuda::set_slab_policy(Some((on, 1 << 20)));
    let xs = c.activations(64 * cols, 1.0);
    let x = c.act(&[64, cols], &xs)?;
    let (mut a, mut b) = (c.output(&[64, rows])?, c.output(&[64, rows])?);
    let ran = c.gpu.reserve_matmul_scratch(64).and_then(|_| {
        c.gpu.matmul(&x.gpu, a_w, None, &mut a.gpu)?;
        c.gpu.matmul(&x.gpu, b_w, None, &mut b.gpu)
    });
    tm_cuda::set_slab_policy(None);
    ran.ctx("slabs")?;
    c.check_same_bytes("slabs", &a.gpu, &b.gpu)
}

/// The int4 layout of `w`, if it is an int4 weight.
fn int4_layout_of(w: &tm_core::quant::Weight) -> Option<tm_core::quant::Int4Layout> {
    match w {
        tm_core::quant::Weight::Int4(q) => Some(q.layout),
        _ => None,
    }
}

/// The int4 kernels on one weight uploaded twice, row-major and tile-major (`q4_gemv::set_tiling`;
/// the CUDA backend picks tile-major for these lean shapes): decode products (plain, q/k/v-like
/// `matmul_many`, gate/up/SiLU), the prefill GEMM with every tile forced and its fallback, the
/// slab path, and the embedding of a table's rows. Both layouts must give the same bytes, and
/// the exact host product within tolerance.
#[test]
fn matmul_int4_layouts() {
    use tm_core::quant::Int4Layout;
    use tm_cuda::kernels::q4_gemm::{set_policy, Policy, Tile};
    use tm_cuda::kernels::q4_gemv::set_tiling;
    let _serial = decode_variant_lock();
    let _prefill = prefill_policy_lock();
    run("matmul_int4_layouts", &[DType::F16, DType::BF16], |s| {
        for (ns, rows, cols) in [(&[1usize, 3, 8, 64, 200][..], 1024, 4096), (&[1, 5, 40][..], 2048, 14336)] {
            s.case(format!("int4 layouts W[{rows}, {cols}]ᵀ g128, n in {ns:?}, embedding, slabs"), |c| {
                set_tiling(Some(true));
                let w = c.weight(Kind::Int4(128), rows, cols, (3.0 / cols as f32).sqrt());
                set_tiling(Some(false));
                let w = w?;
                let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
                let rm = tm_model::llama::quant_load::upload_quant(c.gpu, q).ctx("row-major upload");
                set_tiling(None);
                let rm = rm?;
                if int4_layout_of(&w.gpu) != Some(Int4Layout::Tiles16x128)
                    || int4_layout_of(&rm) != Some(Int4Layout::RowMajor)
                {
                    return Err(format!("layouts {:?} and {:?}", int4_layout_of(&w.gpu), int4_layout_of(&rm)));
                }
                for &n in ns {
                    let xs = c.activations(n * cols, 1.0);
                    let x = c.act(&[n, cols], &xs)?;
                    let mut want = vec![0f32; n * rows];
                    tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host product")?;
                    let policies: &[Policy] = if n > 8 {
                        &[
                            Policy::Auto,
                            Policy::Off,
                            Policy::Force(Tile::Medium),
                            Policy::Force(Tile::Wgmma),
                            Policy::Force(Tile::WgmmaK128),
                        ]
                    } else {
                        &[Policy::Auto]
                    };
                    for &p in policies {
                        let (mut a, mut b) = (c.output(&[n, rows])?, c.output(&[n, rows])?);
                        set_policy(Some(p));
                        let ran = c.gpu.matmul(&x.gpu, &w.gpu, None, &mut a.gpu);
                        let ran = ran.and_then(|_| c.gpu.matmul(&x.gpu, &rm, None, &mut b.gpu));
                        set_policy(None);
                        ran.ctx(format!("cuda matmul n = {n} ({p:?})"))?;
                        c.check_same_bytes(&format!("n = {n} {p:?}: tile-major vs row-major"), &a.gpu, &b.gpu)?;
                        c.check(&format!("n = {n} {p:?}"), &a.gpu, &want, rows, 1.0)?;
                    }
                }
                // Decode q/k/v-like and gate/up/SiLU launches over two tile-major weights.
                let xs = c.activations(2 * cols, 1.0);
                let x = c.act(&[2, cols], &xs)?;
                let (mut a, mut b) = (c.output(&[2, rows])?, c.output(&[2, rows])?);
                let (mut g1, mut u1, mut g2, mut u2) =
                    (c.output(&[2, rows])?, c.output(&[2, rows])?, c.output(&[2, rows])?, c.output(&[2, rows])?);
                c.gpu.gate_up_silu(&x.gpu, &w.gpu, &w.gpu, &mut g1.gpu, &mut u1.gpu, &mut a.gpu).ctx("silu tiled")?;
                c.gpu.gate_up_silu(&x.gpu, &rm, &rm, &mut g2.gpu, &mut u2.gpu, &mut b.gpu).ctx("silu row-major")?;
                c.check_same_bytes("gate/up/SiLU", &a.gpu, &b.gpu)?;
                {
                    let mut ta = [c.output(&[2, rows])?, c.output(&[2, rows])?];
                    let mut tb = [c.output(&[2, rows])?, c.output(&[2, rows])?];
                    let [a0, a1] = &mut ta;
                    c.gpu
                        .matmul_many(&x.gpu, &[&w.gpu, &w.gpu], &[None, None], &mut [&mut a0.gpu, &mut a1.gpu])
                        .ctx("many")?;
                    let [b0, b1] = &mut tb;
                    c.gpu
                        .matmul_many(&x.gpu, &[&rm, &rm], &[None, None], &mut [&mut b0.gpu, &mut b1.gpu])
                        .ctx("many")?;
                    c.check_same_bytes("matmul_many", &ta[1].gpu, &tb[1].gpu)?;
                }
                slabs_same_bytes(c, &w.gpu, &rm, rows, cols)?;
                // Rows of the weight as an embedding table.
                let ids: Vec<u32> = (0..7).map(|_| c.gen.below(rows) as u32).collect();
                let (mut a, mut b) = (c.output(&[7, cols])?, c.output(&[7, cols])?);
                c.gpu.embedding(&w.gpu, &ids, &mut a.gpu).ctx("embedding tiled")?;
                c.gpu.embedding(&rm, &ids, &mut b.gpu).ctx("embedding row-major")?;
                c.check_same_bytes("embedding", &a.gpu, &b.gpu)?;
                let mut e = c.output(&[7, cols])?;
                c.cpu.embedding(&w.cpu, &ids, &mut e.cpu).ctx("cpu embedding")?;
                let want = c.cpu.download_f32(&e.cpu).ctx("cpu download")?;
                c.check("embedding", &a.gpu, &want, cols, 1.0)
            });
        }
    });
}

/// Gate and up weights given tile-ordered scales and mins by `Ops::prepare_gate_up`
/// (`Int4Layout::TilesAndScales16x128`): the gate/up/SiLU decode kernel that reads them
/// (`silu_lnts`) gives the bytes of the tile-major kernel on the same weights; every other int4
/// path takes them too (plain decode products fall back, the prefill GEMM with every tile forced,
/// its fallback and the slab path give the tile-major weights' bytes), all within tolerance of the
/// exact host product.
#[test]
fn matmul_int4_tile_ordered_scales() {
    use tm_core::quant::Int4Layout;
    use tm_cuda::kernels::q4_gemm::{set_policy, Policy, Tile};
    use tm_cuda::kernels::q4_gemv::set_tiling;
    let _serial = decode_variant_lock();
    let _prefill = prefill_policy_lock();
    run("matmul_int4_tile_ordered_scales", &[DType::F16, DType::BF16], |s| {
        let (rows, cols) = (1024, 4096);
        s.case(format!("gate/up W[{rows}, {cols}]ᵀ g128 with tile-ordered scales"), |c| {
            set_tiling(Some(true));
            let made = c.weight(Kind::Int4(128), rows, cols, (3.0 / cols as f32).sqrt()).and_then(|w| {
                let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
                let upload = || tm_model::llama::quant_load::upload_quant(c.gpu, q).ctx("tile-major upload");
                let (g, u) = (upload()?, upload()?);
                Ok((w, g, u))
            });
            set_tiling(None);
            let (w, mut g, mut u) = made?;
            c.gpu.prepare_gate_up(&mut g, &mut u).ctx("prepare_gate_up")?;
            if int4_layout_of(&w.gpu) != Some(Int4Layout::Tiles16x128)
                || int4_layout_of(&g) != Some(Int4Layout::TilesAndScales16x128)
                || int4_layout_of(&u) != Some(Int4Layout::TilesAndScales16x128)
            {
                return Err(format!(
                    "layouts {:?}, {:?}, {:?}",
                    int4_layout_of(&w.gpu),
                    int4_layout_of(&g),
                    int4_layout_of(&u)
                ));
            }
            let q = w.quant.as_ref().ok_or("int4 weight without its host copy")?;
            for n in [1usize, 2, 5, 8] {
                let xs = c.activations(n * cols, 1.0);
                let x = c.act(&[n, cols], &xs)?;
                let mut outs = Vec::new();
                for _ in 0..6 {
                    outs.push(c.output(&[n, rows])?);
                }
                let [a, b, g1, u1, g2, u2] = &mut outs[..] else { unreachable!() };
                c.gpu.gate_up_silu(&x.gpu, &g, &u, &mut g1.gpu, &mut u1.gpu, &mut a.gpu).ctx("silu tile-ordered")?;
                c.gpu
                    .gate_up_silu(&x.gpu, &w.gpu, &w.gpu, &mut g2.gpu, &mut u2.gpu, &mut b.gpu)
                    .ctx("silu tile-major")?;
                c.check_same_bytes(&format!("gate/up/SiLU n = {n}"), &a.gpu, &b.gpu)?;
                // A plain decode product on such a weight falls back to another kernel.
                let mut want = vec![0f32; n * rows];
                tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host product")?;
                c.gpu.matmul(&x.gpu, &g, None, &mut a.gpu).ctx(format!("matmul n = {n}"))?;
                c.check(&format!("plain product n = {n}"), &a.gpu, &want, rows, 1.0)?;
            }
            for n in [64usize, 200] {
                let xs = c.activations(n * cols, 1.0);
                let x = c.act(&[n, cols], &xs)?;
                let mut want = vec![0f32; n * rows];
                tm_cpu::quant_matmul::matmul_int4_exact(&xs, n, &q.view(), &mut want).ctx("host product")?;
                for p in [
                    Policy::Auto,
                    Policy::Off,
                    Policy::Force(Tile::Medium),
                    Policy::Force(Tile::Wgmma),
                    Policy::Force(Tile::WgmmaK128),
                ] {
                    let (mut a, mut b) = (c.output(&[n, rows])?, c.output(&[n, rows])?);
                    set_policy(Some(p));
                    let ran = c.gpu.matmul(&x.gpu, &g, None, &mut a.gpu);
                    let ran = ran.and_then(|_| c.gpu.matmul(&x.gpu, &w.gpu, None, &mut b.gpu));
                    set_policy(None);
                    ran.ctx(format!("cuda matmul n = {n} ({p:?})"))?;
                    c.check_same_bytes(&format!("n = {n} {p:?}: tile-ordered vs row-major scales"), &a.gpu, &b.gpu)?;
                    c.check(&format!("n = {n} {p:?}"), &a.gpu, &want, rows, 1.0)?;
                }
            }
            slabs_same_bytes(c, &g, &w.gpu, rows, cols)?;
            // A table with such scales is refused, not misread.
            let mut e = c.output(&[1, cols])?;
            if c.gpu.embedding(&g, &[3], &mut e.gpu).is_ok() {
                return Err("embedding accepted a table with tile-ordered scales".into());
            }
            Ok(())
        });
    });
}

#[test]
fn sample_distributions() {
    run("sample_distributions", &ALL_DTYPES, |s| {
        let p = |temperature, top_k, top_p, min_p| SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..Default::default()
        };
        sample_distribution(s, "pure softmax", 50, -2.0, p(1.0, 0, 1.0, 0.0), 16);
        sample_distribution(s, "all filters", 1024, -2.0, p(0.8, 30, 0.9, 0.01), 32);
        // The tail holds about 4% of the mass: top-p 0.77 keeps 6 ladder tokens when normalised
        // over all 128256 logits, but 5 when the tail is left out.
        sample_distribution(s, "large vocab top-p", 128256, -10.0, p(1.0, 0, 0.77, 0.0), 4);
    });
}

#[test]
fn sample_greedy_and_penalties() {
    run("sample_greedy_and_penalties", &ALL_DTYPES, |s| {
        sample_greedy(s, 16, 128256);
        sample_greedy(s, 256, 32000);
        sample_greedy(s, 7, 49152);
        sample_greedy(s, 64, 384);
        // Rows that are not 16-byte aligned (the argmax kernel's scalar path) and a vector tail.
        sample_greedy(s, 5, 1001);
        sample_penalties(s, 48, 32000);
        sample_penalties(s, 8, 151936);
    });
}

#[test]
fn sample_stochastic_allowed_sets() {
    run("sample_stochastic_allowed_sets", &ALL_DTYPES, |s| {
        sample_stochastic(s, 60, 32000);
        sample_stochastic(s, 20, 128256);
        sample_stochastic(s, 30, 384);
    });
}

/// A small case of every op, for `compute-sanitizer` (memcheck, racecheck), where kernels run
/// 10–100 times slower: `conformance sanitizer_subset` (bf16 unless `TM_CONFORMANCE_DTYPES` says).
#[test]
fn sanitizer_subset() {
    let wanted = if std::env::var("TM_CONFORMANCE_DTYPES").is_ok() { ALL_DTYPES.to_vec() } else { vec![DType::BF16] };
    run("sanitizer_subset", &wanted, |s| {
        load_dense_case(s, DType::F32, 3, 64);
        embedding(s, Kind::Dense, 300, 64, &[5]);
        embedding(s, Kind::Int8(32), 300, 64, &[5]);
        embedding(s, Kind::Int4(32), 300, 64, &[5]);
        rms_norm(s, 3, 576, 576, 1e-5);
        rms_norm(s, 3, 4 * 64, 64, 1e-5);
        add_rms_norm(s, 3, 896, 1e-5);
        for kind in [Kind::Dense, Kind::Int8(32), Kind::Int4(32)] {
            matmul(s, kind, 1, 96, 256, true);
            matmul(s, kind, 17, 64, 576, false);
        }
        matmul_many(s, Kind::Dense, 3, &[96, 32, 32], 256, true);
        gate_up_silu(s, Kind::Dense, 2, 96, 256);
        // The int4 decode kernels with row tails and a partial last step.
        matmul_many(s, Kind::Int4(32), 3, &[40, 17, 33], 160, true);
        gate_up_silu(s, Kind::Int4(64), 2, 33, 192);
        let r = rope_configs(64);
        rope(s, &r[0], 3, 4, 64, 1000);
        rope(s, &r[4], 3, 4, 64, 1000);
        let rkv = |fp8| RopeKv { heads: 8, kv_heads: 2, head_dim: 64, block_size: 16, tokens: 3, first: 14, fp8 };
        rope_write_kv(s, &r[1], rkv(false));
        rope_write_kv(s, &r[1], rkv(true));
        silu_mul(s, 3, 1536);
        add_in_place(s, 3, 576);
        gather_rows(s, 5, 576, 3);
        let a = |heads, kv_heads, head_dim, block_size, window, seqs| Attn {
            heads,
            kv_heads,
            head_dim,
            block_size,
            window,
            seqs,
            fp8: false,
            twice: false,
        };
        attention(s, "mixed small", a(8, 2, 64, 16, None, vec![(1, 40), (9, 9), (5, 70)]));
        attention(s, "mixed small", a(8, 8, 128, 32, Some(16), vec![(1, 100), (20, 50)]));
        // split decode (5 and 3 splits) merged by the last split CTA (the fused combine, default)
        attention(s, "split decode", Attn { twice: true, ..a(8, 2, 64, 16, None, vec![(1, 300), (1, 130)]) });
        // the fp8-cache kernels (raw stage + conversion: racecheck covers their barriers)
        write_kv_fp8(s, 5, 64);
        let fp8 = |heads, kv_heads, head_dim, block_size, window, seqs| Attn {
            fp8: true,
            ..a(heads, kv_heads, head_dim, block_size, window, seqs)
        };
        attention(s, "mixed small", fp8(8, 2, 64, 16, None, vec![(1, 40), (9, 9), (5, 300)]));
        attention(s, "mixed small", fp8(8, 8, 128, 32, Some(16), vec![(1, 200), (70, 150)]));
        sample_greedy(s, 4, 1000);
        sample_penalties(s, 4, 1000);
        sample_stochastic(s, 10, 1000);
    });
}

/// Inputs that are out of range must come back as errors, not faults or panics.
#[test]
fn zz_invalid_inputs_are_errors() {
    run("zz_invalid_inputs_are_errors", &[DType::BF16], |s| {
        // Each closure must return Err from the backend; Ok is a failure.
        fn expect_err(c: &mut Case<'_>, what: &str, r: tm_core::Result<()>) {
            match r {
                Err(e) => c.notes.push(format!("{what}: {e}")),
                Ok(()) => c.problems.push(format!("{what}: accepted (must be an error)")),
            }
        }
        s.case("matmul with a wrong output shape", |c| {
            let x = c.act(&[2, 64], &[0.5; 128])?;
            let w = c.weight(Kind::Dense, 32, 64, 0.1)?;
            let mut out = c.output(&[2, 31])?;
            let r = c.gpu.matmul(&x.gpu, &w.gpu, None, &mut out.gpu);
            expect_err(c, "matmul", r);
            Ok(())
        });
        s.case("embedding with a token id past the vocabulary", |c| {
            let w = c.weight(Kind::Dense, 100, 64, 1.0)?;
            let mut out = c.output(&[2, 64])?;
            let r = c.gpu.embedding(&w.gpu, &[3, 100], &mut out.gpu);
            expect_err(c, "embedding", r);
            Ok(())
        });
        s.case("write_kv to a slot past the cache", |c| {
            let k = c.act(&[1, 64], &[1.0; 64])?;
            let mut kc = c.output(&[2, 16, 1, 64])?;
            let mut vc = c.output(&[2, 16, 1, 64])?;
            let r = c.gpu.write_kv(&k.gpu, &k.gpu, &mut kc.gpu, &mut vc.gpu, &[32]);
            expect_err(c, "write_kv", r);
            Ok(())
        });
        s.case("rope_write_kv to a slot past the cache", |c| {
            let freqs = RopeConfig { dim: 64, base: 1e4, scaling: RopeScaling::None, style: RopeStyle::Half }.freqs(8);
            let mut q = c.act(&[1, 64], &[1.0; 64])?;
            let (mut k, v) = (c.act(&[1, 64], &[1.0; 64])?, c.act(&[1, 64], &[1.0; 64])?);
            let mut kc = c.output(&[2, 16, 1, 64])?;
            let mut vc = c.output(&[2, 16, 1, 64])?;
            let r = c.gpu.rope_write_kv(&mut q.gpu, &mut k.gpu, &v.gpu, &mut kc.gpu, &mut vc.gpu, &[3], &freqs, &[32]);
            expect_err(c, "rope_write_kv", r);
            Ok(())
        });
        s.case("attention through a block past the cache", |c| {
            let q = c.act(&[1, 64], &[1.0; 64])?;
            let kc = c.act(&[2, 16, 1, 64], &vec![0.0; 2 * 16 * 64])?;
            let table = [5u32];
            let seqs = [SeqAttention { query_start: 0, query_len: 1, context_len: 3, block_table: &table }];
            let meta = AttentionMeta { seqs: &seqs, block_size: 16, scale: 0.125, sliding_window: None };
            let mut out = c.output(&[1, 64])?;
            let r = c.gpu.attention(&q.gpu, &kc.gpu, &kc.gpu, &meta, &mut out.gpu);
            expect_err(c, "attention", r);
            Ok(())
        });
        s.case("gather_rows of a row past the tensor", |c| {
            let x = c.act(&[4, 64], &[1.0; 256])?;
            let mut out = c.output(&[1, 64])?;
            let r = c.gpu.gather_rows(&x.gpu, &[4], &mut out.gpu);
            expect_err(c, "gather_rows", r);
            Ok(())
        });
        s.case("sample with fewer requests than rows", |c| {
            let l = c.act(&[2, 10], &[0.0; 20])?;
            let reqs = [Req { params: SamplingParams::greedy(), prompt: vec![], output: vec![] }];
            let r = sample_with(c.gpu, &l.gpu, &reqs, 0).map(|_| ());
            expect_err(c, "sample", r);
            Ok(())
        });
        // The backend still works after refusing all of that.
        add_in_place(s, 3, 576);
    });
}

/// KV-cache copy-on-write (`copy_chunks`) copies exactly the chunks asked for on the device.
#[test]
fn copy_chunks_on_device() {
    if no_gpu("copy_chunks_on_device") {
        return;
    }
    let backend = cuda(DType::BF16).unwrap_or_else(|e| panic!("opening CUDA: {e}"));
    let (chunks, chunk_elems) = (16usize, 4096usize);
    let values: Vec<u16> = (0..chunks * chunk_elems).map(|i| (i * 7919 % 65521) as u16).collect();
    let mut t = backend
        .zeros(tm_core::TensorDesc::new(DType::BF16, &[chunks, chunk_elems]), "kv cache")
        .unwrap_or_else(|e| panic!("zeros: {e}"));
    backend.upload(&mut t, bytemuck::cast_slice(&values)).unwrap_or_else(|e| panic!("upload: {e}"));
    let pairs = [(3u32, 9u32), (0, 15), (15, 1)];
    backend.copy_chunks(&mut t, chunk_elems * 2, &pairs).unwrap_or_else(|e| panic!("copy_chunks: {e}"));
    let mut want = values.clone();
    for &(s, d) in &pairs {
        let (s, d) = (s as usize * chunk_elems, d as usize * chunk_elems);
        want.copy_within(s..s + chunk_elems, d);
    }
    let mut got = vec![0u16; values.len()];
    backend.download(&t, bytemuck::cast_slice_mut(&mut got)).unwrap_or_else(|e| panic!("download: {e}"));
    assert!(got == want, "copy_chunks moved the wrong bytes");
    assert!(backend.copy_chunks(&mut t, chunk_elems * 2, &[(16, 0)]).is_err(), "an out-of-range chunk must be refused");
    println!("ok   copy_chunks: {} chunks of {} bytes", pairs.len(), chunk_elems * 2);
}
