// Shared helpers for tm's CUDA kernels (see ABI.md).
//
// - dtype conversion: `tmk::to_float(x)` and `tmk::from_float<T>(f)` for float, __half and
//   __nv_bfloat16 (round to nearest even);
// - 16-byte vectors: `tmk::Vec16<T>` (4 floats or 8 halves), `tmk::aligned16(p)`;
// - reductions: `tmk::warp_sum`, `tmk::warp_max`, `tmk::block_sum`, `tmk::block_max` (any block size
//   that is a multiple of 32, up to 1024; every thread of the block must call them);
// - `TM_KERNEL(name, (params), (args))`: defines `extern "C" __global__` kernels `name_f32`,
//   `name_f16` and `name_bf16`, each calling the device template `name_impl<T>(args)`; `params` may
//   name the dtype as `T`. `TM_KERNEL_BOUNDS(name, threads, ...)` adds `__launch_bounds__(threads)`.
//   The wrapper calls `pdl_launch_dependents()` and `pdl_wait()` before `name_impl`;
// - programmatic dependent launch: `tmk::pdl_launch_dependents()`, `tmk::pdl_wait()`. Every kernel
//   not defined through `TM_KERNEL` must call `pdl_wait()` before it reads what an earlier kernel
//   wrote, before any global write and before any `return` (the tm-kernels test
//   `every_kernel_waits_for_its_predecessors` checks the sources; see ABI.md).
//
// Only the CUDA fp16/bf16 headers are included, so the sources also compile with NVRTC.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tmk {

typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

/// Programmatic dependent launch (sm_90+), part 1: lets the next kernel of the stream, when it is
/// launched with the programmatic-serialization attribute, start its blocks before this grid ends.
/// Safe anywhere: it only allows the next grid to be scheduled; that grid still calls `pdl_wait`
/// before it reads anything this grid writes. A no-op before sm_90.
///
/// It does nothing unless built with `-DTM_PDL_EARLY_TRIGGER=1`: the next grid is then scheduled
/// as this grid's blocks exit (the implicit trigger), which still hides its launch behind this
/// grid's end. Triggering at the top let successors' blocks (and theirs, in a cascade) sit in
/// `pdl_wait` on SM slots the running grids needed: slower on the H200 (tm-cuda's pdl.rs).
#ifndef TM_PDL_EARLY_TRIGGER
#define TM_PDL_EARLY_TRIGGER 0
#endif
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && TM_PDL_EARLY_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// `pdl_launch_dependents`, always (sm_90+): for the kernels whose grids are small at decode
/// time (the norms, RoPE with the KV write, decode attention). The next grid (an int4 GEMV, say)
/// then starts its blocks on the SMs these leave free and issues its weight loads, which depend
/// on no kernel, while this one runs; its `pdl_wait` still holds it until this grid is done. The
/// next grids themselves trigger late, so blocks waiting early take only slots that this grid
/// does not need (it triggers only once all its blocks are resident). Batch-1 decode of a
/// Llama-3-8B int4 model on the H200: see scripts/gpu/q4_decode_chain.cu.
__device__ __forceinline__ void pdl_launch_dependents_early() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Programmatic dependent launch, part 2: blocks until every grid this one depends on has finished
/// and its writes are visible. Anything read from an earlier kernel's output, and every global
/// write, must come after it; loads of data no earlier kernel writes (weights) may come before.
/// Returns at once when the grid was launched without the attribute. A no-op before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Loads of what an earlier kernel wrote, in kernels that use programmatic dependent launch: never
// `__ldg` (ld.global.nc). The non-coherent path requires the data to be read-only for the whole
// life of the kernel, which under PDL overlaps the previous kernel's writes, and ptxas does hoist
// such loads above `griddepcontrol.wait` (q4_gemv.cu's x loads were: they read x before the
// previous kernel had written it). `__ldca` keeps the L1 caching and stays after the wait;
// `scripts/check_pdl_order.py` checks the built SASS for non-coherent loads above a wait.

/// Byte offset of the 16-byte chunk `blk` (columns 32 blk .. 32 blk + 31) of row `r` of an int4
/// weight of `cols` columns: row-major (`tiled` = 0), or tile-major (`tiled` = 1 or 2: tm-core's
/// `Int4Layout::Tiles16x128` and `TilesAndScales16x128`, `int4_chunk_offset`, ABI.md "int4
/// layouts"; rows % 16 == 0, cols % 128 == 0). Every int4 kernel takes the layout as an `int tiled`
/// argument.
__device__ __forceinline__ long long q4_chunk_offset(int r, int blk, int cols, int tiled) {
    return tiled ? ((long long)(r >> 4) * (cols >> 7) + (blk >> 2)) * 1024 + ((r >> 3) & 1) * 512 + (r & 7) * 64 +
                       (blk & 3) * 16
                 : (long long)r * (cols >> 1) + blk * 16;
}

/// Index of the scale (and of the min) of group 0 of row `r` of an int4 weight with `groups`
/// groups per row: row-major for `tiled` 0 and 1 (r * groups + g for group g); for `tiled` = 2
/// (tm-core's `Int4Layout::TilesAndScales16x128`, `int4_scale_index`) in tile order, the 16 rows of
/// a tile and one group 16 consecutive entries with rows i and i + 8 side by side: ((r / 16 *
/// groups + g) * 8 + r % 8) * 2 + r / 8 % 2. Rows 16 k apart are 16 k groups entries apart in
/// both orders.
__device__ __forceinline__ long long q4_scale_row(int r, int groups, int tiled) {
    return tiled == 2 ? ((long long)(r >> 4) * groups * 8 + (r & 7)) * 2 + ((r >> 3) & 1) : (long long)r * groups;
}
/// The distance between consecutive groups of one row in that order (1, or 16 for `tiled` = 2).
__device__ __forceinline__ int q4_scale_group_stride(int tiled) { return tiled == 2 ? 16 : 1; }
/// `q4_scale_row(r) + g * q4_scale_group_stride()`: the entry of row `r`, group `g`.
__device__ __forceinline__ long long q4_scale_index(int r, int g, int groups, int tiled) {
    return q4_scale_row(r, groups, tiled) + (long long)g * q4_scale_group_stride(tiled);
}

/// Rounds `x` to `T` and back (what storing to a `T` tensor and reloading it gives).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
    return to_float(from_float<T>(x));
}

/// 16 bytes of `T`: one 128-bit load or store.
template <typename T>
struct __align__(16) Vec16 {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

/// Whether `p` is 16-byte aligned.
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<u64>(p) & 15ull) == 0; }

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
    return *reinterpret_cast<const Vec16<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& v) {
    *reinterpret_cast<Vec16<T>*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/// Sum over the block, returned to every thread. `blockDim.x` must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

/// Maximum over the block, returned to every thread. `blockDim.x` must be a multiple of 32.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : __int_as_float(0xff800000);  // -inf
    return warp_max(v);
}

}  // namespace tmk

#define TM_KERNEL_ONE_(name, sfx, TYPE, bounds, trigger, PARAMS, ARGS) \
    namespace tm_kernel_##name##_##sfx {                               \
    typedef TYPE T;                                                    \
    extern "C" __global__ void bounds name##_##sfx PARAMS {             \
        tmk::trigger();                                                \
        tmk::pdl_wait();                                               \
        name##_impl<T> ARGS;                                           \
    }                                                                  \
    }

#define TM_KERNEL_ALL_(name, bounds, trigger, PARAMS, ARGS)                   \
    TM_KERNEL_ONE_(name, f32, float, bounds, trigger, PARAMS, ARGS)           \
    TM_KERNEL_ONE_(name, f16, __half, bounds, trigger, PARAMS, ARGS)          \
    TM_KERNEL_ONE_(name, bf16, __nv_bfloat16, bounds, trigger, PARAMS, ARGS)

/// `name_f32`, `name_f16`, `name_bf16` calling `name_impl<T> ARGS`.
#define TM_KERNEL(name, PARAMS, ARGS) TM_KERNEL_ALL_(name, , pdl_launch_dependents, PARAMS, ARGS)

/// As `TM_KERNEL`, with `__launch_bounds__(threads)`.
#define TM_KERNEL_BOUNDS(name, threads, PARAMS, ARGS) \
    TM_KERNEL_ALL_(name, __launch_bounds__(threads), pdl_launch_dependents, PARAMS, ARGS)

/// As `TM_KERNEL` / `TM_KERNEL_BOUNDS`, triggering the next grid first thing
/// (`tmk::pdl_launch_dependents_early`): for kernels whose decode-time grids are small.
#define TM_KERNEL_EARLY(name, PARAMS, ARGS) TM_KERNEL_ALL_(name, , pdl_launch_dependents_early, PARAMS, ARGS)
#define TM_KERNEL_BOUNDS_EARLY(name, threads, PARAMS, ARGS) \
    TM_KERNEL_ALL_(name, __launch_bounds__(threads), pdl_launch_dependents_early, PARAMS, ARGS)
