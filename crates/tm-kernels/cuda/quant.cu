// int4 / int8 weight matrix products: out[n, rows] = x[n, cols] · W^T (see ABI.md, "quant.cu").
//
// W is group-quantized (tm-core/src/quant.rs): int4 `packed` u8 [rows, cols/2] with, in each run of
// 32 columns starting at c0, byte c0/2 + i holding column c0+i in its low nibble and c0+16+i in its
// high nibble, f16 `scales` / `mins` [rows, cols/group], w = q * scale + min; int8 `q` i8
// [rows, cols], f16 `scales`, w = q * scale. Activations and outputs are T; all sums are f32.
//
// Two paths, chosen by the launcher (tm-cuda/src/kernels/quant.rs):
// - GEMV (`matmul_q{4,8}_gemv{NB}_T`, n <= NB, NB in {1, 2, 4, 8}): one warp per weight row, lanes
//   striding over 16-byte chunks of the packed row; each chunk is dequantized in registers once and
//   multiplied with all n activation rows. 256 threads = 8 rows per block.
// - Tiled (`matmul_q{4,8}_tiled_T`): CTA tiles over (n, rows); each k-step dequantizes a weight
//   tile into shared memory (never into global memory) and stages the next tile's global loads in
//   registers while the current one is multiplied. T = f16 / bf16 use tensor cores
//   (mma.sync m16n8k16, f32 accumulators; block tile 64 x 128 x 64, 8 warps of 32 x 32);
//   T = f32 uses CUDA cores (block tile 64 x 64 x 32, 4 x 4 per thread), so f32 stays f32-exact.
//
// A third entry, `dequant_q4_rows_T` (f16/bf16), writes a slab of int4 rows dequantized into a
// scratch buffer for the large-batch path that multiplies it with cuBLASLt.
//
// The int4 entries take the weight's layout last (`int tiled`: 0 row-major, 1 tile-major, 2
// tile-major with the scales and mins in tile order, see `tmk::q4_chunk_offset` and
// `tmk::q4_scale_index`); the int8 ones are always row-major.
//
// Requirements checked by the launcher: cols % 32 == 0, group % 32 == 0, cols % group == 0,
// `packed` / `q` 16-byte aligned. `x` and `out` need only element alignment (16-byte vector loads
// of x are used when x is 16-byte aligned). Offsets into W and x are 64-bit.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "common.cuh"  // tmk::pdl_launch_dependents, tmk::pdl_wait

namespace tmq {

typedef unsigned long long u64;

// ---------------------------------------------------------------------------------------------
// Element conversions.

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Packs two floats into the 32-bit pair of T (T = __half or __nv_bfloat16), low half first.
template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// Unpacks the 32-bit pair of T into two floats (low half first).
__device__ __forceinline__ float2 unpack2(unsigned v, __half) {
    __half2 h = *reinterpret_cast<__half2*>(&v);
    return __half22float2(h);
}
__device__ __forceinline__ float2 unpack2(unsigned v, __nv_bfloat16) {
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    return __bfloat1622float2(h);
}

// Byte k (0..3) of `word` (each byte < 256) as an exact float 2^23 + byte; subtract the bias to get
// the value. One PRMT (builds 0x4B0000bb) instead of an int-to-float conversion.
__device__ __forceinline__ float byte_biased(unsigned word, unsigned k) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | k));
}

// 16 consecutive elements of T at p (an element offset that is a multiple of 16 from a row start)
// as floats; `vec` says p is 16-byte aligned. Activations: `__ldca`, not `__ldg` (common.cuh).
__device__ __forceinline__ void load16(const float* __restrict__ p, bool vec, float* v) {
    if (vec) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float4 f = __ldca(reinterpret_cast<const float4*>(p) + i);
            v[4 * i] = f.x;
            v[4 * i + 1] = f.y;
            v[4 * i + 2] = f.z;
            v[4 * i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = p[i];
    }
}
template <class T> __device__ __forceinline__ void load16(const T* __restrict__ p, bool vec, float* v) {
    if (vec) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            uint4 u = __ldca(reinterpret_cast<const uint4*>(p) + i);
            unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float2 f = unpack2(w[k], T());
                v[8 * i + 2 * k] = f.x;
                v[8 * i + 2 * k + 1] = f.y;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = to_f(p[i]);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0;
}

// ---------------------------------------------------------------------------------------------
// GEMV: n <= NB activation rows, one warp per weight row.

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_ROWS = GEMV_THREADS / 32;

// Multiplies 16 dequantized weights `w` (columns c..c+15) with the n activation rows.
template <class T, int NB>
__device__ __forceinline__ void gemv_fma16(const float* w, const T* __restrict__ x, long long c, int n, int cols,
                                           bool xvec, float* acc) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            float xv[16];
            load16(x + (long long)j * cols + c, xvec, xv);
            float a0 = 0.f, a1 = 0.f;
#pragma unroll
            for (int i = 0; i < 16; i += 2) {
                a0 = fmaf(w[i], xv[i], a0);
                a1 = fmaf(w[i + 1], xv[i + 1], a1);
            }
            acc[j] += a0 + a1;
        }
    }
}

template <class T, int NB>
__device__ __forceinline__ void gemv_q4(T* __restrict__ out, const T* __restrict__ x,
                                        const unsigned char* __restrict__ packed, const __half* __restrict__ scales,
                                        const __half* __restrict__ mins, int n, int rows, int cols, int group,
                                        int tiled) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_ROWS + (threadIdx.x >> 5);
    if (row >= rows) return;  // uniform per warp
    const int nblk = cols >> 5;  // 32-column blocks, 16 bytes each
    const int groups = cols / group;
    // Block b of the row (row-major: 16 b bytes on; tile-major: tmk::q4_chunk_offset).
    auto wblk = [&](int b) { return reinterpret_cast<const uint4*>(packed + tmk::q4_chunk_offset(row, b, cols, tiled)); };
    const bool xvec = aligned16(x);
    float acc[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j] = 0.f;

    int b = lane;
    uint4 cur = b < nblk ? __ldg(wblk(b)) : make_uint4(0, 0, 0, 0);
    while (b < nblk) {
        const int bn = b + 32;
        const uint4 nxt = bn < nblk ? __ldg(wblk(bn)) : make_uint4(0, 0, 0, 0);
        const long long gi = tmk::q4_scale_index(row, (b << 5) / group, groups, tiled);
        const float s = __half2float(scales[gi]);
        const float m = __half2float(mins[gi]);
        const unsigned words[4] = {cur.x, cur.y, cur.z, cur.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: low nibbles, columns c0..c0+15; h = 1: high, c0+16..c0+31
            float w[16];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned nib = (h ? (words[k] >> 4) : words[k]) & 0x0F0F0F0Fu;
#pragma unroll
                for (int e = 0; e < 4; ++e) w[4 * k + e] = fmaf(byte_biased(nib, e) - 8388608.f, s, m);
            }
            gemv_fma16<T, NB>(w, x, ((long long)b << 5) + 16 * h, n, cols, xvec, acc);
        }
        cur = nxt;
        b = bn;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            const float v = warp_sum(acc[j]);
            if (lane == 0) out[(long long)j * rows + row] = from_f<T>(v);
        }
    }
}

template <class T, int NB>
__device__ __forceinline__ void gemv_q8(T* __restrict__ out, const T* __restrict__ x,
                                        const signed char* __restrict__ q, const __half* __restrict__ scales, int n,
                                        int rows, int cols, int group) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_ROWS + (threadIdx.x >> 5);
    if (row >= rows) return;  // uniform per warp
    const int nseg = cols >> 4;  // 16-column segments, 16 bytes each
    const int groups = cols / group;
    const uint4* wrow = reinterpret_cast<const uint4*>(q + (long long)row * cols);
    const __half* srow = scales + (long long)row * groups;
    const bool xvec = aligned16(x);
    float acc[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j] = 0.f;

    int b = lane;
    uint4 cur = b < nseg ? __ldg(wrow + b) : make_uint4(0, 0, 0, 0);
    while (b < nseg) {
        const int bn = b + 32;
        const uint4 nxt = bn < nseg ? __ldg(wrow + bn) : make_uint4(0, 0, 0, 0);
        const float s = __half2float(srow[(b << 4) / group]);
        const unsigned words[4] = {cur.x ^ 0x80808080u, cur.y ^ 0x80808080u, cur.z ^ 0x80808080u,
                                   cur.w ^ 0x80808080u};  // q + 128 as unsigned bytes
        float w[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) w[4 * k + e] = (byte_biased(words[k], e) - 8388736.f) * s;
        }
        gemv_fma16<T, NB>(w, x, (long long)b << 4, n, cols, xvec, acc);
        cur = nxt;
        b = bn;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            const float v = warp_sum(acc[j]);
            if (lane == 0) out[(long long)j * rows + row] = from_f<T>(v);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tiled path, tensor cores (T = __half or __nv_bfloat16).

constexpr int TILED_THREADS = 256;
constexpr int MMA_BM = 64;   // activation rows per block
constexpr int MMA_BN = 128;  // weight rows per block
constexpr int MMA_BK = 64;   // columns per k-step
constexpr int MMA_LDS = MMA_BK + 8;  // shared row stride in elements (144 bytes: conflict-free ldmatrix)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b, __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b, __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 8 elements of T (16 bytes) at element offset `off` of x, or zeros when !ok.
template <class T>
__device__ __forceinline__ uint4 load8(const T* __restrict__ x, long long off, bool ok, bool vec) {
    if (!ok) return make_uint4(0, 0, 0, 0);
    if (vec) return __ldca(reinterpret_cast<const uint4*>(x + off));
    unsigned short h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = __ldca(reinterpret_cast<const unsigned short*>(x + off) + i);
    return make_uint4(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16), h[4] | ((unsigned)h[5] << 16),
                      h[6] | ((unsigned)h[7] << 16));
}

// Q4: each thread stages one 32-column block (16 bytes) of one weight row per k-step:
// row = tid / 2, block = tid % 2. Q8: two 16-column segments: chunk c = tid + 256 * i,
// row = c / 4, segment = c % 4.
template <class T, bool Q4>
__device__ __forceinline__ void tiled_mma(T* __restrict__ out, const T* __restrict__ x,
                                          const unsigned char* __restrict__ wq, const __half* __restrict__ scales,
                                          const __half* __restrict__ mins, int n, int rows, int cols, int group,
                                          int tiled) {
    __shared__ __align__(16) T xs[MMA_BM * MMA_LDS];
    __shared__ __align__(16) T ws[MMA_BN * MMA_LDS];
    constexpr int WCH = Q4 ? 1 : 2;  // weight chunks per thread per k-step

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2;  // warp's 32-row slice of the 64 activation rows
    const int wn = warp & 3;   // warp's 32-row slice of the 128 weight rows
    const int m0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN;
    const int groups = cols / group;
    const int ksteps = (cols + MMA_BK - 1) / MMA_BK;
    const bool xvec = aligned16(x);

    uint4 xr[2];
    uint4 wr[WCH];
    float sr[WCH], mr[WCH];
    bool wok[WCH];

    auto load_tile = [&](int kt) {
        const int k0 = kt * MMA_BK;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + TILED_THREADS * i;
            const int r = c >> 3, k = k0 + ((c & 7) << 3);
            const int gm = m0 + r;
            xr[i] = load8(x, (long long)gm * cols + k, gm < n && k < cols, xvec);
        }
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            int r, k;
            if (Q4) {
                r = tid >> 1;
                k = k0 + ((tid & 1) << 5);
            } else {
                const int c = tid + TILED_THREADS * i;
                r = c >> 2;
                k = k0 + ((c & 3) << 4);
            }
            const int gn = n0 + r;
            wok[i] = gn < rows && k < cols;
            wr[i] = make_uint4(0, 0, 0, 0);
            sr[i] = 0.f;
            mr[i] = 0.f;
            if (wok[i]) {
                const long long gi = Q4 ? tmk::q4_scale_index(gn, k / group, groups, tiled) : (long long)gn * groups + k / group;
                sr[i] = __half2float(scales[gi]);
                if (Q4) {
                    mr[i] = __half2float(mins[gi]);
                    wr[i] = __ldg(reinterpret_cast<const uint4*>(wq + tmk::q4_chunk_offset(gn, k >> 5, cols, tiled)));
                } else {
                    wr[i] = __ldg(reinterpret_cast<const uint4*>(wq + (long long)gn * cols + k));
                }
            }
        }
    };

    auto store_tile = [&]() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + TILED_THREADS * i;
            *reinterpret_cast<uint4*>(&xs[(c >> 3) * MMA_LDS + ((c & 7) << 3)]) = xr[i];
        }
#pragma unroll
        for (int i = 0; i < WCH; ++i) {
            const unsigned words[4] = {wr[i].x, wr[i].y, wr[i].z, wr[i].w};
            if (Q4) {
                const int r = tid >> 1, kb = (tid & 1) << 5;
                T* dst = &ws[r * MMA_LDS + kb];
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // low nibbles -> columns kb..kb+15, high -> kb+16..kb+31
                    unsigned p[8];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const unsigned nib = (h ? (words[k] >> 4) : words[k]) & 0x0F0F0F0Fu;
                        float f[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            f[e] = wok[i] ? fmaf(byte_biased(nib, e) - 8388608.f, sr[i], mr[i]) : 0.f;
                        p[2 * k] = pack2<T>(f[0], f[1]);
                        p[2 * k + 1] = pack2<T>(f[2], f[3]);
                    }
                    *reinterpret_cast<uint4*>(dst + 16 * h) = make_uint4(p[0], p[1], p[2], p[3]);
                    *reinterpret_cast<uint4*>(dst + 16 * h + 8) = make_uint4(p[4], p[5], p[6], p[7]);
                }
            } else {
                const int c = tid + TILED_THREADS * i;
                T* dst = &ws[(c >> 2) * MMA_LDS + ((c & 3) << 4)];
                unsigned p[8];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const unsigned u = words[k] ^ 0x80808080u;
                    float f[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) f[e] = (byte_biased(u, e) - 8388736.f) * sr[i];  // 0 when !wok
                    p[2 * k] = pack2<T>(f[0], f[1]);
                    p[2 * k + 1] = pack2<T>(f[2], f[3]);
                }
                *reinterpret_cast<uint4*>(dst) = make_uint4(p[0], p[1], p[2], p[3]);
                *reinterpret_cast<uint4*>(dst + 8) = make_uint4(p[4], p[5], p[6], p[7]);
            }
        }
    };

    float acc[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    if (ksteps > 0) {
        load_tile(0);
        store_tile();
    }
    __syncthreads();
    for (int kt = 0; kt < ksteps; ++kt) {
        if (kt + 1 < ksteps) load_tile(kt + 1);  // in flight while this tile is multiplied
#pragma unroll
        for (int kk = 0; kk < MMA_BK; kk += 16) {
            unsigned af[2][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                // lanes 0-15: rows 0-15 at k kk; lanes 16-31: rows 0-15 at k kk+8 (a0..a3 of m16n8k16)
                const int r = wm * 32 + mi * 16 + (lane & 15);
                const int k = kk + ((lane >> 4) << 3);
                ldmatrix_x4(smem_addr(&xs[r * MMA_LDS + k]), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                const int r = wn * 32 + p * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int k = kk + (((lane >> 3) & 1) << 3);
                ldmatrix_x4(smem_addr(&ws[r * MMA_LDS + k]), bf[2 * p][0], bf[2 * p][1], bf[2 * p + 1][0],
                            bf[2 * p + 1][1]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma16816(acc[mi][ni], af[mi], bf[ni], T());
        }
        __syncthreads();
        if (kt + 1 < ksteps) {
            store_tile();
            __syncthreads();
        }
    }

    // c0, c1: row g, columns 2t, 2t+1; c2, c3: row g+8 (g = lane / 4, t = lane % 4).
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = n0 + wn * 32 + ni * 8 + 2 * t4;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int m = m0 + wm * 32 + mi * 16 + g + 8 * hr;
                if (m < n) {
                    T* o = out + (long long)m * rows + col;
                    if (col < rows) o[0] = from_f<T>(acc[mi][ni][2 * hr]);
                    if (col + 1 < rows) o[1] = from_f<T>(acc[mi][ni][2 * hr + 1]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tiled path, CUDA cores (T = float).

constexpr int SIMT_BM = 64;
constexpr int SIMT_BN = 64;
constexpr int SIMT_BK = 32;
constexpr int SIMT_LDS = 68;  // shared row stride (floats): [k][m] and [k][n] tiles, 16-byte aligned rows

// Each thread stages 2 float4 of x (chunk c = tid + 256 i: row c / 8, columns 4 (c % 8)) and 8
// weight columns of one row (row = tid / 4, part = tid % 4): Q4 bytes 4 part .. 4 part + 3 (columns
// 4 part + e and 16 + 4 part + e), Q8 columns 8 part .. 8 part + 7.
template <bool Q4>
__device__ __forceinline__ void tiled_simt(float* __restrict__ out, const float* __restrict__ x,
                                           const unsigned char* __restrict__ wq, const __half* __restrict__ scales,
                                           const __half* __restrict__ mins, int n, int rows, int cols, int group,
                                           int tiled) {
    __shared__ __align__(16) float xs[SIMT_BK * SIMT_LDS];
    __shared__ __align__(16) float ws[SIMT_BK * SIMT_LDS];
    const int tid = threadIdx.x;
    const int ty = tid >> 4, tx = tid & 15;  // thread's 4 activation rows / 4 weight rows
    const int m0 = blockIdx.y * SIMT_BM, n0 = blockIdx.x * SIMT_BN;
    const int groups = cols / group;
    const int ksteps = cols / SIMT_BK;  // cols is a multiple of 32
    const bool xvec = aligned16(x);

    float4 xr[2];
    unsigned wr[2];
    float sr = 0.f, mr = 0.f;
    const int wrow = tid >> 2, wpart = tid & 3;
    const int gn = n0 + wrow;

    auto load_tile = [&](int kt) {
        const int k0 = kt * SIMT_BK;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + TILED_THREADS * i;
            const int gm = m0 + (c >> 3);
            const long long off = (long long)gm * cols + k0 + ((c & 7) << 2);
            if (gm >= n) {
                xr[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            } else if (xvec) {
                xr[i] = __ldca(reinterpret_cast<const float4*>(x + off));
            } else {
                xr[i] = make_float4(x[off], x[off + 1], x[off + 2], x[off + 3]);
            }
        }
        wr[0] = wr[1] = 0u;
        sr = 0.f;
        mr = 0.f;
        if (gn < rows) {
            const long long gi = Q4 ? tmk::q4_scale_index(gn, k0 / group, groups, tiled) : (long long)gn * groups + k0 / group;
            sr = __half2float(scales[gi]);
            if (Q4) {
                mr = __half2float(mins[gi]);
                wr[0] = __ldg(reinterpret_cast<const unsigned*>(wq + tmk::q4_chunk_offset(gn, k0 >> 5, cols, tiled)) + wpart);
            } else {
                const uint2 v =
                    __ldg(reinterpret_cast<const uint2*>(wq + (long long)gn * cols + k0) + wpart);
                wr[0] = v.x;
                wr[1] = v.y;
            }
        }
    };

    auto store_tile = [&]() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + TILED_THREADS * i;
            const int m = c >> 3, k = (c & 7) << 2;
            xs[(k + 0) * SIMT_LDS + m] = xr[i].x;
            xs[(k + 1) * SIMT_LDS + m] = xr[i].y;
            xs[(k + 2) * SIMT_LDS + m] = xr[i].z;
            xs[(k + 3) * SIMT_LDS + m] = xr[i].w;
        }
        const bool ok = gn < rows;
        if (Q4) {
            const unsigned lo = wr[0] & 0x0F0F0F0Fu, hi = (wr[0] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int k = 4 * wpart + e;
                ws[k * SIMT_LDS + wrow] = ok ? fmaf(byte_biased(lo, e) - 8388608.f, sr, mr) : 0.f;
                ws[(k + 16) * SIMT_LDS + wrow] = ok ? fmaf(byte_biased(hi, e) - 8388608.f, sr, mr) : 0.f;
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned u = wr[h] ^ 0x80808080u;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    ws[(8 * wpart + 4 * h + e) * SIMT_LDS + wrow] = (byte_biased(u, e) - 8388736.f) * sr;  // 0 when !ok
            }
        }
    };

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    if (ksteps > 0) {
        load_tile(0);
        store_tile();
    }
    __syncthreads();
    for (int kt = 0; kt < ksteps; ++kt) {
        if (kt + 1 < ksteps) load_tile(kt + 1);
#pragma unroll 8
        for (int k = 0; k < SIMT_BK; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(&xs[k * SIMT_LDS + 4 * ty]);
            const float4 b = *reinterpret_cast<const float4*>(&ws[k * SIMT_LDS + 4 * tx]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
        if (kt + 1 < ksteps) {
            store_tile();
            __syncthreads();
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = m0 + 4 * ty + i;
        if (m >= n) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = n0 + 4 * tx + j;
            if (col < rows) out[(long long)m * rows + col] = acc[i][j];
        }
    }
}

template <class T, bool Q4>
__device__ __forceinline__ void tiled(T* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ wq,
                                      const __half* __restrict__ scales, const __half* __restrict__ mins, int n,
                                      int rows, int cols, int group, int tiled) {
    tiled_mma<T, Q4>(out, x, wq, scales, mins, n, rows, cols, group, tiled);
}
template <>
__device__ __forceinline__ void tiled<float, true>(float* __restrict__ out, const float* __restrict__ x,
                                                   const unsigned char* __restrict__ wq,
                                                   const __half* __restrict__ scales, const __half* __restrict__ mins,
                                                   int n, int rows, int cols, int group, int tiled) {
    tiled_simt<true>(out, x, wq, scales, mins, n, rows, cols, group, tiled);
}
template <>
__device__ __forceinline__ void tiled<float, false>(float* __restrict__ out, const float* __restrict__ x,
                                                    const unsigned char* __restrict__ wq,
                                                    const __half* __restrict__ scales, const __half* __restrict__ mins,
                                                    int n, int rows, int cols, int group, int tiled) {
    tiled_simt<false>(out, x, wq, scales, mins, n, rows, cols, group, tiled);
}

// ---------------------------------------------------------------------------------------------
// Dequantization of a slab of int4 rows into T (T = __half or __nv_bfloat16), for the
// large-batch slab path (tm-cuda/src/ops/q4_slab.rs): out[(r - r0) * cols + c] = T(q * scale + min)
// for rows r in [r0, r0 + nrows), rounded exactly like the tiled kernel's shared-memory tiles
// (fmaf in f32, then round to nearest T). One thread per 32-column block: a 16-byte load of the
// packed row, four 16-byte stores (cols % 32 == 0 keeps every store 16-byte aligned when `out`
// is).

constexpr int DEQ_THREADS = 256;

template <class T>
__device__ __forceinline__ void dequant_q4_rows(T* __restrict__ out, const unsigned char* __restrict__ packed,
                                                const __half* __restrict__ scales, const __half* __restrict__ mins,
                                                int r0, int nrows, int cols, int group, int tiled) {
    const long long nblk = cols >> 5;
    const long long i = (long long)blockIdx.x * DEQ_THREADS + threadIdx.x;
    if (i >= (long long)nrows * nblk) return;
    const long long r = i / nblk, b = i - r * nblk;
    const long long row = (long long)r0 + r;
    const int groups = cols / group;
    const long long gi = tmk::q4_scale_index((int)row, (int)((b << 5) / group), groups, tiled);
    const float s = __half2float(scales[gi]);
    const float m = __half2float(mins[gi]);
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(packed + tmk::q4_chunk_offset((int)row, (int)b, cols, tiled)));
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    T* dst = out + r * cols + (b << 5);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // low nibbles -> columns 0..15 of the block, high -> 16..31
        unsigned p[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned nib = (h ? (words[k] >> 4) : words[k]) & 0x0F0F0F0Fu;
            float f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) f[e] = fmaf(byte_biased(nib, e) - 8388608.f, s, m);
            p[2 * k] = pack2<T>(f[0], f[1]);
            p[2 * k + 1] = pack2<T>(f[2], f[3]);
        }
        reinterpret_cast<uint4*>(dst + 16 * h)[0] = make_uint4(p[0], p[1], p[2], p[3]);
        reinterpret_cast<uint4*>(dst + 16 * h + 8)[0] = make_uint4(p[4], p[5], p[6], p[7]);
    }
}

}  // namespace tmq

// ---------------------------------------------------------------------------------------------
// Entry points.

#define TMQ_GEMV(SUF, T, NB)                                                                                     \
    extern "C" __global__ void __launch_bounds__(tmq::GEMV_THREADS)                                             \
        matmul_q4_gemv##NB##_##SUF(T* __restrict__ out, const T* __restrict__ x,                                 \
                                   const unsigned char* __restrict__ packed, const __half* __restrict__ scales, \
                                   const __half* __restrict__ mins, int n, int rows, int cols, int group,       \
                                   int tiled) {                                                                 \
        tmk::pdl_launch_dependents();                                                                           \
        tmk::pdl_wait();                                                                                        \
        tmq::gemv_q4<T, NB>(out, x, packed, scales, mins, n, rows, cols, group, tiled);                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(tmq::GEMV_THREADS)                                             \
        matmul_q8_gemv##NB##_##SUF(T* __restrict__ out, const T* __restrict__ x, const signed char* __restrict__ q, \
                                   const __half* __restrict__ scales, int n, int rows, int cols, int group) {   \
        tmk::pdl_launch_dependents();                                                                           \
        tmk::pdl_wait();                                                                                        \
        tmq::gemv_q8<T, NB>(out, x, q, scales, n, rows, cols, group);                                           \
    }

#define TMQ_KERNELS(SUF, T)                                                                                      \
    TMQ_GEMV(SUF, T, 1)                                                                                          \
    TMQ_GEMV(SUF, T, 2)                                                                                          \
    TMQ_GEMV(SUF, T, 4)                                                                                          \
    TMQ_GEMV(SUF, T, 8)                                                                                          \
    extern "C" __global__ void __launch_bounds__(tmq::TILED_THREADS)                                            \
        matmul_q4_tiled_##SUF(T* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ packed, \
                              const __half* __restrict__ scales, const __half* __restrict__ mins, int n, int rows, \
                              int cols, int group, int tiled) {                                                  \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tmq::tiled<T, true>(out, x, packed, scales, mins, n, rows, cols, group, tiled);                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(tmq::TILED_THREADS)                                            \
        matmul_q8_tiled_##SUF(T* __restrict__ out, const T* __restrict__ x, const signed char* __restrict__ q,   \
                              const __half* __restrict__ scales, int n, int rows, int cols, int group) {        \
        tmk::pdl_launch_dependents();                                                                           \
        tmk::pdl_wait();                                                                                        \
        tmq::tiled<T, false>(out, x, reinterpret_cast<const unsigned char*>(q), scales, nullptr, n, rows, cols, \
                             group, 0);                                                                          \
    }

TMQ_KERNELS(f32, float)
TMQ_KERNELS(f16, __half)
TMQ_KERNELS(bf16, __nv_bfloat16)

#define TMQ_DEQUANT(SUF, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(tmq::DEQ_THREADS)                                              \
        dequant_q4_rows_##SUF(T* __restrict__ out, const unsigned char* __restrict__ packed,                    \
                              const __half* __restrict__ scales, const __half* __restrict__ mins, int r0,       \
                              int nrows, int cols, int group, int tiled) {                                      \
        tmk::pdl_launch_dependents();                                                                           \
        tmk::pdl_wait(); /* the previous slab's GEMM may still read the scratch this overwrites */             \
        tmq::dequant_q4_rows<T>(out, packed, scales, mins, r0, nrows, cols, group, tiled);                      \
    }

TMQ_DEQUANT(f16, __half)
TMQ_DEQUANT(bf16, __nv_bfloat16)
