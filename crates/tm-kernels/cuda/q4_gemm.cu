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

// Bytes a thread's packed-weight source pointer advances after k-tile `kt` of `kt_cols` (64 or
// 128) columns: row-major kt_cols / 2; tile-major (`tmk::q4_chunk_offset`) 1 KiB per 128
// columns, so a 64-column tile moves 32 bytes within the step and the next one 992 to the next.
__device__ __forceinline__ int packed_advance(int kt, int kt_cols, int tiled) {
    if (!tiled) return kt_cols / 2;
    return kt_cols == 128 ? 1024 : (kt & 1) ? 992 : 32;
}

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
                                        const __half* __restrict__ mins, int n, int rows, int cols, int group,
                                        int tiled) {
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
    // (128 rows on is 128 row_bytes on in both layouts: whole 16-row tiles.)
    const unsigned char* b_src = packed + tmk::q4_chunk_offset(n0 + b_r0, b_blk, cols, tiled);
    const long long b_step = 128ll * row_bytes;
    int b_kt = 0;  // the k-tile b_src points at
    const unsigned b_dst = b_r0 * 32 + ((b_blk ^ ((b_r0 >> 2) & 1)) << 4);
    // Scale index of the row's group 0 (rows 128 apart: 128 groups entries in either order).
    const long long s_row = tmk::q4_scale_row(n0 + b_r0, groups, tiled);
    const int s_gstride = tmk::q4_scale_group_stride(tiled);
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
        b_src += packed_advance(b_kt++, BK, tiled);
    };
    __half sv[S::B_PER_THREAD], mv[S::B_PER_THREAD];
    auto load_scales = [&](int kt) {
        const int g = (kt * BK + b_blk * 32) / group;
#pragma unroll
        for (int i = 0; i < S::B_PER_THREAD; ++i) {
            if (n0 + b_r0 + 128 * i < rows) {
                const long long gi = s_row + (long long)i * 128 * groups + (long long)g * s_gstride;
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
// sm_90a: the same product with Hopper's warpgroup mma (wgmma), weights as the register operand.
//
// The GEMM is computed transposed, out^T[rows, n] = W[rows, cols] · x^T, so that the dequantized
// weights are wgmma's A operand, which may come from registers: a warpgroup (4 warps, 128 threads)
// runs wgmma.m64nNk16 with A = 64 weight rows x 16 columns dequantized in registers and B = the
// activation tile (N tokens x 16 columns) read by the tensor cores straight from shared memory
// through a matrix descriptor. The register fragment of A is the one of mma.m16n8k16 per warp
// (warp w of the warpgroup holds rows 16 w .. 16 w + 15), so the dequantization is `dequant8`
// above, unchanged: for weight row g (+ 8) and a 32-column block, one word gives the fragments of
// both 16-column steps.
//
// A block is two warpgroups (256 threads): 128 weight rows (64 per warpgroup) x NTOK tokens.
// - shared memory per stage (k-tiles of 64 SUBS columns, SUBS = 1 or 2): the activation tile as
//   SUBS sub-tiles of NTOK rows of 64 columns (128 bytes) in the 128-byte swizzle wgmma reads
//   (16-byte chunk c of row r at chunk c ^ (r & 7), bases 1024-byte aligned: the layout of the
//   mma.sync kernel's activation tile), then the packed tile, 128 rows of 32 SUBS bytes whose
//   16-byte blocks are XOR-swizzled by row so that a warp's reads hit distinct banks;
// - cp.async brings tile kt + STAGES - 1 into the stage tile kt - 1 used while tile kt is
//   multiplied (one block barrier per tile; cp.async writes are generic-proxy writes, so each
//   thread fences them for the async proxy before the barrier);
// - per warpgroup and k-tile, two halves (one 32-column block each for 64-column k-tiles, two
//   for 128-column ones) with their own A registers: wait until only one wgmma group is in
//   flight (the other half's, so this half's of tile kt - 1 are done), dequantize this half's
//   fragments, issue its wgmmas as one group. So a half's dequantization overlaps the other
//   half's wgmmas. A wgmma reads its register operand
//   asynchronously and ptxas does not protect it: registers may be rewritten only after the wait
//   that retires the wgmmas reading them (a rolled loop that dequantized the next tile into the
//   registers of in-flight wgmmas gave wrong sums; asking ptxas to keep them alive made it
//   serialize every wgmma);
// - the packed words of tile kt + 1 are read from shared memory right after the barrier, the
//   scales and mins two tiles ahead from global memory into registers (one tile ahead left their
//   latency exposed: 450 -> 520 TFLOP/s on the H200).
// Epilogue: the accumulator of a thread holds, for weight rows g and g + 8 of its warp's 16, the
// tokens 8 j + 2 t and 8 j + 2 t + 1; written as 2-byte stores.
//
// Requirements: those of the mma.sync kernel, and an sm_90a image: the build compiles sm_90 as
// sm_90a; elsewhere these kernels trap, and only the sm_90a image defines the marker kernel
// `matmul_q4_gemm_sm90a`, which the launcher looks up before it picks them.

namespace tmw {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TMW_WGMMA 1
#else
#define TMW_WGMMA 0
#endif

constexpr int THREADS = 256;  // two warpgroups
constexpr int BW = 128;       // weight rows per block

// SUBS: 64-column sub-tiles per stage (k-tile of 64 SUBS columns). SUBS = 2 needs
// `group % 128 == 0` (one group per k-tile and row).
template <int NTOK, int STAGES, int SUBS> struct Shape {
    static constexpr int KT = 64 * SUBS;           // columns per k-tile
    static constexpr int X_SUB = NTOK * 128;       // one 64-column sub-tile of activations
    static constexpr int X_BYTES = SUBS * X_SUB;   // activation tile per stage
    static constexpr int ROW = 32 * SUBS;          // packed bytes per weight row and k-tile
    static constexpr int W_BYTES = BW * ROW;       // packed tile per stage
    static constexpr int STAGE = X_BYTES + W_BYTES;
    static_assert(STAGE % 1024 == 0, "stage bases stay 1024-byte aligned");
    static constexpr int SMEM = STAGES * STAGE + 1024;  // + alignment slack
    // 16-byte chunks per sub-tile and thread; below 32 tokens only threads tid < NTOK * 8 copy one.
    static constexpr bool X_PARTIAL = NTOK * 8 < THREADS;
    static constexpr int X_PER_THREAD = X_PARTIAL ? 1 : NTOK * 8 / THREADS;
    static constexpr int W_PER_THREAD = BW * 2 * SUBS / THREADS;
    static constexpr int BLOCKS = 2 * SUBS;        // 32-column blocks per k-tile
    static constexpr int ACC = NTOK / 2;  // f32 accumulators per thread (m64 x NTOK / 128)
    static_assert(X_PARTIAL ? THREADS % (NTOK * 8) == 0 : X_PER_THREAD * THREADS == NTOK * 8, "copy split");
    static_assert(W_PER_THREAD * THREADS == BW * 2 * SUBS, "copy split");
    static_assert(SUBS == 1 || SUBS == 2, "one or two sub-tiles");
    static_assert(STAGES >= 3, "tiles kt + 1 .. kt + STAGES - 1 in flight while kt is multiplied");
};

#if TMW_WGMMA
// wgmma.m64n16k16 with A from registers, B through `desc`, D += A B in f32 (TY: the PTX type).
#define TMW_WGMMA_RS_N16(TY, T)                                                                                    \
    __device__ __forceinline__ void wgmma_rs(float(&d)[8], const unsigned(&a)[4], unsigned long long desc, T) {    \
        asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {"                                  \
                     "%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"                     \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
                       "+f"(d[7])                                                                                 \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                    \
    }
// wgmma.m64n32k16 with A from registers, B through `desc`, D += A B in f32 (TY: the PTX type).
#define TMW_WGMMA_RS_N32(TY, T)                                                                                     \
    __device__ __forceinline__ void wgmma_rs(float(&d)[16], const unsigned(&a)[4], unsigned long long desc, T) {    \
        asm volatile(                                                                                               \
            "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {"                                            \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"                                  \
            "}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"                                                           \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                               \
    }
// wgmma.m64n64k16 with A from registers, B through `desc`, D += A B in f32 (TY: the PTX type).
#define TMW_WGMMA_RS_N64(TY, T)                                                                                       \
    __device__ __forceinline__ void wgmma_rs(float(&d)[32], const unsigned(&a)[4], unsigned long long desc, T) {      \
        asm volatile(                                                                                                 \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                              \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                          \
            "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"                                                             \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                                 \
    }
// wgmma.m64n128k16 with A from registers, B through `desc`, D += A B in f32 (TY: the PTX type).
#define TMW_WGMMA_RS_N128(TY, T)                                                                                      \
    __device__ __forceinline__ void wgmma_rs(float(&d)[64], const unsigned(&a)[4], unsigned long long desc, T) {      \
        asm volatile(                                                                                                 \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                             \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                          \
            "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"                                                             \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                                 \
    }
// wgmma.m64n256k16 with A from registers, B through `desc`, D += A B in f32 (TY: the PTX type).
#define TMW_WGMMA_RS_N256(TY, T)                                                                                              \
    __device__ __forceinline__ void wgmma_rs(float(&d)[128], const unsigned(&a)[4], unsigned long long desc, T) {             \
        asm volatile(                                                                                                         \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"                                                     \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                \
            "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                \
            "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                \
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                    \
            "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"                  \
            "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"                                                                \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),         \
              "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),         \
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),         \
              "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),         \
              "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),         \
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),     \
              "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
              "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                                         \
    }
TMW_WGMMA_RS_N16("f16", __half)
TMW_WGMMA_RS_N32("f16", __half)
TMW_WGMMA_RS_N64("f16", __half)
TMW_WGMMA_RS_N128("f16", __half)
TMW_WGMMA_RS_N256("f16", __half)
TMW_WGMMA_RS_N16("bf16", __nv_bfloat16)
TMW_WGMMA_RS_N32("bf16", __nv_bfloat16)
TMW_WGMMA_RS_N64("bf16", __nv_bfloat16)
TMW_WGMMA_RS_N128("bf16", __nv_bfloat16)
TMW_WGMMA_RS_N256("bf16", __nv_bfloat16)

// Orders this thread's shared-memory writes (cp.async is a generic-proxy write) before later
// reads through the async proxy (wgmma's descriptor operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Descriptor of a K-major operand tile in the 128-byte swizzle: start address >> 4, leading
// offset unused (1), stride between 8-row groups 1024 bytes, swizzle mode 1 (128 bytes).
// The f16 pair (v, v) of the f16 bits in the low half of `bits`.
__device__ __forceinline__ unsigned dup_bits(unsigned bits) { return __byte_perm(bits, 0, 0x1010); }

__device__ __forceinline__ unsigned long long desc_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}
#endif

// The block's tile: weight rows 128 bx on, tokens NTOK blockIdx.y on, K slice bz (the entry points
// map grid.x onto a launch's weights and slices). Split-K: slice z takes columns [z kcols, min(cols,
// (z + 1) kcols)) (kcols a multiple of 128 and of the k-tile) and, with `partial`, stores its f32
// sums at partial[(z n + token) rows + row] for `matmul_q4_gemm_reduce` to add up in order;
// without (`partial` null, kcols = cols, bz = 0) it stores T sums in `out`.
template <class T, int NTOK, int STAGES, int SUBS>
__device__ __forceinline__ void q4_gemm_wgmma(T* __restrict__ out, float* __restrict__ partial,
                                              const T* __restrict__ x, const unsigned char* __restrict__ packed,
                                              const __half* __restrict__ scales, const __half* __restrict__ mins,
                                              int n, int rows, int cols, int group, int tiled, int kcols,
                                              int bx, int bz) {
#if TMW_WGMMA
    typedef Shape<NTOK, STAGES, SUBS> S;
    constexpr int KT = S::KT, NB = S::BLOCKS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const unsigned raw0 = tmg::smem_u32(smem_raw);
    const unsigned base = (raw0 + 1023u) & ~1023u;
    unsigned char* const sbase = smem_raw + (base - raw0);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int w0 = bx * BW;            // first weight row of the block
    const int t0 = blockIdx.y * NTOK;  // first token of the block
    const int k0 = bz * kcols;         // first column of the block's K slice
    const int ktiles = (min(cols, k0 + kcols) - k0) / KT;
    const int groups = cols / group;

    // Packed block b (16 bytes, 32 columns) of weight row r sits at position b ^ swz(r) of the
    // row's ROW bytes, so that the 8 rows a warp reads at once hit distinct banks.
    auto swz = [](int r) { return SUBS == 1 ? (r >> 2) & 1 : (r >> 1) & 3; };

    // Producer: activation chunk i = tid + 256 i of each sub-tile -> token tid / 8 + 32 i, chunk
    // tid % 8 (tokens 32 apart share (token & 7)); packed chunk j = tid + 256 j -> weight row
    // (tid + 256 j) / NB, block tid % NB.
    const int a_chunk = tid & 7, a_r0 = tid >> 3;
    const T* a_src = x + (long long)(t0 + a_r0) * cols + k0 + a_chunk * 8;
    const long long a_step = 32ll * cols;
    const unsigned a_dst = a_r0 * 128 + ((a_chunk ^ (a_r0 & 7)) << 4);
    const int a_valid = (n - t0 - a_r0 + 31) / 32;  // this thread's tokens a_r0 + 32 i < n - t0 for i < a_valid
    const unsigned char* b_src[S::W_PER_THREAD];
    bool b_ok[S::W_PER_THREAD];
    unsigned b_dst[S::W_PER_THREAD];
#pragma unroll
    for (int j = 0; j < S::W_PER_THREAD; ++j) {
        const int c = tid + THREADS * j, r = c / NB, blk = c % NB;
        b_ok[j] = w0 + r < rows;
        b_src[j] = packed + tmk::q4_chunk_offset(b_ok[j] ? w0 + r : 0, (k0 >> 5) + blk, cols, tiled);
        b_dst[j] = S::X_BYTES + r * S::ROW + ((blk ^ swz(r)) << 4);
    }
    int b_kt = k0 / KT;  // the k-tile b_src points at (its parity steps the tile-major layout)

    auto issue_tile = [&](int stage) {
        const unsigned sb = base + stage * S::STAGE;
#pragma unroll
        for (int i = 0; i < S::X_PER_THREAD; ++i) {
            if (S::X_PARTIAL && a_r0 >= NTOK) break;  // the tile's rows are covered
            const bool ok = i < a_valid;
#pragma unroll
            for (int sub = 0; sub < SUBS; ++sub)
                tmg::cp_async16(sb + sub * S::X_SUB + a_dst + i * 32 * 128, ok ? a_src + i * a_step + sub * 64 : x, ok);
        }
#pragma unroll
        for (int j = 0; j < S::W_PER_THREAD; ++j) {
            tmg::cp_async16(sb + b_dst[j], b_src[j], b_ok[j]);
            b_src[j] += tmg::packed_advance(b_kt, KT, tiled);
        }
        ++b_kt;
        a_src += KT;
    };

    // Consumer: this thread's weight rows r0 = 64 wg + 16 wq + g and r0 + 8 (same swz).
    const int g = lane >> 2, t = lane & 3;
    const int r0 = wg * 64 + wq * 16 + g;
    const unsigned sel = (t & 1) ? 0x7362u : 0x5140u;
    unsigned b_off[NB];
#pragma unroll
    for (int blk = 0; blk < NB; ++blk)
        b_off[blk] = S::X_BYTES + r0 * S::ROW + ((blk ^ swz(r0)) << 4) + ((t >> 1) << 2);
    // Scales and mins of rows r0, r0 + 8 (rows past the end read row 0 and are never stored).
    long long s_idx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = w0 + r0 + 8 * h;
        s_idx[h] = tmk::q4_scale_row(r < rows ? r : 0, groups, tiled);
    }
    const int s_gstride = tmk::q4_scale_group_stride(tiled);
    // Per row h and 32-column block of a k-tile (SUBS = 2: one group for the whole k-tile, so
    // one pair per row): the f16 bits in the low half of a register (as __half values the
    // compiler packed two per register and spent ~30 PRMT per tile on moving them).
    constexpr int SB = SUBS == 1 ? 2 : 1;
    typedef unsigned ScaleSet[2][SB];
    const unsigned short* const scale_bits = reinterpret_cast<const unsigned short*>(scales);
    const unsigned short* const min_bits = reinterpret_cast<const unsigned short*>(mins);
    // The next k-tile load_scales reads: its first column's group, as the offset of that group's
    // entries (group * s_gstride), and its offset in that group (kept incrementally: a division
    // per tile cost about 30 instructions of the loop's 290, a multiplication by the stride ~40).
    int s_goff = k0 / group * s_gstride, s_col = k0 % group;
    auto load_scales = [&](ScaleSet& sc, ScaleSet& mn) {
        const int gi[2] = {s_goff, s_goff + (s_col + 32 >= group ? s_gstride : 0)};
#pragma unroll
        for (int blk = 0; blk < SB; ++blk) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long si = s_idx[h] + gi[blk];
                sc[h][blk] = __ldg(scale_bits + si);
                mn[h][blk] = __ldg(min_bits + si);
            }
        }
        s_col += KT;  // SUBS = 1: group >= 32, at most two groups end within a tile; SUBS = 2: group % 128 == 0
        if (s_col >= group) {
            s_col -= group;
            s_goff += s_gstride;
            if (SUBS == 1 && s_col >= group) {
                s_col -= group;
                s_goff += s_gstride;
            }
        }
    };

    float acc[S::ACC];
#pragma unroll
    for (int i = 0; i < S::ACC; ++i) acc[i] = 0.f;

    // The packed words of the next tile: [block][row h][first/second 8-byte half].
    unsigned raw[NB][2][2];
    auto load_raw = [&](int stage) {
        const unsigned char* sb = sbase + stage * S::STAGE;
#pragma unroll
        for (int blk = 0; blk < NB; ++blk)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const unsigned char* p = sb + b_off[blk] + hr * 8 * S::ROW;
                raw[blk][hr][0] = *reinterpret_cast<const unsigned*>(p);
                raw[blk][hr][1] = *reinterpret_cast<const unsigned*>(p + 8);
            }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) issue_tile(s);
        tmg::cp_async_commit();
    }
    tmg::cp_async_wait<STAGES - 2>();  // tile 0 has landed
    fence_proxy_async();               // (cp.async writes, visible to wgmma's async-proxy reads)
    __syncthreads();
    load_raw(0);
    // Scales and mins are read two tiles ahead (a global load's latency exceeds a tile's math),
    // into two sets: the even tiles' and the odd tiles'.
    ScaleSet sv, mv, sv1, mv1;
    load_scales(sv, mv);
    if (ktiles > 1) load_scales(sv1, mv1);

    // Tile kt: two halves (SUBS blocks of 32 columns each), each with its own A registers. A
    // wgmma reads its register operand asynchronously and ptxas does not protect it, so a half's
    // registers are rewritten only after the wait that retires the wgmmas which read them one
    // tile earlier; each half's dequantization overlaps the other half's wgmmas. Then, while they
    // run: wait for tile kt + 1, refill the stage tile kt - 1 used with tile kt + STAGES - 1, read
    // tile kt + 1's packed words and tile kt + 2's scales (into the registers tile kt's scales
    // held: the loop is unrolled twice so that the two scale sets alternate without copies).
    int rd = 0, wr = STAGES - 1;
    auto tile = [&](int kt, ScaleSet& ts, ScaleSet& tm) {
        const unsigned xb = base + rd * S::STAGE;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            wgmma_wait<1>();  // everything but the latest group: this half's wgmmas of tile kt - 1
            fence_acc(acc);
            unsigned a[2 * SUBS][4];  // the half's 16-column steps
#pragma unroll
            for (int bb = 0; bb < SUBS; ++bb) {
                const int blk = half * SUBS + bb, sblk = SUBS == 1 ? blk : 0;
                unsigned h[2][4];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr)
                    tmg::dequant8(__byte_perm(raw[blk][hr][0], raw[blk][hr][1], sel), dup_bits(ts[hr][sblk]),
                                  dup_bits(tm[hr][sblk]), h[hr], T());
                // a0 = (row g, k 2t..), a1 = (row g + 8, k 2t..), a2 = (row g, k 2t + 8..), a3 = (row g + 8, k 2t + 8..)
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    a[2 * bb + k][0] = h[0][2 * k];
                    a[2 * bb + k][1] = h[1][2 * k];
                    a[2 * bb + k][2] = h[0][2 * k + 1];
                    a[2 * bb + k][3] = h[1][2 * k + 1];
                }
            }
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 2 * SUBS; ++ks) {
                const int kk = half * 2 * SUBS + ks;  // 16-column step within the k-tile
                wgmma_rs(acc, a[ks], desc_sw128(xb + (kk >> 2) * S::X_SUB + (kk & 3) * 32), T());
            }
            wgmma_commit();
            fence_acc(acc);
        }
        if (kt + 1 < ktiles) {
            tmg::cp_async_wait<STAGES - 3>();  // this thread's copies of tile kt + 1 have landed
            fence_proxy_async();
            __syncthreads();  // everyone's have, and every warpgroup has retired tile kt - 1's wgmmas
            if (kt + STAGES - 1 < ktiles) issue_tile(wr);
            tmg::cp_async_commit();
            rd = rd == STAGES - 1 ? 0 : rd + 1;
            load_raw(rd);
            if (kt + 2 < ktiles) load_scales(ts, tm);
        }
        wr = wr == STAGES - 1 ? 0 : wr + 1;
    };
    for (int kt = 0; kt < ktiles; kt += 2) {
        tile(kt, sv, mv);
        if (kt + 1 < ktiles) tile(kt + 1, sv1, mv1);
    }
    wgmma_wait<0>();
    fence_acc(acc);
    tmg::cp_async_wait<0>();

    // Epilogue: acc[4 j + e] = (weight row r0 + 8 (e >> 1), token 8 j + 2 t + (e & 1)).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = w0 + r0 + 8 * h;
        if (r >= rows) continue;
#pragma unroll
        for (int j = 0; j < NTOK / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = t0 + 8 * j + 2 * t + e;
                if (tok >= n) continue;
                if (partial)
                    partial[((long long)bz * n + tok) * rows + r] = acc[4 * j + 2 * h + e];
                else
                    out[(long long)tok * rows + r] = tmk::from_float<T>(acc[4 * j + 2 * h + e]);
            }
        }
    }
#else
    __trap();  // sm_90a only; the launcher never picks this kernel elsewhere
#endif
}

}  // namespace tmw

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
                                      const __half* __restrict__ mins, int n, int rows, int cols, int group,     \
                                      int tiled) {                                                               \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tmg::q4_gemm<T, BM, BN, WM, WN, ST>(out, x, packed, scales, mins, n, rows, cols, group, tiled);         \
    }

#define TMG_KERNELS(SUF, T)                          \
    TMG_KERNEL(l, SUF, T, 128, 256, 2, 4, 3, 1)      \
    TMG_KERNEL(m, SUF, T, 128, 128, 2, 4, 4, 2)      \
    TMG_KERNEL(s, SUF, T, 64, 128, 2, 4, 4, 2)       \
    TMG_KERNEL(t, SUF, T, 128, 256, 1, 8, 3, 1)

TMG_KERNELS(f16, __half)
TMG_KERNELS(bf16, __nv_bfloat16)

// sm_90a wgmma kernels (see above): `w`: 256 tokens x 128 weight rows, 64-column k-tiles, 4 stages
// (145 KiB shared); `v`: 128 x 128, 4 stages (81 KiB); `u`: 64 x 128 (m64n64), 4 stages (49 KiB, 126
// registers: two blocks per SM); `y`: `u` with 128-column k-tiles (97 KiB, two blocks per SM), for
// decode batches of up to 64 tokens with `group % 128 == 0`; `z`: `y` for 32 tokens (m64n32, 65
// KiB), for batches of up to 32; `q`: `y` for 16 tokens (m64n16, 49 KiB), up to 16; `x`: `w` with 128-column k-tiles (two
// sub-tiles per stage, half the barriers and waits per column), 3 stages (217 KiB), for
// `group % 128 == 0`. One block per SM for `w`, `v`, `x` (w: about 220 registers per thread, x: about
// 240).
//
// Each launch computes up to three products of one x (`parts`: a layer's q, k and v, or gate and
// up, in one grid instead of one launch each; the ones past `parts` are ignored): part i, of
// `rows_i` weight rows, owns ceil(rows_i / 128) * splits consecutive blocks of grid.x (`splits` =
// ceil(cols / kcols)); its block b takes rows 128 (b % blocks_i) on and K slice b / blocks_i. With
// split-K (`partial` non-null) part i stores its f32 partial sums from partial + splits * n *
// (rows_0 + ... + rows_{i-1}) on, which `matmul_q4_gemm_reduce_T` then adds up into the outputs.
// AWQ 8B-shaped layers at 64 decode tokens on the H200 (scripts/gpu/q4_gemm_decode.cu, products
// only): q/k/v and gate/up one launch each with `y`, 3618 us per step against 6313 with `v`
// launched per weight; at 32 tokens `z` 2916 against `y`'s 3367; at 16 tokens `q` 2658-2664
// against `z`'s 2794-2803 and `y`'s 3240.
#define TMW_KERNEL(NAME, SUF, T, NTOK, ST, SUBS, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(tmw::THREADS, MINB) matmul_q4_gemm_##NAME##_##SUF(               \
        const T* __restrict__ x, int n, int cols, int group, float* __restrict__ partial, int kcols, int parts,    \
        T* out0, const unsigned char* packed0, const __half* scales0, const __half* mins0, int rows0, int tiled0,  \
        T* out1, const unsigned char* packed1, const __half* scales1, const __half* mins1, int rows1, int tiled1,  \
        T* out2, const unsigned char* packed2, const __half* scales2, const __half* mins2, int rows2, int tiled2) { \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        const int splits = (cols + kcols - 1) / kcols;                                                           \
        const int nb0 = (rows0 + tmw::BW - 1) / tmw::BW, nb1 = (rows1 + tmw::BW - 1) / tmw::BW;                  \
        int b = blockIdx.x, i = 0;                                                                               \
        if (parts > 1 && b >= nb0 * splits) {                                                                    \
            b -= nb0 * splits;                                                                                   \
            i = 1;                                                                                               \
            if (parts > 2 && b >= nb1 * splits) {                                                                \
                b -= nb1 * splits;                                                                               \
                i = 2;                                                                                           \
            }                                                                                                    \
        }                                                                                                        \
        const int rows = i == 0 ? rows0 : i == 1 ? rows1 : rows2;                                                \
        const int nb = (rows + tmw::BW - 1) / tmw::BW;                                                           \
        const long long before = i == 0 ? 0 : i == 1 ? rows0 : (long long)rows0 + rows1;                         \
        tmw::q4_gemm_wgmma<T, NTOK, ST, SUBS>(i == 0 ? out0 : i == 1 ? out1 : out2,                              \
                                              partial ? partial + splits * (long long)n * before : partial, x,    \
                                              i == 0 ? packed0 : i == 1 ? packed1 : packed2,                      \
                                              i == 0 ? scales0 : i == 1 ? scales1 : scales2,                      \
                                              i == 0 ? mins0 : i == 1 ? mins1 : mins2, n, rows, cols, group,      \
                                              i == 0 ? tiled0 : i == 1 ? tiled1 : tiled2, kcols, b % nb, b / nb); \
    }

TMW_KERNEL(w, f16, __half, 256, 4, 1, 1)
TMW_KERNEL(v, f16, __half, 128, 4, 1, 1)
TMW_KERNEL(u, f16, __half, 64, 4, 1, 1)
TMW_KERNEL(y, f16, __half, 64, 4, 2, 2)
TMW_KERNEL(z, f16, __half, 32, 4, 2, 2)
TMW_KERNEL(q, f16, __half, 16, 4, 2, 2)
TMW_KERNEL(x, f16, __half, 256, 3, 2, 1)
TMW_KERNEL(w, bf16, __nv_bfloat16, 256, 4, 1, 1)
TMW_KERNEL(v, bf16, __nv_bfloat16, 128, 4, 1, 1)
TMW_KERNEL(u, bf16, __nv_bfloat16, 64, 4, 1, 1)
TMW_KERNEL(y, bf16, __nv_bfloat16, 64, 4, 2, 2)
TMW_KERNEL(z, bf16, __nv_bfloat16, 32, 4, 2, 2)
TMW_KERNEL(q, bf16, __nv_bfloat16, 16, 4, 2, 2)
TMW_KERNEL(x, bf16, __nv_bfloat16, 256, 3, 2, 1)

// The split-K sums of a launch's `parts` products: out_i[j] = T(sum over z < splits of
// partial_i[z n rows_i + j]) for j < n rows_i (a multiple of 4), partial_i = partial + splits n
// (rows_0 + ... + rows_{i-1}), in order of z, so the result does not depend on the schedule.
#define TMW_REDUCE(SUF, T)                                                                                          \
    extern "C" __global__ void matmul_q4_gemm_reduce_##SUF(const float* __restrict__ partial, int splits, int n,  \
                                                           int parts, T* out0, int rows0, T* out1, int rows1,      \
                                                           T* out2, int rows2) {                                   \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        const long long c0 = (long long)n * rows0, c1 = parts > 1 ? (long long)n * rows1 : 0,                    \
                        c2 = parts > 2 ? (long long)n * rows2 : 0;                                               \
        const long long quads = (c0 + c1 + c2) >> 2;                                                             \
        for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < quads;                          \
             q += (long long)gridDim.x * blockDim.x) {                                                           \
            long long j = 4 * q, count = c0, base = 0;                                                           \
            T* out = out0;                                                                                       \
            if (j >= c0) {                                                                                       \
                j -= c0;                                                                                         \
                base = splits * c0;                                                                              \
                count = c1;                                                                                      \
                out = out1;                                                                                      \
                if (j >= c1) {                                                                                   \
                    j -= c1;                                                                                     \
                    base += splits * c1;                                                                         \
                    count = c2;                                                                                  \
                    out = out2;                                                                                  \
                }                                                                                                \
            }                                                                                                    \
            const float* p = partial + base + j;                                                                 \
            float4 v = __ldcg(reinterpret_cast<const float4*>(p));                                               \
            for (int z = 1; z < splits; ++z) {                                                                   \
                const float4 w = __ldcg(reinterpret_cast<const float4*>(p + z * count));                         \
                v.x += w.x;                                                                                      \
                v.y += w.y;                                                                                      \
                v.z += w.z;                                                                                      \
                v.w += w.w;                                                                                      \
            }                                                                                                    \
            T* o = out + j;                                                                                      \
            o[0] = tmk::from_float<T>(v.x);                                                                      \
            o[1] = tmk::from_float<T>(v.y);                                                                      \
            o[2] = tmk::from_float<T>(v.z);                                                                      \
            o[3] = tmk::from_float<T>(v.w);                                                                      \
        }                                                                                                        \
    }
TMW_REDUCE(f16, __half)
TMW_REDUCE(bf16, __nv_bfloat16)

#if TMW_WGMMA || !defined(__CUDA_ARCH__)
// Present only in an sm_90a image (and, for whole-program nvcc builds, the host pass): the
// launcher's test that the `w` and `v` kernels are real.
extern "C" __global__ void matmul_q4_gemm_sm90a() { tmk::pdl_wait(); }
#endif
