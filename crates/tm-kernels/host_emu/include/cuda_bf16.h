// Host stand-in for cuda_bf16.h (see cuda_fp16.h).
#pragma once
#include "cuda_fp16.h"
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
    uint32_t u; std::memcpy(&u, &v, 4);
    if (std::isnan(v)) return __nv_bfloat16{(uint16_t)0x7fc0};
    u += 0x7fff + ((u >> 16) & 1);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline __nv_bfloat162 __float2bfloat162_rn(float v) { auto b = __float2bfloat16_rn(v); return __nv_bfloat162{b, b}; }
inline __nv_bfloat16 bfma1(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __float2bfloat16_rn((float)std::fma((double)__bfloat162float(a), (double)__bfloat162float(b), (double)__bfloat162float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) { return __nv_bfloat162{bfma1(a.x, b.x, c.x), bfma1(a.y, b.y, c.y)}; }
