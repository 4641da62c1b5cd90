// Dense matrix-vector products for decoding: out[n, rows] = x[n, cols] · W^T with n <= NB small
// (a decode batch), W a dense T matrix [rows, cols] (see ABI.md, "gemv.cu").
//
// At small n a product only streams W once, so what matters is keeping enough loads in flight:
// one warp per weight row, each lane loading 16-byte chunks of the row (four at a time, with the
// streaming cache hint: W is read once), every chunk multiplied with the n activation rows (x
// stays in L1/L2). Sums are f32; the warp reduces them with shuffles.
//
// - `gemv{NB}_T`: up to three weights sharing the input x (a layer's q, k and v) in one launch.
//   Their rows are numbered one after the other (rows0, then rows1, then rows2); each warp finds
//   its weight from its row. Optional biases (null when absent) are added before rounding.
// - `gemv_silu{NB}_T`: the gated MLP input in one launch: out = silu(x·G^T) * (x·U^T) for the
//   gate G and up U [rows, cols]. Each warp computes row r of both, rounds each to T (what the
//   separate products would store) and writes silu(g) * u.
//
// Requirements checked by the launcher (tm-cuda/src/kernels/gemv.rs): cols a multiple of
// 16 / sizeof(T); W, x 16-byte aligned. NB in {1, 2, 4, 8}; 256 threads = 8 rows per block.

#include "common.cuh"

namespace tmg {

using tmk::i64;
using tmk::Vec16;

constexpr int THREADS = 256;
constexpr int ROWS = THREADS / 32;
constexpr int UNROLL = 4;

// A 16-byte chunk of W, read once: streaming (evict-first) load.
template <typename T>
__device__ __forceinline__ Vec16<T> load_w(const T* p) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Vec16<T>*>(&u);
}

// acc[j] += w · x[j, off .. off + E) for the n activation rows.
template <typename T, int NB>
__device__ __forceinline__ void fma_chunk(const Vec16<T>& w, const T* __restrict__ x, i64 off, int n, int cols,
                                          float* acc) {
    constexpr int E = Vec16<T>::N;
    float wf[E];
#pragma unroll
    for (int e = 0; e < E; ++e) wf[e] = tmk::to_float(w.v[e]);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            const uint4 u = __ldca(reinterpret_cast<const uint4*>(x + (i64)j * cols + off));
            const Vec16<T> xv = *reinterpret_cast<const Vec16<T>*>(&u);
            float a = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) a = fmaf(wf[e], tmk::to_float(xv.v[e]), a);
            acc[j] += a;
        }
    }
}

// This lane's share of row `w` times the n activation rows, into acc[0..NB).
template <typename T, int NB>
__device__ __forceinline__ void dot_row(const T* __restrict__ w, const T* __restrict__ x, int n, int cols,
                                        float* acc) {
    constexpr int E = Vec16<T>::N;
    const int lane = threadIdx.x & 31;
    const int chunks = cols / E;
    int c = lane;
    for (; c + 32 * (UNROLL - 1) < chunks; c += 32 * UNROLL) {
        Vec16<T> wv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wv[u] = load_w(w + (i64)(c + 32 * u) * E);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) fma_chunk<T, NB>(wv[u], x, (i64)(c + 32 * u) * E, n, cols, acc);
    }
    for (; c < chunks; c += 32) fma_chunk<T, NB>(load_w(w + (i64)c * E), x, (i64)c * E, n, cols, acc);
}

template <typename T, int NB>
__device__ __forceinline__ void gemv_impl(T* o0, T* o1, T* o2, const T* __restrict__ w0, const T* __restrict__ w1,
                                          const T* __restrict__ w2, const T* b0, const T* b1, const T* b2,
                                          const T* __restrict__ x, int rows0, int rows1, int rows2, int n, int cols) {
    int row = blockIdx.x * ROWS + (threadIdx.x >> 5);
    // The warp's weight (uniform per warp).
    T* out = o0;
    const T* w = w0;
    const T* bias = b0;
    int rows = rows0;
    if (row >= rows0) {
        row -= rows0;
        out = o1, w = w1, bias = b1, rows = rows1;
        if (row >= rows1) {
            row -= rows1;
            out = o2, w = w2, bias = b2, rows = rows2;
            if (row >= rows2) return;
        }
    }
    float acc[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[j] = 0.f;
    dot_row<T, NB>(w + (i64)row * cols, x, n, cols, acc);
    const float b = bias ? tmk::to_float(bias[row]) : 0.f;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            const float v = tmk::warp_sum(acc[j]);
            if ((threadIdx.x & 31) == 0) out[(i64)j * rows + row] = tmk::from_float<T>(v + b);
        }
    }
}

template <typename T, int NB>
__device__ __forceinline__ void gemv_silu_impl(T* out, const T* __restrict__ wg, const T* __restrict__ wu,
                                               const T* __restrict__ x, int rows, int n, int cols) {
    const int row = blockIdx.x * ROWS + (threadIdx.x >> 5);
    if (row >= rows) return;  // uniform per warp
    float g[NB], u[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) g[j] = u[j] = 0.f;
    dot_row<T, NB>(wg + (i64)row * cols, x, n, cols, g);
    dot_row<T, NB>(wu + (i64)row * cols, x, n, cols, u);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        if (j < n) {
            const float gv = tmk::round_to<T>(tmk::warp_sum(g[j]));
            const float uv = tmk::round_to<T>(tmk::warp_sum(u[j]));
            if ((threadIdx.x & 31) == 0) out[(i64)j * rows + row] = tmk::from_float<T>(gv / (1.f + __expf(-gv)) * uv);
        }
    }
}

}  // namespace tmg

#define TM_GEMV_(NB)                                                                                            \
    template <typename T>                                                                                       \
    __device__ __forceinline__ void gemv##NB##_impl(T* o0, T* o1, T* o2, const T* w0, const T* w1, const T* w2, \
                                                    const T* b0, const T* b1, const T* b2, const T* x, int r0,   \
                                                    int r1, int r2, int n, int cols) {                           \
        tmg::gemv_impl<T, NB>(o0, o1, o2, w0, w1, w2, b0, b1, b2, x, r0, r1, r2, n, cols);                     \
    }                                                                                                           \
    TM_KERNEL_BOUNDS(gemv##NB, tmg::THREADS,                                                                    \
                     (T * o0, T * o1, T * o2, const T* w0, const T* w1, const T* w2, const T* b0, const T* b1,  \
                      const T* b2, const T* x, int r0, int r1, int r2, int n, int cols),                        \
                     (o0, o1, o2, w0, w1, w2, b0, b1, b2, x, r0, r1, r2, n, cols))                              \
    template <typename T>                                                                                       \
    __device__ __forceinline__ void gemv_silu##NB##_impl(T* out, const T* wg, const T* wu, const T* x, int rows, \
                                                         int n, int cols) {                                     \
        tmg::gemv_silu_impl<T, NB>(out, wg, wu, x, rows, n, cols);                                              \
    }                                                                                                           \
    TM_KERNEL_BOUNDS(gemv_silu##NB, tmg::THREADS,                                                               \
                     (T * out, const T* wg, const T* wu, const T* x, int rows, int n, int cols),                \
                     (out, wg, wu, x, rows, n, cols))

TM_GEMV_(1)
TM_GEMV_(2)
TM_GEMV_(4)
TM_GEMV_(8)
