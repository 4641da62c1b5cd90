// One-shot collectives between the GPUs of one process that have peer access (see ABI.md,
// "collectives.cu", and the launcher crates/tm-cuda/src/peer.rs).
//
// Every rank owns one device buffer (`bufs[rank]`), which the other ranks write into directly:
//   u32 header (byte 0): flags[BLOCKS][MAX_RANKS] (flags[b][src]: the last epoch block b of rank
//   `src` published here), epoch[BLOCKS] (this rank's call count per block), poison, claim;
//   data (byte DATA_OFFSET): slot[parity][src], `slot_bytes` each, parity = epoch & 1;
//   LL data (right after the slots): ll_slot[parity][src], `2 * ll_bytes` each (none when
//   `ll_bytes` is 0): `ll_bytes / 8` packs of 16 bytes (see "The low-latency protocol" below).
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
// that summed it; steps 0-3 are the same code, so the kernels share the epochs.
//
// The low-latency ("LL") protocol (`peer_all_reduce_ll`, `peer_all_reduce_add_rms_norm_ll`) is
// for messages of at most `ll_bytes` (the host, peer.rs, picks it per call for every all-reduce
// that fits, 64 KiB by default, unless TM_PEER_LL=0; every rank makes the same choice, as it
// depends only on the message's size). The flag travels with the data, so steps 2
// and 3 (a system fence, then a flag round trip after the data's) disappear: the payload is cut
// into packs of 8 bytes, and pack j goes to packs j of ll_slot[e & 1][r] of every peer as ONE
// 16-byte store of two 8-byte words {payload bytes 0-3, e} {payload bytes 4-7, e}
// (st.relaxed.sys.v2.u64). The PTX memory model treats a vector access as separate accesses of
// its elements, and an aligned 8-byte access as single-copy atomic, so each word arrives whole:
// a reader that sees the flag e in a word also sees that word's payload (no 16-byte atomicity is
// assumed; each word carries its own flag). The receiver polls its own packs
// (ld.relaxed.sys.v2.u64) until both flags equal e, with the same deadline, report, poison and
// abort words as step 3, and sums in rank order in f32 exactly as step 4 does (its own
// contribution comes from its input, bit for bit what it pushed), so the results are the other
// protocol's bits. The fused LL kernel lays out rows in whole packs (row r's pack j at
// r * ceil(cols / packsize) + j) so that no pack straddles two rows, i.e. two blocks.
// The epochs are the same counters: every kernel, of either protocol, increments every block's.
//
// Why double buffering suffices (both protocols, mixed in any order): rank r writes parity p
// (slot or LL slot) again only at epoch e + 2, in a kernel that started after its call e + 1
// had completed (stream order; the PDL wait at the top of every kernel comes before any
// store). Call e + 1 of r could complete only after it observed something every peer q wrote in
// call e + 1: the flags of every block (flag protocol), or, in the LL protocol, pack 0 of the
// message, which block 0 thread 0 of every kernel waits for from every peer (every message has
// at least one element, and pack 0 is always block 0's, thread 0's). Every rank writes anything
// of call e + 1 only after its call e completed (again: the PDL wait precedes every store), so
// q had finished reading parity p of call e (and of every earlier call) before r can write it
// again. The grid is always BLOCKS blocks, so every block's epoch counts every call.
//
// Why a stale LL pack is never taken for a new one: an LL flag is a 32-bit epoch, and a call
// only writes the packs its message needs, so a pack beyond a small message keeps an old flag.
// The packs of parity p hold epochs of parity p only and an LL call waits for the flag equal to
// its own epoch, so an old flag could match only 2^32 epochs later (hours of decoding). To rule
// that out, every call of every kernel refreshes LL_REFRESH packs of ll_slot[e & 1][r] in every
// peer with {0, e} (`ll_refresh`), at positions ((e >> 1) * LL_REFRESH + t) mod packs that its
// own message does not use (those it writes anyway): a sweep of the LL slot takes
// packs / LL_REFRESH calls of that parity, so every pack's flag is at most a few thousand epochs
// old, never 2^32. Refreshing is as safe as writing data of call e there (the argument above),
// and the receiver of call e does not read those packs; stores of one rank to one location land
// in program order across kernels (each kernel's stores complete before the next starts).
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
constexpr int LL_REFRESH = 32;                       // LL packs refreshed per call (one warp)

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

/// One unsuccessful poll of a wait for rank `src` in the call with epoch `e`: every 256th checks
/// the deadline (measured from `*start`, which 0 means "now": the first unsuccessful poll), the
/// host's abort word and the rank's poison word. Returns `false` when the caller must give up: it
/// has then reported the peer (first reporter of the rank, unless the wait was aborted) and
/// poisoned the rank, which makes every other waiting thread of the rank give up too.
__device__ __forceinline__ bool keep_waiting(u64* start, unsigned* spins, unsigned* own, unsigned* status, int src,
                                             unsigned e, unsigned tag, long long deadline_ns) {
    if (*start == 0) *start = globaltimer();
    if ((++*spins & 255u) != 0u) return true;
    const u64 waited = globaltimer() - *start;
    const bool aborted = reinterpret_cast<volatile unsigned*>(status)[ST_ABORT] != 0u ||
                         reinterpret_cast<volatile unsigned*>(own)[POISON] != 0u;
    if (!aborted && waited <= (u64)deadline_ns) return true;
    if (!aborted) report(own, status, src, e, tag, waited);
    reinterpret_cast<volatile unsigned*>(own)[POISON] = 1u;
    return false;
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
        u64 start = globaltimer();
        unsigned spins = 0;
        while ((int)(ld_acquire_sys(flag) - e) < 0) {
            if (!keep_waiting(&start, &spins, own, status, src, e, tag, deadline_ns)) {
                *s_fail = 1;
                break;
            }
        }
    }
    __syncthreads();
    return !*s_fail;
}

// ---- The low-latency protocol's pieces (see the header) ----

/// 8 bytes of `T`: the payload of one LL pack.
template <typename T>
struct __align__(8) Pack8 {
    static constexpr int N = 8 / sizeof(T);
    T v[N];
};

/// Whether `p` is 8-byte aligned.
__device__ __forceinline__ bool aligned8(const void* p) { return (reinterpret_cast<u64>(p) & 7ull) == 0; }

/// LL slot (parity, src) of `buf`: after the `2 * world` slots, `2 * ll_bytes` bytes each.
__device__ __forceinline__ const char* ll_slot(const char* buf, u64 parity, int world, int src, u64 slot_bytes,
                                               u64 ll_bytes) {
    return buf + DATA_OFFSET + 2ull * world * slot_bytes + (parity * world + src) * 2ull * ll_bytes;
}

/// The `avail` elements at `p` (all `N` when `avail >= N`) as a pack, zeros past `avail`; one
/// 8-byte load when the pack is whole and `vec` (then `p` is 8-byte aligned).
template <typename T>
__device__ __forceinline__ u64 load_pack(const T* p, long long avail, bool vec) {
    constexpr int N = Pack8<T>::N;
    Pack8<T> r;
    if (vec && avail >= N) {
        r = *reinterpret_cast<const Pack8<T>*>(p);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) r.v[k] = k < avail ? p[k] : tmk::from_float<T>(0.0f);
    }
    return *reinterpret_cast<const u64*>(&r);
}

/// Stores the first `avail` elements of `r` (all when `avail >= N`) at `p`, as `load_pack` loads.
template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack8<T>& r, long long avail, bool vec) {
    constexpr int N = Pack8<T>::N;
    if (vec && avail >= N) {
        *reinterpret_cast<Pack8<T>*>(p) = r;
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            if (k < avail) p[k] = r.v[k];
        }
    }
}

/// One LL pack into peer memory: two 8-byte words {payload bytes 0-3, e}, {payload bytes 4-7,
/// e} in one 16-byte store, each word single-copy atomic.
__device__ __forceinline__ void ll_store(const char* p, u64 payload, unsigned e) {
    const u64 lo = (payload & 0xffffffffull) | ((u64)e << 32);
    const u64 hi = (payload >> 32) | ((u64)e << 32);
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}

/// Reads the LL pack at `p` (this rank's memory): whether both of its words carry epoch `e`,
/// and the payload in `*payload` (valid only then).
__device__ __forceinline__ bool ll_load(const char* p, unsigned e, u64* payload) {
    u64 lo, hi;
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
    *payload = (lo & 0xffffffffull) | (hi << 32);
    return (unsigned)(lo >> 32) == e && (unsigned)(hi >> 32) == e;
}

/// Every kernel's refresh of the LL flags (see the header): warp 0 of block 0 writes {0, e} into
/// LL_REFRESH packs of ll_slot[e & 1][rank] of every peer, skipping the first `used` packs (this
/// call's LL message; 0 for the flag protocol). Nothing when there is no LL region.
__device__ void ll_refresh(char* const* bufs, int rank, int world, unsigned e, u64 slot_bytes, u64 ll_bytes,
                           long long used) {
    if (ll_bytes == 0 || blockIdx.x != 0 || threadIdx.x >= (unsigned)LL_REFRESH) return;
    const u64 packs = ll_bytes / 8;
    const long long j = (long long)(((u64)(e >> 1) * LL_REFRESH + threadIdx.x) % packs);
    if (j < used) return;
    for (int w = 0; w < world; ++w) {
        if (w != rank) ll_store(ll_slot(bufs[w], e & 1u, world, rank, slot_bytes, ll_bytes) + j * 16, 0, e);
    }
}

/// Step 1 of the LL protocol for one pack: `payload` into pack `pos` of ll_slot[parity][rank] of
/// every peer (the rank's own contribution never leaves it).
__device__ __forceinline__ void ll_push(u64 payload, long long pos, char* const* bufs, int rank, int world,
                                        unsigned e, u64 slot_bytes, u64 ll_bytes) {
    for (int w = 0; w < world; ++w) {
        if (w != rank) ll_store(ll_slot(bufs[w], e & 1u, world, rank, slot_bytes, ll_bytes) + pos * 16, payload, e);
    }
}

/// What an LL receiver needs besides the pack: its buffer, the geometry and the wait's state.
struct LlWait {
    unsigned* own;
    unsigned* status;
    int rank, world;
    unsigned e, tag;
    u64 slot_bytes, ll_bytes;
    long long deadline_ns;
    u64 start;  // 0 until the first unsuccessful poll
    unsigned spins;
};

/// Steps 3 and 4 of the LL protocol for one pack: waits until pack `pos` of every peer's LL slot
/// in this rank's memory carries the epoch, and sums the packs in rank order in f32 (rank
/// `rank`'s is `mine`, its own input) into `*out` — `reduce`'s arithmetic. `false` when the wait
/// gave up (`keep_waiting`): `*out` is then not set.
template <typename T>
__device__ __forceinline__ bool ll_sum(Pack8<T>* out, u64 mine, long long pos, LlWait& w) {
    constexpr int N = Pack8<T>::N;
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.0f;
    const char* own = reinterpret_cast<const char*>(w.own);
    for (int src = 0; src < w.world; ++src) {
        u64 v = mine;
        if (src != w.rank) {
            const char* p = ll_slot(own, w.e & 1u, w.world, src, w.slot_bytes, w.ll_bytes) + pos * 16;
            while (!ll_load(p, w.e, &v)) {
                if (!keep_waiting(&w.start, &w.spins, w.own, w.status, src, w.e, w.tag, w.deadline_ns)) return false;
            }
        }
        const Pack8<T> pk = *reinterpret_cast<const Pack8<T>*>(&v);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += tmk::to_float(pk.v[k]);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) out->v[k] = tmk::from_float<T>(acc[k]);
    return true;
}

template <typename T, bool GATHER>
__device__ void oneshot(const T* in, T* out, long long count, int rank, int world, long long slot_bytes,
                        long long ll_bytes, long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1,
                        u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
    __shared__ volatile unsigned s_epoch;
    __shared__ volatile int s_fail;
    char* bufs[MAX_RANKS] = {(char*)b0, (char*)b1, (char*)b2, (char*)b3, (char*)b4, (char*)b5, (char*)b6, (char*)b7};
    unsigned* own = reinterpret_cast<unsigned*>(bufs[rank]);
    if (!enter(own, &s_epoch, &s_fail)) return;
    const unsigned e = s_epoch;
    const u64 parity = e & 1u;
    const u64 sb = (u64)slot_bytes;
    ll_refresh(bufs, rank, world, e, sb, (u64)ll_bytes, 0);
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
                                     long long ll_bytes, long long deadline_ns, unsigned* status, unsigned tag, u64 b0,
                                     u64 b1, u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
    oneshot<T, false>(in, out, count, rank, world, slot_bytes, ll_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4,
                      b5, b6, b7);
}

template <typename T>
__device__ void peer_all_gather_impl(const T* in, T* out, long long count, int rank, int world, long long slot_bytes,
                                     long long ll_bytes, long long deadline_ns, unsigned* status, unsigned tag, u64 b0,
                                     u64 b1, u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
    oneshot<T, true>(in, out, count, rank, world, slot_bytes, ll_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4,
                     b5, b6, b7);
}

/// The all-reduce over the LL protocol (see the header): `count` elements, at most `ll_bytes` of
/// packs. Pack j (elements j * N ...) is thread j of the grid's (grid-stride), in both loops, so
/// with `in == out` a thread reads its own input again before it overwrites it. A thread that
/// gives up writes none of its packs; the others' are written (a rank whose peer never arrives
/// writes nothing, as no pack arrives).
template <typename T>
__device__ void peer_all_reduce_ll_impl(const T* in, T* out, long long count, int rank, int world,
                                        long long slot_bytes, long long ll_bytes, long long deadline_ns,
                                        unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3, u64 b4, u64 b5,
                                        u64 b6, u64 b7) {
    __shared__ volatile unsigned s_epoch;
    __shared__ volatile int s_fail;
    char* bufs[MAX_RANKS] = {(char*)b0, (char*)b1, (char*)b2, (char*)b3, (char*)b4, (char*)b5, (char*)b6, (char*)b7};
    unsigned* own = reinterpret_cast<unsigned*>(bufs[rank]);
    if (!enter(own, &s_epoch, &s_fail)) return;
    const unsigned e = s_epoch;
    const u64 sb = (u64)slot_bytes, lb = (u64)ll_bytes;
    constexpr int N = Pack8<T>::N;
    const long long packs = (count + N - 1) / N;
    const bool vec = aligned8(in) && aligned8(out);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = first; j < packs; j += stride) {
        ll_push(load_pack(in + j * N, count - j * N, vec), j, bufs, rank, world, e, sb, lb);
    }
    ll_refresh(bufs, rank, world, e, sb, lb, packs);
    LlWait w{own, status, rank, world, e, tag, sb, lb, deadline_ns, 0, 0};
    for (long long j = first; j < packs; j += stride) {
        const long long avail = count - j * N;
        Pack8<T> o;
        if (!ll_sum<T>(&o, load_pack(in + j * N, avail, vec), j, w)) return;
        store_pack(out + j * N, o, avail, vec);
    }
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
                                                  int rank, int world, long long slot_bytes, long long ll_bytes,
                                                  long long deadline_ns, unsigned* status, unsigned tag, u64 b0,
                                                  u64 b1, u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7) {
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
    ll_refresh(bufs, rank, world, e, sb, (u64)ll_bytes, 0);
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

/// `peer_all_reduce_add_rms_norm` over the LL protocol (see the header): the rows in whole
/// packs (row r's pack j at LL position r * ceil(cols / N) + j, at most `ll_bytes / 8` packs in
/// all), striped like the flag protocol's (block b: rows b, b + BLOCKS, ...; in a row, pack j is
/// thread j's, in both loops). Each row is summed into `x`, then — after a barrier that also
/// tells the block whether any of its threads gave up (then it returns, having written at most
/// part of that row's sums in `x`, never `residual` or `out`) — normalized by `norm_row`, as the
/// flag protocol's kernel does, so the two give the same bits.
template <typename T>
__device__ void peer_all_reduce_add_rms_norm_ll_impl(T* x, T* residual, T* out, const T* w, float eps, int rows,
                                                     int cols, int rank, int world, long long slot_bytes,
                                                     long long ll_bytes, long long deadline_ns, unsigned* status,
                                                     unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3, u64 b4, u64 b5,
                                                     u64 b6, u64 b7) {
    __shared__ volatile unsigned s_epoch;
    __shared__ volatile int s_fail;
    char* bufs[MAX_RANKS] = {(char*)b0, (char*)b1, (char*)b2, (char*)b3, (char*)b4, (char*)b5, (char*)b6, (char*)b7};
    unsigned* own = reinterpret_cast<unsigned*>(bufs[rank]);
    if (!enter(own, &s_epoch, &s_fail)) return;
    const unsigned e = s_epoch;
    const u64 sb = (u64)slot_bytes, lb = (u64)ll_bytes;
    constexpr int N = Pack8<T>::N;
    const int row_packs = (cols + N - 1) / N;
    const bool vec = aligned8(x) && cols % N == 0;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* in = x + (tmk::i64)row * cols;
        for (int j = threadIdx.x; j < row_packs; j += blockDim.x) {
            ll_push(load_pack(in + j * N, cols - j * N, vec), (long long)row * row_packs + j, bufs, rank, world, e,
                    sb, lb);
        }
    }
    ll_refresh(bufs, rank, world, e, sb, lb, (long long)rows * row_packs);
    LlWait wait{own, status, rank, world, e, tag, sb, lb, deadline_ns, 0, 0};
    bool ok = true;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const tmk::i64 off = (tmk::i64)row * cols;
        for (int j = threadIdx.x; ok && j < row_packs; j += blockDim.x) {
            const long long avail = cols - j * N;
            Pack8<T> o;
            ok = ll_sum<T>(&o, load_pack(x + off + j * N, avail, vec), (long long)row * row_packs + j, wait);
            if (ok) store_pack(x + off + j * N, o, avail, vec);
        }
        // The row is complete in `x` for the whole block, or some thread gave up.
        if (__syncthreads_or(!ok)) return;
        norm_row<T, true>(out + off, residual + off, x + off, w, eps, cols);
    }
}

}  // namespace tmc

using tmc::peer_all_gather_impl;
using tmc::peer_all_reduce_add_rms_norm_impl;
using tmc::peer_all_reduce_add_rms_norm_ll_impl;
using tmc::peer_all_reduce_impl;
using tmc::peer_all_reduce_ll_impl;
using tmk::u64;

#define TMC_PARAMS                                                                                               \
    (const T* in, T* out, long long count, int rank, int world, long long slot_bytes, long long ll_bytes,        \
     long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, \
     u64 b7)
#define TMC_ARGS \
    (in, out, count, rank, world, slot_bytes, ll_bytes, deadline_ns, status, tag, b0, b1, b2, b3, b4, b5, b6, b7)
#define TMC_NORM_PARAMS                                                                                          \
    (T * x, T* residual, T* out, const T* w, float eps, int rows, int cols, int rank, int world,                 \
     long long slot_bytes, long long ll_bytes, long long deadline_ns, unsigned* status, unsigned tag, u64 b0, u64 b1, \
     u64 b2, u64 b3, u64 b4, u64 b5, u64 b6, u64 b7)
#define TMC_NORM_ARGS                                                                                            \
    (x, residual, out, w, eps, rows, cols, rank, world, slot_bytes, ll_bytes, deadline_ns, status, tag, b0, b1, b2, \
     b3, b4, b5, b6, b7)

TM_KERNEL_BOUNDS(peer_all_reduce, 256, TMC_PARAMS, TMC_ARGS)
TM_KERNEL_BOUNDS(peer_all_gather, 256, TMC_PARAMS, TMC_ARGS)
TM_KERNEL_BOUNDS(peer_all_reduce_add_rms_norm, NORM_MAX_THREADS, TMC_NORM_PARAMS, TMC_NORM_ARGS)
TM_KERNEL_BOUNDS(peer_all_reduce_ll, 256, TMC_PARAMS, TMC_ARGS)
TM_KERNEL_BOUNDS(peer_all_reduce_add_rms_norm_ll, NORM_MAX_THREADS, TMC_NORM_PARAMS, TMC_NORM_ARGS)
