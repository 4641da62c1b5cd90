// Probe for the dense LM-head GEMV (n = 1, f16, a Llama-3-8B head [128256, 4096], 1.05 GB):
// gemv.cu's design (`cur`: one warp per row, 8 rows per block, U chunks in flight, x via L1) with
// load hints, persistent warps streaming their rows without a break (`pers16`: x in registers;
// `pers`, printed as pers8: an 8-chunk ring), a plain read of the bytes and a copy, each timed
// with events (min and median of 15), outputs checked against `cur`.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/lmh scripts/gpu/lm_head_gemv.cu && /tmp/lmh
//
// H200, 2026-12-02 (session 16), min us: copy kernel 540 (3.90 TB/s r+w; cudaMemcpy D2D 3.98),
// plain read 231.4 (4.54 TB/s); cur U4 242.7 (4.33), U8 242.8, U16 247.8; the L2::256B prefetch
// hint 251-253 (slower); L1::no_allocate 242.8; pers16 236.2-236.8; pers8 at 2 / 3 / 4 blocks per
// SM 237.8 / 241.5 / 234.4 (4.48 TB/s). In the engine, though, the same persistent kernel (built
// as `gemv_stream` in gemv.cu, 4 blocks per SM, an 8-chunk ring per lane, its first chunks loaded
// before `pdl_wait`, reverted) made the AWQ 8B batch-1 step 2026.8-2035.2 us against
// 1986.6-1992.0 with gemv1 (bf16 4542 against 4502): +40 us where the probe promised -8. Not
// understood. Loading the first chunks before the wait is not the cause by itself (gemv.cu's
// kernels doing so: AWQ unchanged, bf16 +20 us); the other suspect is the static row split of a
// one-wave grid when some SMs start late (the previous kernels' CTAs still resident under PDL).
//
// Chain mode (after the table above; written in session 16, run in session 17): each head after a stand-in for the last down product (2 CTAs per SM streaming
// 29 MB, triggering after its loop) and the final norm (one block, triggering first thing), every
// launch with programmatic stream serialization; it prints what the head adds to the pair, for
// `cur` waiting first and the persistent kernel at 2 and 4 blocks per SM with its first ring
// loaded before the wait (`pre`), after it (`post`), and with rows taken from a queue in runs of
// four (`dyn`), outputs checked. H200, 2026-12-02 (session 17): `cur` adds 242.8 us (median of 5);
// pers8 x4 post 239.3, pre 239.9; x2 pre / post 247.5 / 248.4; dyn x2 / x4 253.1 / 257.6. So the
// persistent head wins at most 3.5 us in a chain, and the engine's +40 us is not reproduced here.
// Same run, alone: cur U4 244.4 us, pers8 x4 238.5, plain read 234.5 (4.48 TB/s), cudaMemcpy
// D2D 4.12 TB/s r+w.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)
typedef __half T;
__device__ __forceinline__ float wsum(float v) { for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o); return v; }
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    const __half2* a = (const __half2*)&w; const __half2* b = (const __half2*)&x; float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 fa = __half22float2(a[i]), fb = __half22float2(b[i]); s = fmaf(fa.x, fb.x, s); s = fmaf(fa.y, fb.y, s); }
    return s;
}
template <int LOADHINT> __device__ __forceinline__ uint4 ldw(const uint4* p) {
    if (LOADHINT == 0) return __ldcs(p);
    uint4 r;
    if (LOADHINT == 1) asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    else asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// Programmatic dependent launch: both return at once in a grid launched without the attribute.
__device__ __forceinline__ void gdc_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void gdc_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Current design: one warp per row, 8 rows per 256-thread block, U chunks in flight, x via L1;
// waiting first, as the TM_KERNEL wrapper does.
template <int U, int H>
__global__ void __launch_bounds__(256) cur(T* out, const uint4* w, const uint4* x, int rows, int cols) {
    gdc_wait();
    int row = blockIdx.x * 8 + (threadIdx.x >> 5); if (row >= rows) return;
    const int lane = threadIdx.x & 31, chunks = cols / 8;
    const uint4* wr = w + (size_t)row * chunks; float acc = 0.f;
    for (int c = lane; c < chunks; c += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ldw<H>(wr + c + 32 * u);
#pragma unroll
        for (int u = 0; u < U; ++u) acc += dot8(v[u], __ldca(x + c + 32 * u));
    }
    acc = wsum(acc); if (lane == 0) out[row] = __float2half(acc);
}
// Persistent warps: each warp takes rows gw, gw + W, ...; x of the lane's 16 chunks kept in
// registers (cols == 4096); the next row's chunk i is loaded as soon as chunk i of this row is used.
template <int H>
__global__ void __launch_bounds__(256, 1) pers16(T* out, const uint4* w, const uint4* x, int rows, int cols) {
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * 8 + (threadIdx.x >> 5), W = gridDim.x * 8;
    constexpr int C = 16;  // chunks per lane per row (cols 4096)
    uint4 xv[C], b[C];
#pragma unroll
    for (int i = 0; i < C; ++i) xv[i] = x[lane + 32 * i];
    int row = gw;
    if (row < rows) {
#pragma unroll
        for (int i = 0; i < C; ++i) b[i] = ldw<H>(w + (size_t)row * 512 + lane + 32 * i);
    }
    for (; row < rows; row += W) {
        const int nx = row + W < rows ? row + W : row;  // reload same row at the end (harmless)
        const uint4* wn = w + (size_t)nx * 512 + lane;
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < C; ++i) { acc += dot8(b[i], xv[i]); b[i] = ldw<H>(wn + 32 * i); }
        acc = wsum(acc); if (lane == 0) out[row] = __float2half(acc);
    }
}
// Pure read of the same bytes (grid-stride, U in flight).
template <int U>
__global__ void __launch_bounds__(256) readall(const uint4* w, size_t n, unsigned* sink) {
    size_t i = (size_t)blockIdx.x * 256 + threadIdx.x, s = (size_t)gridDim.x * 256; unsigned a = 0;
    for (; i + s * (U - 1) < n; i += s * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = __ldcs(w + i + s * u);
#pragma unroll
        for (int u = 0; u < U; ++u) a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (a == 0x1234567u) sink[0] = a;
}
__global__ void copyk(uint4* d, const uint4* s, size_t n) { for (size_t i = (size_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (size_t)gridDim.x * 256) d[i] = s[i]; }
__global__ void fill(uint4* p, size_t n, unsigned seed) {
    for (size_t i = (size_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (size_t)gridDim.x * 256) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; uint4 v; unsigned* q = (unsigned*)&v;
        for (int k = 0; k < 4; ++k) { h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
            // two f16 in [-0.5, 0.5)
            unsigned lo = 0x3000u | (h & 0x3ffu) | ((h >> 10) & 1u) << 15, hi = 0x3000u | ((h >> 11) & 0x3ffu) | ((h >> 21) & 1u) << 15; q[k] = lo | hi << 16; }
        p[i] = v;
    }
}
// ---- chain mode: the head after a stand-in for the last down product and the final norm, every
// launch with programmatic stream serialization (as tm launches them), to see what the engine sees.
// Two CTAs per SM streaming `per` uint4 each (a down product's 29 MB over 264 CTAs), triggering
// after the loop as q4_gemv.cu's kernels do.
__global__ void __launch_bounds__(256, 2) busy(const uint4* p, size_t per, unsigned* sink) {
    gdc_wait();
    const uint4* q = p + blockIdx.x * per; unsigned a = 0;
    for (size_t i = threadIdx.x; i < per; i += 1024) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + 256 * u < per) v[u] = __ldcs(q + i + 256 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u) if (i + 256 * u < per) a ^= v[u].x ^ v[u].w;
    }
    gdc_launch();
    __syncthreads();
    if (a == 0x1234567u) sink[0] = a;
}
// The final norm's stand-in: one block, triggering first thing, rewrites x, zeroes the row queue.
__global__ void norm_like(uint4* x, int n16, unsigned* queue) {
    gdc_launch(); gdc_wait();
    for (int i = threadIdx.x; i < n16; i += blockDim.x) { uint4 v = __ldcg(x + i); v.x ^= 0; x[i] = v; }
    if (threadIdx.x == 0) *queue = 0;
}
// Persistent warps (cols 4096), 8 chunks in flight per lane (a half-row ring): warp v takes rows
// v, v + W, ...; PRE loads the first ring before the wait (gemv_stream did); DYN takes rows from
// `queue` in runs of 4 (one atomic per run) instead; H the load hint, MINB the blocks per SM the
// registers are sized for.
template <bool PRE, bool DYN, int H = 0, int MINB = 4>
__global__ void __launch_bounds__(256, MINB) pers(T* out, const uint4* w, const uint4* x, int rows, int cols, unsigned* queue) {
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * 8 + (threadIdx.x >> 5), W = gridDim.x * 8;
    constexpr int RUN = 4;
    auto grab = [&]() { unsigned r = 0; if (lane == 0) r = atomicAdd(queue, RUN); return (int)__shfl_sync(0xffffffffu, r, 0); };
    uint4 b[8];
    int row = DYN ? -1 : gw, left = 0;
    if (!DYN && PRE && row < rows) {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = ldw<H>(w + (size_t)row * 512 + lane + 32 * i);
    }
    gdc_wait();
    int next_run = 0;
    if (DYN) { row = grab(); left = RUN; next_run = grab(); }
    if (row >= rows) return;
    if (DYN || !PRE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = ldw<H>(w + (size_t)row * 512 + lane + 32 * i);
    }
    while (row < rows) {
        int nx;
        if (DYN) {
            if (--left > 0 && row + 1 < rows) nx = row + 1;
            else { nx = next_run; left = RUN; next_run = nx < rows ? grab() : rows; }
        } else nx = row + W;
        const bool more = nx < rows;
        const uint4* wc = w + (size_t)row * 512 + lane;
        const uint4* wn = w + (size_t)(more ? nx : row) * 512 + lane;
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) { acc += dot8(b[i], __ldca(x + lane + 32 * i)); b[i] = ldw<H>(wc + 256 + 32 * i); }
#pragma unroll
        for (int i = 0; i < 8; ++i) { acc += dot8(b[i], __ldca(x + lane + 256 + 32 * i)); if (more) b[i] = ldw<H>(wn + 32 * i); }
        acc = wsum(acc); if (lane == 0) out[row] = __float2half(acc);
        row = nx;
    }
}
template <class K, class... A> void pdl_launch(K k, int grid, int block, cudaStream_t st, A... a) {
    cudaLaunchConfig_t c = {}; cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    c.gridDim = dim3(grid); c.blockDim = dim3(block); c.stream = st; c.attrs = at; c.numAttrs = 1;
    CK(cudaLaunchKernelEx(&c, k, a...));
}
int main() {
    const int rows = 128256, cols = 4096; const size_t nw = (size_t)rows * cols / 8; const double bytes = nw * 16.0;
    uint4 *w, *x, *w2; T* out; T* ref; unsigned* sink; int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaMalloc(&w, nw * 16)); CK(cudaMalloc(&w2, nw * 16)); CK(cudaMalloc(&x, cols * 2)); CK(cudaMalloc(&out, rows * 2)); CK(cudaMalloc(&ref, rows * 2)); CK(cudaMalloc(&sink, 4));
    fill<<<2048, 256>>>(w, nw, 1); fill<<<4, 256>>>(x, cols / 8, 7); CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::vector<T> h(rows), hr(rows);
    auto run = [&](const char* name, auto launch, bool check) {
        for (int i = 0; i < 3; ++i) launch();
        CK(cudaDeviceSynchronize());
        std::vector<float> ts;
        for (int i = 0; i < 15; ++i) { cudaEventRecord(e0); launch(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms * 1e3f); }
        std::sort(ts.begin(), ts.end());
        double maxd = 0;
        if (check) { CK(cudaMemcpy(h.data(), out, rows * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hr.data(), ref, rows * 2, cudaMemcpyDeviceToHost));
            for (int r = 0; r < rows; ++r) maxd = std::max(maxd, (double)fabsf(__half2float(h[r]) - __half2float(hr[r]))); }
        printf("%-22s min %7.1f us  med %7.1f us  %5.2f TB/s (min)  maxdiff %.3g\n", name, ts[0], ts[7], bytes / ts[0] / 1e6, maxd);
    };
    cur<4, 0><<<(rows + 7) / 8, 256>>>(ref, w, x, rows, cols); CK(cudaDeviceSynchronize());
    run("copy (r+w, 2x bytes)", [&] { copyk<<<sms * 8, 256>>>(w2, w, nw); }, false);
    CK(cudaEventRecord(e0)); CK(cudaMemcpyAsync(w2, w, nw * 16, cudaMemcpyDeviceToDevice)); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    { float ms; cudaEventElapsedTime(&ms, e0, e1); printf("cudaMemcpy D2D %.1f us = %.2f TB/s r+w\n", ms * 1e3, 2 * bytes / ms / 1e9); }
    run("readall U4 x8", [&] { readall<4><<<sms * 8, 256>>>(w, nw, sink); }, false);
    run("readall U8 x4", [&] { readall<8><<<sms * 4, 256>>>(w, nw, sink); }, false);
    run("cur U4 ldcs", [&] { cur<4, 0><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    run("cur U4 L2::256B", [&] { cur<4, 1><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    run("cur U4 noalloc", [&] { cur<4, 2><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    run("cur U8 ldcs", [&] { cur<8, 0><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    run("cur U16 ldcs", [&] { cur<16, 0><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    run("cur U8 L2::256B", [&] { cur<8, 1><<<(rows + 7) / 8, 256>>>(out, w, x, rows, cols); }, true);
    for (int b : {1, 2}) {
        char nm[64];
        snprintf(nm, 64, "pers16 x%d ldcs", b); run(nm, [&] { pers16<0><<<sms * b, 256>>>(out, w, x, rows, cols); }, true);
        snprintf(nm, 64, "pers16 x%d 256B", b); run(nm, [&] { pers16<1><<<sms * b, 256>>>(out, w, x, rows, cols); }, true);
    }
    for (int b : {2, 3, 4}) {
        char nm[64];
        snprintf(nm, 64, "pers8 x%d ldcs", b); run(nm, [&] { pers<true, false, 0, 2><<<sms * b, 256>>>(out, w, x, rows, cols, nullptr); }, true);
        snprintf(nm, 64, "pers8 x%d 256B", b); run(nm, [&] { pers<true, false, 1, 2><<<sms * b, 256>>>(out, w, x, rows, cols, nullptr); }, true);
    }
    // chain: [busy, norm_like, head] x 20 minus [busy, norm_like] x 20, in one stream
    {
        unsigned* queue; CK(cudaMalloc(&queue, 4)); CK(cudaMemset(queue, 0, 4));
        const size_t per = (size_t)(29360128 / 16) / (sms * 2);
        cudaStream_t st; CK(cudaStreamCreate(&st));
        auto chain = [&](const char* name, auto head) {
            auto once = [&](bool with) {
                pdl_launch(busy, sms * 2, 256, st, (const uint4*)w2, per, sink);
                pdl_launch(norm_like, 1, 256, st, x, cols / 8, queue);
                if (with) head();
            };
            CK(cudaMemset(out, 0, rows * 2));
            float ms[2][5];
            for (int rep = 0; rep < 5; ++rep)
                for (int with = 0; with < 2; ++with) {
                    for (int i = 0; i < 3; ++i) once(with);
                    CK(cudaEventRecord(e0, st));
                    for (int i = 0; i < 20; ++i) once(with);
                    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&ms[with][rep], e0, e1));
                }
            std::sort(ms[0], ms[0] + 5); std::sort(ms[1], ms[1] + 5);
            double maxd = 0;
            CK(cudaMemcpy(h.data(), out, rows * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hr.data(), ref, rows * 2, cudaMemcpyDeviceToHost));
            for (int r = 0; r < rows; ++r) maxd = std::max(maxd, (double)fabsf(__half2float(h[r]) - __half2float(hr[r])));
            printf("chain %-18s head adds %7.1f us (median of 5; min %7.1f); busy+norm %6.1f us  maxdiff %.3g\n", name,
                   (ms[1][2] - ms[0][2]) * 1e3 / 20, (ms[1][0] - ms[0][0]) * 1e3 / 20, ms[0][2] * 1e3 / 20, maxd);
        };
        CK(cudaMemset(out, 0, rows * 2));
        chain("cur (wait first)", [&] { pdl_launch(cur<4, 0>, (rows + 7) / 8, 256, st, out, (const uint4*)w, (const uint4*)x, rows, cols); });
        for (int b : {2, 4}) {
            char nm[3][64]; snprintf(nm[0], 64, "pers8 x%d pre", b); snprintf(nm[1], 64, "pers8 x%d post", b); snprintf(nm[2], 64, "pers8 x%d dyn", b);
            chain(nm[0], [&] { pdl_launch(pers<true, false>, sms * b, 256, st, out, (const uint4*)w, (const uint4*)x, rows, cols, queue); });
            chain(nm[1], [&] { pdl_launch(pers<false, false>, sms * b, 256, st, out, (const uint4*)w, (const uint4*)x, rows, cols, queue); });
            chain(nm[2], [&] { pdl_launch(pers<false, true>, sms * b, 256, st, out, (const uint4*)w, (const uint4*)x, rows, cols, queue); });
        }
    }
    CK(cudaGetLastError());
    return 0;
}
