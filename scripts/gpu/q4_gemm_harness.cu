// Development harness for the int4 prefill GEMM kernels of crates/tm-kernels/cuda/q4_gemm.cu,
// compiled with the GPU machine's own nvcc (no Rust build, ~15 s per try):
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I crates/tm-kernels/cuda \
//        -o /tmp/q4h scripts/gpu/q4_gemm_harness.cu && /tmp/q4h 20
//
// It runs structured probes first (x one-hot per token, W[r, c] = (r + 3 c) % 16 with scale 1 and
// min 0, so every output is an exact small integer; odd n and rows, groups 32..256) and prints how
// many outputs of each kernel are wrong, then times every kernel (l, m: mma.sync; w, v, u, y, z, q, x: wgmma)
// on the Llama-3-8B shapes with random data, with the largest error of 2048 sampled outputs
// relative to sum |x w| against an f32 reference. `/tmp/q4h 1 one` launches w once per dtype
// (for ncu). The cuBLAS comparison is `tm-cuda`'s `q4_gemm_bench` (or torch's `x @ w.t()`).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include "q4_gemm.cu"


#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ unsigned hash(unsigned x) { x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16; return x; }
__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = hash(i * 2654435761u + seed) & 0xFF;
}
template <class T> __global__ void fill_x(T* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = tmk::from_float<T>((hash(i * 747796405u + seed) & 0xFFFF) / 32768.0f - 1.0f);
}
__global__ void fill_sm(__half* s, __half* m, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sc = 0.005f + (hash(i + seed) & 0xFF) / 25600.0f;
        s[i] = __float2half(sc);
        m[i] = __float2half(-8.f * sc + ((hash(i * 3 + seed) & 0xFF) / 2560.0f - 0.05f));
    }
}
// Reference for sampled (token, row) pairs: f32 dot of x with q*s+m.
template <class T> __global__ void ref_pairs(const T* x, const unsigned char* packed, const __half* s, const __half* m,
                                             int rows, int cols, int group, const int* tok, const int* row, float* ref, float* mag, int np) {
    int p = blockIdx.x; if (p >= np) return;
    int tk = tok[p], r = row[p];
    float acc = 0.f, ab = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        int blk = c / 32, o = c % 32;
        unsigned char b = packed[(size_t)r * (cols / 2) + blk * 16 + (o & 15)];
        int q = o < 16 ? (b & 15) : (b >> 4);
        int gi = c / group;
        float w = q * __half2float(s[(size_t)r * (cols / group) + gi]) + __half2float(m[(size_t)r * (cols / group) + gi]);
        float xv = tmk::to_float(x[(size_t)tk * cols + c]);
        acc += xv * w; ab += fabsf(xv * w);
    }
    acc = tmk::block_sum(acc); ab = tmk::block_sum(ab);
    if (threadIdx.x == 0) { ref[p] = acc; mag[p] = ab; }
}

typedef void (*Kern)(void*, const void*, const unsigned char*, const __half*, const __half*, int, int, int, int);

// The kernels with the harness's arguments (row-major weights, one weight per launch, no split).
template <class T, int BM, int BN, int WM, int WN, int ST, int MINB>
__global__ void __launch_bounds__(256, MINB) mma_k(T* out, const T* x, const unsigned char* packed, const __half* s,
                                                    const __half* m, int n, int rows, int cols, int group) {
    tmk::pdl_wait();
    tmg::q4_gemm<T, BM, BN, WM, WN, ST>(out, x, packed, s, m, n, rows, cols, group, 0);
}
template <class T, int NTOK, int ST, int SUBS, int MINB>
__global__ void __launch_bounds__(256, MINB) wg_k(T* out, const T* x, const unsigned char* packed, const __half* s,
                                                   const __half* m, int n, int rows, int cols, int group) {
    tmk::pdl_wait();
    tmw::q4_gemm_wgmma<T, NTOK, ST, SUBS>(out, nullptr, x, packed, s, m, n, rows, cols, group, 0, cols, blockIdx.x, 0);
}

struct K { const char* name; Kern f; int bm, bn, smem; };  // bm: tokens per block, bn: weight rows per block

template <class T> std::vector<K> kernels();
#define KS(T) \
  { {"l", (Kern)mma_k<T, 128, 256, 2, 4, 3, 1>, 128, 256, 3 * (128 * 128 + 256 * 32 + 256 * 16)}, \
    {"m", (Kern)mma_k<T, 128, 128, 2, 4, 4, 2>, 128, 128, 4 * (128 * 128 + 128 * 32 + 128 * 16)}, \
    {"w", (Kern)wg_k<T, 256, 4, 1, 1>, 256, 128, tmw::Shape<256, 4, 1>::SMEM}, \
    {"v", (Kern)wg_k<T, 128, 4, 1, 1>, 128, 128, tmw::Shape<128, 4, 1>::SMEM}, \
    {"u", (Kern)wg_k<T, 64, 4, 1, 1>, 64, 128, tmw::Shape<64, 4, 1>::SMEM}, \
    {"y", (Kern)wg_k<T, 64, 4, 2, 2>, 64, 128, tmw::Shape<64, 4, 2>::SMEM}, \
    {"z", (Kern)wg_k<T, 32, 4, 2, 2>, 32, 128, tmw::Shape<32, 4, 2>::SMEM}, \
    {"q", (Kern)wg_k<T, 16, 4, 2, 2>, 16, 128, tmw::Shape<16, 4, 2>::SMEM}, \
    {"x", (Kern)wg_k<T, 256, 3, 2, 1>, 256, 128, tmw::Shape<256, 3, 2>::SMEM} }
template <> std::vector<K> kernels<__half>() { return KS(__half); }
template <> std::vector<K> kernels<__nv_bfloat16>() { return KS(__nv_bfloat16); }

template <class T> void run(const char* dt, int iters) {
    int shapes[4][2] = {{4096, 4096}, {6144, 4096}, {14336, 4096}, {4096, 14336}};
    int ms[3] = {512, 2048, 8192};
    const int group = 128;
    auto ks = kernels<T>();
    for (auto& k : ks) CK(cudaFuncSetAttribute(k.f, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
    for (auto& sh : shapes) {
        int rows = sh[0], cols = sh[1];
        size_t pb = (size_t)rows * cols / 2, ng = (size_t)rows * (cols / group);
        unsigned char* packed; __half *s, *m; T *x, *out; 
        CK(cudaMalloc(&packed, pb)); CK(cudaMalloc(&s, ng * 2)); CK(cudaMalloc(&m, ng * 2));
        CK(cudaMalloc(&x, (size_t)8192 * cols * sizeof(T))); CK(cudaMalloc(&out, (size_t)8192 * rows * sizeof(T)));
        fill_bytes<<<1024, 256>>>(packed, pb, 1); fill_sm<<<1024, 256>>>(s, m, ng, 2); fill_x<T><<<1024, 256>>>(x, (size_t)8192 * cols, 3);
        const int np = 2048;
        std::vector<int> ht(np), hr(np);
        int *dt_, *dr; float *ref, *mag; CK(cudaMalloc(&dt_, np * 4)); CK(cudaMalloc(&dr, np * 4)); CK(cudaMalloc(&ref, np * 4)); CK(cudaMalloc(&mag, np * 4));
        for (int mi = 0; mi < 3; ++mi) {
            int n = ms[mi] - (mi == 0 ? 7 : 0);  // one ragged n
            srand(n + rows);
            for (int i = 0; i < np; ++i) { ht[i] = rand() % n; hr[i] = rand() % rows; }
            if (np > 2) { ht[0] = n - 1; hr[0] = rows - 1; ht[1] = 0; hr[1] = 0; }
            CK(cudaMemcpy(dt_, ht.data(), np * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dr, hr.data(), np * 4, cudaMemcpyHostToDevice));
            ref_pairs<T><<<np, 256>>>(x, packed, s, m, rows, cols, group, dt_, dr, ref, mag, np);
            std::vector<float> href(np), hmag(np);
            CK(cudaMemcpy(href.data(), ref, np * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hmag.data(), mag, np * 4, cudaMemcpyDeviceToHost));
            printf("%s %5dx%5d n=%5d:", dt, rows, cols, n);
            for (auto& k : ks) {
                dim3 grid((rows + k.bn - 1) / k.bn, (n + k.bm - 1) / k.bm);
                if (k.name[0] == 'l' || k.name[0] == 'm') grid = dim3((rows + k.bn - 1) / k.bn, (n + k.bm - 1) / k.bm);
                CK(cudaMemset(out, 0xFF, (size_t)n * rows * sizeof(T)));
                k.f<<<grid, 256, k.smem>>>(out, x, packed, s, m, n, rows, cols, group);
                CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
                std::vector<T> ho((size_t)n * rows);
                CK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(T), cudaMemcpyDeviceToHost));
                double maxe = 0;
                for (int i = 0; i < np; ++i) {
                    float v;
                    if constexpr (sizeof(T) == 2 && std::is_same<T, __half>::value) v = __half2float(ho[(size_t)ht[i] * rows + hr[i]]);
                    else v = __bfloat162float(ho[(size_t)ht[i] * rows + hr[i]]);
                    double e = fabs(v - href[i]) / (hmag[i] + 1e-6);
                    if (!(e == e)) e = 1e9;
                    if (e > maxe) { maxe = e; }
                }
                cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
                for (int i = 0; i < 3; ++i) k.f<<<grid, 256, k.smem>>>(out, x, packed, s, m, n, rows, cols, group);
                cudaEventRecord(a);
                for (int i = 0; i < iters; ++i) k.f<<<grid, 256, k.smem>>>(out, x, packed, s, m, n, rows, cols, group);
                cudaEventRecord(b); CK(cudaEventSynchronize(b));
                float msec; cudaEventElapsedTime(&msec, a, b);
                double us = msec * 1000 / iters;
                printf("  %s %7.1fus %4.0fTF err %.1e", k.name, us, 2.0 * n * rows * cols / us / 1e6, maxe);
            }
            printf("\n"); fflush(stdout);
        }
        cudaFree(packed); cudaFree(s); cudaFree(m); cudaFree(x); cudaFree(out); cudaFree(dt_); cudaFree(dr); cudaFree(ref); cudaFree(mag);
    }
}

// Structured probe: x[tok, c] = (c == (7 tok) % cols), W[r, c] = (r + 3 c) % 16 (s = 1, m = 0), so
// out[tok, r] = (r + 3 ((7 tok) % cols)) % 16 exactly. Prints the first mismatches.
__global__ void probe_fill(unsigned char* packed, __half* s, __half* m, __half* x, int rows, int cols, int n, int group) {
    int stride = gridDim.x * blockDim.x;
    for (int tid = threadIdx.x + blockIdx.x * blockDim.x; tid < rows * cols / 2; tid += stride) {
        int r = tid / (cols / 2), byte = tid % (cols / 2), blk = byte / 16, i = byte % 16;
        int c0 = blk * 32 + i, c1 = c0 + 16;
        packed[tid] = ((r + 3 * c0) % 16) | (((r + 3 * c1) % 16) << 4);
    }
    for (int tid = threadIdx.x + blockIdx.x * blockDim.x; tid < rows * (cols / group); tid += stride) { s[tid] = __float2half(1.f); m[tid] = __float2half(0.f); }
    for (int tid = threadIdx.x + blockIdx.x * blockDim.x; tid < n * cols; tid += stride) { int tok = tid / cols, c = tid % cols; x[tid] = __float2half(c == (7 * tok) % cols ? 1.f : 0.f); }
}
void probe(Kern f, int bm, int bn, int smem, const char* name, int rows, int cols, int n, int group) {
    if ((name[0] == 'x' || name[0] == 'y' || name[0] == 'z' || name[0] == 'q') && (group % 128 || cols % 128)) return;
    unsigned char* packed; __half *s, *m, *x, *out;
    CK(cudaMalloc(&packed, rows * cols / 2)); CK(cudaMalloc(&s, rows * (cols / group) * 2)); CK(cudaMalloc(&m, rows * (cols / group) * 2));
    CK(cudaMalloc(&x, n * cols * 2)); CK(cudaMalloc(&out, n * rows * 2));
    probe_fill<<<64, 256>>>(packed, s, m, x, rows, cols, n, group);
    CK(cudaMemset(out, 0xFF, n * rows * 2));
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    f<<<dim3((rows + bn - 1) / bn, (n + bm - 1) / bm), 256, smem>>>(out, x, packed, s, m, n, rows, cols, group);
    CK(cudaDeviceSynchronize());
    std::vector<__half> ho(n * rows);
    CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int tok = 0; tok < n; ++tok) for (int r = 0; r < rows; ++r) {
        float v = __half2float(ho[tok * rows + r]); int want = (r + 3 * ((7 * tok) % cols)) % 16;
        if (v != want) { if (bad < 12) printf("  %s tok %d row %d got %g want %d\n", name, tok, r, v, want); ++bad; }
    }
    printf("probe %s rows %d cols %d n %d group %d: %d of %d wrong\n", name, rows, cols, n, group, bad, n * rows);
    cudaFree(packed); cudaFree(s); cudaFree(m); cudaFree(x); cudaFree(out);
}

// One launch of w (f16, then bf16) on 4096 x 4096, n = 8192, for a profiler.
void one() {
    int rows = 4096, cols = 4096, n = 8192, group = 128;
    unsigned char* packed; __half *s, *m; __half *x, *out;
    CK(cudaMalloc(&packed, rows * cols / 2)); CK(cudaMalloc(&s, rows * 32 * 2)); CK(cudaMalloc(&m, rows * 32 * 2));
    CK(cudaMalloc(&x, (size_t)n * cols * 2)); CK(cudaMalloc(&out, (size_t)n * rows * 2));
    fill_bytes<<<1024, 256>>>(packed, rows * cols / 2, 1); fill_sm<<<1024, 256>>>(s, m, rows * 32, 2); fill_x<__half><<<1024, 256>>>(x, (size_t)n * cols, 3);
    for (auto& k : kernels<__half>()) if (k.name[0] == 'w') {
        CK(cudaFuncSetAttribute(k.f, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
        k.f<<<dim3(rows / 128, n / 256), 256, k.smem>>>(out, x, packed, s, m, n, rows, cols, group);
    }
    for (auto& k : kernels<__nv_bfloat16>()) if (k.name[0] == 'w') {
        CK(cudaFuncSetAttribute(k.f, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
        k.f<<<dim3(rows / 128, n / 256), 256, k.smem>>>(out, x, packed, s, m, n, rows, cols, group);
    }
    CK(cudaDeviceSynchronize());
}

int main(int argc, char** argv) {
    if (argc > 2 && argv[2][0] == 'o') { one(); return 0; }
    for (auto& k : kernels<__half>()) {
        probe(k.f, k.bm, k.bn, k.smem, k.name, 128, 64, 256, 64);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 128, 128, 256, 64);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 128, 512, 256, 128);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 256, 512, 512, 128);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 384, 1024, 777, 32);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 392, 1152, 1000, 128);
        probe(k.f, k.bm, k.bn, k.smem, k.name, 128, 1280, 300, 256);
    }
    if (argc > 2) return 0;
    int iters = argc > 1 ? atoi(argv[1]) : 20;
    run<__half>("f16 ", iters);
    run<__nv_bfloat16>("bf16", iters);
    return 0;
}
