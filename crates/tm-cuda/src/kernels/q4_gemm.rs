//! Launcher for `q4_gemm.cu`: the w4a16 prefill GEMM `out[n, rows] = x[n, cols] · Wᵀ` with `W` in
//! tm's int4 layout ([`tm_core::quant`]), f16 or bf16 activations, tensor cores (mma.sync
//! m16n8k16, f32 accumulators), the packed weights dequantized in registers right before the mma
//! (never into memory).
//!
//! [`crate::kernels::quant::matmul_q4`] sends a call here when `n` is above the GEMV range and
//! [`eligible`] accepts it; everything else (f32, `cols % 64 != 0`, unaligned pointers, pre-sm_80
//! devices) stays on the older `matmul_q4_tiled` kernel.
//!
//! Three tile shapes (`n` × `rows` per block, 256 threads), chosen by [`pick`] for the fewest
//! estimated waves of work (override with `TM_Q4_GEMM`, see [`Policy`]):
//! - [`Tile::Large`]: 128 × 256, warp tiles 64 × 64, 3 pipeline stages, 84 KiB shared memory;
//! - [`Tile::Medium`]: 128 × 128, warp tiles 64 × 32, 4 stages, 88 KiB (two blocks per SM where
//!   shared memory allows);
//! - [`Tile::Small`]: 64 × 128, warp tiles 32 × 32, 4 stages, 56 KiB;
//! - [`Tile::Tall`] (only when forced): 128 × 256, warp tiles 128 × 32, 3 stages, 84 KiB.
//!
//! All fit the 99 KiB per block of sm_86/sm_89 and the Jetson's (sm_87) 163 KiB. On sm_90 two more
//! shapes use Hopper's warpgroup mma (wgmma, the weights dequantized into its register operand,
//! the activations read by the tensor cores from shared memory), when the loaded image is the
//! sm_90a one ([`wgmma_available`]):
//! - [`Tile::Wgmma`]: 256 tokens × 128 weight rows, 64-column k-tiles, 4 stages, 145 KiB;
//! - [`Tile::WgmmaK128`]: the same with 128-column k-tiles (half the barriers and waits per
//!   column), 3 stages, 217 KiB, for `group % 128 == 0` (what [`choose`] takes instead of
//!   [`Tile::Wgmma`] there, up to [`K128_MAX_COLS`] columns);
//! - [`Tile::WgmmaNarrow`]: 128 × 128, 4 stages, 81 KiB (more blocks for mid-sized batches);
//! - [`Tile::WgmmaSmall`]: 64 × 128, 4 stages, 49 KiB, two blocks per SM, for batches of up to
//!   [`WGMMA_SMALL_MAX_TOKENS`] tokens;
//! - [`Tile::WgmmaSmallK128`]: the same with 128-column k-tiles, 97 KiB, two blocks per SM, for
//!   batches of up to [`WGMMA_SMALL_K128_MAX_TOKENS`] tokens where `group % 128 == 0`;
//! - [`Tile::WgmmaTinyK128`]: 32 × 128 with 128-column k-tiles, 65 KiB, two blocks per SM, for
//!   batches of up to [`WGMMA_TINY_K128_MAX_TOKENS`] tokens where `group % 128 == 0`;
//! - [`Tile::WgmmaMiniK128`]: 16 × 128 with 128-column k-tiles, 49 KiB, two blocks per SM, for
//!   batches of up to [`WGMMA_MINI_K128_MAX_TOKENS`] tokens where `group % 128 == 0`.
//!
//! The wgmma kernels take up to three weights of one `x` per launch ([`Part`]: a layer's q, k
//! and v, or gate and up, as one grid; [`launch`]).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

use tm_core::quant::Int4Layout;
use tm_core::{DType, Error, Result};

use super::suffix;
use crate::runtime::{Gpu, KernelArg};

/// Threads per block.
const THREADS: u32 = 256;
/// Columns per k-tile; `cols` must be a multiple.
pub const BK: usize = 64;
/// The hardware's limit on `grid.y` (the `n` tiles).
const MAX_GRID_Y: usize = 65535;

/// A block tile shape of the kernel (`BM` activation rows × `BN` weight rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tile {
    /// 128 × 256 (warp tiles 64 × 64), 3 stages: large prefill batches.
    Large,
    /// 128 × 128 (warp tiles 64 × 32), 4 stages: mid-sized batches, or too few large tiles.
    Medium,
    /// 64 × 128 (warp tiles 32 × 32), 4 stages: small batches.
    Small,
    /// 128 × 256 with tall warp tiles (128 × 32, warps 1 × 8), 3 stages: each weight is
    /// dequantized once per block instead of twice, for twice the activation ldmatrix traffic.
    /// Never picked automatically; forced (`TM_Q4_GEMM=t`) to measure it against [`Tile::Large`].
    Tall,
    /// sm_90a: 256 × 128 with wgmma (two warpgroups of 64 weight rows × 256 tokens), 4 stages.
    Wgmma,
    /// sm_90a: [`Tile::Wgmma`] with 128-column k-tiles, 3 stages; needs `group % 128 == 0`.
    WgmmaK128,
    /// sm_90a: 128 × 128 with wgmma, 4 stages: twice the blocks of [`Tile::Wgmma`].
    WgmmaNarrow,
    /// sm_90a: 64 × 128 with wgmma (m64n64), 4 stages, two blocks per SM: batches of up to
    /// [`WGMMA_SMALL_MAX_TOKENS`] tokens.
    WgmmaSmall,
    /// sm_90a: [`Tile::WgmmaSmall`] with 128-column k-tiles (half the barriers and waits per
    /// column), 4 stages, two blocks per SM; needs `group % 128 == 0`: decode batches of up to
    /// [`WGMMA_SMALL_K128_MAX_TOKENS`] tokens.
    WgmmaSmallK128,
    /// sm_90a: 32 × 128 (m64n32) with 128-column k-tiles, 4 stages, two blocks per SM; needs
    /// `group % 128 == 0`: decode batches of up to [`WGMMA_TINY_K128_MAX_TOKENS`] tokens.
    WgmmaTinyK128,
    /// sm_90a: 16 × 128 (m64n16) with 128-column k-tiles, 4 stages, two blocks per SM; needs
    /// `group % 128 == 0`: decode batches of up to [`WGMMA_MINI_K128_MAX_TOKENS`] tokens.
    WgmmaMiniK128,
}

impl Tile {
    /// Every tile shape.
    pub const ALL: [Tile; 11] = [
        Tile::Large,
        Tile::Medium,
        Tile::Small,
        Tile::Tall,
        Tile::Wgmma,
        Tile::WgmmaK128,
        Tile::WgmmaNarrow,
        Tile::WgmmaSmall,
        Tile::WgmmaSmallK128,
        Tile::WgmmaTinyK128,
        Tile::WgmmaMiniK128,
    ];
    /// The shapes [`pick`] chooses from, largest first (the wgmma ones only where available).
    pub const AUTO: [Tile; 6] =
        [Tile::Wgmma, Tile::WgmmaNarrow, Tile::WgmmaSmall, Tile::Large, Tile::Medium, Tile::Small];

    /// Whether the shape is one of the sm_90a wgmma kernels.
    pub fn wgmma(self) -> bool {
        matches!(
            self,
            Tile::Wgmma
                | Tile::WgmmaK128
                | Tile::WgmmaNarrow
                | Tile::WgmmaSmall
                | Tile::WgmmaSmallK128
                | Tile::WgmmaTinyK128
                | Tile::WgmmaMiniK128
        )
    }

    /// 64-column sub-tiles per k-tile (2 for the 128-column k-tiles, else 1).
    fn subs(self) -> usize {
        if matches!(self, Tile::WgmmaK128 | Tile::WgmmaSmallK128 | Tile::WgmmaTinyK128 | Tile::WgmmaMiniK128) {
            2
        } else {
            1
        }
    }

    /// Blocks of this shape an H200 SM holds at once (the wgmma kernels' registers and shared
    /// memory): two for the shapes of 64 tokens and fewer, else one. [`split_k`] fills this many
    /// per SM.
    pub fn blocks_per_sm(self) -> usize {
        if matches!(self, Tile::WgmmaSmall | Tile::WgmmaSmallK128 | Tile::WgmmaTinyK128 | Tile::WgmmaMiniK128) {
            2
        } else {
            1
        }
    }

    /// The letter in the kernel name (`matmul_q4_gemm_{tag}_{dtype}`).
    pub fn tag(self) -> &'static str {
        match self {
            Tile::Large => "l",
            Tile::Medium => "m",
            Tile::Small => "s",
            Tile::Tall => "t",
            Tile::Wgmma => "w",
            Tile::WgmmaK128 => "x",
            Tile::WgmmaNarrow => "v",
            Tile::WgmmaSmall => "u",
            Tile::WgmmaSmallK128 => "y",
            Tile::WgmmaTinyK128 => "z",
            Tile::WgmmaMiniK128 => "q",
        }
    }

    /// Activation rows (`n`) per block.
    pub fn bm(self) -> usize {
        match self {
            Tile::Wgmma | Tile::WgmmaK128 => 256,
            Tile::Large | Tile::Medium | Tile::Tall | Tile::WgmmaNarrow => 128,
            Tile::Small | Tile::WgmmaSmall | Tile::WgmmaSmallK128 => 64,
            Tile::WgmmaTinyK128 => 32,
            Tile::WgmmaMiniK128 => 16,
        }
    }

    /// Weight rows per block.
    pub fn bn(self) -> usize {
        match self {
            Tile::Large | Tile::Tall => 256,
            Tile::Medium
            | Tile::Small
            | Tile::Wgmma
            | Tile::WgmmaK128
            | Tile::WgmmaNarrow
            | Tile::WgmmaSmall
            | Tile::WgmmaSmallK128
            | Tile::WgmmaTinyK128
            | Tile::WgmmaMiniK128 => 128,
        }
    }

    fn stages(self) -> usize {
        match self {
            Tile::Large | Tile::Tall | Tile::WgmmaK128 => 3,
            Tile::Medium
            | Tile::Small
            | Tile::Wgmma
            | Tile::WgmmaNarrow
            | Tile::WgmmaSmall
            | Tile::WgmmaSmallK128
            | Tile::WgmmaTinyK128
            | Tile::WgmmaMiniK128 => 4,
        }
    }

    /// Dynamic shared memory per block: per stage the activation tile (`bm` × 64 × 2 bytes), the
    /// packed weight tile (`bn` × 32 bytes) and, for the mma.sync shapes, the scale/min pairs
    /// (`bn` × 16 bytes; the wgmma shapes keep them in registers and align their stages to 1 KiB,
    /// for which they ask 1 KiB more; [`Tile::WgmmaK128`] holds two 64-column sub-tiles).
    pub fn shared_bytes(self) -> usize {
        if self.wgmma() {
            return self.stages() * self.subs() * (self.bm() * BK * 2 + self.bn() * BK / 2) + 1024;
        }
        self.stages() * (self.bm() * BK * 2 + self.bn() * BK / 2 + self.bn() * 16)
    }

    /// Relative math throughput of a block of this shape (bigger warp tiles reuse each loaded or
    /// dequantized fragment more), for [`pick`].
    fn efficiency(self) -> f64 {
        // The wgmma shapes measured about 1.9x and 1.3-1.4x the large tile's throughput (H200;
        // at 1024 tokens x 6144 rows two waves of `w` beat three of `v`).
        match self {
            Tile::Wgmma | Tile::WgmmaK128 => 1.9,
            // Per tile area as the narrow shape (it is a candidate only for small batches, see
            // WGMMA_SMALL_MAX_TOKENS).
            Tile::WgmmaNarrow | Tile::WgmmaSmall | Tile::WgmmaSmallK128 | Tile::WgmmaTinyK128 | Tile::WgmmaMiniK128 => {
                1.4
            }
            Tile::Large | Tile::Tall => 1.0,
            Tile::Medium => 0.8,
            Tile::Small => 0.6,
        }
    }

    /// The tile named by `s` (`l`, `m`, `s`, `t`, `w`, `x`, `v`, `u`, `y`, `z`, `q`, or `large`,
    /// `medium`, `small`, `tall`, `wgmma`, `wgmma-k128`, `wgmma-narrow`, `wgmma-small`,
    /// `wgmma-small-k128`, `wgmma-tiny-k128`, `wgmma-mini-k128`).
    pub fn parse(s: &str) -> Option<Tile> {
        match s.trim().to_ascii_lowercase().as_str() {
            "l" | "large" => Some(Tile::Large),
            "m" | "medium" => Some(Tile::Medium),
            "s" | "small" => Some(Tile::Small),
            "t" | "tall" => Some(Tile::Tall),
            "w" | "wgmma" => Some(Tile::Wgmma),
            "x" | "wgmma-k128" => Some(Tile::WgmmaK128),
            "v" | "wgmma-narrow" => Some(Tile::WgmmaNarrow),
            "u" | "wgmma-small" => Some(Tile::WgmmaSmall),
            "y" | "wgmma-small-k128" => Some(Tile::WgmmaSmallK128),
            "z" | "wgmma-tiny-k128" => Some(Tile::WgmmaTinyK128),
            "q" | "wgmma-mini-k128" => Some(Tile::WgmmaMiniK128),
            _ => None,
        }
    }
}

/// Which prefill kernel int4 matmuls use, from `TM_Q4_GEMM`: unset or `auto` → [`Policy::Auto`];
/// `off`/`0`/`tiled` → [`Policy::Off`] (the older tiled kernel, for comparisons); `l`/`m`/`s`/`t`/
/// `w`/`x`/`v`/`u`/`y`/`z`/`q` → [`Policy::Force`] (a wgmma shape where wgmma is unavailable falls
/// back to `auto`; `x` where `group % 128 != 0` to `w`, `y`, `z` and `q` to `u`). Anything else is reported once on stderr and treated as `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// [`pick`] chooses the tile.
    Auto,
    /// Never use this kernel.
    Off,
    /// Always this tile (when the call is [`eligible`]).
    Force(Tile),
}

impl Policy {
    /// Parses a `TM_Q4_GEMM` value.
    pub fn parse(v: Option<&str>) -> std::result::Result<Policy, String> {
        match v.map(|s| s.trim().to_ascii_lowercase()) {
            None => Ok(Policy::Auto),
            Some(s) if s.is_empty() || s == "auto" => Ok(Policy::Auto),
            Some(s) if s == "off" || s == "0" || s == "tiled" => Ok(Policy::Off),
            Some(s) => Tile::parse(&s)
                .map(Policy::Force)
                .ok_or_else(|| format!("TM_Q4_GEMM = {s:?} is not one of auto, off, l, m, s, t, w, x, v, u, y, z, q")),
        }
    }

    /// The process's policy (read once).
    pub fn from_env() -> Policy {
        static POLICY: OnceLock<Policy> = OnceLock::new();
        *POLICY.get_or_init(|| {
            let v = std::env::var("TM_Q4_GEMM").ok();
            Policy::parse(v.as_deref()).unwrap_or_else(|e| {
                eprintln!("warning: {e}; using auto");
                Policy::Auto
            })
        })
    }
}

/// The process-wide override of [`Policy::from_env`] set by [`set_policy`]: 0 = none, 1 = auto,
/// 2 = off, 3 + i = force `Tile::ALL[i]`.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Overrides `TM_Q4_GEMM` for the whole process (`None`: back to the environment's policy). For
/// tests and benchmarks that compare the tile shapes or the older kernel in one process.
pub fn set_policy(policy: Option<Policy>) {
    let code = match policy {
        None => 0,
        Some(Policy::Auto) => 1,
        Some(Policy::Off) => 2,
        Some(Policy::Force(t)) => 3 + Tile::ALL.iter().position(|&a| a == t).unwrap_or(0) as u8,
    };
    OVERRIDE.store(code, Ordering::Relaxed);
}

/// The policy in force: [`set_policy`]'s override, else `TM_Q4_GEMM` ([`Policy::from_env`]).
pub fn policy() -> Policy {
    match OVERRIDE.load(Ordering::Relaxed) {
        0 => Policy::from_env(),
        1 => Policy::Auto,
        2 => Policy::Off,
        c => Policy::Force(Tile::ALL[usize::from(c - 3).min(Tile::ALL.len() - 1)]),
    }
}

/// Whether the kernel takes a call: f16/bf16 on sm_80+, `cols % 64 == 0`, `group % 32 == 0`
/// dividing `cols`, `rows % 8 == 0`, `x` and `packed` 16-byte aligned, `out` 4-byte and
/// `scales`/`mins` 2-byte aligned, and `n` within the grid limit of the smallest tile. The
/// caller has validated sizes against `int` already.
#[allow(clippy::too_many_arguments)]
pub fn eligible(
    sm: u32,
    dt: DType,
    n: usize,
    rows: usize,
    cols: usize,
    group: usize,
    x: u64,
    out: u64,
    packed: u64,
    scales: u64,
    mins: u64,
) -> bool {
    sm >= 80
        && matches!(dt, DType::F16 | DType::BF16)
        && cols > 0
        && cols.is_multiple_of(BK)
        && group > 0
        && group.is_multiple_of(32)
        && cols.is_multiple_of(group)
        && rows.is_multiple_of(8)
        && x.is_multiple_of(16)
        && packed.is_multiple_of(16)
        && out.is_multiple_of(4)
        && scales.is_multiple_of(2)
        && mins.is_multiple_of(2)
        && n.div_ceil(Tile::Small.bm()) <= MAX_GRID_Y
}

/// The most tokens for which [`pick`] considers [`Tile::WgmmaSmall`]. AWQ 8B decode replay on the
/// H200 (the step's GEMMs split along K, [`split_k`]), per step, with the small shape against
/// the narrow one: 16 tokens 6704 against 7038 us; 32 tokens 7693-7699 against 7426-7439, 48
/// tokens 8126-8132 against 7863-7876, 64 tokens 8689-8692 against 8371-8378 (though ncu timed
/// each of its products alone 14-15% faster at 64 tokens).
pub const WGMMA_SMALL_MAX_TOKENS: usize = 16;

/// The tile with the least estimated time on `sms` multiprocessors: whole waves of blocks (one
/// block per SM) times the work of a block over its `Tile::efficiency`. The wgmma shapes are
/// candidates only with `wgmma` ([`wgmma_available`]), [`Tile::WgmmaSmall`] only up to
/// [`WGMMA_SMALL_MAX_TOKENS`]; tiles whose `n` grid would exceed the hardware limit are skipped
/// (the small tile always fits an [`eligible`] call).
pub fn pick(n: usize, rows: usize, sms: usize, wgmma: bool) -> Tile {
    let sms = sms.max(1);
    let mut best = (f64::INFINITY, Tile::Small);
    for tile in Tile::AUTO {
        if (tile.wgmma() && !wgmma)
            || n.div_ceil(tile.bm()) > MAX_GRID_Y
            || (tile == Tile::WgmmaSmall && n > WGMMA_SMALL_MAX_TOKENS)
        {
            continue;
        }
        let blocks = n.div_ceil(tile.bm()) * rows.div_ceil(tile.bn());
        let waves = blocks.div_ceil(sms) as f64;
        let cost = waves * (tile.bm() * tile.bn()) as f64 / tile.efficiency();
        if cost < best.0 {
            best = (cost, tile);
        }
    }
    best.1
}

/// The most K slices [`split_k`] cuts a call into.
pub const MAX_SPLITS: usize = 16;
/// The fewest columns of a K slice.
pub const MIN_SPLIT_COLS: usize = 256;

/// Whether `TM_Q4_GEMM_SPLIT` allows split-K (unset or anything but `0`, `off`, `false`); read
/// once, for A/B runs.
fn split_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| crate::switches::env_on("TM_Q4_GEMM_SPLIT"))
}

/// Whether a decode batch of `n` tokens runs several weights of one `x` (q/k/v, gate/up) as one
/// launch ([`crate::kernels::quant::matmul_q4_grouped`]): `GEMV_MAX_N < n <=`
/// [`WGMMA_SMALL_K128_MAX_TOKENS`], unless `TM_Q4_GEMM_GROUP=0` (read once, for A/B runs).
pub fn groups(n: usize) -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    n > crate::kernels::quant::GEMV_MAX_N
        && n <= WGMMA_SMALL_K128_MAX_TOKENS
        && *ALLOWED.get_or_init(|| crate::switches::env_on("TM_Q4_GEMM_GROUP"))
}

/// How many K slices a wgmma launch of `n` tokens × the weights of `rows` rows (one per
/// [`Part`]) × `cols` columns is cut into on `sms` multiprocessors (1: none). A batch of a few
/// dozen tokens gives such a call `rows / 128` blocks, e.g. 8 for a 1024-row k or v projection,
/// each streaming its rows' whole K while the other SMs idle (AWQ 8B at 64 tokens: 43 us for
/// every q/k/v/o product, 142 for down). Grids of at most half the blocks the GPU holds at once
/// (`sms` × [`Tile::blocks_per_sm`]) are cut into slices of whole 128-column units, at least
/// [`MIN_SPLIT_COLS`] each, up to [`MAX_SPLITS`], so that they fill about every slot; each slice
/// stores f32 partial sums and `matmul_q4_gemm_reduce` adds them up in order.
pub fn split_k(tile: Tile, n: usize, rows: &[usize], cols: usize, sms: usize) -> usize {
    if !tile.wgmma() || !cols.is_multiple_of(128) || !split_allowed() {
        return 1;
    }
    let blocks = n.div_ceil(tile.bm()) * rows.iter().map(|r| r.div_ceil(tile.bn())).sum::<usize>();
    let slots = sms * tile.blocks_per_sm();
    if blocks == 0 || blocks * 2 > slots {
        return 1;
    }
    let want = (slots / blocks).min(MAX_SPLITS).min(cols / MIN_SPLIT_COLS);
    if want < 2 {
        return 1;
    }
    cols.div_ceil(split_cols(cols, want))
}

/// The columns of each of `splits` K slices of `cols` columns: whole 128-column units, the last
/// slice taking what is left.
fn split_cols(cols: usize, splits: usize) -> usize {
    (cols / 128).div_ceil(splits) * 128
}

/// Products that ran split ([`split_k`]) in this process.
static SPLIT_PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// How many int4 products have run with split-K in this process: tests read it to confirm which
/// path ran.
pub fn split_products() -> u64 {
    SPLIT_PRODUCTS.load(Ordering::Relaxed)
}

/// Launches of several weights at once ([`launch`] with more than one [`Part`] on a wgmma shape).
static GROUPED_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many wgmma launches in this process computed several weights in one grid: tests read it to
/// confirm that q/k/v and gate/up went that way.
pub fn grouped_launches() -> u64 {
    GROUPED_LAUNCHES.load(Ordering::Relaxed)
}

/// Bytes of f32 partial sums a launch cut into `splits` K slices needs for `rows` weight rows in
/// all (0 for one slice).
pub fn partial_bytes(splits: usize, n: usize, rows: usize) -> usize {
    if splits > 1 {
        splits * n * rows * 4
    } else {
        0
    }
}

/// The kernel name, grid and dynamic shared memory of a call with `tile`.
pub fn plan(tile: Tile, dt: DType, n: usize, rows: usize) -> Result<(String, (u32, u32, u32), u32)> {
    let sfx = suffix(dt)?;
    if dt == DType::F32 {
        return Err(Error::invalid("matmul_q4_gemm: f32 activations are not supported (f16 or bf16 only)"));
    }
    let gx = rows.div_ceil(tile.bn());
    let gy = n.div_ceil(tile.bm());
    if gy > MAX_GRID_Y {
        return Err(Error::invalid(format!(
            "matmul_q4_gemm: n = {n} exceeds the grid limit of {} for tile {tile:?}",
            MAX_GRID_Y * tile.bm()
        )));
    }
    let gx = u32::try_from(gx)
        .map_err(|_| Error::invalid(format!("matmul_q4_gemm: rows = {rows} needs too many blocks")))?;
    Ok((format!("matmul_q4_gemm_{}_{sfx}", tile.tag()), (gx, gy as u32, 1), tile.shared_bytes() as u32))
}

/// One weight of a launch: `packed` u8 `[rows, cols/2]` in tm's nibble order and `layout`,
/// `scales`/`mins` f16 `[rows, cols/group]`, and its output `out` `[n, rows]`. Device addresses.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// The product's output.
    pub out: u64,
    /// The packed nibbles.
    pub packed: u64,
    /// The groups' scales.
    pub scales: u64,
    /// The groups' mins.
    pub mins: u64,
    /// Weight rows (output features).
    pub rows: usize,
    /// The packed weight's layout.
    pub layout: Int4Layout,
}

/// The most weights one launch takes.
pub const MAX_PARTS: usize = 3;

/// Launches the kernel with `tile` for `parts` (1 to [`MAX_PARTS`] weights of `cols` columns and
/// groups of `group`, each [`eligible`] with `x` `[n, cols]` in `dt`; the caller checked that):
/// the wgmma shapes compute them all in one grid (split along K as [`split_k`] says when
/// `partials`, a device buffer (address, bytes), holds the partial sums; without one, or when it
/// is too small, the launch is not split), the mma.sync shapes one launch per weight. The
/// kernels are queued on the GPU's stream.
#[allow(clippy::too_many_arguments)]
pub fn launch(
    gpu: &Gpu,
    partials: Option<(u64, usize)>,
    tile: Tile,
    dt: DType,
    x: u64,
    n: usize,
    cols: usize,
    group: usize,
    parts: &[Part],
) -> Result<()> {
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| Error::invalid(format!("matmul_q4_gemm: {what} = {v} exceeds the kernel's int")))
    };
    if parts.is_empty() || parts.len() > MAX_PARTS {
        return Err(Error::invalid(format!(
            "matmul_q4_gemm: {} weights in one launch (1 to {MAX_PARTS})",
            parts.len()
        )));
    }
    let (n32, c32, g32) = (int("n", n)?, int("cols", cols)?, int("group", group)?);
    // Weights of no rows own no blocks (the kernel maps blocks onto the others).
    let parts: Vec<Part> = parts.iter().copied().filter(|p| p.rows > 0).collect();
    for p in &parts {
        if !eligible(gpu.sm(), dt, n, p.rows, cols, group, x, p.out, p.packed, p.scales, p.mins) {
            return Err(Error::invalid(format!(
                "matmul_q4_gemm: the call (dtype {dt}, n = {n}, rows = {}, cols = {cols}, group = {group}, sm_{}) \
                 does not meet the kernel's requirements (f16/bf16, sm_80+, cols % 64, rows % 8, aligned pointers)",
                p.rows,
                gpu.sm()
            )));
        }
    }
    if n == 0 || parts.is_empty() {
        return Ok(());
    }
    let total_rows: usize = parts.iter().map(|p| p.rows).sum();
    if !tile.wgmma() {
        for p in &parts {
            let tiled = super::layout_arg("matmul_q4_gemm", p.layout, p.rows, cols)?;
            let (name, (gx, gy, _), smem) = plan(tile, dt, n, p.rows)?;
            let args = [
                KernelArg::Ptr(p.out),
                KernelArg::Ptr(x),
                KernelArg::Ptr(p.packed),
                KernelArg::Ptr(p.scales),
                KernelArg::Ptr(p.mins),
                KernelArg::I32(n32),
                KernelArg::I32(int("rows", p.rows)?),
                KernelArg::I32(c32),
                KernelArg::I32(g32),
                tiled,
            ];
            gpu.launch(&name, (gx, gy, 1), (THREADS, 1, 1), smem, &args)?;
        }
        return Ok(());
    }
    let sms = gpu.info().multiprocessors as usize;
    let rows: Vec<usize> = parts.iter().map(|p| p.rows).collect();
    let want = split_k(tile, n, &rows, cols, sms);
    let buf = partials.filter(|&(_, bytes)| want > 1 && partial_bytes(want, n, total_rows) <= bytes).map(|b| b.0);
    let (splits, kcols) = match buf {
        Some(_) => (want, split_cols(cols, want)),
        None => (1, cols),
    };
    let (name, (_, gy, _), smem) = plan(tile, dt, n, total_rows)?;
    let blocks: usize = rows.iter().map(|r| r.div_ceil(tile.bn())).sum::<usize>() * splits;
    let gx = u32::try_from(blocks)
        .map_err(|_| Error::invalid(format!("matmul_q4_gemm: {total_rows} rows need too many blocks")))?;
    let mut args = vec![
        KernelArg::Ptr(x),
        KernelArg::I32(n32),
        KernelArg::I32(c32),
        KernelArg::I32(g32),
        KernelArg::Ptr(buf.unwrap_or(0)),
        KernelArg::I32(int("kcols", kcols)?),
        KernelArg::I32(parts.len() as i32),
    ];
    for i in 0..MAX_PARTS {
        match parts.get(i) {
            Some(p) => args.extend([
                KernelArg::Ptr(p.out),
                KernelArg::Ptr(p.packed),
                KernelArg::Ptr(p.scales),
                KernelArg::Ptr(p.mins),
                KernelArg::I32(int("rows", p.rows)?),
                super::layout_arg("matmul_q4_gemm", p.layout, p.rows, cols)?,
            ]),
            None => args.extend([
                KernelArg::Ptr(0),
                KernelArg::Ptr(0),
                KernelArg::Ptr(0),
                KernelArg::Ptr(0),
                KernelArg::I32(0),
                KernelArg::I32(0),
            ]),
        }
    }
    gpu.launch(&name, (gx, gy, 1), (THREADS, 1, 1), smem, &args)?;
    if parts.len() > 1 {
        GROUPED_LAUNCHES.fetch_add(1, Ordering::Relaxed);
    }
    let Some(buf) = buf else { return Ok(()) };
    // n * rows is a multiple of 4 (rows % 8 == 0): one float4 of every slice per thread and step.
    let quads = n * total_rows / 4;
    let blocks = u32::try_from(quads.div_ceil(256).min(sms * 8)).unwrap_or(1);
    let mut args = vec![
        KernelArg::Ptr(buf),
        KernelArg::I32(int("splits", splits)?),
        KernelArg::I32(n32),
        KernelArg::I32(parts.len() as i32),
    ];
    for i in 0..MAX_PARTS {
        let (out, r) = parts.get(i).map_or((0, 0), |p| (p.out, p.rows));
        args.extend([KernelArg::Ptr(out), KernelArg::I32(int("rows", r)?)]);
    }
    gpu.launch(&format!("matmul_q4_gemm_reduce_{}", suffix(dt)?), (blocks, 1, 1), (256, 1, 1), 0, &args)?;
    SPLIT_PRODUCTS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The tile [`crate::kernels::quant::matmul_q4`] uses for an [`eligible`] call with int4 groups
/// of `group` columns under `policy`, or `None` for the older tiled kernel. `wgmma`: whether the
/// sm_90a shapes can run ([`wgmma_available`]); a forced one that cannot falls back to [`pick`].
/// [`Tile::Wgmma`] becomes [`Tile::WgmmaK128`] where `group % 128 == 0` (`cols` is then a multiple
/// of 128 too) and `cols <= K128_MAX_COLS`; a forced [`Tile::WgmmaK128`] becomes [`Tile::Wgmma`]
/// where the groups do not allow it. Automatically, batches of up to
/// [`WGMMA_MINI_K128_MAX_TOKENS`], [`WGMMA_TINY_K128_MAX_TOKENS`] and
/// [`WGMMA_SMALL_K128_MAX_TOKENS`] tokens take [`Tile::WgmmaMiniK128`], [`Tile::WgmmaTinyK128`]
/// and [`Tile::WgmmaSmallK128`] where the groups allow it (a forced one becomes
/// [`Tile::WgmmaSmall`] where they do not).
pub fn choose(
    policy: Policy,
    n: usize,
    rows: usize,
    cols: usize,
    group: usize,
    sms: usize,
    wgmma: bool,
) -> Option<Tile> {
    let k128 = group.is_multiple_of(128);
    let tile = match policy {
        Policy::Off => return None,
        Policy::Force(t) if n.div_ceil(t.bm()) <= MAX_GRID_Y && (wgmma || !t.wgmma()) => t,
        Policy::Auto if wgmma && k128 && n <= WGMMA_MINI_K128_MAX_TOKENS => Tile::WgmmaMiniK128,
        Policy::Auto if wgmma && k128 && n <= WGMMA_TINY_K128_MAX_TOKENS => Tile::WgmmaTinyK128,
        Policy::Auto if wgmma && k128 && n <= WGMMA_SMALL_K128_MAX_TOKENS => Tile::WgmmaSmallK128,
        Policy::Force(_) | Policy::Auto => pick(n, rows, sms, wgmma),
    };
    Some(match tile {
        Tile::Wgmma if k128 && cols <= K128_MAX_COLS && policy != Policy::Force(Tile::Wgmma) => Tile::WgmmaK128,
        Tile::WgmmaK128 if !k128 => Tile::Wgmma,
        Tile::WgmmaSmallK128 | Tile::WgmmaTinyK128 | Tile::WgmmaMiniK128 if !k128 => Tile::WgmmaSmall,
        t => t,
    })
}

/// The most tokens for which [`choose`] takes [`Tile::WgmmaSmallK128`] (where the groups allow
/// it). AWQ 8B-shaped layers on the H200, a decode step's products (q/k/v and gate/up one launch
/// each; scripts/gpu/q4_gemm_decode.cu): 64 tokens 3618 us against 6313 with
/// [`Tile::WgmmaNarrow`] launched per weight and 4284 with [`Tile::WgmmaSmall`]; 32 tokens 3348
/// against 6127 / 4031; 16 tokens 3237 against 4792 (the small shape per weight, what [`pick`]
/// takes there) / 3919.
pub const WGMMA_SMALL_K128_MAX_TOKENS: usize = 64;

/// The most tokens for which [`choose`] takes [`Tile::WgmmaTinyK128`] (where the groups allow
/// it). Same harness and shapes: 32 tokens 2916 us per step against 3367 with
/// [`Tile::WgmmaSmallK128`], 16 tokens 2809 against 3249.
pub const WGMMA_TINY_K128_MAX_TOKENS: usize = 32;

/// The most tokens for which [`choose`] takes [`Tile::WgmmaMiniK128`] (where the groups allow
/// it). Same harness and shapes: 16 tokens 2658-2664 us per step against 2794-2803 with
/// [`Tile::WgmmaTinyK128`], 12 tokens 2642-2645 against 2785-2798, 9 tokens 2626-2633 against 2765.
pub const WGMMA_MINI_K128_MAX_TOKENS: usize = 16;

/// The longest `cols` for which [`choose`] prefers [`Tile::WgmmaK128`] to [`Tile::Wgmma`]. H200,
/// 2048-8192 tokens: bf16 6-10% faster on the 8B q/o, q/k/v and gate/up products (4096 columns),
/// f16 0-4%; on down (14336 columns) 6-10% slower in both.
pub const K128_MAX_COLS: usize = 8192;

/// The marker kernel that only `q4_gemm.cu`'s sm_90a image defines.
const WGMMA_MARKER: &str = "matmul_q4_gemm_sm90a";

/// Whether the wgmma shapes can run on `gpu`: an sm_90 device whose loaded `q4_gemm` image is the
/// sm_90a one (`cargo xtask build-kernels` and the NVRTC fallback build sm_90 as sm_90a; an image
/// built otherwise has trapping stubs and no marker kernel). Looked up once per process.
pub fn wgmma_available(gpu: &Gpu) -> bool {
    /// 0: not yet known, 1: no, 2: yes.
    static KNOWN: AtomicU8 = AtomicU8::new(0);
    if gpu.sm() != 90 {
        return false;
    }
    match KNOWN.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let yes = gpu.function(WGMMA_MARKER).is_ok();
            KNOWN.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_every_supported_arch() {
        // sm_86/sm_89 allow 99 KiB of dynamic shared memory per block, sm_90 227 KiB.
        for t in Tile::ALL {
            let limit = if t.wgmma() { 227 } else { 99 } * 1024;
            assert!(t.shared_bytes() <= limit, "{t:?}: {} bytes", t.shared_bytes());
        }
        assert_eq!(Tile::Wgmma.shared_bytes(), 4 * (32768 + 4096) + 1024);
        assert_eq!(Tile::WgmmaNarrow.shared_bytes(), 4 * (16384 + 4096) + 1024);
        assert_eq!(Tile::WgmmaSmall.shared_bytes(), 4 * (8192 + 4096) + 1024);
        assert_eq!(Tile::WgmmaSmallK128.shared_bytes(), 4 * 2 * (8192 + 4096) + 1024);
        assert_eq!(Tile::WgmmaTinyK128.shared_bytes(), 4 * 2 * (4096 + 4096) + 1024);
        assert_eq!(Tile::WgmmaMiniK128.shared_bytes(), 4 * 2 * (2048 + 4096) + 1024);
        assert_eq!(Tile::WgmmaK128.shared_bytes(), 3 * 2 * (32768 + 4096) + 1024);
        assert_eq!(Tile::Large.shared_bytes(), 3 * (16384 + 8192 + 4096));
        assert_eq!(Tile::Small.shared_bytes(), 4 * (8192 + 4096 + 2048));
    }

    #[test]
    fn split_k_fills_the_gpu_with_grids_of_at_most_half_its_sms() {
        let v = Tile::WgmmaNarrow;
        // 64 tokens on 132 SMs: k/v (8 blocks) in 16 slices of 256 columns, q/o and down (32
        // blocks) in 4, gate/up (112 blocks) not at all.
        assert_eq!(split_k(v, 64, &[1024], 4096, 132), 16);
        assert_eq!((split_cols(4096, 16), partial_bytes(16, 64, 1024)), (256, 16 * 64 * 1024 * 4));
        assert_eq!(split_k(v, 64, &[4096], 4096, 132), 4);
        assert_eq!(split_k(v, 64, &[4096], 14336, 132), 4);
        assert_eq!(split_cols(14336, 4), 3584);
        assert_eq!(split_k(v, 64, &[14336], 4096, 132), 1);
        // Slices are whole 128-column units of at least MIN_SPLIT_COLS; the last takes the rest.
        assert_eq!(split_k(v, 16, &[512], 1536, 132), 6);
        assert_eq!(split_k(v, 16, &[512], 640, 132), 2);
        assert_eq!(split_cols(640, 2), 384);
        assert_eq!(split_k(v, 16, &[512], 384, 132), 1);
        assert_eq!(split_k(v, 16, &[512], 4160, 132), 1, "cols % 128 != 0");
        // A wave's worth of blocks, the mma.sync tiles, and small GPUs are left alone.
        assert_eq!(split_k(Tile::Wgmma, 512, &[4096], 4096, 132), 2);
        assert_eq!(split_k(Tile::Wgmma, 1024, &[4096], 4096, 132), 1);
        assert_eq!(split_k(Tile::Small, 64, &[1024], 4096, 132), 1);
        assert_eq!(split_k(v, 64, &[1024], 4096, 8), 1);
        // One launch of several weights counts all their blocks; the 64-token shapes fill two
        // blocks per SM: q/k/v (48 blocks) in 5 slices, gate/up (224) not at all, down in 8.
        let y = Tile::WgmmaSmallK128;
        assert_eq!(split_k(y, 64, &[4096, 1024, 1024], 4096, 132), 5);
        assert_eq!(split_k(y, 64, &[14336, 14336], 4096, 132), 1);
        assert_eq!(split_k(y, 64, &[4096], 14336, 132), 8);
        assert_eq!(split_k(Tile::WgmmaSmall, 16, &[1024], 4096, 132), 16);
        assert_eq!(partial_bytes(1, 64, 1024), 0);
    }

    #[test]
    fn eligibility() {
        let ok = |sm, dt, n, rows, cols, group, x, out| {
            eligible(sm, dt, n, rows, cols, group, x, out, 0x1000, 0x2000, 0x3000)
        };
        assert!(ok(90, DType::F16, 512, 4096, 4096, 128, 0x100, 0x200));
        assert!(ok(80, DType::BF16, 9, 14336, 4096, 32, 0x100, 0x204));
        assert!(ok(87, DType::BF16, 1000, 8, 64, 64, 0x100, 0x200));
        assert!(!ok(75, DType::F16, 512, 4096, 4096, 128, 0x100, 0x200));
        assert!(!ok(90, DType::F32, 512, 4096, 4096, 128, 0x100, 0x200));
        assert!(!ok(90, DType::F16, 512, 4096, 4064, 32, 0x100, 0x200)); // cols % 64
        assert!(!ok(90, DType::F16, 512, 4100, 4096, 32, 0x100, 0x200)); // rows % 8
        assert!(!ok(90, DType::F16, 512, 4096, 4096, 48, 0x100, 0x200)); // group
        assert!(!ok(90, DType::F16, 512, 4096, 4096, 128, 0x108, 0x200)); // x alignment
        assert!(!ok(90, DType::F16, 512, 4096, 4096, 128, 0x100, 0x202)); // out alignment
        assert!(!eligible(90, DType::F16, 512, 4096, 4096, 128, 0x100, 0x200, 0x1008, 0x2000, 0x3000));
        assert!(!eligible(90, DType::F16, 512, 4096, 4096, 128, 0x100, 0x200, 0x1000, 0x2001, 0x3000));
    }

    #[test]
    fn picks_tiles_by_waves() {
        // 8192 tokens: plenty of large tiles.
        assert_eq!(pick(8192, 14336, 132, false), Tile::Large);
        assert_eq!(pick(2048, 4096, 132, false), Tile::Large);
        // 512 tokens x 4096 rows: 64 large tiles would leave half the SMs idle.
        assert_eq!(pick(512, 4096, 132, false), Tile::Medium);
        assert_eq!(pick(64, 4096, 132, false), Tile::Small);
        assert_eq!(pick(9, 576, 16, false), Tile::Small);
        // With wgmma: the wide shape for large batches, the narrow one where the wide would leave
        // SMs idle (down to one wave of narrow blocks).
        assert_eq!(pick(8192, 14336, 132, true), Tile::Wgmma);
        assert_eq!(pick(2048, 4096, 132, true), Tile::Wgmma);
        assert_eq!(pick(512, 4096, 132, true), Tile::WgmmaNarrow);
        assert_eq!(pick(512, 6144, 132, true), Tile::Wgmma);
        assert_eq!(pick(1024, 6144, 132, true), Tile::Wgmma);
        assert_eq!(pick(128, 14336, 132, true), Tile::WgmmaNarrow);
        assert_eq!(pick(64, 4096, 132, true), Tile::WgmmaNarrow);
        assert_eq!(pick(17, 1024, 132, true), Tile::WgmmaNarrow);
        // The 64-token wgmma shape up to WGMMA_SMALL_MAX_TOKENS.
        assert_eq!(pick(16, 4096, 132, true), Tile::WgmmaSmall);
        assert_eq!(pick(9, 14336, 132, true), Tile::WgmmaSmall);
        let (name, grid, smem) = plan(Tile::Large, DType::BF16, 1000, 4104).unwrap();
        assert_eq!((name.as_str(), grid, smem), ("matmul_q4_gemm_l_bf16", (17, 8, 1), 86016));
        assert!(plan(Tile::Small, DType::F32, 10, 8).is_err());
    }

    #[test]
    fn policy_from_text() {
        assert_eq!(Policy::parse(None), Ok(Policy::Auto));
        assert_eq!(Policy::parse(Some("auto")), Ok(Policy::Auto));
        assert_eq!(Policy::parse(Some("off")), Ok(Policy::Off));
        assert_eq!(Policy::parse(Some(" M ")), Ok(Policy::Force(Tile::Medium)));
        assert_eq!(Policy::parse(Some("t")), Ok(Policy::Force(Tile::Tall)));
        assert!(Policy::parse(Some("huge")).is_err());
        assert_eq!(Policy::parse(Some("w")), Ok(Policy::Force(Tile::Wgmma)));
        assert_eq!(Policy::parse(Some("v")), Ok(Policy::Force(Tile::WgmmaNarrow)));
        assert_eq!(Policy::parse(Some("x")), Ok(Policy::Force(Tile::WgmmaK128)));
        assert_eq!(Policy::parse(Some("u")), Ok(Policy::Force(Tile::WgmmaSmall)));
        assert_eq!(Policy::parse(Some("y")), Ok(Policy::Force(Tile::WgmmaSmallK128)));
        // Decode batches up to 16 / 32 / 64 tokens: the mini / tiny / small shape with
        // 128-column k-tiles where the groups allow it.
        assert_eq!(choose(Policy::Auto, 64, 4096, 4096, 128, 132, true), Some(Tile::WgmmaSmallK128));
        assert_eq!(choose(Policy::Auto, 33, 4096, 4096, 128, 132, true), Some(Tile::WgmmaSmallK128));
        assert_eq!(choose(Policy::Auto, 32, 4096, 4096, 128, 132, true), Some(Tile::WgmmaTinyK128));
        assert_eq!(choose(Policy::Auto, 17, 4096, 4096, 128, 132, true), Some(Tile::WgmmaTinyK128));
        assert_eq!(choose(Policy::Auto, 16, 4096, 4096, 128, 132, true), Some(Tile::WgmmaMiniK128));
        assert_eq!(choose(Policy::Auto, 9, 1024, 4096, 128, 132, true), Some(Tile::WgmmaMiniK128));
        assert_eq!(choose(Policy::Auto, 65, 4096, 4096, 128, 132, true), Some(Tile::WgmmaNarrow));
        assert_eq!(choose(Policy::Auto, 64, 4096, 4096, 64, 132, true), Some(Tile::WgmmaNarrow));
        assert_eq!(choose(Policy::Auto, 16, 4096, 4096, 32, 132, true), Some(Tile::WgmmaSmall));
        assert_eq!(choose(Policy::Auto, 64, 4096, 4096, 128, 132, false), Some(Tile::Small));
        assert_eq!(choose(Policy::Force(Tile::WgmmaSmallK128), 64, 4096, 4096, 64, 132, true), Some(Tile::WgmmaSmall));
        assert_eq!(choose(Policy::Force(Tile::WgmmaTinyK128), 16, 4096, 4096, 32, 132, true), Some(Tile::WgmmaSmall));
        assert_eq!(Policy::parse(Some("z")), Ok(Policy::Force(Tile::WgmmaTinyK128)));
        assert_eq!(Policy::parse(Some("q")), Ok(Policy::Force(Tile::WgmmaMiniK128)));
        assert_eq!(choose(Policy::Force(Tile::WgmmaMiniK128), 16, 4096, 4096, 64, 132, true), Some(Tile::WgmmaSmall));
        assert_eq!(choose(Policy::Off, 512, 4096, 4096, 128, 132, true), None);
        assert_eq!(choose(Policy::Force(Tile::Small), 8192, 4096, 4096, 128, 132, true), Some(Tile::Small));
        assert_eq!(choose(Policy::Auto, 8192, 4096, 4096, 128, 132, false), Some(Tile::Large));
        // The wide wgmma shape takes 128-column k-tiles where the groups allow.
        assert_eq!(choose(Policy::Auto, 8192, 4096, 4096, 128, 132, true), Some(Tile::WgmmaK128));
        assert_eq!(choose(Policy::Auto, 8192, 4096, 14336, 128, 132, true), Some(Tile::Wgmma));
        assert_eq!(choose(Policy::Auto, 8192, 4096, 4096, 64, 132, true), Some(Tile::Wgmma));
        assert_eq!(choose(Policy::Force(Tile::Wgmma), 8192, 4096, 4096, 128, 132, true), Some(Tile::Wgmma));
        assert_eq!(choose(Policy::Force(Tile::WgmmaK128), 8192, 4096, 4032, 96, 132, true), Some(Tile::Wgmma));
        // A forced wgmma shape without wgmma: the automatic choice instead.
        assert_eq!(choose(Policy::Force(Tile::Wgmma), 8192, 4096, 4096, 128, 132, false), Some(Tile::Large));
        assert_eq!(choose(Policy::Force(Tile::WgmmaNarrow), 8192, 4096, 4096, 128, 132, true), Some(Tile::WgmmaNarrow));
    }

    #[test]
    fn policy_override_round_trips() {
        for p in [
            Policy::Auto,
            Policy::Off,
            Policy::Force(Tile::Large),
            Policy::Force(Tile::Tall),
            Policy::Force(Tile::WgmmaNarrow),
        ] {
            set_policy(Some(p));
            assert_eq!(policy(), p);
        }
        set_policy(None);
        assert_eq!(policy(), Policy::from_env());
    }
}
