// Elementwise and row-wise kernels: embeddings, RMSNorm, RoPE, SiLU·up, additions, KV-cache
// writes (alone or fused with RoPE) and row gathers. Parameter lists: ABI.md; launch
// configurations: the launchers in crates/tm-cuda/src/kernels/elementwise.rs.
//
// Launch shapes (every kernel also loops, so smaller grids stay correct):
// - row kernels (embedding*, write_kv, gather_rows, zero_rows): grid.x = rows, 1-D blocks;
// - rms_norm, add_rms_norm: block (bx, by) with bx a multiple of 32; each row is handled by the
//   bx threads of one `threadIdx.y`; by > 1 only with bx == 32 (one warp per row);
// - rope: grid.x = tokens (or fewer), dynamic shared memory `head_dim * sizeof(float)`;
// - rope_write_kv: as rope, grid.y over the query heads followed by the key heads (rope.cuh);
// - silu_mul, add: 1-D grid-stride; add_bias: grid.x over columns, grid.y over rows (strided).
// 16-byte vector paths are taken only when every pointer involved is 16-byte aligned and the
// row length is a multiple of the vector width; otherwise the scalar path runs.

#include "common.cuh"
#include "norm.cuh"
#include "rope.cuh"

using tmk::from_float;
using tmk::i64;
using tmk::to_float;
using tmk::u64;
using tmk::Vec16;

// ---------------------------------------------------------------------------------------------
// Row copies: embedding (dense), gather_rows, write_kv.

/// Copies `cols` elements with the block's threads.
template <typename T>
__device__ __forceinline__ void copy_row(T* __restrict__ dst, const T* __restrict__ src, int cols) {
    constexpr int N = Vec16<T>::N;
    if (tmk::aligned16(dst) && tmk::aligned16(src) && cols % N == 0) {
        const int nvec = cols / N;
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) tmk::store16(dst + (i64)i * N, tmk::load16(src + (i64)i * N));
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
    }
}

template <typename T>
__device__ __forceinline__ void embedding_impl(T* out, const T* table, const unsigned* ids, int n, int hidden) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        copy_row(out + (i64)r * hidden, table + (u64)ids[r] * (u64)hidden, hidden);
    }
}
TM_KERNEL(embedding, (T * out, const T* table, const unsigned* ids, int n, int hidden), (out, table, ids, n, hidden))

template <typename T>
__device__ __forceinline__ void gather_rows_impl(T* out, const T* x, const unsigned* rows, int n, int cols) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        copy_row(out + (i64)r * cols, x + (u64)rows[r] * (u64)cols, cols);
    }
}
TM_KERNEL(gather_rows, (T * out, const T* x, const unsigned* rows, int n, int cols), (out, x, rows, n, cols))

/// `x[r] = 0` for every row `r < n` with `keep[r] == 0` (a vocab-parallel embedding's rows of
/// tokens another rank holds); other rows are left alone.
template <typename T>
__device__ __forceinline__ void zero_rows_impl(T* x, const unsigned* keep, int n, int cols) {
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        if (keep[r] != 0u) continue;
        T* row = x + (i64)r * cols;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) row[i] = from_float<T>(0.0f);
    }
}
TM_KERNEL(zero_rows, (T * x, const unsigned* keep, int n, int cols), (x, keep, n, cols))

/// Slot `0xffffffff` marks a padding token that is not written.
template <typename T>
__device__ __forceinline__ void write_kv_impl(T* k_cache, T* v_cache, const T* k, const T* v, const unsigned* slots,
                                              int tokens, int kv_dim) {
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const unsigned slot = slots[t];
        if (slot == 0xffffffffu) continue;
        const u64 dst = (u64)slot * (u64)kv_dim;
        const i64 src = (i64)t * kv_dim;
        copy_row(k_cache + dst, k + src, kv_dim);
        copy_row(v_cache + dst, v + src, kv_dim);
    }
}
TM_KERNEL(write_kv, (T * k_cache, T* v_cache, const T* k, const T* v, const unsigned* slots, int tokens, int kv_dim),
          (k_cache, v_cache, k, v, slots, tokens, kv_dim))

// ---------------------------------------------------------------------------------------------
// Quantized embeddings (layouts: ABI.md, tm-core/src/quant.rs). `group` is a multiple of 32.

/// int8: `w = q * scale`.
template <typename T>
__device__ __forceinline__ void embedding_q8_impl(T* out, const signed char* q, const __half* scales,
                                                  const unsigned* ids, int n, int hidden, int group) {
    const int groups = hidden / group;
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const u64 id = ids[r];
        const signed char* qr = q + id * (u64)hidden;
        const __half* sr = scales + id * (u64)groups;
        T* o = out + (i64)r * hidden;
        if ((reinterpret_cast<u64>(qr) & 3ull) == 0 && hidden % 4 == 0) {
            // 4 columns per thread; they share a group since `group` is a multiple of 4.
            for (int i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
                const char4 v = reinterpret_cast<const char4*>(qr)[i];
                const int c = 4 * i;
                const float s = __half2float(sr[c / group]);
                o[c + 0] = from_float<T>((float)v.x * s);
                o[c + 1] = from_float<T>((float)v.y * s);
                o[c + 2] = from_float<T>((float)v.z * s);
                o[c + 3] = from_float<T>((float)v.w * s);
            }
        } else {
            for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
                o[c] = from_float<T>((float)qr[c] * __half2float(sr[c / group]));
            }
        }
    }
}
TM_KERNEL(embedding_q8,
          (T * out, const signed char* q, const __half* scales, const unsigned* ids, int n, int hidden, int group),
          (out, q, scales, ids, n, hidden, group))

/// `q * scale + min`, rounded after the product as the CPU reference does (no FMA).
__device__ __forceinline__ float dequant4(unsigned q, float s, float m) { return __fadd_rn(__fmul_rn((float)q, s), m); }

/// int4: byte `c0/2 + i` of each 32-column run holds column `c0+i` (low nibble) and `c0+16+i`
/// (high nibble); `w = q * scale + min`. `tiled`: the table is stored tile-major (each 32-column
/// run's 16 bytes at `tmk::q4_chunk_offset`).
template <typename T>
__device__ __forceinline__ void embedding_q4_impl(T* out, const unsigned char* packed, const __half* scales,
                                                  const __half* mins, const unsigned* ids, int n, int hidden,
                                                  int group, int tiled) {
    const int groups = hidden / group;
    const int bytes = hidden / 2;
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const u64 id = ids[r];
        const unsigned char* pr = packed + id * (u64)bytes;
        const __half* sr = scales + id * (u64)groups;
        const __half* mr = mins + id * (u64)groups;
        T* o = out + (i64)r * hidden;
        if (tiled || (reinterpret_cast<u64>(pr) & 3ull) == 0) {
            // 4 bytes per thread: columns lo..lo+3 and lo+16..lo+19 of one 32-column run.
            for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
                const unsigned word =
                    tiled ? *reinterpret_cast<const unsigned*>(packed + tmk::q4_chunk_offset((int)id, i >> 2, hidden, 1) +
                                                               4 * (i & 3))
                          : reinterpret_cast<const unsigned*>(pr)[i];
                const int b = 4 * i;
                const int lo = (b / 16) * 32 + (b % 16);
                const int g = lo / group;
                const float s = __half2float(sr[g]), m = __half2float(mr[g]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned byte = (word >> (8 * j)) & 0xffu;
                    o[lo + j] = from_float<T>(dequant4(byte & 15u, s, m));
                    o[lo + 16 + j] = from_float<T>(dequant4(byte >> 4, s, m));
                }
            }
        } else {
            for (int b = threadIdx.x; b < bytes; b += blockDim.x) {
                const unsigned byte = pr[b];
                const int lo = (b / 16) * 32 + (b % 16);
                const int g = lo / group;
                const float s = __half2float(sr[g]), m = __half2float(mr[g]);
                o[lo] = from_float<T>(dequant4(byte & 15u, s, m));
                o[lo + 16] = from_float<T>(dequant4(byte >> 4, s, m));
            }
        }
    }
}
TM_KERNEL(embedding_q4,
          (T * out, const unsigned char* packed, const __half* scales, const __half* mins, const unsigned* ids, int n,
           int hidden, int group, int tiled),
          (out, packed, scales, mins, ids, n, hidden, group, tiled))

// ---------------------------------------------------------------------------------------------
// RMSNorm: `out = x * (1 / sqrt(mean(x^2) + eps)) * w`, one row per `threadIdx.y`.

// The row arithmetic (`norm_row`) lives in norm.cuh, shared with the fused all-reduce + norm of
// collectives.cu so that both round identically.

template <typename T>
__device__ __forceinline__ void rms_norm_impl(T* out, const T* x, const T* w, float eps, int rows, int cols) {
    // One row per threadIdx.y; with a block-wide reduction blockDim.y is 1, so the loop condition
    // is uniform over the block.
    for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += gridDim.x * blockDim.y) {
        const i64 off = (i64)row * cols;
        norm_row<T, false>(out + off, nullptr, x + off, w, eps, cols);
    }
}
TM_KERNEL_BOUNDS_EARLY(rms_norm, NORM_MAX_THREADS, (T * out, const T* x, const T* w, float eps, int rows, int cols), (out, x, w, eps, rows, cols))

template <typename T>
__device__ __forceinline__ void add_rms_norm_impl(T* out, T* residual, const T* x, const T* w, float eps, int rows,
                                                  int cols) {
    for (int row = blockIdx.x * blockDim.y + threadIdx.y; row < rows; row += gridDim.x * blockDim.y) {
        const i64 off = (i64)row * cols;
        norm_row<T, true>(out + off, residual + off, x + off, w, eps, cols);
    }
}
TM_KERNEL_BOUNDS_EARLY(add_rms_norm, NORM_MAX_THREADS, (T * out, T* residual, const T* x, const T* w, float eps, int rows, int cols),
          (out, residual, x, w, eps, rows, cols))

// ---------------------------------------------------------------------------------------------
// RoPE, in place on `x: [tokens, heads * head_dim]`. Pair `i < head_dim/2` is `(i, i + half)`, or
// `(2i, 2i+1)` when `interleaved`. The angle is `(float)pos * inv_freq[i]` through `sincosf`, and
// the rotation is rounded step by step as on the CPU (no FMA contraction).

template <typename T>
__device__ __forceinline__ void rope_impl(T* x, const unsigned* positions, const float* inv_freq,
                                          float attention_factor, int tokens, int heads, int head_dim,
                                          int interleaved) {
    float* cs = tmk::rope_shared();
    const int half = head_dim / 2;
    // blockIdx.y takes a contiguous range of heads (several blocks per token when decoding).
    const tmk::YRange hs = tmk::y_range(heads);
    const int pairs = max(0, hs.hi - hs.lo) * half;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        tmk::rope_table(cs, positions[t], inv_freq, attention_factor, half);
        __syncthreads();
        T* xt = x + (i64)t * heads * head_dim;
        for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
            const int hr = p / half, i = p - hr * half, h = hs.lo + hr;
            T ya, yb;
            tmk::rope_rotate(xt + h * head_dim, tmk::rope_pair(i, half, interleaved), cs[i], cs[half + i], ya, yb);
        }
        __syncthreads();  // the table is rewritten for the next token
    }
}
TM_KERNEL(rope,
          (T * x, const unsigned* positions, const float* inv_freq, float attention_factor, int tokens, int heads,
           int head_dim, int interleaved),
          (x, positions, inv_freq, attention_factor, tokens, heads, head_dim, interleaved))

/// A KV cache in `T`: elements are stored as they are (what `write_kv` does).
template <typename T>
struct CacheSame {
    static __device__ __forceinline__ void put(T* dst, T x) { *dst = x; }
    static __device__ __forceinline__ void row(T* dst, const T* src, int n) { copy_row(dst, src, n); }
};

/// `rope` of `q`, `rope` of `k`, then `write_kv` of the rotated `k` and `v`, in one launch
/// (`tmk::rope_write_kv_tokens`, rope.cuh): the same values, bit for bit.
template <typename T>
__device__ __forceinline__ void rope_write_kv_impl(T* q, T* k, const T* v, T* k_cache, T* v_cache,
                                                   const unsigned* positions, const unsigned* slots,
                                                   const float* inv_freq, float attention_factor, int tokens,
                                                   int heads, int kv_heads, int head_dim, int interleaved) {
    tmk::rope_write_kv_tokens<T, T, CacheSame<T>>(q, k, v, k_cache, v_cache, positions, slots, inv_freq,
                                                  attention_factor, tokens, heads, kv_heads, head_dim, interleaved);
}
TM_KERNEL_EARLY(rope_write_kv,
          (T * q, T* k, const T* v, T* k_cache, T* v_cache, const unsigned* positions, const unsigned* slots,
           const float* inv_freq, float attention_factor, int tokens, int heads, int kv_heads, int head_dim,
           int interleaved),
          (q, k, v, k_cache, v_cache, positions, slots, inv_freq, attention_factor, tokens, heads, kv_heads, head_dim,
           interleaved))

// ---------------------------------------------------------------------------------------------
// Flat elementwise ops over `n` elements (64-bit), grid-stride.

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

template <typename T>
__device__ __forceinline__ void silu_mul_impl(T* out, const T* gate, const T* up, i64 n) {
    constexpr int N = Vec16<T>::N;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 done = 0;
    if (tmk::aligned16(out) && tmk::aligned16(gate) && tmk::aligned16(up)) {
        const i64 nvec = n / N;
        for (i64 i = tid; i < nvec; i += stride) {
            const Vec16<T> g = tmk::load16(gate + i * N), u = tmk::load16(up + i * N);
            Vec16<T> r;
#pragma unroll
            for (int j = 0; j < N; ++j) r.v[j] = from_float<T>(silu_times(to_float(g.v[j]), to_float(u.v[j])));
            tmk::store16(out + i * N, r);
        }
        done = nvec * N;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_float<T>(silu_times(to_float(gate[i]), to_float(up[i])));
}
TM_KERNEL(silu_mul, (T * out, const T* gate, const T* up, long long n), (out, gate, up, n))

template <typename T>
__device__ __forceinline__ void add_impl(T* x, const T* y, i64 n) {
    constexpr int N = Vec16<T>::N;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 done = 0;
    if (tmk::aligned16(x) && tmk::aligned16(y)) {
        const i64 nvec = n / N;
        for (i64 i = tid; i < nvec; i += stride) {
            Vec16<T> a = tmk::load16(x + i * N);
            const Vec16<T> b = tmk::load16(y + i * N);
#pragma unroll
            for (int j = 0; j < N; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
            tmk::store16(x + i * N, a);
        }
        done = nvec * N;
    }
    for (i64 i = done + tid; i < n; i += stride) x[i] = from_float<T>(to_float(x[i]) + to_float(y[i]));
}
TM_KERNEL(add, (T * x, const T* y, long long n), (x, y, n))

/// `x[r, c] += bias[c]`: grid.x strides over columns, grid.y over rows.
template <typename T>
__device__ __forceinline__ void add_bias_impl(T* x, const T* bias, int rows, int cols) {
    constexpr int N = Vec16<T>::N;
    const int c0 = blockIdx.x * blockDim.x + threadIdx.x;
    const int cstride = gridDim.x * blockDim.x;
    if (tmk::aligned16(x) && tmk::aligned16(bias) && cols % N == 0) {
        const int nvec = cols / N;
        for (int i = c0; i < nvec; i += cstride) {
            const Vec16<T> b = tmk::load16(bias + (i64)i * N);
            for (int r = blockIdx.y; r < rows; r += gridDim.y) {
                T* p = x + (i64)r * cols + (i64)i * N;
                Vec16<T> a = tmk::load16(p);
#pragma unroll
                for (int j = 0; j < N; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
                tmk::store16(p, a);
            }
        }
    } else {
        for (int c = c0; c < cols; c += cstride) {
            const float b = to_float(bias[c]);
            for (int r = blockIdx.y; r < rows; r += gridDim.y) {
                T* p = x + (i64)r * cols + c;
                *p = from_float<T>(to_float(*p) + b);
            }
        }
    }
}
TM_KERNEL(add_bias, (T * x, const T* bias, int rows, int cols), (x, bias, rows, cols))

/// A deferred RMSNorm finished in place (q4_gemv.cu, "Deferred RMSNorm"): `x[r, c] = T(x[r, c] *
/// rsqrt(sums[r] / cols + eps))`, the scale the products would have applied. Grid-stride.
template <typename T>
__device__ __forceinline__ void norm_finish_impl(T* x, const double* sums, int rows, int cols, float eps) {
    const i64 n = (i64)rows * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float s = rsqrtf((float)sums[i / cols] / (float)cols + eps);
        x[i] = from_float<T>(to_float(x[i]) * s);
    }
}
/// `x[i] = 0` for i < n (grid-stride; a kernel so that CUDA graphs record it like the others).
template <typename T>
__device__ __forceinline__ void fill_zero_impl(T* x, long long n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] = from_float<T>(0.f);
}
TM_KERNEL(fill_zero, (T * x, long long n), (x, n))
TM_KERNEL(norm_finish, (T * x, const double* sums, int rows, int cols, float eps), (x, sums, rows, cols, eps))
