//! Launchers for `q4_gemv.cu`: int4 decode products on tensor cores (w4a16),
//! `out[n, rows] = x[n, cols] · Wᵀ` for `n <= 8` with `W` in tm's int4 layout
//! ([`tm_core::quant`]), `x` and `out` f16 or bf16, f32 sums.
//!
//! - [`q4_gemv`]: up to three weights sharing `x` (a layer's q, k and v) in one launch, with
//!   optional biases; one weight is a plain product.
//! - [`q4_gemv_silu`]: `out = silu(x·Gᵀ) * (x·Uᵀ)` (the gated MLP input) in one launch.
//!
//! [`fits`] says whether a call can take this path; callers use `matmul_q4` (the CUDA-core GEMV,
//! and the only path for f32) otherwise. `TM_Q4_GEMV=0` turns the path off, to compare.
//!
//! Each CTA (256 threads, 8 warps) computes 32 rows of one weight (16 for `n16`, `ln`, `ln4`;
//! or 16 rows of the gate and the same 16 of the up weight) with K split over its warps; see the
//! kernel source for the layout. Every warp keeps a ring of `U` steps' loads in flight (software
//! pipelined). The variants ([`Unroll`]):
//! - `u2`: U = 2, at most 128 registers, two CTAs per SM;
//! - `n16` (plain products only): 16-row CTAs, U = 2, x loaded at use, at most 80 registers so
//!   three CTAs fit per SM: twice the CTAs of `u2`, for weights too small to give every SM two
//!   32-row CTAs (the q/k/v, o and down products of an 8B model on an H200: 192, 128 and 128
//!   CTAs on 132 SMs);
//! - `ln` and `ln4` (the lean kernels; [`lean_fits`]: group 128, `cols % 1024 == 0`, whole
//!   16-row tiles, so nothing is predicated and the lane's addresses are fixed offsets): `n16`'s
//!   configuration and U = 4 at two CTAs per SM (SiLU: U = 2 at two CTAs per SM, U = 4 at one)
//!   with the magic-sum step: the mma takes the nibbles as OFF + q straight from the LOP3, and
//!   scale and min are applied per 128-column step and row in f32. About 40% fewer instructions
//!   per step than `u2`'s (SASS: 246 against 413 per gate/up step). H200, f16, n = 1, in a graph:
//!   gate/up 23.4 us (`u2` 26.7), down 13.7 (`ln4`; `n16` 15.2), o 5.6 (`ln4`; `n16` 5.9), q/k/v
//!   7.3 (`ln`; `n16` 7.1).
//!
//! Tile-major weights ([`tm_core::quant::Int4Layout::Tiles16x128`], [`Q4Slot::tiled`]; what the
//! CUDA backend stores for the lean shapes, [`preferred_layout`]) take the lean kernels' `*t`
//! forms (`lnt`, `ln4t`, `silu_lnt`, `silu_ln4t`, `lnt_rope`), which read each warp step's 1 KiB
//! in two 512-byte loads: H200, f16, n = 1, in a graph, gate/up 21.1 µs, q/k/v 6.2, o 5.1 against
//! 23.1, 6.9, 5.3 row-major (same call); `silu_lnt` has since kept one step in flight per warp at
//! three CTAs per SM (AWQ 8B batch-1 step 2126-2130 -> 2080 us). A forced non-lean variant means
//! `Auto`'s lean choice for them.
//!
//! Programmatic dependent launch (sm_90+): every variant lets the next kernel start once its main
//! loop is done (`trigger_after_loop`, q4_gemv.cu) and issues the weight loads of its first U steps before
//! `pdl_wait` (weights do not depend on earlier kernels); x is read and outputs written after it.
//! When the launch carries the programmatic-serialization attribute, the weight stream thus
//! overlaps the previous kernel's tail; without it the waits return at once.
//!
//! `Auto` takes the lean kernels where they fit (unless `TM_Q4_GEMV_LEAN=0`): `ln4` for a plain
//! product whose 16-row grid is one wave at two CTAs per SM, else `ln`, and `ln` for SiLU.
//! Elsewhere `n16` for a plain product whose 32-row grid is under two CTAs per SM, else `u2`
//! (the SiLU variant `u2`). `TM_Q4_GEMV_UNROLL=2|n16|ln|ln4` overrides it (the lean ones fall back
//! on the automatic non-lean choice where they do not fit; `n16` means `u2` for the SiLU
//! variant), and [`set_unroll`] overrides both (tests, benchmarks). `q4_gemv_bench` times every
//! variant on the 8B shapes. (The variants no shape chose any more were removed: `u4`,
//! `n16u4`, and `pf`/`pf8`, which read the scales at use after an L2 prefetch.)

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

use tm_core::quant::{int4_tiles_fit, Int4Layout};
use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{Gpu, KernelArg};

/// Threads per CTA.
const THREADS: u32 = 256;
/// Output rows per CTA of [`q4_gemv_silu`].
const SILU_ROWS_PER_CTA: usize = 16;
/// The most activation rows the kernels take.
pub const MAX_N: usize = 8;

/// The kernel variant: steps in flight per warp and rows per CTA (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unroll {
    /// `n16` for plain products under two 32-row CTAs per SM, else `u2`, or the lean kernels
    /// where they fit (`TM_Q4_GEMV_UNROLL` overrides it).
    Auto,
    /// `*_u2_*`: 32-row CTAs, at most 128 registers, two CTAs per SM.
    Two,
    /// `q4_gemv_n16_*`: 16-row CTAs, three per SM (plain products; the SiLU variant takes `u2`).
    Narrow,
    /// `q4_gemv_ln_*` (16-row CTAs, U = 2, three per SM) and `q4_gemv_silu_ln_*` (U = 2, two per
    /// SM): the lean kernels, for group 128, `cols % 1024 == 0` and weights of whole 16-row tiles
    /// ([`lean_fits`]); other shapes take `Auto`'s non-lean choice.
    Lean,
    /// `q4_gemv_ln4_*` (U = 4, two per SM) and `q4_gemv_silu_ln4_*` (U = 4, one per SM): `Lean`
    /// with twice the steps in flight.
    Lean4,
}

impl Unroll {
    /// Every variant but `Auto`, in the order the benchmark prints them.
    pub const ALL: [Unroll; 4] = [Unroll::Two, Unroll::Narrow, Unroll::Lean, Unroll::Lean4];

    /// The variant's name in `TM_Q4_GEMV_UNROLL` and the benchmark's tables.
    pub fn name(self) -> &'static str {
        match self {
            Unroll::Auto => "auto",
            Unroll::Two => "u2",
            Unroll::Narrow => "n16",
            Unroll::Lean => "ln",
            Unroll::Lean4 => "ln4",
        }
    }

    /// Parses a `TM_Q4_GEMV_UNROLL` value: 2 (or u2), n16, ln, ln4 or auto.
    pub fn parse(v: &str) -> Option<Unroll> {
        match v.trim() {
            "auto" => Some(Unroll::Auto),
            "2" | "u2" => Some(Unroll::Two),
            "n16" => Some(Unroll::Narrow),
            "ln" => Some(Unroll::Lean),
            "ln4" => Some(Unroll::Lean4),
            _ => None,
        }
    }

    /// Whether the variant has a SiLU kernel of its own (`n16` takes `u2` there).
    pub fn has_silu_form(self) -> bool {
        matches!(self, Unroll::Two | Unroll::Lean | Unroll::Lean4)
    }

    /// Whether the variant is one of the lean kernels (which take only [`lean_fits`] shapes).
    pub fn is_lean(self) -> bool {
        matches!(self, Unroll::Lean | Unroll::Lean4)
    }
}

/// [`set_unroll`]'s override: 0 = none, else 1 + the index in [`Unroll::ALL`].
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Makes `Auto` mean `unroll` for the whole process, over `TM_Q4_GEMV_UNROLL` (`None`, or
/// `Some(Auto)`: back to the environment and the automatic choice). For tests and benchmarks
/// that run every variant in one process.
pub fn set_unroll(unroll: Option<Unroll>) {
    let code = unroll.and_then(|u| Unroll::ALL.iter().position(|&a| a == u)).map_or(0, |i| i as u8 + 1);
    OVERRIDE.store(code, Ordering::Relaxed);
}

/// The variant `Auto` is forced to: [`set_unroll`]'s, else `TM_Q4_GEMV_UNROLL`'s.
fn forced() -> Option<Unroll> {
    match OVERRIDE.load(Ordering::Relaxed) {
        0 => forced_unroll(),
        c => Unroll::ALL.get(usize::from(c - 1)).copied(),
    }
}

impl Unroll {
    /// The kernel for a plain product whose grid has `ctas16` 16-row and `ctas32` 32-row CTAs,
    /// on `sms` multiprocessors, `lean` saying whether the shape fits the lean kernels
    /// ([`lean_fits`]); never `Auto`.
    fn resolve(self, ctas16: usize, ctas32: usize, sms: usize, lean: bool) -> Unroll {
        self.resolve_with(forced(), ctas16, ctas32, sms, lean && lean_enabled())
    }

    /// [`Unroll::resolve`] with `forced` as the override of `Auto` and `lean` as whether `Auto`
    /// may take (and a forced variant may be) a lean kernel.
    fn resolve_with(self, forced: Option<Unroll>, ctas16: usize, ctas32: usize, sms: usize, lean: bool) -> Unroll {
        let sized = if ctas32 < 2 * sms { Unroll::Narrow } else { Unroll::Two };
        // Lean: U = 4 when the 16-row grid is one wave at two CTAs per SM (o, down), else U = 2.
        let lean_sized = if ctas16 <= 2 * sms { Unroll::Lean4 } else { Unroll::Lean };
        let u = match self {
            Unroll::Auto => match forced {
                Some(u) if u != Unroll::Auto => u,
                _ if lean => lean_sized,
                _ => sized,
            },
            u => u,
        };
        if u.is_lean() && !lean {
            sized
        } else {
            u
        }
    }

    /// The SiLU kernel's variant (`lean` as in [`Unroll::resolve_with`]): `Auto` takes `Lean`
    /// when it may, else the forced variant or `u2`.
    fn resolve_silu_with(self, forced: Option<Unroll>, lean: bool) -> Unroll {
        let u = match self {
            Unroll::Auto => match forced {
                Some(u) if u != Unroll::Auto => u,
                _ if lean => Unroll::Lean,
                _ => Unroll::Two,
            },
            u => u,
        };
        if u.is_lean() && !lean {
            Unroll::Two
        } else {
            u
        }
    }

    /// Rows per CTA of the plain product.
    fn rows_per_cta(self) -> usize {
        match self {
            Unroll::Narrow | Unroll::Lean | Unroll::Lean4 => 16,
            Unroll::Auto | Unroll::Two => 32,
        }
    }

    /// The plain kernel's name stem.
    fn plain_stem(self) -> &'static str {
        match self {
            Unroll::Narrow => "q4_gemv_n16",
            Unroll::Lean => "q4_gemv_ln",
            Unroll::Lean4 => "q4_gemv_ln4",
            Unroll::Auto | Unroll::Two => "q4_gemv_u2",
        }
    }

    /// The SiLU kernel's name stem (`Narrow` has no SiLU form: `u2`).
    fn silu_stem(self) -> &'static str {
        match self {
            Unroll::Lean => "q4_gemv_silu_ln",
            Unroll::Lean4 => "q4_gemv_silu_ln4",
            Unroll::Auto | Unroll::Two | Unroll::Narrow => "q4_gemv_silu_u2",
        }
    }
}

/// `TM_Q4_GEMV_UNROLL` when it names a variant (2, n16, ln, ln4; auto: none).
fn forced_unroll() -> Option<Unroll> {
    static FORCED: OnceLock<Option<Unroll>> = OnceLock::new();
    *FORCED.get_or_init(|| {
        let v = std::env::var("TM_Q4_GEMV_UNROLL").ok()?;
        match Unroll::parse(&v) {
            Some(Unroll::Auto) => None,
            Some(u) => Some(u),
            None => {
                tracing::warn!("TM_Q4_GEMV_UNROLL={v} ignored: expected 2, n16, ln, ln4 or auto");
                None
            }
        }
    })
}

/// Whether `Auto` may take the lean kernels (`TM_Q4_GEMV_LEAN` is not `0`).
pub fn lean_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_Q4_GEMV_LEAN").map_or(true, |v| v.trim() != "0"))
}

/// Whether a product of `cols` columns with int4 groups of `group` over the weights `slots` (empty
/// ones included) suits the lean kernels: group 128 (each 128-column step inside one group),
/// `cols` a multiple of 1024 (whole steps for each of a CTA's 8 warps) and every weight of whole
/// 16-row tiles. Llama-3-8B's products all do, and so do their halves under tp = 2.
pub fn lean_fits(cols: usize, group: usize, slots: &[Q4Slot]) -> bool {
    lean_columns(cols, group) && slots.iter().all(|s| s.rows.is_multiple_of(16))
}

/// [`lean_fits`]'s condition on the columns and groups: group 128, `cols` a multiple of 1024.
fn lean_columns(cols: usize, group: usize) -> bool {
    group == 128 && cols > 0 && cols.is_multiple_of(1024)
}

thread_local! {
    /// [`set_tiling`]'s override for this thread: 0 = none (the environment decides), 1 = off, 2 = on.
    static TILING: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// Makes [`preferred_layout`] store new int4 weights tile-major (`Some(true)`), row-major
/// (`Some(false)`), or as `TM_Q4_TILED` says (`None`), for the weights the calling thread uploads:
/// for tests and benchmarks that compare the layouts (thread by thread, so tests running in
/// parallel do not change each other's uploads). Weights already uploaded keep theirs.
pub fn set_tiling(on: Option<bool>) {
    TILING.with(|t| t.set(on.map_or(0, |b| 1 + u8::from(b))));
}

/// The layout the CUDA backend stores a `[rows, cols]` int4 weight of `group` in, for activations
/// `dt`: tile-major ([`tm_core::quant::Int4Layout::Tiles16x128`]) for f16/bf16 and the lean
/// kernels' shapes ([`lean_fits`]), where the decode product reads each 1 KiB step of a 16-row
/// tile in one piece (scripts/gpu/q4_decode_chain.cu: 32 int4 8B layers 1567 -> 1438 us per
/// step); row-major otherwise, or when `TM_Q4_TILED=0` or the lean kernels are off
/// (`TM_Q4_GEMV_LEAN=0`). Every int4 kernel reads both layouts; the decode products read
/// tile-major weights only with the lean kernels.
pub fn preferred_layout(dt: DType, rows: usize, cols: usize, group: usize) -> Int4Layout {
    static ENV: OnceLock<bool> = OnceLock::new();
    let on = match TILING.with(std::cell::Cell::get) {
        0 => *ENV.get_or_init(|| std::env::var("TM_Q4_TILED").map_or(true, |v| v.trim() != "0")) && lean_enabled(),
        c => c == 2,
    };
    if on && matches!(dt, DType::F16 | DType::BF16) && lean_columns(cols, group) && int4_tiles_fit(rows, cols) {
        Int4Layout::Tiles16x128
    } else {
        Int4Layout::RowMajor
    }
}

/// Whether the path is on (`TM_Q4_GEMV` is not `0`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_Q4_GEMV").map_or(true, |v| v.trim() != "0"))
}

/// One int4 weight of a launch: device addresses of `packed [rows, cols/2]`, f16 `scales` and
/// `mins [rows, cols/group]`, the optional bias `[rows]` (0 when absent) and `out [n, rows]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Q4Slot {
    /// Packed nibbles.
    pub packed: u64,
    /// Group scales.
    pub scales: u64,
    /// Group mins.
    pub mins: u64,
    /// The bias, or 0.
    pub bias: u64,
    /// The output (unused by [`q4_gemv_silu`], which takes its own).
    pub out: u64,
    /// Rows of the weight (features of the output).
    pub rows: usize,
    /// The order of `packed`, `scales` and `mins`: tile-major weights are read only by the lean
    /// kernels' tile-major forms (`lnt`, `ln4t`, `silu_lnt`, `silu_ln4t`), and only in
    /// [`lean_fits`] shapes; tile-ordered scales
    /// ([`tm_core::quant::Int4Layout::TilesAndScales16x128`], a layer's gate and up weights) only
    /// by [`q4_gemv_silu`]'s `silu_lnts` ([`fits`] refuses them for the others).
    pub layout: Int4Layout,
}

impl Q4Slot {
    /// Whether `packed` is tile-major.
    pub fn tiled(&self) -> bool {
        self.layout.is_tiled()
    }

    /// Whether `scales` and `mins` are in tile order.
    pub fn tiled_scales(&self) -> bool {
        self.layout == Int4Layout::TilesAndScales16x128
    }
}

/// Whether the weights of one launch are tile-major: all or none of them, and only in
/// [`lean_fits`] shapes (what the CUDA backend stores tile-major), else an error.
fn tiled_launch(op: &str, cols: usize, group: usize, slots: &[Q4Slot]) -> Result<bool> {
    let tiled = slots.first().is_some_and(Q4Slot::tiled);
    if slots.iter().any(|s| s.tiled() != tiled) {
        return Err(Error::invalid(format!("{op}: the weights of one launch are in different int4 layouts")));
    }
    if tiled && !lean_fits(cols, group, slots) {
        return Err(Error::invalid(format!(
            "{op}: tile-major int4 weights need group 128, cols % 1024 == 0 and whole 16-row tiles \
             (cols {cols}, group {group})"
        )));
    }
    Ok(tiled)
}

/// For tile-major weights: the lean variant `u` asks for, or `Auto`'s lean choice (`fallback`)
/// when `u` (forced by `TM_Q4_GEMV_UNROLL` or a test) is not a lean one; the kernel-name suffix.
fn tiled_variant(u: Unroll, fallback: Unroll, tiled: bool) -> (Unroll, &'static str) {
    match (tiled, u.is_lean()) {
        (false, _) => (u, ""),
        (true, true) => (u, "t"),
        (true, false) => (fallback, "t"),
    }
}

/// Whether `n` activation rows of `cols` features in `dt`, with int4 weights of group size
/// `group`, can use these kernels: f16/bf16, `1 <= n <= 8`, `cols` and `group` multiples of 32
/// with `group` dividing `cols`, sizes within the kernels' `int` (`rows * cols / group`
/// included), `x` and every packed weight
/// 16-byte aligned, scales and mins 2-byte aligned, and no weight with tile-ordered scales
/// ([`Q4Slot::tiled_scales`]: [`fits_silu`] takes those).
pub fn fits(dt: DType, n: usize, cols: usize, group: usize, x: u64, slots: &[Q4Slot]) -> bool {
    slots.iter().all(|s| !s.tiled_scales()) && fits_any_scales(dt, n, cols, group, x, slots)
}

/// [`fits`] for a [`q4_gemv_silu`] launch of `gate` and `up`: also with tile-ordered scales, which
/// only its lean tile-major kernel reads (both weights alike, [`lean_fits`] shapes).
pub fn fits_silu(dt: DType, n: usize, cols: usize, group: usize, x: u64, gate: &Q4Slot, up: &Q4Slot) -> bool {
    let slots = [*gate, *up];
    let ts = gate.tiled_scales() || up.tiled_scales();
    fits_any_scales(dt, n, cols, group, x, &slots)
        && (!ts || (gate.layout == up.layout && lean_fits(cols, group, &slots)))
}

fn fits_any_scales(dt: DType, n: usize, cols: usize, group: usize, x: u64, slots: &[Q4Slot]) -> bool {
    matches!(dt, DType::F16 | DType::BF16)
        && (1..=MAX_N).contains(&n)
        && cols > 0
        && cols.is_multiple_of(32)
        && group > 0
        && group.is_multiple_of(32)
        && cols.is_multiple_of(group)
        && i32::try_from(cols).is_ok()
        && x.is_multiple_of(16)
        && !slots.is_empty()
        && slots.iter().all(|s| {
            // The kernels index scales as `row * groups + group` in `int`.
            s.rows.checked_mul(cols / group).is_some_and(|v| i32::try_from(v).is_ok())
                && s.packed.is_multiple_of(16)
                && s.scales.is_multiple_of(2)
                && s.mins.is_multiple_of(2)
                && s.bias.is_multiple_of(2)
        })
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::invalid(format!("q4_gemv: {what} = {v} exceeds the kernel limit of {}", i32::MAX)))
}

/// CTAs for `rows` at `per` rows each.
fn ctas(rows: usize, per: usize) -> usize {
    rows.div_ceil(per)
}

/// The grid of a [`q4_gemv`] launch: each weight's rows in CTAs of `per` rows.
fn plain_grid(slots: &[Q4Slot], per: usize) -> Result<u32> {
    let total: usize = slots.iter().map(|s| ctas(s.rows, per)).sum();
    u32::try_from(total).map_err(|_| Error::invalid(format!("q4_gemv: {total} CTAs exceed the grid limit")))
}

/// `slot.out = x · slot.Wᵀ (+ slot.bias)` for each of up to three int4 weights of `cols`
/// columns and group size `group`, in one launch. The caller checked [`fits`] and the shapes.
#[allow(clippy::too_many_arguments)]
pub fn q4_gemv(
    gpu: &Gpu,
    dt: DType,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    slots: &[Q4Slot],
    unroll: Unroll,
) -> Result<()> {
    if slots.is_empty() || slots.len() > 3 {
        return Err(Error::invalid(format!("q4_gemv: {} weights in one launch (1 to 3)", slots.len())));
    }
    // Empty weights take no CTAs; the kernel finds a CTA's weight from the counts.
    let used: Vec<Q4Slot> = slots.iter().copied().filter(|s| s.rows > 0).collect();
    let grid32 = plain_grid(&used, 32)?;
    if grid32 == 0 || n == 0 {
        return Ok(());
    }
    let grid16 = plain_grid(&used, 16)?;
    let tiled = tiled_launch("q4_gemv", cols, group, &used)?;
    let lean = lean_fits(cols, group, &used);
    let sms = gpu.info().multiprocessors as usize;
    let u = unroll.resolve(grid16 as usize, grid32 as usize, sms, lean);
    let lean_auto = Unroll::Auto.resolve_with(None, grid16 as usize, grid32 as usize, sms, true);
    let (u, t) = tiled_variant(u, lean_auto, tiled);
    let grid = plain_grid(&used, u.rows_per_cta())?;
    let name = format!("{}{t}_{}", u.plain_stem(), suffix(dt)?);
    let args = plain_args(x, n, cols, group, &used)?;
    gpu.launch(&name, (grid, 1, 1), (THREADS, 1, 1), 0, &args)
}

/// The arguments the plain kernels (and [`q4_gemv_rope`]) start with: x, n, cols, group, then
/// the outputs, packed weights, scales, mins, biases and rows of up to three weights (absent
/// ones zero).
fn plain_args(x: u64, n: usize, cols: usize, group: usize, used: &[Q4Slot]) -> Result<Vec<KernelArg>> {
    let s = |i: usize| used.get(i).copied().unwrap_or_default();
    let mut args = vec![
        KernelArg::Ptr(x),
        KernelArg::I32(int("n", n)?),
        KernelArg::I32(int("cols", cols)?),
        KernelArg::I32(int("group", group)?),
    ];
    args.extend((0..3).map(|i| KernelArg::Ptr(s(i).out)));
    args.extend((0..3).map(|i| KernelArg::Ptr(s(i).packed)));
    args.extend((0..3).map(|i| KernelArg::Ptr(s(i).scales)));
    args.extend((0..3).map(|i| KernelArg::Ptr(s(i).mins)));
    args.extend((0..3).map(|i| KernelArg::Ptr(s(i).bias)));
    for i in 0..3 {
        args.push(KernelArg::I32(int("rows", s(i).rows)?));
    }
    Ok(args)
}

/// The RoPE and KV-cache operands of [`q4_gemv_rope`] (those of `rope_write_kv`): device
/// addresses of the caches (in the activation dtype), the u32 positions and cache slots of the
/// `n` tokens and the f32 inverse frequencies `[head_dim / 2]`.
#[derive(Clone, Copy, Debug)]
pub struct RopeKv {
    /// Key cache.
    pub k_cache: u64,
    /// Value cache.
    pub v_cache: u64,
    /// Position of each token.
    pub positions: u64,
    /// Cache slot of each token (`u32::MAX`: not cached).
    pub slots: u64,
    /// Inverse frequencies.
    pub inv_freq: u64,
    /// Factor on cos and sin.
    pub attention_factor: f32,
    /// Elements per head.
    pub head_dim: usize,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + head_dim / 2)`.
    pub interleaved: bool,
}

/// A deferred RMSNorm's scale for the products that read its output (q4_gemv.cu, "Deferred
/// RMSNorm"; tm-core's `DeferredNorm`): the device address of the slot's f64 sums (one per batch
/// row, written by [`q4_gemv_join`]) and the norm's epsilon (its width is the products' `cols`).
#[derive(Clone, Copy, Debug)]
pub struct NormArgs {
    /// The slot's sums of squares, f64 `[n]`.
    pub sums: u64,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// The two kernel arguments of an optional [`NormArgs`] (a null slot: no scale).
fn norm_args(norm: Option<&NormArgs>) -> [KernelArg; 2] {
    match norm {
        Some(a) => [KernelArg::Ptr(a.sums), KernelArg::F32(a.eps)],
        None => [KernelArg::Ptr(0), KernelArg::F32(0.0)],
    }
}

/// [`q4_gemv_rope`] launches in this process (all devices): tests read it to confirm the fused
/// path ran.
static ROPE_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many [`q4_gemv_rope`] launches this process has made.
pub fn rope_launches() -> u64 {
    ROPE_LAUNCHES.load(Ordering::Relaxed)
}

/// Whether `TM_Q4_GEMV_ROPE` allows [`q4_gemv_rope`] (unset or not `0`).
pub fn rope_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_Q4_GEMV_ROPE").map_or(true, |v| v.trim() != "0"))
}

/// Whether [`q4_gemv_rope`] takes q, k, v `slots` of `cols` columns and group `group` with
/// heads of `head_dim` and the pair convention `interleaved` (the caller checked [`fits`]): the
/// path on (and the lean path, with no variant forced by `TM_Q4_GEMV_UNROLL` or a test) and
/// [`rope_shape_fits`].
pub fn rope_fits(cols: usize, group: usize, slots: &[Q4Slot; 3], head_dim: usize, interleaved: bool) -> bool {
    rope_enabled() && lean_enabled() && forced().is_none() && rope_shape_fits(cols, group, slots, head_dim, interleaved)
}

/// The shapes [`q4_gemv_rope`] takes: the lean kernels' ([`lean_fits`]), whole heads of q, k and
/// v with k and v alike, and for row-major weights `head_dim` a multiple of 16 (a head is whole
/// 16-row tiles, each pairing rows `i` and `i + head_dim / 2`, or `2i` and `2i + 1`); for
/// tile-major ones (whose tiles are 16 consecutive rows: the kernel pairs the tiles of rows `i`
/// and `i + head_dim / 2` instead) rotate-half pairs and `head_dim` a multiple of 32.
pub fn rope_shape_fits(cols: usize, group: usize, slots: &[Q4Slot; 3], head_dim: usize, interleaved: bool) -> bool {
    let [q, k, v] = slots;
    let tiled = slots.iter().all(Q4Slot::tiled);
    let (mixed, pair_align) = (slots.iter().any(Q4Slot::tiled) && !tiled, if tiled { 32 } else { 16 });
    lean_fits(cols, group, slots)
        && !mixed
        && !(tiled && interleaved)
        && head_dim > 0
        && head_dim.is_multiple_of(pair_align)
        && q.rows.is_multiple_of(head_dim)
        && k.rows.is_multiple_of(head_dim)
        && k.rows > 0
        && k.rows == v.rows
}

/// The q/k/v products (`slots` q, k, v, as [`q4_gemv`]) with RoPE of q and k and the cache write
/// of the rotated k and of v in the epilogue (`q4_gemv_ln_rope_*`, 16 rows per CTA; for tile-major
/// weights `q4_gemv_lnt_rope_*`, 32 rows per CTA: two tiles): what [`q4_gemv`] then
/// `rope_write_kv` store, bit for bit. With `norm`, x is a deferred RMSNorm's output and the sums
/// are scaled first. The caller checked [`fits`], [`rope_fits`] and the shapes.
#[allow(clippy::too_many_arguments)]
pub fn q4_gemv_rope(
    gpu: &Gpu,
    dt: DType,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    slots: &[Q4Slot; 3],
    rope: &RopeKv,
    norm: Option<&NormArgs>,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let tiled = tiled_launch("q4_gemv_rope", cols, group, slots)?;
    let grid = plain_grid(slots, if tiled { 32 } else { 16 })?;
    let mut args = plain_args(x, n, cols, group, slots)?;
    args.extend([
        KernelArg::Ptr(rope.k_cache),
        KernelArg::Ptr(rope.v_cache),
        KernelArg::Ptr(rope.positions),
        KernelArg::Ptr(rope.slots),
        KernelArg::Ptr(rope.inv_freq),
        KernelArg::F32(rope.attention_factor),
        KernelArg::I32(int("head_dim", rope.head_dim)?),
        KernelArg::I32(i32::from(rope.interleaved)),
    ]);
    args.extend(norm_args(norm));
    let stem = if tiled { "q4_gemv_lnt_rope" } else { "q4_gemv_ln_rope" };
    gpu.launch(&format!("{stem}_{}", suffix(dt)?), (grid, 1, 1), (THREADS, 1, 1), 0, &args)?;
    ROPE_LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// `out [n, rows] = silu(x · Gᵀ) * (x · Uᵀ)` for int4 `gate` and `up` `[rows, cols]` of group size
/// `group` (their `out` and `bias` are ignored), in one launch. The caller checked [`fits`] and
/// the shapes.
#[allow(clippy::too_many_arguments)]
pub fn q4_gemv_silu(
    gpu: &Gpu,
    dt: DType,
    out: u64,
    gate: &Q4Slot,
    up: &Q4Slot,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    unroll: Unroll,
    norm: Option<&NormArgs>,
) -> Result<()> {
    if gate.rows != up.rows {
        return Err(Error::invalid(format!("q4_gemv_silu: gate has {} rows, up {}", gate.rows, up.rows)));
    }
    let rows = gate.rows;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let grid = u32::try_from(ctas(rows, SILU_ROWS_PER_CTA))
        .map_err(|_| Error::invalid(format!("q4_gemv_silu: {rows} rows need too many CTAs")))?;
    // `Narrow` takes `u2`'s kernel.
    let tiled = tiled_launch("q4_gemv_silu", cols, group, &[*gate, *up])?;
    let lean = lean_fits(cols, group, &[*gate, *up]) && lean_enabled();
    let name = if gate.tiled_scales() || up.tiled_scales() {
        // Tile-ordered scales: one kernel reads them, `silu_lnt`'s configuration (`Unroll::Lean`)
        // whatever `unroll` asks for.
        if gate.layout != up.layout {
            return Err(Error::invalid("q4_gemv_silu: gate and up must both have tile-ordered scales, tile-major"));
        }
        format!("q4_gemv_silu_lnts_{}", suffix(dt)?)
    } else {
        let u = unroll.resolve_silu_with(forced(), lean);
        let (u, t) = tiled_variant(u, Unroll::Lean, tiled);
        format!("{}{t}_{}", u.silu_stem(), suffix(dt)?)
    };
    let mut args = vec![
        KernelArg::Ptr(out),
        KernelArg::Ptr(x),
        KernelArg::I32(int("n", n)?),
        KernelArg::I32(int("cols", cols)?),
        KernelArg::I32(int("group", group)?),
        KernelArg::Ptr(gate.packed),
        KernelArg::Ptr(gate.scales),
        KernelArg::Ptr(gate.mins),
        KernelArg::Ptr(up.packed),
        KernelArg::Ptr(up.scales),
        KernelArg::Ptr(up.mins),
        KernelArg::I32(int("rows", rows)?),
    ];
    args.extend(norm_args(norm));
    gpu.launch(&name, (grid, 1, 1), (THREADS, 1, 1), 0, &args)
}

/// The producer of a deferred RMSNorm (q4_gemv.cu, "Deferred RMSNorm"): `y = x · Wᵀ` for the
/// int4 `weight` (`[rows, cols]`, rows the hidden size; its `out` is the join's output), then per
/// row `residual = T(residual + T(y))`, `out = T(residual · gamma)`, and each row's sum of squares
/// of the new residual added into the slot `sums` (f64 `[n]`, zeroed before). 16 rows per CTA:
/// the lean configuration `Unroll::Auto` picks for the shape (except that the tile-major
/// `Lean4` join, a layer's o and down at batch 1, keeps two steps in flight: q4_gemv.cu), else
/// `n16`'s. The caller checked [`fits`] and the shapes.
#[allow(clippy::too_many_arguments)]
pub fn q4_gemv_join(
    gpu: &Gpu,
    dt: DType,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    weight: &Q4Slot,
    residual: u64,
    gamma: u64,
    sums: u64,
) -> Result<()> {
    if n == 0 || weight.rows == 0 {
        return Ok(());
    }
    let slots = [*weight];
    let tiled = tiled_launch("q4_gemv_join", cols, group, &slots)?;
    let (grid16, grid32) = (plain_grid(&slots, 16)?, plain_grid(&slots, 32)?);
    let sms = gpu.info().multiprocessors as usize;
    let lean = lean_fits(cols, group, &slots);
    let u = Unroll::Auto.resolve(grid16 as usize, grid32 as usize, sms, lean);
    let lean_auto = Unroll::Auto.resolve_with(None, grid16 as usize, grid32 as usize, sms, true);
    let (u, t) = tiled_variant(u, lean_auto, tiled);
    let stem = match u {
        Unroll::Lean => "q4_gemv_ln",
        Unroll::Lean4 => "q4_gemv_ln4",
        _ => "q4_gemv_n16",
    };
    let args = [
        KernelArg::Ptr(x),
        KernelArg::I32(int("n", n)?),
        KernelArg::I32(int("cols", cols)?),
        KernelArg::I32(int("group", group)?),
        KernelArg::Ptr(weight.packed),
        KernelArg::Ptr(weight.scales),
        KernelArg::Ptr(weight.mins),
        KernelArg::I32(int("rows", weight.rows)?),
        KernelArg::Ptr(residual),
        KernelArg::Ptr(weight.out),
        KernelArg::Ptr(gamma),
        KernelArg::Ptr(sums),
    ];
    gpu.launch(&format!("{stem}{t}_join_{}", suffix(dt)?), (grid16, 1, 1), (THREADS, 1, 1), 0, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(rows: usize) -> Q4Slot {
        Q4Slot {
            packed: 0x1000,
            scales: 0x2000,
            mins: 0x3000,
            bias: 0,
            out: 0x4000,
            rows,
            layout: Int4Layout::RowMajor,
        }
    }

    #[test]
    fn rope_fits_whole_heads_of_lean_shapes() {
        let llama = [slot(4096), slot(1024), slot(1024)];
        let fits = |c, g, s: &[Q4Slot; 3], d| rope_shape_fits(c, g, s, d, false);
        assert!(fits(4096, 128, &llama, 128));
        assert!(fits(4096, 128, &llama, 64));
        assert!(fits(4096, 128, &llama, 16));
        assert!(rope_shape_fits(4096, 128, &llama, 128, true));
        assert!(!fits(4096, 128, &llama, 40), "head_dim not a multiple of 16");
        assert!(!fits(4096, 64, &llama, 128), "group 64 is not lean");
        assert!(!fits(4608, 128, &llama, 128), "cols not a multiple of 1024");
        assert!(!fits(4096, 128, &[slot(4096), slot(1024), slot(512)], 128), "k and v differ");
        assert!(!fits(4096, 128, &[slot(4096), slot(0), slot(0)], 128), "no kv heads");
        assert!(!fits(4096, 128, &[slot(4000), slot(1024), slot(1024)], 128), "q not whole heads");
        // Tile-major: rotate-half pairs of whole 16-row tiles, head_dim % 32.
        let tiles = llama.map(|s| Q4Slot { layout: Int4Layout::Tiles16x128, ..s });
        assert!(fits(4096, 128, &tiles, 128));
        assert!(fits(4096, 128, &tiles, 32));
        assert!(!fits(4096, 128, &tiles, 16), "a tile and its pair tile need head_dim % 32");
        assert!(!rope_shape_fits(4096, 128, &tiles, 128, true), "interleaved pairs are rows of one tile");
        assert!(!fits(4096, 128, &[tiles[0], llama[1], llama[2]], 128), "mixed layouts");
    }

    #[test]
    fn fits_only_decode_shapes_of_16_bit_types() {
        let s = [slot(4096)];
        assert!(fits(DType::F16, 1, 4096, 128, 0x100, &s));
        assert!(fits(DType::BF16, 8, 96, 32, 0x100, &s));
        assert!(!fits(DType::F32, 1, 4096, 128, 0x100, &s));
        assert!(!fits(DType::F16, 0, 4096, 128, 0x100, &s));
        assert!(!fits(DType::F16, 9, 4096, 128, 0x100, &s));
        assert!(!fits(DType::F16, 1, 4080, 48, 0x100, &s));
        assert!(!fits(DType::F16, 1, 96, 64, 0x100, &s));
        assert!(!fits(DType::F16, 1, 4096, 128, 0x108, &s));
        assert!(!fits(DType::F16, 1, 4096, 128, 0x100, &[]));
        assert!(!fits(DType::F16, 1, 4096, 128, 0x100, &[Q4Slot { packed: 0x1008, ..slot(8) }]));
        assert!(!fits(DType::F16, 1, 4096, 128, 0x100, &[Q4Slot { scales: 0x2001, ..slot(8) }]));
        assert!(!fits(DType::F16, 1, 4096, 32, 0x100, &[slot(1 << 24)]));
    }

    #[test]
    fn grid_counts_each_weights_ctas() {
        assert_eq!(plain_grid(&[slot(4096), slot(1024), slot(1024)], 32).unwrap(), 192);
        assert_eq!(plain_grid(&[slot(4096), slot(1024), slot(1024)], 16).unwrap(), 384);
        assert_eq!(plain_grid(&[slot(200), slot(72)], 32).unwrap(), 7 + 3);
        assert_eq!(plain_grid(&[slot(200), slot(72)], 16).unwrap(), 13 + 5);
        assert_eq!(plain_grid(&[slot(1)], 32).unwrap(), 1);
        assert_eq!(ctas(14336, SILU_ROWS_PER_CTA), 896);
        assert_eq!(ctas(100, SILU_ROWS_PER_CTA), 7);
    }

    #[test]
    fn unroll_variants() {
        assert_eq!(Unroll::Two.resolve(20, 10, 132, false), Unroll::Two);
        assert_eq!(Unroll::Narrow.resolve(2000, 1000, 132, false), Unroll::Narrow);
        // An 8B model on an H200: q/k/v 384 and 192, o and down 256 and 128 16- and 32-row CTAs;
        // 132 SMs.
        assert_eq!(Unroll::Auto.resolve_with(None, 256, 128, 132, false), Unroll::Narrow);
        assert_eq!(Unroll::Auto.resolve_with(None, 384, 192, 132, false), Unroll::Narrow);
        assert_eq!(Unroll::Auto.resolve_with(None, 528, 264, 132, false), Unroll::Two);
        assert_eq!(Unroll::Auto.resolve_with(Some(Unroll::Narrow), 528, 264, 132, false), Unroll::Narrow);
        assert_eq!(Unroll::Two.resolve_with(Some(Unroll::Narrow), 528, 264, 132, false), Unroll::Two);
        assert_eq!(Unroll::Narrow.rows_per_cta(), 16);
        assert_eq!(Unroll::Two.rows_per_cta(), 32);
        assert_eq!(Unroll::Narrow.plain_stem(), "q4_gemv_n16");
        assert_eq!(Unroll::Narrow.silu_stem(), "q4_gemv_silu_u2");
        assert_eq!(Unroll::Two.silu_stem(), "q4_gemv_silu_u2");
        assert!(Unroll::Two.has_silu_form() && !Unroll::Narrow.has_silu_form());
    }

    #[test]
    fn lean_kernels_take_only_their_shapes() {
        // Llama-3-8B: q/k/v, o, gate/up and down, and their tp = 2 halves.
        assert!(lean_fits(4096, 128, &[slot(4096), slot(1024), slot(1024)]));
        assert!(lean_fits(14336, 128, &[slot(4096)]));
        assert!(lean_fits(7168, 128, &[slot(4096)]));
        assert!(lean_fits(2048, 128, &[slot(4096)]));
        assert!(!lean_fits(4096, 64, &[slot(4096)]));
        assert!(!lean_fits(4096, 256, &[slot(4096)]));
        assert!(!lean_fits(4096 + 128, 128, &[slot(4096)]));
        assert!(!lean_fits(4096, 128, &[slot(4096), slot(1000)]));
        assert!(!lean_fits(0, 128, &[slot(16)]));
        // Auto takes the lean kernel where it may; a forced lean variant falls back elsewhere.
        assert_eq!(Unroll::Auto.resolve_with(None, 256, 128, 132, true), Unroll::Lean4);
        assert_eq!(Unroll::Auto.resolve_with(None, 384, 192, 132, true), Unroll::Lean);
        assert_eq!(Unroll::Auto.resolve_with(None, 256, 128, 132, false), Unroll::Narrow);
        assert_eq!(Unroll::Auto.resolve_with(None, 1792, 896, 132, false), Unroll::Two);
        assert_eq!(Unroll::Auto.resolve_with(Some(Unroll::Lean4), 256, 128, 132, true), Unroll::Lean4);
        assert_eq!(Unroll::Auto.resolve_with(Some(Unroll::Lean4), 256, 128, 132, false), Unroll::Narrow);
        assert_eq!(Unroll::Auto.resolve_with(Some(Unroll::Narrow), 256, 128, 132, true), Unroll::Narrow);
        assert_eq!(Unroll::Lean.resolve_with(None, 1792, 896, 132, false), Unroll::Two);
        assert_eq!(Unroll::Auto.resolve_silu_with(None, true), Unroll::Lean);
        assert_eq!(Unroll::Auto.resolve_silu_with(None, false), Unroll::Two);
        assert_eq!(Unroll::Auto.resolve_silu_with(Some(Unroll::Lean4), true), Unroll::Lean4);
        assert_eq!(Unroll::Lean4.resolve_silu_with(None, false), Unroll::Two);
        assert_eq!(Unroll::Auto.resolve_silu_with(Some(Unroll::Two), true), Unroll::Two);
        assert_eq!(Unroll::Lean.plain_stem(), "q4_gemv_ln");
        assert_eq!(Unroll::Lean4.silu_stem(), "q4_gemv_silu_ln4");
        assert_eq!(Unroll::Lean.rows_per_cta(), 16);
        assert!(Unroll::Lean.has_silu_form() && Unroll::Lean4.is_lean() && !Unroll::Two.is_lean());
    }

    #[test]
    fn unroll_names_round_trip() {
        for u in Unroll::ALL {
            assert_eq!(Unroll::parse(u.name()), Some(u));
        }
        assert_eq!(Unroll::parse(" 2 "), Some(Unroll::Two));
        assert_eq!(Unroll::parse("auto"), Some(Unroll::Auto));
        assert_eq!(Unroll::parse("pf"), None);
        assert_eq!(Unroll::parse("u8"), None);
    }

    #[test]
    fn set_unroll_forces_auto() {
        // The only test that sets the override (tests of this module share the process).
        set_unroll(Some(Unroll::Narrow));
        assert_eq!(forced(), Some(Unroll::Narrow));
        assert_eq!(Unroll::Auto.resolve(2000, 1000, 132, false), Unroll::Narrow);
        set_unroll(Some(Unroll::Lean4));
        assert_eq!(forced(), Some(Unroll::Lean4));
        set_unroll(Some(Unroll::Auto));
        assert_eq!(forced(), forced_unroll());
        set_unroll(None);
        assert_eq!(forced(), forced_unroll());
    }

    #[test]
    fn set_tiling_holds_for_the_calling_thread_only() {
        use tm_core::quant::Int4Layout::{RowMajor, Tiles16x128};
        let lean = |dt| preferred_layout(dt, 4096, 4096, 128);
        let unforced = lean(DType::F16);
        set_tiling(Some(true));
        assert_eq!(lean(DType::F16), Tiles16x128);
        assert_eq!(lean(DType::BF16), Tiles16x128);
        // never for f32, group 64 or shapes the lean kernels do not take
        assert_eq!(lean(DType::F32), RowMajor);
        assert_eq!(preferred_layout(DType::F16, 4096, 4096, 64), RowMajor);
        assert_eq!(preferred_layout(DType::F16, 4096, 1000, 128), RowMajor);
        // another thread sees the environment's choice
        assert_eq!(std::thread::spawn(move || lean(DType::F16)).join().ok(), Some(unforced));
        set_tiling(Some(false));
        assert_eq!(lean(DType::F16), RowMajor);
        set_tiling(None);
        assert_eq!(lean(DType::F16), unforced);
    }
}
