// Access-pattern probe for int4 decode weights (no math): reads a weight of each Llama-3-8B
// decode shape once per launch in three orders and prints the time and bandwidth, at 8, 4, 3 and
// 2 CTAs per SM (dynamic shared memory caps the residency):
//   gemv-like:  the row-major lean GEMV's pattern (lane (g, t) of warp w: 16 bytes of rows g and
//               g + 8 at column block 4 (w + 8 j) + t; 64 bytes of each of 16 rows per warp step);
//   warp-contiguous K: the same bytes with warp w taking steps w J .. w J + J - 1;
//   contiguous: each CTA's 16-row slab read linearly;
//   tiled:      the tile-major layout (tm-core Int4Layout::Tiles16x128): a warp step's 1 KiB in
//               two 512-byte loads.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/ap scripts/gpu/q4_access_pattern.cu && /tmp/ap
//
// H200, 2026-12-01, 2 CTAs per SM (the lean kernels' residency), U = 4 loads in flight per lane:
// down (4096 x 14336, 29.4 MB) gemv-like 10.3-10.7 us, warp-contiguous 10.3, tiled 6.5-6.8;
// gate/up (2 x 14336 x 4096, 58.7 MB) 16.9-17.0, 17.3, 15.3. This is why the CUDA backend stores
// these weights tile-major.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
// CONTIG: warp w takes steps w J .. w J + J - 1 (warp-contiguous K) instead of w, w + 8, ...
template <int U, bool CONTIG = false>
__global__ void __launch_bounds__(256, 2) gemv_like(const uint4* w, int cols, unsigned* sink) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int J = cols >> 10;
    const int rs = cols >> 5;  // uint4 per row
    const uint4* p0 = w + (size_t)(blockIdx.x * 16 + g) * rs + 4 * (CONTIG ? warp * J : warp) + t;
    const uint4* p1 = p0 + 8 * rs;
    constexpr int STEP = CONTIG ? 4 : 32;  // uint4 between a warp's steps
    unsigned acc = 0;
    for (int j0 = 0; j0 < J; j0 += U) {
        uint4 a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) if (j0 + u < J) { a[u] = __ldcs(p0 + STEP * (j0 + u)); b[u] = __ldcs(p1 + STEP * (j0 + u)); }
#pragma unroll
        for (int u = 0; u < U; ++u) if (j0 + u < J) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ b[u].x ^ b[u].y ^ b[u].z ^ b[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
template <int U>
__global__ void __launch_bounds__(256, 2) contiguous(const uint4* w, int cols, unsigned* sink) {
    const int per = 16 * (cols >> 5);  // uint4 in the CTA's slab
    const uint4* p = w + (size_t)blockIdx.x * per + threadIdx.x;
    unsigned acc = 0;
    for (int i0 = 0; i0 < per; i0 += 256 * U) {
        uint4 a[U];
#pragma unroll
        for (int u = 0; u < U; ++u) if (i0 + 256 * u < per) a[u] = __ldcs(p + i0 + 256 * u);
#pragma unroll
        for (int u = 0; u < U; ++u) if (i0 + 256 * u < per) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
// Tiled layout: the warp's step j is 1 KiB contiguous (16 rows x 64 B), lane reads 2 x 16 B of it.
template <int U>
__global__ void __launch_bounds__(256, 2) tiled(const uint4* w, int cols, unsigned* sink) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int J = cols >> 10;
    const uint4* p = w + (size_t)blockIdx.x * 16 * (cols >> 5) + (size_t)warp * 64 + lane;
    unsigned acc = 0;
    for (int j0 = 0; j0 < J; j0 += U) {
        uint4 a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) if (j0 + u < J) { a[u] = __ldcs(p + 512 * (j0 + u)); b[u] = __ldcs(p + 512 * (j0 + u) + 32); }
#pragma unroll
        for (int u = 0; u < U; ++u) if (j0 + u < J) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ b[u].x ^ b[u].y ^ b[u].z ^ b[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
int g_smem = 0;  // dynamic shared memory per CTA: limits the CTAs per SM
template <class K> float timeit(K k, int grid, const uint4* w, int cols, unsigned* sink) {
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, g_smem);
    for (int i = 0; i < 3; ++i) k<<<grid, 256, g_smem>>>(w, cols, sink);
    cudaEventRecord(e0);
    const int it = 50;
    for (int i = 0; i < it; ++i) k<<<grid, 256, g_smem>>>(w, cols, sink);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); return 1000.f * ms / it;
}
int main() {
    const size_t big = 200ull << 20;
    uint4* w; unsigned* sink; CK(cudaMalloc(&w, big)); CK(cudaMalloc(&sink, 4)); CK(cudaMemset(w, 1, big));
    struct S { const char* name; int rows, cols; } shapes[] = {{"gate+up", 28672, 4096}, {"down", 4096, 14336}, {"o", 4096, 4096}, {"big", 65536, 4096}};
    for (int per_sm : {8, 4, 3, 2}) {
    g_smem = per_sm == 8 ? 0 : (220 << 10) / per_sm;
    printf("-- at most %d CTAs per SM (dynamic smem %d KiB)\n", per_sm, g_smem >> 10);
    for (auto s : shapes) {
        const double bytes = (double)s.rows * s.cols / 2;
        const int grid = s.rows / 16;
        float a2 = timeit(gemv_like<2>, grid, w, s.cols, sink), a4 = timeit(gemv_like<4>, grid, w, s.cols, sink);
        float c2 = timeit(contiguous<2>, grid, w, s.cols, sink), c4 = timeit(contiguous<4>, grid, w, s.cols, sink);
        float t2 = timeit(tiled<2>, grid, w, s.cols, sink), t4 = timeit(tiled<4>, grid, w, s.cols, sink);
        float w2 = timeit(gemv_like<2, true>, grid, w, s.cols, sink), w4 = timeit(gemv_like<4, true>, grid, w, s.cols, sink);
        printf("%-8s warp-contiguous K U2 %6.1f (%4.2f) U4 %6.1f (%4.2f)\n", s.name, w2, bytes / w2 / 1e6, w4, bytes / w4 / 1e6);
        printf("%-8s %6.1f MB: gemv-like U2 %6.1f us (%4.2f TB/s) U4 %6.1f (%4.2f) | contiguous U2 %6.1f (%4.2f) U4 %6.1f (%4.2f) | tiled U2 %6.1f (%4.2f) U4 %6.1f (%4.2f)\n",
               s.name, bytes / 1e6, a2, bytes / a2 / 1e6, a4, bytes / a4 / 1e6, c2, bytes / c2 / 1e6, c4, bytes / c4 / 1e6, t2, bytes / t2 / 1e6, t4, bytes / t4 / 1e6);
    }
    }
    CK(cudaGetLastError());
    return 0;
}
