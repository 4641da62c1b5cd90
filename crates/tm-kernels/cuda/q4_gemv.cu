// int4 decode products on tensor cores (w4a16): out[n, rows] = x[n, cols] · W^T for n <= 8, W in
// tm's int4 layout (tm-core/src/quant.rs), activations T = f16 or bf16, f32 sums (see ABI.md,
// "q4_gemv.cu"; launcher tm-cuda/src/kernels/q4_gemv.rs).
//
// A decode product streams W once, so the kernel is built to keep DRAM busy with few instructions:
//
// - mma.sync m16n8k16 even for n = 1: 16 weight rows are operand A, the activation rows are the
//   8 columns of B (lanes whose batch column is >= n hold zeros), sums in f32.
// - The reduction index of an mma may be permuted freely when A and B use the same permutation.
//   Lane (g = lane / 4, t = lane % 4) of a warp takes, per step, one 16-byte chunk (a 32-column
//   block) of weight rows g and g + 8 of each tile, straight from global memory (block 4 s + t of
//   step s), and x[g] of the same 32 columns. Word k of a chunk (bytes 4k..4k+3) holds columns
//   4k+0..3 in its low nibbles and 16+4k+0..3 in its high nibbles; it feeds two mmas, one taking
//   the pairs of columns (4k, 4k+2) and (4k+1, 4k+3) as the lane's k-slots (2t, 2t+1) and
//   (2t+8, 2t+9), the other the same of the high nibbles. The matching x pairs are picked from
//   the loaded x words with one PRMT each. W is neither staged in shared memory nor re-laid out.
// - Dequantization with the magic-number trick: `(word & 0x000F000F) | magic` is a half2 (bf162)
//   holding (1024 + q) (f16) or (128 + q) (bf16) for two nibbles; one exact subtraction gives q,
//   then w = fma(q, scale, min) rounded once to T (the bias is not folded into the fma: that would
//   lose precision). f16 takes the high nibbles unshifted, as 1024 + 16 q, and gets q exactly as
//   fma(v, 1/16, -64). Scales and mins are f16, exact in f16; bf16 moves the group's integer
//   zero point into the subtraction first (see Q4<__nv_bfloat16>::prep), so that rounding the
//   scale and the remaining min to bf16 costs about one bf16 rounding of the group's sum.
// - K is split over the 8 warps of a CTA (warp w takes steps w, w + 8, ...); the partial sums are
//   reduced through shared memory. Each warp keeps a ring of U step buffers: the loads of its
//   first U steps are issued up front, and a buffer is refilled with the step U * 8 ahead as soon
//   as its math is issued, so U - 1 to U steps' loads stay in flight while the warp computes.
//   A CTA covers NT tiles of 16 rows: 16 NT consecutive rows of one weight, or 16 rows of the
//   gate and the same 16 rows of the up weight (the SiLU variant, NT = 2).
// - Programmatic dependent launch (sm_90+; no-ops before): every kernel lets the next kernel of
//   the stream launch once its main loop is done (`trigger_after_loop`), issues the weight loads of
//   its ring's first U steps (they do not depend on any earlier kernel) and only then waits for
//   the previous kernel (`tmk::pdl_wait`) before it reads x or writes anything. Launched with the
//   programmatic-serialization attribute, a CTA's weight stream thus overlaps the previous
//   kernel's tail; for a 4096-column product at U = 4 it is the whole of the CTA's weights.
//   This relies on no kernel writing int4 weights (they arrive by copies, which PDL does not
//   overlap); a kernel that wrote them would need a plain stream dependency before these.
//
// Kernels (T = f16, bf16):
// - `q4_gemv_u2_T` (NT = 2, U = 2: two CTAs per SM) and `q4_gemv_n16_T` (NT = 1, U = 2, x loaded
//   at use rather than buffered, at most 80 registers: three CTAs per SM, twice the CTAs for small
//   weights): up to three weights sharing x (a layer's q, k and v), rows of weight i in CTAs
//   numbered one weight after the other (ceil(rows_i / 16 NT) each). Optional biases (null when
//   absent) are added before rounding to T.
// - `q4_gemv_silu_u2_T`: out = silu(x·G^T) * (x·U^T) for gate G and up U [rows, cols], each
//   product rounded to T first (what separate products would store); ceil(rows / 16) CTAs.
//
// - `q4_gemv_ln_T`, `q4_gemv_ln4_T` (`n16`'s configuration, and with U = 4 at two CTAs per SM) and
//   `q4_gemv_silu_ln_T`, `q4_gemv_silu_ln4_T` (U = 2, x at use, two CTAs per SM; U = 4, x
//   buffered, one): the lean kernels, for group 128, cols % 1024 == 0 and weights of whole 16-row
//   tiles (`q4_tiles_lean`: nothing predicated, fixed address offsets) with the magic-sum step
//   (`step_math_lean`: no dequantization, scale and min applied per step and row in f32). SASS
//   per gate/up step: 246 instructions against `u2`'s 413.
// - `q4_gemv_lnt_T`, `q4_gemv_ln4t_T`, `q4_gemv_silu_lnt_T`, `q4_gemv_silu_ln4t_T`: the lean
//   kernels for weights stored tile-major (`q4_tiles_lean`'s TILED; the launcher takes them for
//   every weight of that layout, which the CUDA backend gives exactly the lean shapes), except
//   that `silu_lnt` runs U = 1 with x loaded with the weights at three CTAs per SM (79 registers
//   against 123 at U = 2: 24 warps per SM to hide the step math's latency, which bounds gate/up;
//   AWQ 8B batch-1 step on the H200 2080 us against 2126-2130 at U = 2, two per SM).
// - `q4_gemv_silu_lnts_T`: `silu_lnt` for gate and up weights whose scales and mins are stored in
//   tile order (tm-core's `Int4Layout::TilesAndScales16x128`, `tiled` = 2: a warp step's two rows
//   per lane are one 32-bit load of each instead of two 16-bit loads over eight rows' sectors):
//   AWQ 8B batch-1 replay on the H200 1942.7-1949.7 us against 1951.9-1962.2 with row-major
//   scales (five alternations; scripts/gpu/q4_decode_chain.cu mode `smi`).
// - `q4_gemv_*_join_T` (deferred RMSNorm, below): the plain kernel of the same name's
//   configuration followed by the residual join, except that `ln4t_join` (a layer's o and down
//   at batch 1) keeps two steps in flight per warp, not four (still two CTAs per SM): AWQ 8B
//   batch-1 step on the H200 2014-2020 us at U = 3 against 2061-2071 at U = 4, and 1984-1994 at
//   U = 2 against 2000-2012 at U = 3 (U = 6 / 7: 2113 / 2141; U = 2 at three CTAs per SM
//   2172-2183; U = 1 at four 2307-2312; o alone at U = 1: 2055; more in scripts/gpu/
//   q4_decode_chain.cu, "Session 15").
// - Every lean kernel at batch 1 on sm_90 (TM_Q4_LEAN_B1 = 2, `q4_tiles_lean_loop`'s B1): the
//   mmas' batch columns 1..7 are discarded, so the lanes that feed them (g >= 1) are free to feed
//   the ones-mma other words of x, and one ones-mma sums a step's x instead of eight; f16's high
//   nibbles then need no shift (`raw4`'s HI4). silu_lnts' loop 198 SASS instructions per step
//   against 252, ln4t_join's 248 per two steps against 287, lnt_rope's 386 against 482; H100
//   q4_gemv_bench --hot 2.6 us a layer less (TM_Q4_LEAN_B1 above).
// - The tile-major NT = 1 lean kernels (o and down) pair the nibbles by column instead of the x
//   values (TM_Q4_LEAN_WSWAP): no shifts, x words used as loaded; ln4t_join 233 instructions per
//   two steps against 248 at batch 1 on sm_90.
//
// Tuning knobs (macros; scripts/gpu_kernel_variants.sh builds kernels with other values for an
// A/B): TM_Q4_JOIN_TILED_U, the steps in flight of `ln4t_join` (2); TM_Q4_ROPE_TILED_U, of
// `lnt_rope` (2); TM_Q4_LEAN_B1, the batch-1 loop (2 on sm_90, else 0); TM_Q4_LEAN_WSWAP, the
// NT = 1 nibble pairing (1); TM_Q4_ABLATE_* (below), timing-only ablations of the lean step.
//
// Requirements checked by the launcher: 1 <= n <= 8, cols % 32 == 0, group % 32 == 0,
// cols % group == 0, packed weights and x 16-byte aligned, scales and mins 2-byte aligned.

#include "common.cuh"

#ifndef TM_Q4_JOIN_TILED_U
#define TM_Q4_JOIN_TILED_U 2
#endif
#ifndef TM_Q4_ROPE_TILED_U
#define TM_Q4_ROPE_TILED_U 2
#endif
// Ablations of `step_math_lean`, for timing only (the sums are wrong): TM_Q4_ABLATE_XSUM drops the
// ones-mma (X = 0: 8 of a gate/up step's 24 HMMAs), TM_Q4_ABLATE_RAW the nibble extraction (the
// packed words go to the mma as they are: silu_lnts' step 181 SASS instructions against 252),
// TM_Q4_ABLATE_EPI the per-step scale and min (acc += t; the scale and min loads then go too),
// TM_Q4_ABLATE_SMLOAD only the scale and min loads (a loop-invariant scale and min instead: the
// epilogue's FFMAs stay, its conversions leave the loop; 2: in the NT = 2 loops only),
// TM_Q4_ABLATE_ODD_E the epilogue's updates of batch columns 2t + 1 (what a batch-1
// specialisation would save); TM_Q4_ABLATE_SMHIT (below) a part of the scale and min loads.
// Measured in scripts/gpu/q4_decode_chain.cu's header (sessions 23 to 25); build them with
// scripts/gpu_kernel_variants.sh. They act on the general loop: at batch 1 on sm_90, where the B1
// loop runs (TM_Q4_LEAN_B1), add -DTM_Q4_LEAN_B1=0 to compare with those figures.
#ifndef TM_Q4_ABLATE_XSUM
#define TM_Q4_ABLATE_XSUM 0
#endif
#ifndef TM_Q4_ABLATE_RAW
#define TM_Q4_ABLATE_RAW 0
#endif
#ifndef TM_Q4_ABLATE_EPI
#define TM_Q4_ABLATE_EPI 0
#endif
#ifndef TM_Q4_ABLATE_SMLOAD
#define TM_Q4_ABLATE_SMLOAD 0
#endif
#ifndef TM_Q4_ABLATE_ODD_E
#define TM_Q4_ABLATE_ODD_E 0
#endif
// TM_Q4_ABLATE_SMHIT (timing only): every step loads step 0's scales and mins (an address the
// compiler cannot see is fixed), so the loads stay but hit L1: their instructions without their
// DRAM requests and latency.
#ifndef TM_Q4_ABLATE_SMHIT
#define TM_Q4_ABLATE_SMHIT 0
#endif
// TM_Q4_ABLATE_XLOAD (timing only, the lean loops): no ones-mma; X of the lane's batch columns
// 2t, 2t + 1 comes from one 8-byte load a step instead (from x itself, an L1 hit as a per-step
// X array written by x's producer would be): what the consumers would pay for X from producers.
#ifndef TM_Q4_ABLATE_XLOAD
#define TM_Q4_ABLATE_XLOAD 0
#endif
namespace tmq4 {

using tmk::i64;
using tmk::u64;

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;  // K slices per CTA
constexpr int BLOCKS_PER_STEP = 4;   // 32-column blocks per warp step (one per lane of a row quad)

__device__ __forceinline__ unsigned and_or(unsigned a, unsigned mask, unsigned bits) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));  // (a & mask) | bits
    return r;
}

// Per dtype: the half2 type `V2`, a group's scale and min as the dequantization needs them
// (`Scale`, from `prep`), and the dequantization of one 32-bit word of packed nibbles (bytes
// b0..b3, i.e. columns c+0..3 low and c+16+0..3 high) into four pairs: p[0] = (b0.lo, b2.lo),
// p[1] = (b1.lo, b3.lo), p[2] = (b0.hi, b2.hi), p[3] = (b1.hi, b3.hi), each w = q * s + m
// rounded to T once.
template <class T> struct Q4;

template <> struct Q4<__half> {
    typedef __half2 V2;
    struct Scale {
        V2 s, m;
    };
    // f16 holds the f16 scale and min exactly.
    __device__ static __forceinline__ Scale prep(__half s, __half m) { return {__half2half2(s), __half2half2(m)}; }
    __device__ static __forceinline__ void dequant(unsigned w, const Scale& sc, unsigned p[4]) {
        const unsigned magic = 0x64006400u;  // 1024.0 in each half
        const V2 k1024 = __half2half2(__ushort_as_half(0x6400));
        const V2 k16th = __half2half2(__ushort_as_half(0x2C00));  // 1/16
        const V2 km64 = __half2half2(__ushort_as_half(0xD400));   // -64
        const unsigned w8 = w >> 8;
        unsigned r[4] = {and_or(w, 0x000F000Fu, magic), and_or(w8, 0x000F000Fu, magic), and_or(w, 0x00F000F0u, magic),
                         and_or(w8, 0x00F000F0u, magic)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            V2 v = *reinterpret_cast<V2*>(&r[i]);
            // low nibbles: 1024 + q - 1024; high: (1024 + 16 q) / 16 - 64. Both exact.
            const V2 q = i < 2 ? __hsub2(v, k1024) : __hfma2(v, k16th, km64);
            const V2 d = __hfma2(q, sc.s, sc.m);
            p[i] = *reinterpret_cast<const unsigned*>(&d);
        }
    }
};

template <> struct Q4<__nv_bfloat16> {
    typedef __nv_bfloat162 V2;
    struct Scale {
        V2 s, m, off;
    };
    // bf16 cannot hold the f16 scale and min exactly, and rounding both on their own would leave a
    // systematic error of about 2^-9 * |m| per weight of the group (|m| is ~7.5 scales for
    // zero-centred groups: the AWQ/GPTQ zero point). So the group's integer offset
    // c = round(-m / s) (clamped to 0..15; any integer is exact) moves into the q subtraction:
    // w = (q - c) * s + (m + c * s), with |q - c| small and m + c * s within about half a scale.
    __device__ static __forceinline__ Scale prep(__half sh, __half mh) {
        const float s = __half2float(sh), m = __half2float(mh);
        const float c = fminf(fmaxf(rintf(__fdividef(-m, s)), 0.f), 15.f);  // NaN (s = m = 0) -> 0
        return {__float2bfloat162_rn(s), __float2bfloat162_rn(fmaf(c, s, m)), __float2bfloat162_rn(-128.f - c)};
    }
    __device__ static __forceinline__ void dequant(unsigned w, const Scale& sc, unsigned p[4]) {
        const unsigned magic = 0x43004300u;  // 128.0 in each bf16
        const V2 one = __float2bfloat162_rn(1.f);
        unsigned r[4] = {and_or(w, 0x000F000Fu, magic), and_or(w >> 8, 0x000F000Fu, magic),
                         and_or(w >> 4, 0x000F000Fu, magic), and_or(w >> 12, 0x000F000Fu, magic)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            V2 v = *reinterpret_cast<V2*>(&r[i]);
            const V2 q = __hfma2(v, one, sc.off);  // 128 + q - (128 + c) = q - c, exact
            const V2 d = __hfma2(q, sc.s, sc.m);
            p[i] = *reinterpret_cast<const unsigned*>(&d);
        }
    }
};

// c += a (16x16, row major) * b (16x8) in f32.
__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1, __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1, __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Word k (0..3) of a 16-byte chunk.
__device__ __forceinline__ unsigned word_of(const uint4& c, int k) { return k == 0 ? c.x : k == 1 ? c.y : k == 2 ? c.z : c.w; }

// The two f16 values of a 32-bit word: the low half into lo, the high half into hi.
__device__ __forceinline__ void split_halves(unsigned w, __half& lo, __half& hi) {
    lo = __ushort_as_half((unsigned short)(w & 0xffffu));
    hi = __ushort_as_half((unsigned short)(w >> 16));
}

// The mma B operands of word k of a step: x of the columns (4k, 4k+2) and (4k+1, 4k+3) (low
// nibbles) and the same + 16 (high nibbles), picked from the lane's 32 loaded x values (`xv`:
// words 0..15) with one PRMT each.
struct XPairs {
    unsigned l02, l13, h02, h13;
};
__device__ __forceinline__ XPairs x_pairs(const uint4 (&xv)[4], int k) {
    const unsigned a = word_of(xv[k / 2], (2 * k) % 4), b = word_of(xv[k / 2], (2 * k + 1) % 4);
    const unsigned c = word_of(xv[2 + k / 2], (2 * k) % 4), d = word_of(xv[2 + k / 2], (2 * k + 1) % 4);
    return {__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632), __byte_perm(c, d, 0x5410), __byte_perm(c, d, 0x7632)};
}

// The math of one step of NT tiles: the lane's 16-byte chunks `w[i][h]` of rows g and g + 8 of
// tile i, their groups' prepared scales `sc[i][h]` and x[g] of the chunk's 32 columns (`xv`), into
// acc[i] (the m16n8 C fragment).
template <class T, int NT>
__device__ __forceinline__ void step_math(const uint4 (&w)[NT][2], const typename Q4<T>::Scale (&sc)[NT][2],
                                          const uint4 (&xv)[4], float (*acc)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const XPairs x = x_pairs(xv, k);
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            unsigned pl[4], ph[4];  // rows g and g + 8
            Q4<T>::dequant(word_of(w[i][0], k), sc[i][0], pl);
            Q4<T>::dequant(word_of(w[i][1], k), sc[i][1], ph);
            // a0: row g, slots 2t..2t+1; a1: row g+8, same; a2: row g, slots 2t+8..2t+9; a3: row g+8.
            const unsigned alo[4] = {pl[0], ph[0], pl[1], ph[1]};
            const unsigned ahi[4] = {pl[2], ph[2], pl[3], ph[3]};
            mma(acc[i], alo, x.l02, x.l13, T());
            mma(acc[i], ahi, x.h02, x.h13, T());
        }
    }
}

// The nibbles of one packed word as mma operands without dequantizing them: the same four pairs
// as `Q4<T>::dequant` (p[0] = (b0.lo, b2.lo), p[1] = (b1.lo, b3.lo), p[2] = (b0.hi, b2.hi),
// p[3] = (b1.hi, b3.hi)), each element OFF + q exactly (OFF = 1024 in f16, 128 in bf16): three
// shifts and four LOP3s per word, nothing else.
template <class T> struct Raw4;
template <> struct Raw4<__half> {
    static constexpr unsigned MAGIC = 0x64006400u;  // 1024.0 in each half
    static constexpr unsigned ONES = 0x3C003C00u;   // 1.0 in each half
    static constexpr float OFF = 1024.f;
    static constexpr bool HI4 = true;  // `raw4`'s HI4 applies
};
template <> struct Raw4<__nv_bfloat16> {
    static constexpr unsigned MAGIC = 0x43004300u;  // 128.0 in each bf16
    static constexpr unsigned ONES = 0x3F803F80u;   // 1.0 in each bf16
    static constexpr float OFF = 128.f;
    static constexpr bool HI4 = false;  // bit 7 of a bf16 is its exponent's
};

// TM_Q4_LEAN_B1: batch 1 takes `q4_tiles_lean_loop`'s B1 loop (one ones-mma a step instead of
// eight); 2: that loop with f16's high nibbles as `raw4`'s HI4 leaves them; 0, or n > 1: the general
// loop. Default 2 on sm_90 (H100, 2026-12-07, q4_gemv_bench --hot, f16, n = 1, us per product
// against 0: q/k/v 5.2-5.3 / 5.7-5.8, o 4.1 / 4.5, half of gate/up 12.1 / 12.5, down 9.5 / 10.4;
// 1: 5.4, 4.3, 12.2, 9.9-10.0; scripts/gpu/q4_decode_chain.cu, session 31), 0 below: sm_80 and
// sm_87 spill 8-80 bytes in the B1 loops of several kernels, and no GPU of theirs was at hand.
#ifndef TM_Q4_LEAN_B1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TM_Q4_LEAN_B1 2
#else
#define TM_Q4_LEAN_B1 0
#endif
#endif
// TM_Q4_LEAN_WSWAP: the tile-major NT = 1 lean loops (`lnt`, `ln4t`, their joins: a layer's o and
// down) pair each packed word's nibbles by column, (4k, 4k + 1) and (4k + 2, 4k + 3), with two
// PRMTs per word (`raw4`'s WSWAP) instead of picking the x pairs with four PRMTs per k
// (`x_pairs`): the same PRMTs at NT = 1 (two words a k), but the x operands are then the loaded x
// words as they are (`x_words`) and the words need no shift (HI4's one; otherwise three become
// two). ln4t_join's loop (two steps): 248 SASS instructions against 233 at batch 1 on
// sm_90 (f16), 284 / 268 in the general loop, 316 / 300 on sm_80. Not at NT = 2 (two tiles' words
// a k against one x: more PRMTs), nor row-major (`ln`, `ln_rope` spill more with it). H100,
// q4_gemv_bench --hot, f16, n = 1: down 9.3 us against 9.5 (ln graph 10.6 / 11.0), o 4.0 / 4.1;
// the AWQ 8B batch-1 replay within noise (2247.0-2249.4 us against 2249.5-2249.6).
#ifndef TM_Q4_LEAN_WSWAP
#define TM_Q4_LEAN_WSWAP 1
#endif
// The mma B operands of word k when the weights' nibbles are paired by column (`raw4`'s WSWAP): x
// words 2k, 2k + 1 (low nibbles' columns 4k..4k+3) and 8 + 2k, 9 + 2k (high), no PRMT.
__device__ __forceinline__ XPairs x_words(const uint4 (&xv)[4], int k) {
    return {word_of(xv[k / 2], (2 * k) % 4), word_of(xv[k / 2], (2 * k + 1) % 4), word_of(xv[2 + k / 2], (2 * k) % 4),
            word_of(xv[2 + k / 2], (2 * k + 1) % 4)};
}

// The nibbles of one packed word as mma operands without dequantizing them, each element OFF + q
// exactly (OFF = 1024 in f16, 128 in bf16), from two source words `a` and `b` whose bytes 0 and 2
// hold the pairs: `Q4<T>::dequant`'s pairs (a = w, b = w >> 8: p[0] = (b0.lo, b2.lo), p[1] =
// (b1.lo, b3.lo), p[2] = (b0.hi, b2.hi), p[3] = (b1.hi, b3.hi); three shifts and four LOP3s), or
// with WSWAP the pairs by column (a = (b0, b0, b1, b1), b = (b2, b2, b3, b3), two PRMTs: p[0] =
// columns (4k, 4k + 1), p[1] = (4k + 2, 4k + 3), p[2], p[3] the same + 16). HI4 (f16 only):
// the high nibbles left at bits 4..7 of each half under the magic 64.0 (0x5400: exponent 2^6, so
// those mantissa bits count ones), i.e. p[2] and p[3] are 64 + q instead of 1024 + q, with no
// shift for them.
template <class T, bool HI4 = false, bool WSWAP = false> __device__ __forceinline__ void raw4(unsigned w, unsigned p[4]) {
    static_assert(!HI4 || Raw4<T>::HI4, "HI4 needs f16");
    const unsigned M = Raw4<T>::MAGIC;
    const unsigned a = WSWAP ? __byte_perm(w, 0u, 0x1100u) : w;
    const unsigned b = WSWAP ? __byte_perm(w, 0u, 0x3322u) : w >> 8;
    p[0] = and_or(a, 0x000F000Fu, M);
    p[1] = and_or(b, 0x000F000Fu, M);
    p[2] = HI4 ? and_or(a, 0x00F000F0u, 0x54005400u) : and_or(a >> 4, 0x000F000Fu, M);
    p[3] = HI4 ? and_or(b, 0x00F000F0u, 0x54005400u) : and_or(b >> 4, 0x000F000Fu, M);
}

// `step_math` for the lean kernels, whose 128-column steps each lie inside one group (group 128):
// the mma multiplies x by OFF + q as `raw4` leaves them (no subtraction, no per-weight scale) into
// sums of the step alone, t = sum(q x) + OFF X with X = sum(x) over the step's columns (one more
// mma pair per k with an all-ones A, shared by the tiles); then per row, in f32,
// acc += s t + (m - OFF s) X = s sum(q x) + m X, which is sum((q s + m) x). The products
// (OFF + q) x are exact in f32 and the f32 sums lose about 2^-24 OFF |X| per step: far below a
// rounding of the weights to T, which this path never makes.
template <class T, int NT, bool B1 = false, bool WSWAP = false>
__device__ __forceinline__ void step_math_lean(const uint4 (&w)[NT][2], const __half (&sh)[NT][2],
                                               const __half (&mh)[NT][2], const uint4 (&xv)[4], float (*acc)[4],
                                               float2 xl = make_float2(0.f, 0.f)) {
    // B1 with TM_Q4_LEAN_B1 = 2 (f16): the high nibbles as `raw4`'s HI4 leaves them (64 + q), which
    // costs the epilogue nothing: t = sum(q x) + 1024 X_lo + 64 X_hi (X_lo, X_hi: x summed over
    // the low- and high-nibble columns), and the lanes t = 0, 1 hold the ones-mma's columns 0..3,
    // fed by lanes g < 4 with x of the low nibbles' columns (words 0..7), lanes t = 2, 3 those of
    // the high ones', so each lane's share of the offsets' sum is its share of X times 1024 or 64.
    constexpr bool HI4 = B1 && TM_Q4_LEAN_B1 >= 2 && Raw4<T>::HI4;
    const unsigned ones[4] = {Raw4<T>::ONES, Raw4<T>::ONES, Raw4<T>::ONES, Raw4<T>::ONES};
    // X of batch columns 2t, 2t + 1 (rows g and g + 8 alike)
    float xs[4] = {xl.x, xl.y, xl.x, xl.y};
    float t[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) t[i][e] = 0.f;
    // B1 (batch 1, `q4_tiles_lean`'s B1 loop): one ones-mma sums the step's 128 x values, lane
    // (g, t) feeding words 2g, 2g + 1 of its 32 columns (xv[0] holds them: the loop loads it from
    // 16-byte block g / 2); this lane's share of X is its fragment's column sums c0 + c1.
    float xpart = 0.f;
    if constexpr (B1) {
        const bool odd = (threadIdx.x >> 2) & 1;  // g odd: words 2, 3 of the block
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma(d, ones, odd ? xv[0].z : xv[0].x, odd ? xv[0].w : xv[0].y, T());
        xpart = d[0] + d[1];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const XPairs x = WSWAP ? x_words(xv, k) : x_pairs(xv, k);
        if (!B1 && !TM_Q4_ABLATE_XSUM && !TM_Q4_ABLATE_XLOAD) {
            mma(xs, ones, x.l02, x.l13, T());
            mma(xs, ones, x.h02, x.h13, T());
        }
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            unsigned pl[4], ph[4];  // rows g and g + 8
            if (TM_Q4_ABLATE_RAW) {
#pragma unroll
                for (int e = 0; e < 4; ++e) pl[e] = word_of(w[i][0], k), ph[e] = word_of(w[i][1], k);
            } else {
                raw4<T, HI4, WSWAP>(word_of(w[i][0], k), pl);
                raw4<T, HI4, WSWAP>(word_of(w[i][1], k), ph);
            }
            const unsigned alo[4] = {pl[0], ph[0], pl[1], ph[1]};
            const unsigned ahi[4] = {pl[2], ph[2], pl[3], ph[3]};
            mma(t[i], alo, x.l02, x.l13, T());
            mma(t[i], ahi, x.h02, x.h13, T());
        }
    }
    if constexpr (B1) {
        // Batch column 0 only (rows g, g + 8): acc[i][2h] += s t, which only lanes t = 0 keep
        // (columns 2t > 0 hold other lanes' x), and acc[i][2h + 1] (column 1, unused) += (m - OFF
        // s) times the lane's share of X, which `quad_sum_b1` sums over the quad after the loop.
        const float off = HI4 && (threadIdx.x & 2) ? 64.f : Raw4<T>::OFF;
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sf = __half2float(sh[i][h]);
                const float mf = fmaf(-off, sf, __half2float(mh[i][h]));
                acc[i][2 * h] = fmaf(sf, t[i][2 * h], acc[i][2 * h]);
                acc[i][2 * h + 1] = fmaf(mf, xpart, acc[i][2 * h + 1]);
            }
    } else {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sf = __half2float(sh[i][h]);
                const float mf = fmaf(-Raw4<T>::OFF, sf, __half2float(mh[i][h]));
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e)
                    if (!(TM_Q4_ABLATE_ODD_E && (e & 1)))
                        acc[i][e] = TM_Q4_ABLATE_EPI ? acc[i][e] + t[i][e] : fmaf(sf, t[i][e], fmaf(mf, xs[e], acc[i][e]));
            }
        }
    }
}

// B1's end: lane t = 0's rows g, g + 8 of batch column 0 (e = 0, 2) plus the min terms (e = 1, 3)
// of its quad's four lanes, as the general loop would hold them (the other lanes' columns 2t are
// never stored, nor column 1 at batch 1).
template <int NT> __device__ __forceinline__ void quad_sum_b1(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            float m = acc[i][e + 1];
            m += __shfl_xor_sync(0xffffffffu, m, 1);
            m += __shfl_xor_sync(0xffffffffu, m, 2);
            acc[i][e] += m;
        }
}

// acc = 0: the NT tiles' m16n8 C fragments.
template <int NT> __device__ __forceinline__ void zero_acc(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

// The lean loops' x for this lane (g = lane / 4, t = lane % 4 of warp `warp`): batch row g (row
// 0 past n: those sums land only in mma columns >= n, which nobody stores), the 32 columns of
// block 4 warp + t of the warp's first 128-column step; its step j is 128 chunks on.
template <class T> __device__ __forceinline__ const uint4* lean_x_lane(const T* __restrict__ x, int n, int cols) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    return reinterpret_cast<const uint4*>(x + (i64)(g < n ? g : 0) * cols) + 16 * warp + 4 * t;
}

// x[g] of the lane's 32 columns in step j (L1-cached: every CTA reads the same x).
__device__ __forceinline__ void load_step_x(uint4 (&xv)[4], const uint4* xp, int j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) xv[q] = __ldca(xp + 128 * j + q);
}

// One weight as the kernels see it.
template <class T> struct Slot {
    T* out;
    const unsigned char* packed;
    const __half* scales;
    const __half* mins;
    const T* bias;
    int rows;
};

// The 16-row tile a CTA computes of one weight: rows row0..row0+15; for the lean kernels, the
// rows of fragment row g (0..7) and g + 8 are row0 + gs g and row0 + gs g + hs (the RoPE kernel
// pairs a head's rows i and i + head_dim / 2, or 2i and 2i + 1, that way).
struct Tile {
    const unsigned char* packed;
    const __half* scales;
    const __half* mins;
    int row0;
    int rows;
    int gs = 1;
    int hs = 8;
    // Scales and mins interleaved tile-major, for `q4_tiles_lean`'s SMI: one 32-bit word (scale |
    // min << 16) per row and group at word ((row / 16 * groups + group) * 8 + row % 8) * 2 + row / 8
    // % 2, so a warp step's 16 rows of a tile are 64 consecutive bytes (one 8-byte load per lane).
    // Only scripts/gpu/q4_decode_chain.cu's mode `smi` uses it (gate/up -19 us per 8B step; q/k/v
    // and down slower); the CUDA backend stores gate and up with tile-ordered scales instead
    // (SMI = 2: two loads, as fast in the chain, and no new tensor).
    const unsigned* smi = nullptr;
};

// One warp step's operands as loaded: per tile, the lane's 16-byte chunks of rows g and g + 8
// (h = 0, 1) with their group's scale and min, and x[g] of the chunk's 32 columns.
template <int NT> struct StepBuf {
    uint4 w[NT][2];
    __half s[NT][2], m[NT][2];
    uint4 x[4];
};

// This warp's K share of the NT tiles, into acc[tile][4] (the m16n8 C fragment: c0, c1 = row
// g, batch columns 2t, 2t+1; c2, c3 = row g + 8).
//
// Software pipelined: the warp keeps a ring of U step buffers; the loads of steps w, w + 8, ...,
// w + 8 (U - 1) are issued first, and each step's buffer is refilled with the step U * 8 ahead as
// soon as its math is issued, so U - 1 to U steps' loads are always in flight while the warp
// computes (the previous version waited for all U, computed all U, then loaded again). XPRE:
// x is loaded with the weights (16 more registers per step buffer); else right before the step's
// math (x is small and shared by every CTA, so those loads hit L1/L2; other warps cover them).
//
// `wait()` is called once every warp's first U steps of weights are issued and before anything
// else is read: the kernel passes `tmk::pdl_wait` (so the wait stays visible in its body).
template <class T, int U, int NT, bool XPRE, class Wait>
__device__ __forceinline__ void q4_tiles(const Tile* tiles, const T* __restrict__ x, int n, int cols, int group,
                                         float acc[NT][4], Wait wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nblk = cols >> 5;  // 32-column blocks of a row (16 bytes each)
    const int steps = (nblk + BLOCKS_PER_STEP - 1) / BLOCKS_PER_STEP;
    const int groups = cols / group;
    const int group_blocks = group >> 5;
    // Group of block b: b >> gshift when group / 32 is a power of two, else b / group_blocks.
    const int gshift = (group_blocks & (group_blocks - 1)) == 0 ? __ffs(group_blocks) - 1 : -1;

    // The lane's rows: g and g + 8 of each tile (h = 0, 1); rows past the end read nothing. The
    // weight pointer points at row g's block t of step 0 (row g + 8 is 8 rows on, step s adds 4 s
    // blocks); soff = row g * groups. Both are clamped to row 0 of the tile's weight when row g is
    // past the end (then neither row is read).
    const int rstride = cols >> 5;  // 16-byte chunks per row
    const uint4* wp[NT];
    int soff[NT];
    bool rok[NT][2];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const int r = tiles[i].row0 + g;
        rok[i][0] = r < tiles[i].rows;
        rok[i][1] = r + 8 < tiles[i].rows;
        const int rr = rok[i][0] ? r : 0;
        wp[i] = reinterpret_cast<const uint4*>(tiles[i].packed + (i64)rr * (cols >> 1)) + t;
        soff[i] = rr * groups;
    }
    const bool xok = g < n;
    const uint4* xp = reinterpret_cast<const uint4*>(x + (xok ? (i64)g * cols : 0)) + 4 * t;

    // Issues the loads of x for step s into B (zeros past the end of K or for batch rows >= n).
    auto loadx = [&](StepBuf<NT>& B, int s) {
        const bool xl = s * BLOCKS_PER_STEP + t < nblk && xok;
#pragma unroll
        for (int q = 0; q < 4; ++q) B.x[q] = xl ? __ldca(xp + 4 * s * BLOCKS_PER_STEP + q) : make_uint4(0, 0, 0, 0);
    };
    // Issues the weight loads of step s into B: packed nibbles, scales and mins, zeros past the
    // end of K or the rows. No earlier kernel writes weights, so these may precede the wait for
    // the previous kernel.
    auto loadw = [&](StepBuf<NT>& B, int s) {
        const int b = s * BLOCKS_PER_STEP + t;  // the lane's block
        const bool bok = b < nblk;
        const int gi = gshift >= 0 ? b >> gshift : b / group_blocks;
#pragma unroll
        for (int i = 0; i < NT; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool ok = bok && rok[i][h];
                B.w[i][h] = ok ? __ldcs(wp[i] + h * 8 * rstride + s * BLOCKS_PER_STEP) : make_uint4(0, 0, 0, 0);
                B.s[i][h] = ok ? tiles[i].scales[soff[i] + h * 8 * groups + gi] : __ushort_as_half(0);
                B.m[i][h] = ok ? tiles[i].mins[soff[i] + h * 8 * groups + gi] : __ushort_as_half(0);
            }
        }
    };
    // All the loads of step s into B: the weights, and x too when XPRE.
    auto load = [&](StepBuf<NT>& B, int s) {
        loadw(B, s);
        if (XPRE) loadx(B, s);
    };

    // The math of one loaded step.
    auto compute = [&](const StepBuf<NT>& B) {
        typename Q4<T>::Scale sc[NT][2];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) sc[i][h] = Q4<T>::prep(B.s[i][h], B.m[i][h]);
        step_math<T, NT>(B.w, sc, B.x, acc);
    };

    zero_acc<NT>(acc);

    // The ring's first U steps: the weights are issued before `pdl_wait` (they do not depend on
    // the previous kernel, so under programmatic dependent launch their DRAM traffic overlaps that
    // kernel's tail; for a 4096-column product at U = 4 these are all of the warp's loads), x only
    // after it (the previous kernel may be writing x).
    StepBuf<NT> buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) loadw(buf[u], warp + u * WARPS);
    wait();
    if (XPRE) {
#pragma unroll
        for (int u = 0; u < U; ++u) loadx(buf[u], warp + u * WARPS);
    }
    for (int s0 = warp; s0 < steps; s0 += U * WARPS) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u * WARPS;
            if (s >= steps) break;  // the whole warp
            if (!XPRE) loadx(buf[u], s);
            compute(buf[u]);
            load(buf[u], s + U * WARPS);  // the ring's next step for this slot
        }
    }
}

// `q4_tiles` for the shapes most decode products have, with as few instructions around the math
// as possible (the lean kernels): group 128 (one group per 128-column step), cols a multiple of
// 1024 (every warp takes the same number of whole steps, J = cols / 1024) and every tile's 16 rows
// inside its weight. So nothing is predicated: no row or K tails, no zero fills; the lane's
// addresses are set up once and step j of a warp is at fixed offsets from them (weights 512
// bytes on, scales and mins one group per warp on, x 128 columns per warp on). Batch columns
// past n read row 0 of x: their sums land only in mma columns >= n, which nobody stores. The
// math is `step_math_lean`. The ring, XPRE and the place of `wait()` are `q4_tiles`'s.
//
// TILED: the weights are stored tile-major (tm-core's `Int4Layout::Tiles16x128`, ABI.md): step s
// of a tile's 16 rows is 1 KiB of consecutive bytes, lane 4 g + t's chunks of rows g and g + 8 at
// 16 lane and 512 + 16 lane, so a warp's step reads 1 KiB in two fully used 512-byte loads instead
// of 64 bytes from each of 16 rows (the tile is then rows row0 .. row0 + 15: gs = 1, hs = 8).
// SMI (with TILED): the scales and mins come from `Tile::smi` instead of `scales` and `mins`.
//
// B1 (batch 1; `q4_tiles_lean` takes this loop when TM_Q4_LEAN_B1 is on and n = 1): batch
// columns 1..7 of the mmas are discarded, so lanes g >= 2 may feed them anything. Each lane loads
// its x chunk 0 from 16-byte block g / 2 (lanes g = 0, 1: block 0, as always), and `step_math_lean`
// sums the step's x with one ones-mma instead of eight; the quads' partial sums meet in
// `quad_sum_b1` after the loop.
template <class T, int U, int NT, bool XPRE, bool TILED, int SMI, bool B1, class Wait>
__device__ __forceinline__ void q4_tiles_lean_loop(const Tile* tiles, const T* __restrict__ x, int n, int cols,
                                                   float acc[NT][4], Wait wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int J = cols >> 10;      // steps per warp
    const int groups = cols >> 7;  // group 128
    // Weights, scales and mins of step j of this warp (step warp + 8 j: group warp + 8 j).
    // Row-major: per tile and row, pointers at step 0 (block 4 warp + t). TILED: per-CTA bases and
    // per-lane 32-bit offsets shared by the CTA's tiles (the tile's step warp + 8 j is 1 KiB on
    // from its step 0, rows g and g + 8 at 16 lane and 512 + 16 lane), which keeps the 80-register
    // loops from rebuilding 64-bit addresses per tile each step (silu_lnt: 282 SASS instructions
    // per step against 308; AWQ 8B b1 replay -13..-19 us).
    const uint4* wp[NT][2];
    const __half* sp[NT][2];
    const __half* mp[NT][2];
    const unsigned char* wb[NT];
    unsigned so[NT][2];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        if (TILED) wb[i] = tiles[i].packed + (i64)(tiles[i].row0 >> 4) * 8 * cols;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = tiles[i].row0 + tiles[i].gs * g + tiles[i].hs * h;
            if (TILED) {
                so[i][h] = (unsigned)(r * groups + warp);
            } else {
                wp[i][h] = reinterpret_cast<const uint4*>(tiles[i].packed + (i64)r * (cols >> 1)) + 4 * warp + t;
                sp[i][h] = tiles[i].scales + (i64)r * groups + warp;
                mp[i][h] = tiles[i].mins + (i64)r * groups + warp;
            }
        }
    }
    const unsigned wo = (unsigned)(64 * warp + lane) * 16u;  // TILED
    unsigned smo[NT];                                         // SMI: the lane's word pair at step 0
#pragma unroll
    for (int i = 0; i < NT; ++i) smo[i] = ((unsigned)(tiles[i].row0 >> 4) * groups + warp) * 16u + 2u * g;
    const uint4* xp = lean_x_lane(x, n, cols);
    // TM_Q4_ABLATE_SMLOAD's scale and min (opaque to the compiler, loop-invariant)
    const __half sm_const[2] = {__ushort_as_half((unsigned short)(0x2000u + (tiles[0].row0 & 7))),
                                __ushort_as_half((unsigned short)(0xA400u + (tiles[0].row0 & 7)))};

    struct Buf {
        uint4 w[NT][2];
        __half s[NT][2], m[NT][2];
        uint4 x[4];
        float2 xl;  // TM_Q4_ABLATE_XLOAD
    };
    // The scale and min loads of tile i, row half h (h = 0 loads both rows' where one word holds
    // them) of step j into s, m.
    auto load_sm = [&](__half (&sd)[NT][2], __half (&md)[NT][2], int i, int h, int j) {
        if (TILED && SMI == 2) {
            // scales and mins each in tile-major order: half ((row / 16 * groups + group) * 8 +
            // row % 8) * 2 + row / 8 % 2, so rows g and g + 8 are one 32-bit word
            if (h == 0) {
                const unsigned si = smo[i] / 2 + 64u * (unsigned)j;
                const unsigned sv = reinterpret_cast<const unsigned*>(tiles[i].scales)[si];
                const unsigned mv = reinterpret_cast<const unsigned*>(tiles[i].mins)[si];
                split_halves(sv, sd[i][0], sd[i][1]);
                split_halves(mv, md[i][0], md[i][1]);
            }
        } else if (TILED && SMI) {
            if (h == 0) {
                const uint2 v = *reinterpret_cast<const uint2*>(tiles[i].smi + smo[i] + 128u * (unsigned)j);
                split_halves(v.x, sd[i][0], md[i][0]);
                split_halves(v.y, sd[i][1], md[i][1]);
            }
        } else if (TILED) {
            const unsigned si = so[i][h] + 8u * (unsigned)j;
            sd[i][h] = tiles[i].scales[si];
            md[i][h] = tiles[i].mins[si];
        } else {
            sd[i][h] = sp[i][h][8 * j];
            md[i][h] = mp[i][h][8 * j];
        }
        if (TM_Q4_ABLATE_SMLOAD == 1 || (TM_Q4_ABLATE_SMLOAD == 2 && NT == 2)) {  // the loads above are dead then
            sd[i][h] = sm_const[0];
            md[i][h] = sm_const[1];
        }
    };
    // n <= 8: SMHIT's step is 0 (NT = 2 loops only: the NT = 1 joins drop to 84 registers with it,
    // which would let three CTAs share an SM)
    const int sm_zero = TM_Q4_ABLATE_SMHIT && NT == 2 ? (n >> 8) : 1;
    auto loadw = [&](Buf& B, int j) {
        const unsigned o = wo + 8192u * (unsigned)j;
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (TILED)
                    B.w[i][h] = __ldcs(reinterpret_cast<const uint4*>(wb[i] + o) + 32 * h);
                else
                    B.w[i][h] = __ldcs(wp[i][h] + 32 * j);
                load_sm(B.s, B.m, i, h, j * sm_zero);
            }
    };
    const int xb0 = B1 ? (lane >> 3) : 0;  // B1: x chunk 0's block, g / 2
    auto loadx = [&](Buf& B, int j) {
        load_step_x(B.x, xp, j);
        if (B1) B.x[0] = __ldca(xp + 128 * j + xb0);  // replaces chunk 0 (the load above is dead)
        if (TM_Q4_ABLATE_XLOAD) B.xl = __ldca(reinterpret_cast<const float2*>(xp) + 2 * j);
    };

    zero_acc<NT>(acc);

    Buf buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (u < J) loadw(buf[u], u);
    wait();
    if (XPRE) {
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (u < J) loadx(buf[u], u);
    }
    for (int j0 = 0; j0 < J; j0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            if (j >= J) break;  // the whole warp
            if (!XPRE) loadx(buf[u], j);
            step_math_lean<T, NT, B1, NT == 1 && TILED && TM_Q4_LEAN_WSWAP>(buf[u].w, buf[u].s, buf[u].m, buf[u].x, acc, TM_Q4_ABLATE_XLOAD ? buf[u].xl : make_float2(0.f, 0.f));
            if (j + U < J) {
                loadw(buf[u], j + U);
                if (XPRE) loadx(buf[u], j + U);
            }
        }
    }
    if constexpr (B1) quad_sum_b1<NT>(acc);
}

template <class T, int U, int NT, bool XPRE, bool TILED = false, int SMI = 0, class Wait>
__device__ __forceinline__ void q4_tiles_lean(const Tile* tiles, const T* __restrict__ x, int n, int cols,
                                              float acc[NT][4], Wait wait) {
    if (TM_Q4_LEAN_B1 && n == 1)
        q4_tiles_lean_loop<T, U, NT, XPRE, TILED, SMI, true>(tiles, x, n, cols, acc, wait);
    else
        q4_tiles_lean_loop<T, U, NT, XPRE, TILED, SMI, false>(tiles, x, n, cols, acc, wait);
}

// Called once a CTA's weight loads are all issued and consumed: lets the next kernel's blocks be
// scheduled (they still wait for this grid to finish before reading its output), so its launch and
// first weight loads overlap this grid's reductions and tail. A multi-wave grid's trigger completes
// only once its last blocks have started, so the early blocks never take slots it needs.
// scripts/gpu/q4_decode_chain.cu (32 int4 8B layers, b1): 1703 -> 1638 us per step; with
// TM_Q4_GEMV_EARLY_TRIGGER=0 the kernels trigger at exit as before.
#ifndef TM_Q4_GEMV_EARLY_TRIGGER
#define TM_Q4_GEMV_EARLY_TRIGGER 1
#endif
__device__ __forceinline__ void trigger_after_loop() {
    if (TM_Q4_GEMV_EARLY_TRIGGER) tmk::pdl_launch_dependents_early();
}

// Sums the warps' fragments: thread `tid` (< NT * 128) gets element e = tid / 32 (tile e / 4,
// fragment element e % 4) of lane tid % 32, summed over the warps. Every thread must call it.
template <int NT> __device__ __forceinline__ float reduce_warps_in(float* red, const float acc[NT][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(warp * NT * 4 + i * 4 + e) * 32 + lane] = acc[i][e];
    __syncthreads();
    float v = 0.f;
    if (threadIdx.x < NT * 4 * 32) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w * NT * 4 * 32 + threadIdx.x];
    }
    return v;
}
template <int NT> __device__ __forceinline__ float reduce_warps(const float acc[NT][4]) {
    __shared__ float red[WARPS * NT * 4 * 32];
    return reduce_warps_in<NT>(red, acc);
}

// Deferred RMSNorm (tm-core's `DeferredNorm`). Between a decode product y (o, down) and the next
// layer's products (gate/up, q/k/v) sits the residual join `residual += y; x = rms_norm(residual) *
// gamma`, a kernel of its own. Deferred, the producer (`q4_gemv_join`) ends with the join's
// elementwise part: per row, residual = T(residual + T(y)) (written back), x = T(residual * gamma),
// and each CTA adds its rows' sum of squares of the new residual into one f64 per batch row of its
// slot (atomicAdd; the f32 partials' sum is exact in f64 unless their magnitudes spread over 2^29,
// so the order does not show). The consumers read x as any input, load their batch row's sum right
// after `pdl_wait` (an `__ldcg`: coherent, never hoisted above the wait; it has arrived long before
// the epilogue, where a load would cost its whole L2 latency in every CTA) and multiply their sums
// by rsqrt(sum / cols + eps) before their epilogue (bias, RoPE, SiLU). The slots are zeroed once
// per step (the engine's `fill_zero`), each used by one producer. f16: x is residual * gamma before
// the scale, so |residual * gamma| must stay below 65504 (as |residual| itself must).
// scripts/gpu/q4_decode_chain.cu: -30..-38 us per batch-1 step of the 8B chain.
struct NormScale {
    const double* sums;  // the slot: one sum per batch row; null: the input is already normalized
    int cols;            // features the norm is over
    float eps;
};

// After `pdl_wait`: the sum of batch row j (< n) of the slot, or 0.
__device__ __forceinline__ double load_norm_sum(const NormScale& ns, int n, int j) {
    return ns.sums && j < n ? __ldcg(ns.sums + j) : 0.0;
}

// The row scale from that sum (1 when ns.sums is null).
__device__ __forceinline__ float norm_scale(const NormScale& ns, double sum) {
    return ns.sums ? rsqrtf((float)sum / (float)ns.cols + ns.eps) : 1.f;
}

// The batch row of thread tid's fragment element in the epilogues (`reduce_warps`' order): element
// e = tid / 32 % 4 of lane tid % 32 is batch column 2 (lane % 4) + e % 2.
__device__ __forceinline__ int epilogue_batch_row() {
    return 2 * (threadIdx.x & 3) + ((threadIdx.x >> 5) & 1);
}

// The tile loops' `wait` for a consumer of a deferred norm: `wait()`, then the thread's batch-row
// sum into `sum` (`load_norm_sum`), so that it has arrived before the epilogue.
template <class Wait>
__device__ __forceinline__ auto wait_then_sum(Wait wait, const NormScale& ns, int n, double& sum) {
    return [=, &ns, &sum] {
        wait();
        sum = load_norm_sum(ns, n, epilogue_batch_row());
    };
}

// The SiLU epilogue of a 16-row gate/up CTA (rows row0 .. row0 + 15): `v` as `reduce_warps<2>`
// leaves it (gate sums in threads 0..127, up sums in 128..255, same fragment order), `upv` 128
// floats of shared memory; out = silu(T(gate)) * T(up), what separate products would store.
template <class T>
__device__ __forceinline__ void silu_store(T* out, float v, float* upv, int row0, int rows, int n) {
    if (threadIdx.x >= 128) upv[threadIdx.x - 128] = v;
    __syncthreads();
    if (threadIdx.x < 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row = row0 + (lane >> 2) + 8 * (e >> 1);
        const int j = 2 * (lane & 3) + (e & 1);
        if (j < n && row < rows) {
            const float gv = tmk::round_to<T>(v);
            const float uv = tmk::round_to<T>(upv[threadIdx.x]);
            out[(i64)j * rows + row] = tmk::from_float<T>(gv / (1.f + __expf(-gv)) * uv);
        }
    }
}

// Which tile loop a kernel runs: `q4_tiles`, `q4_tiles_lean`, or `q4_tiles_lean` on tile-major
// weights, with row-major scales and mins or (LEAN_TILED_TS, `tiled` = 2) scales and mins in tile
// order (SMI = 2).
enum Path { GENERIC = 0, LEAN = 1, LEAN_TILED = 2, LEAN_TILED_TS = 3 };

// The plain products with NT 16-row tiles (16 NT consecutive rows of one weight) per CTA.
template <class T, int U, int NT, int PATH, class Wait>
__device__ __forceinline__ void q4_gemv(const T* __restrict__ x, int n, int cols, int group, const Slot<T>* slots,
                                        Wait wait) {
    constexpr int ROWS = 16 * NT;  // rows per CTA
    // The CTA's weight: weight i owns ceil(rows_i / ROWS) CTAs.
    int cta = blockIdx.x, si = 0;
    const int own0 = (slots[0].rows + ROWS - 1) / ROWS;
    const int own1 = (slots[1].rows + ROWS - 1) / ROWS;
    if (cta >= own0) {
        cta -= own0;
        si = 1;
        if (cta >= own1) {
            cta -= own1;
            si = 2;
        }
    }
    const Slot<T> s = si == 0 ? slots[0] : si == 1 ? slots[1] : slots[2];  // constant indices: no local memory
    Tile tiles[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) tiles[i] = Tile{s.packed, s.scales, s.mins, cta * ROWS + 16 * i, s.rows};
    float acc[NT][4];
    if constexpr (PATH == LEAN_TILED)
        q4_tiles_lean<T, U, NT, NT == 2, true>(tiles, x, n, cols, acc, wait);
    else if constexpr (PATH == LEAN)
        q4_tiles_lean<T, U, NT, NT == 2>(tiles, x, n, cols, acc, wait);
    else
        q4_tiles<T, U, NT, NT == 2>(tiles, x, n, cols, group, acc, wait);
    trigger_after_loop();
    const float v = reduce_warps<NT>(acc);
    if (threadIdx.x < NT * 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int row = cta * ROWS + 16 * (e >> 2) + (lane >> 2) + 8 * ((e >> 1) & 1);
        const int j = 2 * (lane & 3) + (e & 1);
        if (j < n && row < s.rows) {
            const float b = s.bias ? tmk::to_float(s.bias[row]) : 0.f;
            s.out[(i64)j * s.rows + row] = tmk::from_float<T>(v + b);
        }
    }
}

// The producer of a deferred RMSNorm (see `NormScale`): y = x · W^T for one weight of `s.rows`
// rows (the hidden size; 16 rows per CTA), then per row and batch row j: residual = T(residual +
// T(y)) (written back: what the product then `add_rms_norm` leave), s.out = T(residual * gamma),
// and the CTA's sum of the squares of its rows of the new residual added into sums[j].
template <class T, int U, int PATH, class Wait>
__device__ __forceinline__ void q4_gemv_join(const T* __restrict__ x, int n, int cols, int group, const Slot<T>& s,
                                             T* resid, const T* gamma, double* sums, Wait wait) {
    const Tile tile{s.packed, s.scales, s.mins, (int)blockIdx.x * 16, s.rows};
    float acc[1][4];
    if constexpr (PATH == LEAN_TILED)
        q4_tiles_lean<T, U, 1, false, true>(&tile, x, n, cols, acc, wait);
    else if constexpr (PATH == LEAN)
        q4_tiles_lean<T, U, 1, false>(&tile, x, n, cols, acc, wait);
    else
        q4_tiles<T, U, 1, false>(&tile, x, n, cols, group, acc, wait);
    trigger_after_loop();
    // Thread tid < 128 holds fragment element e = tid / 32 of lane tid % 32 (`q4_gemv`'s order).
    const int e = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int row = tile.row0 + (lane >> 2) + 8 * (e >> 1);
    const int j = epilogue_batch_row();
    const bool mine = threadIdx.x < 128 && j < n && row < s.rows;
    const i64 at = (i64)j * s.rows + row;
    // Issued before the warps' reduction, which hides their latency.
    const float r0 = mine ? tmk::to_float(resid[at]) : 0.f;
    const float gm = mine ? tmk::to_float(gamma[row]) : 0.f;
    const float v = reduce_warps<1>(acc);
    float sq = 0.f;
    if (mine) {
        const T r = tmk::from_float<T>(r0 + tmk::round_to<T>(v));
        resid[at] = r;
        const float rf = tmk::to_float(r);
        s.out[at] = tmk::from_float<T>(rf * gm);
        sq = rf * rf;
    }
    // The 8 lanes of a warp with the same lane % 4 hold rows g (or g + 8) of one batch row.
    sq += __shfl_xor_sync(0xffffffffu, sq, 4);
    sq += __shfl_xor_sync(0xffffffffu, sq, 8);
    sq += __shfl_xor_sync(0xffffffffu, sq, 16);
    __shared__ float part[4][4];  // [e][lane % 4]
    if (threadIdx.x < 128 && lane < 4) part[e][lane] = sq;
    __syncthreads();
    if ((int)threadIdx.x < n) {  // batch row jj: e = jj % 2 (rows g) and 2 + jj % 2 (rows g + 8), lane = jj / 2
        const int jj = threadIdx.x;
        atomicAdd(sums + jj, (double)part[jj & 1][jj >> 1] + (double)part[2 + (jj & 1)][jj >> 1]);
    }
}

// gate/up with SiLU (the kernels' list above). XPRE: the lean loops load x with the ring's weights
// (the U = 4 kernels and `silu_lnt`'s U = 1) or at use (U = 2); scripts/gpu/q4_decode_chain.cu `g4`
// measured U = 3 and 4 with x at use at two CTAs per SM (slower), `sm` the CTAs per SM.
template <class T, int U, int PATH, bool XPRE = (U > 2), class Wait>
__device__ __forceinline__ void q4_gemv_silu(T* out, const T* __restrict__ x, int n, int cols, int group,
                                             const Slot<T>& gate, const Slot<T>& up, const NormScale& ns, Wait wait) {
    const int row0 = blockIdx.x * 16, rows = gate.rows;
    double nsum = 0.0;
    const auto wait_sum = wait_then_sum(wait, ns, n, nsum);
    const Tile tiles[2] = {Tile{gate.packed, gate.scales, gate.mins, row0, rows},
                           Tile{up.packed, up.scales, up.mins, row0, rows}};
    float acc[2][4];
    if constexpr (PATH == LEAN_TILED_TS)
        q4_tiles_lean<T, U, 2, XPRE, true, 2>(tiles, x, n, cols, acc, wait_sum);
    else if constexpr (PATH == LEAN_TILED)
        q4_tiles_lean<T, U, 2, XPRE, true>(tiles, x, n, cols, acc, wait_sum);
    else if constexpr (PATH == LEAN)
        q4_tiles_lean<T, U, 2, XPRE>(tiles, x, n, cols, acc, wait_sum);
    else
        q4_tiles<T, U, 2, true>(tiles, x, n, cols, group, acc, wait_sum);
    __shared__ float upv[128];
    trigger_after_loop();
    silu_store<T>(out, reduce_warps<2>(acc) * norm_scale(ns, nsum), upv, row0, rows, n);
}

// The RoPE arguments of `q4_gemv_rope` (what `rope_write_kv` takes, ABI.md "RoPE"): per batch row
// j its position and KV-cache slot (0xffffffff: a padding token, rotated but not cached), the
// inverse frequencies [head_dim / 2], the factor on cos and sin, and the pair convention.
template <class T> struct RopeKv {
    T* k_cache;
    T* v_cache;
    const unsigned* positions;
    const unsigned* slots;
    const float* inv_freq;
    float attention_factor;
    int head_dim;
    int interleaved;
};

// The weight slot (0, 1, 2) of this CTA when weight i owns `slots[i].rows >> shift` CTAs, weight
// 0's first; `cta` becomes the CTA's index within its weight.
template <class T> __device__ __forceinline__ int slot_of_cta(const Slot<T>* slots, int shift, int& cta) {
    cta = blockIdx.x;
    const int own0 = slots[0].rows >> shift, own1 = slots[1].rows >> shift;
    if (cta < own0) return 0;
    cta -= own0;
    if (cta < own1) return 1;
    cta -= own1;
    return 2;
}

// Where a CTA of a RoPE launch (2^shift rows per CTA of q, k, then v) works: its weight slot
// si (0 q, 1 k, 2 v) and that weight, its index `cta` within the weight, and for q and k the head
// and the CTA's index tt within the head (head_dim >> shift CTAs per head).
template <class T> struct RopeCta {
    int si;
    Slot<T> s;
    int cta, head, tt;
};
template <class T> __device__ __forceinline__ RopeCta<T> rope_cta(const Slot<T>* slots, int head_dim, int shift) {
    RopeCta<T> c;
    c.si = slot_of_cta(slots, shift, c.cta);
    c.s = c.si == 0 ? slots[0] : c.si == 1 ? slots[1] : slots[2];  // constant indices: no local memory
    const int per_head = head_dim >> shift;
    c.head = c.cta / per_head;
    c.tt = c.cta - c.head * per_head;
    return c;
}

// The RoPE epilogue's stores for batch row j: v (`si` 2) stores `y` at `row` of the output and,
// unless the token is padding, of the value cache; q and k (`rope_pair`) rotate the pair (x1, x2)
// of rows ra, rb (pair index i of the head) exactly as `rope_write_kv` does and store it, k also
// into the key cache.
template <class T> __device__ __forceinline__ void store_v(const Slot<T>& s, const RopeKv<T>& rk, int kv_dim, int j, int row, float y) {
    const T t = tmk::from_float<T>(y);
    s.out[(i64)j * s.rows + row] = t;
    const unsigned slot = rk.slots[j];
    if (slot != 0xffffffffu) rk.v_cache[(u64)slot * kv_dim + row] = t;
}
template <class T>
__device__ __forceinline__ void rope_pair(const Slot<T>& s, const RopeKv<T>& rk, bool is_k, int kv_dim, int j, int i, int ra,
                                          int rb, float x1, float x2) {
    float sn, cs;
    sincosf(__fmul_rn((float)rk.positions[j], rk.inv_freq[i]), &sn, &cs);
    const float c = cs * rk.attention_factor, sv = sn * rk.attention_factor;
    const T ya = tmk::from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sv)));
    const T yb = tmk::from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sv)));
    s.out[(i64)j * s.rows + ra] = ya;
    s.out[(i64)j * s.rows + rb] = yb;
    const unsigned slot = rk.slots[j];
    if (is_k && slot != 0xffffffffu) {
        rk.k_cache[(u64)slot * kv_dim + ra] = ya;
        rk.k_cache[(u64)slot * kv_dim + rb] = yb;
    }
}

// The q/k/v products of a decode step (lean, NT = 1, `ln`'s configuration) with RoPE of q and k
// and the KV-cache write of the rotated k and of v in the epilogue: what `q4_gemv` then
// `rope_write_kv` (elementwise.cu) store, bit for bit. Slots 0, 1, 2 are q, k, v (rows heads * D,
// kv_heads * D, kv_heads * D). A q or k CTA takes one head's rows {8 t + g, 8 t + g + D / 2} (or
// {16 t + 2 g, 16 t + 2 g + 1} when interleaved) for t = 0 .. D / 16 - 1: the two rows of each
// RoPE pair land in one thread's fragment rows g and g + 8; a v CTA takes 16 consecutive rows.
template <class T, class Wait>
__device__ __forceinline__ void q4_gemv_rope(const T* __restrict__ x, int n, int cols, const Slot<T>* slots,
                                             const RopeKv<T>& rk, const NormScale& ns, Wait wait) {
    double nsum = 0.0;
    const auto wait_sum = wait_then_sum(wait, ns, n, nsum);
    const RopeCta<T> c = rope_cta(slots, rk.head_dim, 4);
    const int si = c.si, cta = c.cta, head = c.head, tt = c.tt, D = rk.head_dim;
    const Slot<T>& s = c.s;
    Tile tile{s.packed, s.scales, s.mins, cta * 16, s.rows};
    if (si < 2) {
        tile.row0 = head * D + (rk.interleaved ? 16 * tt : 8 * tt);
        tile.gs = rk.interleaved ? 2 : 1;
        tile.hs = rk.interleaved ? 1 : D >> 1;
    }
    float acc[1][4];
    q4_tiles_lean<T, 2, 1, false>(&tile, x, n, cols, acc, wait_sum);
    trigger_after_loop();
    const float v = reduce_warps<1>(acc) * norm_scale(ns, nsum);
    // Thread tid < 128 holds fragment element e = tid / 32 of lane tid % 32: fragment row
    // g + 8 (e / 2), batch column 2 (lane % 4) + e % 2; rounded to T with the bias, as stored.
    __shared__ float fin[128];
    const int kv_dim = slots[1].rows;
    if (threadIdx.x < 128) {
        const int e = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
        const int row = tile.row0 + tile.gs * g + tile.hs * (e >> 1);
        const float b = s.bias ? tmk::to_float(s.bias[row]) : 0.f;
        fin[threadIdx.x] = tmk::round_to<T>(v + b);
        const int j = 2 * (lane & 3) + (e & 1);
        if (si == 2 && j < n) store_v(s, rk, kv_dim, j, row, fin[threadIdx.x]);
    }
    if (si == 2) return;  // uniform per CTA
    __syncthreads();
    if (threadIdx.x < 64) {
        const int par = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
        const int j = 2 * (lane & 3) + par;
        if (j < n) {
            const int ra = tile.row0 + tile.gs * g, rb = ra + tile.hs;
            const int i = 8 * tt + g;  // the pair's index in its head
            rope_pair(s, rk, si == 1, kv_dim, j, i, ra, rb, fin[par * 32 + lane], fin[(2 + par) * 32 + lane]);
        }
    }
}

// `q4_gemv_rope` for tile-major weights (the tiles as stored are 16 consecutive rows, so the
// RoPE pair of a row is in another tile): rotate-half only, `head_dim % 32 == 0`. A q or k CTA
// takes two tiles of one head, rows 16 t .. 16 t + 15 and the same + head_dim / 2 (t < head_dim /
// 32), with the lean loop at U = 2 over two tiles: the RoPE pair of fragment element e of the first
// tile is element e of the second. A v CTA takes 32 consecutive rows. Each tile's sums are those
// of `q4_gemv`'s `lnt` (same steps, same warp reduction), so the results equal `q4_gemv` then
// `rope_write_kv`, bit for bit, as `q4_gemv_rope`'s do.
template <class T, class Wait>
__device__ __forceinline__ void q4_gemv_rope_tiled(const T* __restrict__ x, int n, int cols, const Slot<T>* slots,
                                                   const RopeKv<T>& rk, const NormScale& ns, Wait wait) {
    double nsum = 0.0;
    const auto wait_sum = wait_then_sum(wait, ns, n, nsum);
    const RopeCta<T> c = rope_cta(slots, rk.head_dim, 5);
    const int si = c.si, cta = c.cta, head = c.head, tt = c.tt, D = rk.head_dim;
    const Slot<T>& s = c.s;
    // First rows of the two tiles: a head's 16 tt and 16 tt + D / 2 (q, k), or 32 cta and + 16 (v).
    const int row_a = si < 2 ? head * D + 16 * tt : 32 * cta;
    const int row_b = si < 2 ? row_a + (D >> 1) : row_a + 16;
    const Tile tiles[2] = {Tile{s.packed, s.scales, s.mins, row_a, s.rows}, Tile{s.packed, s.scales, s.mins, row_b, s.rows}};
    float acc[2][4];
    q4_tiles_lean<T, TM_Q4_ROPE_TILED_U, 2, false, true>(tiles, x, n, cols, acc, wait_sum);
    trigger_after_loop();
    const float v = reduce_warps<2>(acc) * norm_scale(ns, nsum);
    // Thread tid holds fragment element e = tid / 32 (tile e / 4) of lane tid % 32: row g + 8 (e / 2
    // % 2) of its tile, batch column 2 (lane % 4) + e % 2; rounded to T with the bias, as stored.
    __shared__ float fin[256];
    const int kv_dim = slots[1].rows;
    const int e = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int row = (e < 4 ? row_a : row_b) + g + 8 * ((e >> 1) & 1);
    const int j = 2 * (lane & 3) + (e & 1);
    {
        const float b = s.bias ? tmk::to_float(s.bias[row]) : 0.f;
        fin[threadIdx.x] = tmk::round_to<T>(v + b);
    }
    if (si == 2) {  // uniform per CTA
        if (j < n) store_v(s, rk, kv_dim, j, row, fin[threadIdx.x]);
        return;
    }
    __syncthreads();
    if (threadIdx.x < 128 && j < n)  // the pair's index in its head: row - head * D
        rope_pair(s, rk, si == 1, kv_dim, j, row - head * D, row, row + (D >> 1), fin[threadIdx.x],
                  fin[threadIdx.x + 128]);
}

}  // namespace tmq4

// Variants (see the launcher): U = steps in flight per warp, MIN_CTAS = CTAs per SM the register
// budget is cut for. `u2` (32-row CTAs, at most 128 registers: two CTAs per SM), `n16` (16-row
// CTAs, U = 2, at most 80 registers: three CTAs per SM; twice the CTAs of `u2` for weights too
// small to fill the GPU), and the lean `ln` (n16's configuration) and `ln4` (U = 4, two CTAs per
// SM). Every kernel allows the next one to launch first thing and hands `pdl_wait` to the tile
// loop, which calls it once the ring's first weights are in flight.
#define TM_Q4_GEMV_PLAIN(NAME, T, U, NT, MIN_CTAS, PATH)                                                                \
    extern "C" __global__ void __launch_bounds__(tmq4::THREADS, MIN_CTAS)                                               \
        NAME(const T* __restrict__ x, int n, int cols, int group, T* o0, T* o1, T* o2, const unsigned char* w0,         \
             const unsigned char* w1, const unsigned char* w2, const __half* s0, const __half* s1,                      \
             const __half* s2, const __half* m0, const __half* m1, const __half* m2, const T* b0, const T* b1,          \
             const T* b2, int r0, int r1, int r2) {                                                                     \
        tmk::pdl_launch_dependents();                                                                                   \
        const tmq4::Slot<T> slots[3] = {{o0, w0, s0, m0, b0, r0}, {o1, w1, s1, m1, b1, r1}, {o2, w2, s2, m2, b2, r2}};  \
        tmq4::q4_gemv<T, U, NT, tmq4::PATH>(x, n, cols, group, slots, [] { tmk::pdl_wait(); });                               \
    }
// XPRE: x loaded with the ring's weights or at use (`q4_gemv_silu`); the shipped kernels take the
// default (`TM_Q4_GEMV_SILU`), scripts/gpu/q4_decode_chain.cu builds other combinations.
#define TM_Q4_GEMV_SILU_X(NAME, T, U, MIN_CTAS, PATH, XPRE)                                                             \
    extern "C" __global__ void __launch_bounds__(tmq4::THREADS, MIN_CTAS)                                               \
        NAME(T* out, const T* __restrict__ x, int n, int cols, int group,                                               \
                                  const unsigned char* wg, const __half* sg, const __half* mg,                          \
                                  const unsigned char* wu, const __half* su, const __half* mu, int rows,                \
                                  const double* norm_sums, float norm_eps) {                                            \
        tmk::pdl_launch_dependents();                                                                                   \
        const tmq4::Slot<T> gate = {out, wg, sg, mg, nullptr, rows};                                                    \
        const tmq4::Slot<T> up = {out, wu, su, mu, nullptr, rows};                                                      \
        const tmq4::NormScale ns = {norm_sums, cols, norm_eps};                                                         \
        tmq4::q4_gemv_silu<T, U, tmq4::PATH, XPRE>(out, x, n, cols, group, gate, up, ns, [] { tmk::pdl_wait(); });      \
    }
// The deferred join's producer (`q4_gemv_join`): one weight of `rows` rows, the residual, the
// join's output (x), the norm weight and the slot's sums [n] (f64).
#define TM_Q4_GEMV_JOIN(NAME, T, U, MIN_CTAS, PATH)                                                                     \
    extern "C" __global__ void __launch_bounds__(tmq4::THREADS, MIN_CTAS)                                               \
        NAME(const T* __restrict__ x, int n, int cols, int group, const unsigned char* w, const __half* sc,             \
             const __half* mn, int rows, T* resid, T* normed, const T* gamma, double* sums) {                           \
        tmk::pdl_launch_dependents();                                                                                   \
        const tmq4::Slot<T> s = {normed, w, sc, mn, nullptr, rows};                                                     \
        tmq4::q4_gemv_join<T, U, tmq4::PATH>(x, n, cols, group, s, resid, gamma, sums, [] { tmk::pdl_wait(); });        \
    }
#define TM_Q4_GEMV_SILU(NAME, T, U, MIN_CTAS, PATH) TM_Q4_GEMV_SILU_X(NAME, T, U, MIN_CTAS, PATH, (U > 2))
// q/k/v with RoPE and the KV-cache write (`q4_gemv_rope`): the plain parameters (without
// `accumulate`), then the caches, positions, slots, inv_freq, attention_factor, head_dim and
// interleaved of `rope_write_kv`.
#define TM_Q4_GEMV_ROPE(NAME, T, FN, MIN_CTAS)                                                                          \
    extern "C" __global__ void __launch_bounds__(tmq4::THREADS, MIN_CTAS)                                               \
        NAME(const T* __restrict__ x, int n, int cols, int group, T* o0, T* o1, T* o2, const unsigned char* w0,         \
             const unsigned char* w1, const unsigned char* w2, const __half* s0, const __half* s1,                      \
             const __half* s2, const __half* m0, const __half* m1, const __half* m2, const T* b0, const T* b1,          \
             const T* b2, int r0, int r1, int r2, T* k_cache, T* v_cache, const unsigned* positions,                   \
             const unsigned* kv_slots, const float* inv_freq, float attention_factor, int head_dim, int interleaved,    \
             const double* norm_sums, float norm_eps) {                                                                 \
        const tmq4::Slot<T> slots[3] = {{o0, w0, s0, m0, b0, r0}, {o1, w1, s1, m1, b1, r1}, {o2, w2, s2, m2, b2, r2}};  \
        const tmq4::RopeKv<T> rk = {k_cache, v_cache, positions, kv_slots, inv_freq, attention_factor, head_dim,         \
                                    interleaved};                                                                       \
        const tmq4::NormScale ns = {norm_sums, cols, norm_eps};                                                         \
        tmq4::FN<T>(x, n, cols, slots, rk, ns, [] { tmk::pdl_wait(); });                                                \
    }
#define TM_Q4_GEMV(SUF, T)                                                                                              \
    TM_Q4_GEMV_ROPE(q4_gemv_ln_rope_##SUF, T, q4_gemv_rope, 3)                                                          \
    TM_Q4_GEMV_ROPE(q4_gemv_lnt_rope_##SUF, T, q4_gemv_rope_tiled, 2)                                                   \
    TM_Q4_GEMV_PLAIN(q4_gemv_u2_##SUF, T, 2, 2, 2, GENERIC)                                                             \
    TM_Q4_GEMV_PLAIN(q4_gemv_n16_##SUF, T, 2, 1, 3, GENERIC)                                                            \
    TM_Q4_GEMV_PLAIN(q4_gemv_ln_##SUF, T, 2, 1, 3, LEAN)                                                                \
    TM_Q4_GEMV_PLAIN(q4_gemv_ln4_##SUF, T, 4, 1, 2, LEAN)                                                               \
    TM_Q4_GEMV_PLAIN(q4_gemv_lnt_##SUF, T, 2, 1, 3, LEAN_TILED)                                                         \
    TM_Q4_GEMV_PLAIN(q4_gemv_ln4t_##SUF, T, 4, 1, 2, LEAN_TILED)                                                        \
    TM_Q4_GEMV_SILU(q4_gemv_silu_u2_##SUF, T, 2, 2, GENERIC)                                                            \
    TM_Q4_GEMV_SILU(q4_gemv_silu_ln_##SUF, T, 2, 2, LEAN)                                                               \
    TM_Q4_GEMV_SILU(q4_gemv_silu_ln4_##SUF, T, 4, 1, LEAN)                                                              \
    TM_Q4_GEMV_SILU_X(q4_gemv_silu_lnt_##SUF, T, 1, 3, LEAN_TILED, true)                                                \
    TM_Q4_GEMV_SILU_X(q4_gemv_silu_lnts_##SUF, T, 1, 3, LEAN_TILED_TS, true)                                            \
    TM_Q4_GEMV_SILU(q4_gemv_silu_ln4t_##SUF, T, 4, 1, LEAN_TILED)                                                        \
    TM_Q4_GEMV_JOIN(q4_gemv_n16_join_##SUF, T, 2, 3, GENERIC)                                                           \
    TM_Q4_GEMV_JOIN(q4_gemv_ln_join_##SUF, T, 2, 2, LEAN)                                                               \
    TM_Q4_GEMV_JOIN(q4_gemv_ln4_join_##SUF, T, 4, 2, LEAN)                                                              \
    TM_Q4_GEMV_JOIN(q4_gemv_lnt_join_##SUF, T, 2, 2, LEAN_TILED)                                                        \
    TM_Q4_GEMV_JOIN(q4_gemv_ln4t_join_##SUF, T, TM_Q4_JOIN_TILED_U, 2, LEAN_TILED)

TM_Q4_GEMV(f16, __half)
TM_Q4_GEMV(bf16, __nv_bfloat16)

