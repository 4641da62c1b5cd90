// Host stand-ins for the CUDA types and intrinsics q4_gemv.cu and common.cuh use, for the host
// emulation only (see ../README.md): __half via _Float16, bf16 by bit rounding, RN conversions.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <barrier>
struct dim3 { unsigned x, y, z; };
extern thread_local dim3 threadIdx;
extern thread_local dim3 blockIdx;
constexpr dim3 blockDim{256, 1, 1};
#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__
#define __align__(n) alignas(n)
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
struct __half { uint16_t x; };
struct __half2 { __half x, y; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; std::memcpy(&h.x, &f, 2); return h; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline __half2 __half2half2(__half h) { return __half2{h, h}; }
inline __half2 __hsub2(__half2 a, __half2 b) {
    return __half2{__float2half_rn(__half2float(a.x) - __half2float(b.x)), __float2half_rn(__half2float(a.y) - __half2float(b.y))};
}
inline __half hfma1(__half a, __half b, __half c) { return __float2half_rn((float)std::fma((double)__half2float(a), (double)__half2float(b), (double)__half2float(c))); }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2{hfma1(a.x, b.x, c.x), hfma1(a.y, b.y, c.y)}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __expf(float v) { return std::exp(v); }
inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
#include <atomic>
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline void sincosf(float v, float* s, float* c) { *s = std::sin(v); *c = std::cos(v); }
float __shfl_xor_sync(unsigned mask, float v, int lane_mask);  // q4_gemv_emu.cpp: a per-warp exchange
void __syncthreads();
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    uint8_t bytes[8];
    std::memcpy(bytes, &a, 4);
    std::memcpy(bytes + 4, &b, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)bytes[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}
inline int __ffs(int v) { return __builtin_ffs(v); }
inline float __fdividef(float a, float b) { return a / b; }
