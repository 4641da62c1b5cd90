// RoPE device code shared by elementwise.cu (`rope`, `rope_write_kv`) and attention.cu
// (`rope_write_kv_e4m3`), so that the fused RoPE + KV-cache write rounds exactly as the separate
// `rope` and `write_kv` kernels do: the same angle, the same table, the same step-by-step rounded
// rotation (no FMA contraction). Conventions: ABI.md ("RoPE").
#pragma once

#include "common.cuh"

namespace tmk {

/// The `[lo, hi)` range of `n` items (heads) that `blockIdx.y` takes: contiguous ranges of
/// `ceil(n / gridDim.y)`; `hi <= lo` when the block has none.
struct YRange {
    int lo, hi;
};
__device__ __forceinline__ YRange y_range(int n) {
    const int per_block = (n + (int)gridDim.y - 1) / (int)gridDim.y;
    const int lo = (int)blockIdx.y * per_block;
    return YRange{lo, min(n, lo + per_block)};
}

/// The block's dynamic shared memory as the RoPE table (`head_dim` floats).
__device__ __forceinline__ float* rope_shared() {
    extern __shared__ float rope_cs[];  // [half] cos, then [half] sin
    return rope_cs;
}

/// Fills the block's table `cs` (`[half]` cos, then `[half]` sin, both times `attention_factor`)
/// for `position`: angle `(float)position * inv_freq[i]` (rounded, never contracted into the
/// reduction inside `sincosf`) through `sincosf`. The caller synchronizes the block before
/// reading it and before refilling it.
__device__ __forceinline__ void rope_table(float* cs, unsigned position, const float* inv_freq, float attention_factor,
                                           int half) {
    const float pos = (float)position;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(__fmul_rn(pos, inv_freq[i]), &s, &c);
        cs[i] = c * attention_factor;
        cs[half + i] = s * attention_factor;
    }
}

/// The elements of pair `i` of a head: `(i, i + half)`, or `(2i, 2i + 1)` when `interleaved`.
struct RopePair {
    int a, b;
};
__device__ __forceinline__ RopePair rope_pair(int i, int half, int interleaved) {
    return interleaved ? RopePair{2 * i, 2 * i + 1} : RopePair{i, i + half};
}

/// Rotates pair `p` of head `xh` in place by `(c, s)`: `a' = a c - b s`, `b' = b c + a s`, each
/// product and sum rounded in f32, then to `T`. Returns the stored values in `ya`, `yb`.
template <typename T>
__device__ __forceinline__ void rope_rotate(T* xh, RopePair p, float c, float s, T& ya, T& yb) {
    const float x1 = to_float(xh[p.a]), x2 = to_float(xh[p.b]);
    ya = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    yb = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    xh[p.a] = ya;
    xh[p.b] = yb;
}

/// RoPE of `q` and `k` in place plus the KV-cache write of the rotated `k` and of `v`, for
/// `q: [tokens, heads * head_dim]`, `k, v: [tokens, kv_heads * head_dim]`. Grid `(x, y)`: block `x` takes
/// tokens `blockIdx.x`, `blockIdx.x + gridDim.x`, ...; `blockIdx.y` takes a contiguous range of the `heads + kv_heads`
/// "units" (query heads, then key heads; key head `h` brings value head `h` with it). Dynamic
/// shared memory `head_dim * sizeof(float)`. Slot `0xffffffff` (a padding token) is rotated but
/// not written to the caches.
///
/// `Cache` converts to the cache element `C`: `Cache::put(C* dst, T x)` stores one element and
/// `Cache::row(C* dst, const T* src, int n)` stores `n` with the block's threads (no barriers).
template <typename T, typename C, typename Cache>
__device__ __forceinline__ void rope_write_kv_tokens(T* q, T* k, const T* v, C* k_cache, C* v_cache,
                                                     const unsigned* positions, const unsigned* slots,
                                                     const float* inv_freq, float attention_factor, int tokens,
                                                     int heads, int kv_heads, int head_dim, int interleaved) {
    float* cs = rope_shared();
    const int half = head_dim / 2;
    const YRange units = y_range(heads + kv_heads);
    const int pairs = max(0, units.hi - units.lo) * half;
    // The key (and value) heads among this block's units.
    const int k_lo = max(units.lo, heads) - heads, k_hi = max(units.hi, heads) - heads;
    const int kv_dim = kv_heads * head_dim;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        rope_table(cs, positions[t], inv_freq, attention_factor, half);
        __syncthreads();
        const unsigned slot = slots[t];
        const bool store = slot != 0xffffffffu;
        const u64 row = (u64)slot * (u64)kv_dim;  // the slot's cache row (used only when `store`)
        for (int pi = threadIdx.x; pi < pairs; pi += blockDim.x) {
            const int ur = pi / half, i = pi - ur * half, u = units.lo + ur;
            const RopePair p = rope_pair(i, half, interleaved);
            const float c = cs[i], s = cs[half + i];
            T ya, yb;
            if (u < heads) {
                rope_rotate(q + ((i64)t * heads + u) * head_dim, p, c, s, ya, yb);
            } else {
                const int h = u - heads;
                rope_rotate(k + ((i64)t * kv_heads + h) * head_dim, p, c, s, ya, yb);
                if (store) {
                    C* kc = k_cache + row + (u64)h * head_dim;
                    Cache::put(kc + p.a, ya);
                    Cache::put(kc + p.b, yb);
                }
            }
        }
        if (store && k_hi > k_lo) {
            const i64 off = (i64)k_lo * head_dim;
            Cache::row(v_cache + row + off, v + (i64)t * kv_dim + off, (k_hi - k_lo) * head_dim);
        }
        __syncthreads();  // the table is rewritten for the next token
    }
}

}  // namespace tmk
