// One-shot collectives between the GPUs of one process that have peer access (see ABI.md,
// "collectives.cu", and the launcher crates/tm-cuda/src/peer.rs).
//
// Every rank owns one device buffer (`bufs[rank]`), which the other ranks write into directly:
//   u32 header (byte 0): flags[BLOCKS][MAX_RANKS] (flags[b][src]: the last epoch block b of rank
//   `src` published here), epoch[BLOCKS] (this rank's call count per block), poison, claim;
//   data (byte DATA_OFFSET): slot[parity][src], `slot_bytes` each, parity = epoch & 1.
// Block b of rank r, in one call with epoch e (its own counter + 1, kept on the device so that a
// CUDA graph replays correctly):
//   1. pushes its stripe of the input into slot[e & 1][r] of every rank (peer stores);
//   2. fences (system scope) and publishes e in flags[b][r] of every rank (st.release.sys);
//   3. waits until flags[b][src] >= e for every src (ld.acquire.sys on its own memory), at most
//      `deadline_ns` (%globaltimer); on expiry it reports (rank's status words, host-mapped),
//      poisons the rank (every later call returns at once) and returns;
//   4. sums its stripe of every slot in rank order in f32 (all ranks get identical bits) into
//      `out` (all-reduce), or copies slot w to `out + w * count` (all-gather).
// The fused all-reduce + residual add + RMSNorm (`peer_all_reduce_add_rms_norm`) stripes by rows
// instead (block b: rows b, b + BLOCKS, ...) so that step 4 can finish each row's norm in the block
// that summed it; steps 0-3 are the same code, so the three kernels share the epochs.
// Why double buffering suffices: rank r writes slot parity p again only at epoch e + 2, after
// every rank published e + 1, which each did only after its whole call e (stream order) had
// finished reading. The grid is always BLOCKS blocks, so every block's epoch counts every call.
#include "common.cuh"
#include "norm.cuh"

namespace tmc {

using tmk::u64;

constexpr int MAX_RANKS = 8;
constexpr int BLOCKS = 16;
constexpr int FLAGS = 0;                             // u32 index of flags[0][0]
constexpr int EPOCHS = FLAGS + BLOCKS * MAX_RANKS;   // u32 index of epoch[0]
constexpr int POISON = EPOCHS + BLOCKS;              // nonzero: a call of this rank gave up
constexpr int CLAIM = POISON + 1;                    // first reporter of this rank
constexpr u64 DATA_OFFSET = 4096;                    // bytes

// Status words (host-mapped, one block per rank).
constexpr int ST_STATE = 0;  // 0: fine; 1: a peer did not arrive (the fields below are valid)
constexpr int ST_PEER = 1;
constexpr int ST_EPOCH = 2;
constexpr int ST_TAG = 3;
constexpr int ST_BLOCK = 4;
constexpr int ST_WAITED_US = 5;
constexpr int ST_ABORT = 8;  // set by the host: give up waiting at once

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/// One element of `T` with `Vec16`'s interface (the unaligned path).
template <typename T>
struct Pack1 {
    static constexpr int N = 1;
    T v[1];
};

/// A load that bypasses L1 (the data was written by another GPU).
template <typename P>
__device__ __forceinline__ P load_cg(const P* p) {
    if constexpr (sizeof(P) == 16) {
        const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
        return *reinterpret_cast<const P*>(&u);
    } else if constexpr (sizeof(P) == 4) {
        const unsigned u = __ldcg(reinterpret_cast<const unsigned*>(p));
        return *reinterpret_cast<const P*>(&u);
    } else {
        const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
        return *reinterpret_cast<const P*>(&u);
    }
}

__device__ __forceinline__ const char* slot(const char* buf, u64 parity, int world, int src, u64 slot_bytes) {
    return buf + DATA_OFFSET + (parity * world + src) * slot_bytes;
}

/// Step 1: this block's stripe of `in` (`n` packs) into slot[parity][rank] of every rank.
template <typename T, typename P>
__device__ void push(const T* in, long long n, char* const* bufs, int rank, int world, u64 parity, u64 slot_bytes) {
    const P* src = reinterpret_cast<const P*>(in);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const P v = src[i];
        for (int w = 0; w < world; ++w) {
            P* dst = reinterpret_cast<P*>(const_cast<char*>(slot(bufs[w], parity, world, rank, slot_bytes)));
            dst[i] = v;
        }
    }
}

/// Step 4 of the all-reduce: `out[i] = sum over w of slot[parity][w][i]`, in rank order, in f32.
template <typename T, typename P>
__device__ void reduce(T* out, long long n, const char* own, int world, u64 parity, u64 slot_bytes) {
    P* dst = reinterpret_cast<P*>(out);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float acc[P::N];
#pragma unroll
        for (int k = 0; k < P::N; ++k) acc[k] = 0.0f;
        for (int w = 0; w < world; ++w) {
            const P v = load_cg(reinterpret_cast<const P*>(slot(own, parity, world, w, slot_bytes)) + i);
#pragma unroll
            for (int k = 0; k < P::N; ++k) acc[k] += tmk::to_float(v.v[k]);
        }
        P o;
#pragma unroll
        for (int k = 0; k < P::N; ++k) o.v[k] = tmk::from_float<T>(acc[k]);
        dst[i] = o;
    }
}

/// Step 4 of the all-gather: `out[w * n + i] = slot[parity][w][i]`.
template <typename T, typename P>
__device__ void gather(T* out, long long n, const char* own, int world, u64 parity, u64 slot_bytes) {
    P* dst = reinterpret_cast<P*>(out);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        for (int w = 0; w < world; ++w) {
            dst[(long long)w * n + i] = load_cg(reinterpret_cast<const P*>(slot(own, parity, world, w, slot_bytes)) + i);
        }
    }
}

/// Writes the timeout report into the rank's host-mapped status words (first reporter only).
__device__ void report(unsigned* own, volatile unsigned* status, int peer, unsigned epoch, unsigned tag, u64 waited_ns) {
    if (atomicCAS(own + CLAIM, 0u, 1u) != 0u) return;
    status[ST_PEER] = (unsigned)peer;
    status[ST_EPOCH] = epoch;
    status[ST_TAG] = tag;
    status[ST_BLOCK] = blockIdx.x;
    const u64 us = waited_ns / 1000ull;
    status[ST_WAITED_US] = us > 0xffffffffull ? 0xffffffffu : (unsigned)us;
    __threadfence_system();
    status[ST_STATE] = 1u;
    __threadfence_system();
}

/// Step 0 for block `blockIdx.x`: its epoch for this call, its counter + 1 (stored back), into
/// `*s_epoch`. Every thread of the block calls it; it returns, to every thread, `false` when the
/// rank is poisoned (the call then returns at once).
__device__ bool enter(unsigned* own, volatile unsigned* s_epoch, volatile int* s_fail) {
    if (threadIdx.x == 0) {
        *s_fail = *reinterpret_cast<volatile unsigned*>(own + POISON) != 0u;
        const unsigned e = own[EPOCHS + blockIdx.x] + 1u;
        own[EPOCHS + blockIdx.x] = e;
        *s_epoch = e;
    }
    __syncthreads();
    return !*s_fail;
}

/// Steps 2 and 3 for block `blockIdx.x` with epoch `e`, after the block's pushes: fence, publish
/// `e` in every rank's flag word, wait for every rank's (deadline, abort, report, poison). Every
/// thread of the block calls it; it returns, to every thread, whether the wait succeeded.
__device__ bool exchange(char* const* bufs, unsigned* own, int rank, int world, unsigned e, long long deadline_ns,
                         unsigned* status, unsigned tag, volatile int* s_fail) {
    const int b = blockIdx.x;
    __threadfence_system();
    __syncthreads();
    if ((int)threadIdx.x < world) {
        st_release_sys(reinterpret_cast<unsigned*>(bufs[threadIdx.x]) + FLAGS + b * MAX_RANKS + rank, e);
        const int src = threadIdx.x;
        const unsigned* flag = own + FLAGS + b * MAX_RANKS + src;
        const u64 start = globaltimer();
        unsigned spins = 0;
        while ((int)(ld_acquire_sys(flag) - e) < 0) {
            if ((++spins & 255u) != 0u) continue;
            const u64 waited = globaltimer() - start;
            const bool aborted = reinterpret_cast<volatile unsigned*>(status)[ST_ABORT] != 0u ||
                                 reinterpret_cast<volatile unsigned*>(own)[POISON] != 0u;
            if (aborted || waited > (u64)deadline_ns) {
                if (!aborted) report(own, status, src, e, tag, waited);
                reinterpret_cast<volatile unsigned*>(own)[POISON] = 1u;
                *s_fail = 1;
                break;
            }
        }
    }
    __syncthreads();
    return !*s_fail;
}

template <typename T, bool GATHER>
__device__ void oneshot(const T* in, T* out, long long count, int rank, int world, long long slot_bytes,
                        long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3, u64 b4,
                        u64 b5, u64 b6, u64 b7) {
    __shared__ volatile unsigned s_epoch;
    __shared__ volatile int s_fail;
    char* bufs[MAX_RANKS] = {(char*)b0, (char*)b1, (char*)b2, (char*)b3, (char*)b4, (char*)b5, (char*)b6, (char*)b7};
    unsigned* own = reinterpret_cast<unsigned*>(bufs[rank]);
    if (!enter(own, &s_epoch, &s_fail)) return;
    const unsigned e = s_epoch;
    const u64 parity = e & 1u;
    const u64 sb = (u64)slot_bytes;
    const bool vec = tmk::aligned16(in) && tmk::aligned16(out) && ((u64)count * sizeof(T)) % 16 == 0;
    if (vec) {
        push<T, tmk::Vec16<T>>(in, count / tmk::Vec16<T>::N, bufs, rank, world, parity, sb);
    } else {
        push<T, Pack1<T>>(in, count, bufs, rank, world, parity, sb);
    }
    if (!exchange(bufs, own, rank, world, e, deadline_ns, status, tag, &s_fail)) return;
    const char* mine = bufs[rank];
    if (GATHER) {
        if (vec) gather<T, tmk::Vec16<T>>(out, count / tmk::Vec16<T>::N, mine, world, parity, sb);
        else gather<T, Pack1<T>>(out, count, mine, world, parity, sb);
    } else {
        if (vec) reduce<T, tmk::Vec16<T>>(out, count / tmk::Vec16<T>::N, mine, world, parity, sb);
        else reduce<T, Pack1<T>>(out, count, mine, world, parity, sb);
    }
}

template <typename T>
__device__ void peer_all_reduce_impl(const T* in, T* out, long long count, int rank, int world, long long slot_bytes,
                                     long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2,
                                     u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
    oneshot<T, false>(in, out, count, rank, world, slot_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4, b5, b6, b7);
}

template <typename T>
__device__ void peer_all_gather_impl(const T* in, T* out, long long count, int rank, int world, long long slot_bytes,
                                     long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2,
                                     u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
    oneshot<T, true>(in, out, count, rank, world, slot_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4, b5, b6, b7);
}


/// Step 1 of the fused kernel for one row: `n` packs of `in` (the row) into slot[parity][rank] of
/// every rank at byte `off` (the row's), by the block's threads.
template <typename T, typename P>
__device__ void push_row(const T* in, int n, char* const* bufs, int rank, int world, u64 parity, u64 slot_bytes,
                         u64 off) {
    const P* src = reinterpret_cast<const P*>(in);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const P v = src[i];
        for (int w = 0; w < world; ++w) {
            P* dst = reinterpret_cast<P*>(const_cast<char*>(slot(bufs[w], parity, world, rank, slot_bytes)) + off);
            dst[i] = v;
        }
    }
}

/// Step 4 of the fused kernel for one row: `out[i] = sum over w of slot[parity][w][i]` (the row at
/// byte `off`), in rank order, in f32 — `reduce`'s arithmetic — by the block's threads.
template <typename T, typename P>
__device__ void reduce_row(T* out, int n, const char* own, int world, u64 parity, u64 slot_bytes, u64 off) {
    P* dst = reinterpret_cast<P*>(out);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float acc[P::N];
#pragma unroll
        for (int k = 0; k < P::N; ++k) acc[k] = 0.0f;
        for (int w = 0; w < world; ++w) {
            const P v = load_cg(reinterpret_cast<const P*>(slot(own, parity, world, w, slot_bytes) + off) + i);
#pragma unroll
            for (int k = 0; k < P::N; ++k) acc[k] += tmk::to_float(v.v[k]);
        }
        P o;
#pragma unroll
        for (int k = 0; k < P::N; ++k) o.v[k] = tmk::from_float<T>(acc[k]);
        dst[i] = o;
    }
}

/// The all-reduce of `x: [rows, cols]` fused with the residual add and RMSNorm that follow it:
/// `x = sum over ranks of x` (as `peer_all_reduce`), then, as `add_rms_norm` with the same block
/// width, `residual += x` and `out = rms_norm(residual) * w`. Block b handles rows b, b + BLOCKS,
/// ...: it pushes them, exchanges flags like every collective (so the epochs stay in step with the
/// other kernels), then sums each row into `x` (its own input, which no peer reads) and normalizes
/// it with `norm_row` — the code `add_rms_norm` runs — so every rank gets the separate kernels'
/// bits.
template <typename T>
__device__ void peer_all_reduce_add_rms_norm_impl(T* x, T* residual, T* out, const T* w, float eps, int rows, int cols,
                                                  int rank, int world, long long slot_bytes, long long deadline_ns,
                                                  unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3,
                                                  u64 b4, u64 b5, u64 b6, u64 b7) {
    // The TM_KERNEL wrapper has triggered the next kernel and waited for the previous one (PDL),
    // so `x` is the o_proj/down_proj output and the epochs are the last collective's.
    __shared__ volatile unsigned s_epoch;
    __shared__ volatile int s_fail;
    char* bufs[MAX_RANKS] = {(char*)b0, (char*)b1, (char*)b2, (char*)b3, (char*)b4, (char*)b5, (char*)b6, (char*)b7};
    unsigned* own = reinterpret_cast<unsigned*>(bufs[rank]);
    if (!enter(own, &s_epoch, &s_fail)) return;
    const unsigned e = s_epoch;
    const u64 parity = e & 1u;
    const u64 sb = (u64)slot_bytes;
    constexpr int N = tmk::Vec16<T>::N;
    const bool vec = tmk::aligned16(x) && cols % N == 0;
    const u64 row_bytes = (u64)cols * sizeof(T);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* in = x + (tmk::i64)row * cols;
        if (vec) push_row<T, tmk::Vec16<T>>(in, cols / N, bufs, rank, world, parity, sb, (u64)row * row_bytes);
        else push_row<T, Pack1<T>>(in, cols, bufs, rank, world, parity, sb, (u64)row * row_bytes);
    }
    if (!exchange(bufs, own, rank, world, e, deadline_ns, status, tag, &s_fail)) return;
    const char* mine = bufs[rank];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const tmk::i64 off = (tmk::i64)row * cols;
        if (vec) reduce_row<T, tmk::Vec16<T>>(x + off, cols / N, mine, world, parity, sb, (u64)row * row_bytes);
        else reduce_row<T, Pack1<T>>(x + off, cols, mine, world, parity, sb, (u64)row * row_bytes);
        // Every thread reads back only what it wrote itself when norm_row takes the same path,
        // but the barrier makes the row visible to the whole block whatever the paths.
        __syncthreads();
        norm_row<T, true>(out + off, residual + off, x + off, w, eps, cols);
    }
}

}  // namespace tmc

using tmc::peer_all_gather_impl;
using tmc::peer_all_reduce_add_rms_norm_impl;
using tmc::peer_all_reduce_impl;
using tmk::u64;

#define TMC_PARAMS                                                                                              \
    (const T* in, T* out, long long count, int rank, int world, long long slot_bytes, long long deadline_ns,    \
     unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7)
#define TMC_ARGS (in, out, count, rank, world, slot_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4, b5, b6, b7)

TM_KERNEL_BOUNDS(peer_all_reduce, 256, TMC_PARAMS, TMC_ARGS)
TM_KERNEL_BOUNDS(peer_all_gather, 256, TMC_PARAMS, TMC_ARGS)
TM_KERNEL_BOUNDS(peer_all_reduce_add_rms_norm, NORM_MAX_THREADS,
                 (T * x, T* residual, T* out, const T* w, float eps, int rows, int cols, int rank, int world,
                  long long slot_bytes, long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2,
                  u64 b3, u64 b4, u64 b5, u64 b6, u64 b7),
                 (x, residual, out, w, eps, rows, cols, rank, world, slot_bytes, deadline_ns, status, tag, b0, b1, b2,
                  b3, b4, b5, b6, b7))
