// w4a16 prefill GEMM: out[n, rows] = x[n, cols] · W^T with W in tm's int4 layout (see ABI.md,
// "q4_gemm.cu"), T = f16 or bf16 activations and outputs, f32 accumulation on tensor cores.
//
// GEMM terms: M = n (tokens), N = rows (weight rows), K = cols. Each CTA (256 threads, 8 warps in a
// WARPS_M x WARPS_N grid) computes a BM x BN tile of `out`, walking K in tiles of 64 columns:
// - a STAGES-deep cp.async pipeline (16-byte cp.async.cg, one commit group per k-tile, one
//   __syncthreads per k-tile) brings in the activation tile (BM x 64 of T) and the *packed* int4
//   tile (BN rows x 32 bytes). Weights are never dequantized into memory, shared or global.
// - each k-tile's scales and mins (one pair per row per 32-column block) are read with ordinary
//   loads one k-tile ahead into registers, then written to the stage's shared slot as f16 pairs
//   (s, s) and (m, m) one iteration later (latency hidden behind a whole k-tile of math).
// - activations: shared rows of 128 bytes, 16-byte chunk c of row r stored at chunk c ^ (r & 7)
//   (XOR swizzle: ldmatrix.x4 reads 8 rows of one logical chunk from 8 different bank groups).
// - packed weights: shared rows of 32 bytes (two 16-byte blocks, one per 32 columns), block b of
//   row r stored at position b ^ ((r >> 2) & 1), so the 8 rows a warp reads at once hit distinct
//   banks.
// - dequantization in registers right before the mma (m16n8k16, row.col): a thread with
//   t = lane % 4 needs, for its weight row and each 8-column chunk of the k-tile, the columns
//   chunk + 2t and chunk + 2t + 1 (the B fragment). In tm's layout those live in bytes 2t, 2t+1 of
//   each 8-byte half of a 16-byte block (low nibbles: columns 0-15 of the block, high nibbles:
//   16-31). Two 32-bit shared loads (bytes 4(t/2).. of each half) and one PRMT give a word whose
//   bytes are [A(2t), B(2t), A(2t+1), B(2t+1)] (A/B = first/second half). Its nibbles at bits
//   (0, 16), (8, 24), (4, 20), (12, 28) are then exactly the B-fragment pairs for block columns
//   (2t, 2t+1) + {0, 8, 16, 24}: OR-ing them into the mantissa of the f16 pair (1024, 1024)
//   gives 1024 + q exactly (the high nibbles, left in place, give 1024 + 16 q: one hfma2 by
//   1/16, -64 yields q); hfma2(q, scale, min) in f16 the weight, rounded once. bf16 converts that
//   f16 pair to bf16 (one more rounding, like the old tiled kernel's rounding of w to T). So the
//   reduction order is the natural one and the activation tile needs no permutation.
//
// Requirements (checked by the launcher, tm-cuda/src/kernels/q4_gemm.rs): cols % 64 == 0,
// group % 32 == 0, cols % group == 0, rows % 8 == 0, x and packed 16-byte aligned, out 4-byte
// aligned, scales and mins 2-byte aligned, sm_80 or newer. Rows of x past n and weight rows past
// `rows` are zero-filled and never written.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "common.cuh"  // tmk::pdl_launch_dependents, tmk::pdl_wait

namespace tmg {

constexpr int THREADS = 256;
constexpr int BK = 64;  // columns per k-tile

template <class T2> __device__ __forceinline__ T2 as_t2(unsigned v) {
    return *reinterpret_cast<T2*>(&v);
}
template <class T2> __device__ __forceinline__ unsigned as_u32(T2 v) {
    return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, L2 only; zero-filled (nothing read) when !ok.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool ok) {
    const int bytes = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b, __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b, __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A scale or min as the f16 pair (v, v) (both dtypes dequantize in f16, see dequant8).
__device__ __forceinline__ unsigned dup(__half v) { return as_u32(__halves2half2(v, v)); }

// Dequantizes the 8 weights of word `r` (bytes [A(2t), B(2t), A(2t+1), B(2t+1)], see the top) with
// the f16 pairs `s2` = (scale, scale), `m2` = (min, min). b[0] = columns (2t, 2t+1), b[1] = (8+2t, 9+2t),
// b[2] = (16+2t, 17+2t), b[3] = (24+2t, 25+2t) of the 32-column block, low column in the low half.
__device__ __forceinline__ void dequant8(unsigned r, unsigned s2, unsigned m2, unsigned* b, __half) {
    typedef __half2 T2;
    const T2 s = as_t2<T2>(s2), m = as_t2<T2>(m2);
    const T2 magic = as_t2<T2>(0x64006400u);                  // (1024, 1024)
    const T2 sixteenth = as_t2<T2>(0x2C002C00u);              // (1/16, 1/16)
    const T2 neg64 = as_t2<T2>(0xD400D400u);                  // (-64, -64)
    const unsigned r8 = r >> 8;
    // Low nibbles: 1024 + q; high nibbles (bits 4-7 kept in place): 1024 + 16 q.
    const T2 lo0 = as_t2<T2>((r & 0x000F000Fu) | 0x64006400u);
    const T2 lo1 = as_t2<T2>((r8 & 0x000F000Fu) | 0x64006400u);
    const T2 hi0 = as_t2<T2>((r & 0x00F000F0u) | 0x64006400u);
    const T2 hi1 = as_t2<T2>((r8 & 0x00F000F0u) | 0x64006400u);
    b[0] = as_u32(__hfma2(__hsub2(lo0, magic), s, m));
    b[1] = as_u32(__hfma2(__hsub2(lo1, magic), s, m));
    b[2] = as_u32(__hfma2(__hfma2(hi0, sixteenth, neg64), s, m));  // (1024 + 16q) / 16 - 64 = q, exact
    b[3] = as_u32(__hfma2(__hfma2(hi1, sixteenth, neg64), s, m));
}
// bf16: the same f16 arithmetic (scale and min are f16, so q * scale + min is rounded once, to
// f16's 11 bits), then each pair converted to bf16. Doing the fma in bf16 instead would round the
// scale, the min and the result to 8 bits each; the first two errors are systematic over a group
// and about triple the error of the product (measured against the conformance tolerance).
__device__ __forceinline__ void dequant8(unsigned r, unsigned s2, unsigned m2, unsigned* b, __nv_bfloat16) {
    unsigned h[4];
    dequant8(r, s2, m2, h, __half());
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(as_t2<__half2>(h[i]));
        b[i] = as_u32(__floats2bfloat162_rn(f.x, f.y));
    }
}

__device__ __forceinline__ unsigned pack_out(float lo, float hi, __half) {
    return as_u32(__floats2half2_rn(lo, hi));
}
__device__ __forceinline__ unsigned pack_out(float lo, float hi, __nv_bfloat16) {
    return as_u32(__floats2bfloat162_rn(lo, hi));
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES> struct Shape {
    static_assert(WARPS_M * WARPS_N * 32 == THREADS, "8 warps");
    static constexpr int WTM = BM / WARPS_M;  // warp tile rows (tokens)
    static constexpr int WTN = BN / WARPS_N;  // warp tile columns (weight rows)
    static constexpr int MT = WTM / 16;       // m16 tiles per warp
    static constexpr int NT = WTN / 8;        // n8 tiles per warp
    static_assert(MT * 16 == WTM && NT * 8 == WTN, "warp tile");
    static constexpr int A_BYTES = BM * BK * 2;  // activation tile per stage: BM rows of 128 bytes
    static constexpr int B_BYTES = BN * BK / 2;  // packed tile per stage: BN rows of 32 bytes
    static constexpr int S_BYTES = BN * 2 * 8;   // per row and 32-column block: (s, s), (m, m)
    static constexpr int SMEM = STAGES * (A_BYTES + B_BYTES + S_BYTES);
    static constexpr int A_PER_THREAD = BM * 8 / THREADS;  // 16-byte activation chunks per thread
    static constexpr int B_PER_THREAD = BN * 2 / THREADS;  // 16-byte packed chunks per thread
    static_assert(A_PER_THREAD * THREADS == BM * 8 && B_PER_THREAD * THREADS == BN * 2, "copy split");
    static_assert(STAGES >= 3, "the scale staging needs at least 3 stages");
};

template <class T, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__device__ __forceinline__ void q4_gemm(T* __restrict__ out, const T* __restrict__ x,
                                        const unsigned char* __restrict__ packed, const __half* __restrict__ scales,
                                        const __half* __restrict__ mins, int n, int rows, int cols, int group) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    typedef Shape<BM, BN, WARPS_M, WARPS_N, STAGES> S;
    constexpr int MT = S::MT, NT = S::NT;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* const sA = smem;
    unsigned char* const sB = smem + STAGES * S::A_BYTES;
    unsigned char* const sS = sB + STAGES * S::B_BYTES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int ktiles = cols / BK;
    const int groups = cols / group;
    const long long row_bytes = cols >> 1;

    // --- Producer state: what this thread copies each k-tile (tiles are issued in order, so the
    // source pointers simply advance). ---
    // Activations: chunk i = tid + 256 i -> row tid / 8 + 32 i, 16-byte chunk tid % 8; rows 32 i
    // apart share (row & 7), so their shared offsets differ by 32 i * 128.
    const int a_chunk = tid & 7, a_r0 = tid >> 3;
    const T* a_src = x + (long long)(m0 + a_r0) * cols + a_chunk * 8;
    const long long a_step = 32ll * cols;  // elements between a thread's rows
    const unsigned a_dst = a_r0 * 128 + ((a_chunk ^ (a_r0 & 7)) << 4);
    // Packed weights and scales: pair i = tid + 256 i -> row tid / 2 + 128 i, block tid % 2; rows
    // 128 i apart share ((row >> 2) & 1).
    const int b_blk = tid & 1, b_r0 = tid >> 1;
    const unsigned char* b_src = packed + (long long)(n0 + b_r0) * row_bytes + b_blk * 16;
    const long long b_step = 128ll * row_bytes;
    const unsigned b_dst = b_r0 * 32 + ((b_blk ^ ((b_r0 >> 2) & 1)) << 4);
    const long long s_row = (long long)(n0 + b_r0) * groups;  // scale index of the row's group 0
    const unsigned s_dst = b_r0 * 16 + b_blk * 8;

    const unsigned sA0 = smem_u32(sA), sB0 = smem_u32(sB);

    auto issue_tile = [&](int stage) {
#pragma unroll
        for (int i = 0; i < S::A_PER_THREAD; ++i) {
            const bool ok = m0 + a_r0 + 32 * i < n;
            cp_async16(sA0 + stage * S::A_BYTES + a_dst + i * 32 * 128, ok ? a_src + i * a_step : x, ok);
        }
#pragma unroll
        for (int i = 0; i < S::B_PER_THREAD; ++i) {
            const bool ok = n0 + b_r0 + 128 * i < rows;
            cp_async16(sB0 + stage * S::B_BYTES + b_dst + i * 128 * 32, ok ? b_src + i * b_step : packed, ok);
        }
        a_src += BK;
        b_src += BK / 2;
    };
    __half sv[S::B_PER_THREAD], mv[S::B_PER_THREAD];
    auto load_scales = [&](int kt) {
        const int g = (kt * BK + b_blk * 32) / group;
#pragma unroll
        for (int i = 0; i < S::B_PER_THREAD; ++i) {
            if (n0 + b_r0 + 128 * i < rows) {
                const long long gi = s_row + (long long)i * 128 * groups + g;
                sv[i] = __ldg(scales + gi);
                mv[i] = __ldg(mins + gi);
            } else {
                sv[i] = __float2half(0.f);
                mv[i] = __float2half(0.f);
            }
        }
    };
    auto store_scales = [&](int stage) {
#pragma unroll
        for (int i = 0; i < S::B_PER_THREAD; ++i)
            *reinterpret_cast<uint2*>(sS + stage * S::S_BYTES + s_dst + i * 128 * 16) =
                make_uint2(dup(sv[i]), dup(mv[i]));
    };

    // --- Consumer state. ---
    const int g = lane >> 2, t = lane & 3;
    // Packed reads: row (wn * WTN + j * 8 + g); bytes 4 (t / 2) of each 8-byte half of block b,
    // which sits at position b ^ ((row >> 2) & 1) = b ^ ((g >> 2) & 1).
    const int b_row0 = wn * S::WTN + g;
    const unsigned b_off[2] = {(unsigned)(b_row0 * 32 + (((g >> 2) & 1) << 4) + ((t >> 1) << 2)),
                               (unsigned)(b_row0 * 32 + ((((g >> 2) & 1) ^ 1) << 4) + ((t >> 1) << 2))};
    const unsigned sel = (t & 1) ? 0x7362u : 0x5140u;  // bytes [A(2h), B(2h), A(2h+1), B(2h+1)], h = t % 2
    // ldmatrix.x4 for an m16k16 A fragment: lane l gives the address of row (l % 16), chunk 2 s + l / 16.
    const int a_row = wm * S::WTM + (lane & 15);
    const int a_hi = lane >> 4;
    const int a_sw = lane & 7;  // = a_row & 7

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // --- Prologue: tiles 0 .. STAGES-2. ---
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            issue_tile(s);
            load_scales(s);
            store_scales(s);
        }
        cp_async_commit();
    }

    int rd = 0;           // stage of tile kt
    int wr = STAGES - 1;  // stage of tile kt + STAGES - 1
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();              // everyone's have, and everyone is done with tile kt - 1
        // Scales of tile kt + STAGES - 2, loaded during the previous iteration.
        if (kt >= 1 && kt + STAGES - 2 < ktiles) store_scales(wr == 0 ? STAGES - 1 : wr - 1);
        if (kt + STAGES - 1 < ktiles) {
            issue_tile(wr);
            load_scales(kt + STAGES - 1);
        }
        cp_async_commit();

        const unsigned aBase = sA0 + rd * S::A_BYTES;
        const unsigned char* bBase = sB + rd * S::B_BYTES;
        const unsigned char* scBase = sS + rd * S::S_BYTES;
#pragma unroll
        for (int blk = 0; blk < 2; ++blk) {
            // B fragments of steps 2 blk and 2 blk + 1: bf[j][0..1] = step 2 blk, bf[j][2..3] = 2 blk + 1.
            unsigned bf[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const unsigned char* p = bBase + b_off[blk] + j * 8 * 32;
                const unsigned wa = *reinterpret_cast<const unsigned*>(p);
                const unsigned wb = *reinterpret_cast<const unsigned*>(p + 8);
                const uint2 sm = *reinterpret_cast<const uint2*>(scBase + (b_row0 + j * 8) * 16 + blk * 8);
                dequant8(__byte_perm(wa, wb, sel), sm.x, sm.y, bf[j], T());
            }
#pragma unroll
            for (int ss = 0; ss < 2; ++ss) {
                const int chunk = (blk * 2 + ss) * 2 + a_hi;
                unsigned af[MT][4];
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
                    ldmatrix_x4(aBase + (a_row + mi * 16) * 128 + ((chunk ^ a_sw) << 4), af[mi]);
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                    for (int j = 0; j < NT; ++j) mma(acc[mi][j], af[mi], &bf[j][2 * ss], T());
            }
        }
        rd = rd == STAGES - 1 ? 0 : rd + 1;
        wr = wr == STAGES - 1 ? 0 : wr + 1;
    }
    cp_async_wait<0>();  // nothing useful is in flight, but leave no copy outstanding at exit

    // --- Epilogue: c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g + 8. rows % 8 == 0, so a
    // pair is either wholly inside or wholly outside. ---
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int col = n0 + wn * S::WTN + j * 8 + 2 * t;
            if (col >= rows) continue;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int m = m0 + wm * S::WTM + mi * 16 + g + 8 * hr;
                if (m < n)
                    *reinterpret_cast<unsigned*>(out + (long long)m * rows + col) =
                        pack_out(acc[mi][j][2 * hr], acc[mi][j][2 * hr + 1], T());
            }
        }
    }
#else
    __trap();  // sm_80+ only; the launcher never picks this kernel elsewhere
#endif
}

}  // namespace tmg

// ---------------------------------------------------------------------------------------------
// Entry points: matmul_q4_gemm_{l,m,s}_{f16,bf16}; the tile shapes are listed in ABI.md and in the
// launcher. `l`: 128 x 256 (warp tiles 64 x 64, 3 stages); `m`: 128 x 128 (64 x 32, 4 stages, at
// most 128 registers so that two blocks fit an SM where shared memory allows, e.g. sm_90);
// `s`: 64 x 128 (32 x 32, 4 stages); `t`: 128 x 256 with tall warp tiles (128 x 32, 3 stages: each
// weight dequantized once per block instead of twice, at twice the activation ldmatrix traffic;
// chosen only when forced, for measuring against `l`).

#define TMG_KERNEL(NAME, SUF, T, BM, BN, WM, WN, ST, MINB)                                                       \
    extern "C" __global__ void __launch_bounds__(tmg::THREADS, MINB)                                            \
        matmul_q4_gemm_##NAME##_##SUF(T* __restrict__ out, const T* __restrict__ x,                              \
                                      const unsigned char* __restrict__ packed, const __half* __restrict__ scales, \
                                      const __half* __restrict__ mins, int n, int rows, int cols, int group) {   \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tmg::q4_gemm<T, BM, BN, WM, WN, ST>(out, x, packed, scales, mins, n, rows, cols, group);                \
    }

#define TMG_KERNELS(SUF, T)                          \
    TMG_KERNEL(l, SUF, T, 128, 256, 2, 4, 3, 1)      \
    TMG_KERNEL(m, SUF, T, 128, 128, 2, 4, 4, 2)      \
    TMG_KERNEL(s, SUF, T, 64, 128, 2, 4, 4, 2)       \
    TMG_KERNEL(t, SUF, T, 128, 256, 1, 8, 3, 1)

TMG_KERNELS(f16, __half)
TMG_KERNELS(bf16, __nv_bfloat16)
