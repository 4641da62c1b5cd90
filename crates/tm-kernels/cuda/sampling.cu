// Device sampling (see ABI.md, "sampling.cu", and tm-cuda/src/kernels/sampling.rs).
//
// `sample_T`: one 1024-thread block per row of `logits [n, vocab]` (T). Semantics follow
// tm-core's host sampler (`apply_penalties` + `sample_from_logits`):
//   1. scratch row (f32) = logits; the listed penalty tokens get the repetition penalty
//      (`l > 0 ? l / r : l * r`, when r != 1) and, when their output count c > 0 and a
//      presence/frequency penalty is set, `l -= presence + frequency * c` (f32, same roundings);
//   2. greedy rows (temperature == 0): argmax, the host's rule exactly (first index of the largest
//      value; NaNs never win, except that a NaN at index 0 gives 0);
//   3. otherwise v = l / temperature and m = max v. A non-finite m (+inf present, or no finite
//      value) falls back to the argmax. e = exp(v - m) (NaN -> 0).
//   4. Elements are ranked by R = (orderedbits(v) << 32) | (vocab - 1 - index): descending R is
//      the host's descending-logit order with ties broken by the lowest index, so every cut below
//      keeps an exact prefix of that order, like the host's (whose ties fall in unspecified order).
//      top-k: the k-th largest R by radix select (11-bit digits, shared-memory histograms).
//   5. When top-k <= CAP (4096) or top-p < 1: the top min(|K|, CAP) elements are compacted into
//      shared memory and bitonic-sorted; top-p (smallest prefix whose mass reaches top_p, masses
//      as exact 2^s fixed-point integers), min-p (p >= p_max * min_p on the f32 probabilities)
//      and the draw (inverse CDF in descending order, r = u * total) then run on the sorted list as
//      the host does. Only when the top-p prefix is longer than CAP does the row go on to 6, with
//      the top-p cut found by a 5-ary search over the value keys (exact fixed-point masses) and
//      resolved exactly on the <= CAP elements of the final bracket.
//   6. Otherwise the kept set {R >= threshold, p >= min-p threshold} is drawn from by inverse CDF
//      over exact fixed-point weights in a fixed thread-major order (same distribution as the
//      host, different token for the same u).
// Everything is deterministic: no floating-point atomics; integer atomics only count or claim
// slots whose contents are then sorted.
//
// `argmax_T`: one 1024-thread block per row, the host's argmax rule, reading the logits directly.
// `argmax_part_T` + `argmax_final_T`: the same split over blocks of `chunk` logits per row (large
// vocabularies at small batch: one block per row reads 256 KiB of f16 logits at 128k vocab).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "common.cuh"  // tmk::pdl_launch_dependents, tmk::pdl_wait

namespace tms {

typedef unsigned long long u64;

constexpr int NT = 1024;       // threads per block (the launcher's block size)
constexpr int NW = NT / 32;    // warps per block
constexpr int CAP = 4096;      // candidates sorted in shared memory
constexpr int PER = CAP / NT;  // sorted positions per thread
constexpr int BINS = 2048;     // radix histogram bins (11-bit digits)
constexpr unsigned NONE = 0xFFFFFFFFu;
constexpr unsigned FULL = 0xFFFFFFFFu;

// Must match `DeviceSampleParams` in tm-cuda/src/kernels/sampling.rs.
struct Params {
    double uniform;  // in [0, 1), drawn on the host from the row's Rng
    float temperature;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    unsigned top_k;
    unsigned greedy;
    unsigned penalty_offset;
    unsigned penalty_count;
};
static_assert(sizeof(Params) == 48, "Params layout");

struct Smem {
    u64 cand[CAP];
    unsigned hist[BINS];
    u64 buf64[NW];
    double buff[NW];
    unsigned bufu[NW];
    float bufv[NW];
    u64 b64[2];
    unsigned bu[4];
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ bool is_nan(float v) { return v != v; }

// Order-preserving map of a float to u32 (-0 < +0, as total_cmp); NaN -> 0.
__device__ __forceinline__ unsigned key_of(float v) {
    if (is_nan(v)) return 0u;
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float val_of(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// ---------------------------------------------------------------------------------------------
// Block primitives (blockDim.x == NT). Each ends with a barrier so its buffer can be reused.

template <class V> __device__ __forceinline__ V warp_incl_scan(V x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const V y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// Exclusive prefix sum in thread order; `total` gets the block's sum.
template <class V> __device__ V block_scan(V v, V* buf, V& total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const V incl = warp_incl_scan(v);
    V ex = __shfl_up_sync(FULL, incl, 1);
    if (lane == 0) ex = V(0);
    if (lane == 31) buf[w] = incl;
    __syncthreads();
    if (w == 0) buf[lane] = warp_incl_scan(buf[lane]);
    __syncthreads();
    const V before = w > 0 ? buf[w - 1] : V(0);
    total = buf[NW - 1];
    __syncthreads();
    return before + ex;
}

template <class V> __device__ V block_sum(V v, V* buf) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if (lane == 0) buf[w] = v;
    __syncthreads();
    V t = buf[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(FULL, t, o);
    __syncthreads();
    return t;
}

__device__ unsigned block_min(unsigned v, unsigned* buf) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL, v, o));
    if (lane == 0) buf[w] = v;
    __syncthreads();
    unsigned t = buf[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(FULL, t, o));
    __syncthreads();
    return t;
}

// Whether (av, ai) beats (bv, bi): larger value, then lower index; NONE never wins.
__device__ __forceinline__ bool better(float av, unsigned ai, float bv, unsigned bi) {
    return ai != NONE && (bi == NONE || av > bv || (av == bv && ai < bi));
}

// The warp's best (v, i) pair by `better`, in every lane.
__device__ __forceinline__ void warp_argmax(float& v, unsigned& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, v, o);
        const unsigned oi = __shfl_xor_sync(FULL, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

__device__ void block_argmax(float& v, unsigned& i, float* bufv, unsigned* bufi) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    warp_argmax(v, i);
    if (lane == 0) {
        bufv[w] = v;
        bufi[w] = i;
    }
    __syncthreads();
    v = bufv[lane];
    i = bufi[lane];
    warp_argmax(v, i);
    __syncthreads();
}

// Calls f(index, value, valid) for every element of the f32 row (16-byte aligned, padded to a
// multiple of 4) — for all 32 lanes of every warp, so f may use warp intrinsics. Thread t visits
// the float4 chunks t, t + NT, t + 2 NT, ... in that order (the "thread-major" order of the
// draw), four loads in flight.
template <class F> __device__ __forceinline__ void for_each(const float* row, int vocab, F f) {
    const int nq = (vocab + 3) >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int q0 = 0; q0 < nq; q0 += 4 * NT) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int q = q0 + u * NT + (int)threadIdx.x;
            v[u] = q < nq ? __ldcg(r4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = 4 * (q0 + u * NT + (int)threadIdx.x);
            f(i, v[u].x, i < vocab);
            f(i + 1, v[u].y, i + 1 < vocab);
            f(i + 2, v[u].z, i + 2 < vocab);
            f(i + 3, v[u].w, i + 3 < vocab);
        }
    }
}

// Rank of element i with value v: descending rank = descending value, then ascending index.
__device__ __forceinline__ u64 rank_of(int i, float v, int vocab) {
    return ((u64)key_of(v) << 32) | (u64)((unsigned)(vocab - 1) - (unsigned)i);
}

// The threshold R* such that exactly r elements of the row have rank >= R* (1 <= r).
// Digits of R from the top: key bits 63-53, 52-42, 41-32, then the index part's `low_bits` bits
// in chunks of 11. Stops at the first digit whose bin holds exactly the remaining count.
__device__ u64 radix_select(Smem& sm, const float* row, int vocab, unsigned r, int low_bits) {
    if (r >= (unsigned)vocab) return 0;
    const int lane = threadIdx.x & 31;
    const int levels = 3 + (low_bits + 10) / 11;
    u64 prefix = 0, mask = 0;
    unsigned rem = r;
    for (int l = 0; l < levels; ++l) {
        int sh, width;
        if (l < 3) {
            sh = l == 0 ? 53 : (l == 1 ? 42 : 32);
            width = l == 2 ? 10 : 11;
        } else {
            const int hb = low_bits - 11 * (l - 3);  // highest index-part bit still open, exclusive
            width = hb < 11 ? hb : 11;
            sh = hb - width;
        }
        const u64 dmask = (1ull << width) - 1ull;
        for (int b = threadIdx.x; b < BINS; b += NT) sm.hist[b] = 0;
        __syncthreads();
        for_each(row, vocab, [&](int i, float v, bool ok) {
            const u64 R = rank_of(i, v, vocab);
            const bool part = ok && (R & mask) == prefix;
            const unsigned d = part ? (unsigned)((R >> sh) & dmask) : NONE;
            const unsigned peers = __match_any_sync(FULL, d);
            if (part && __ffs(peers) - 1 == lane) atomicAdd(&sm.hist[d], (unsigned)__popc(peers));
        });
        __syncthreads();
        // Thread t holds bins BINS-1-2t (higher) and BINS-2-2t; prefix over threads = count above.
        const int bh = BINS - 1 - 2 * (int)threadIdx.x, bl = bh - 1;
        const unsigned ch = sm.hist[bh], cl = sm.hist[bl];
        unsigned total;
        const unsigned above = block_scan<unsigned>(ch + cl, sm.bufu, total);
        if (above < rem && above + ch >= rem) {
            sm.bu[0] = (unsigned)bh;
            sm.bu[1] = above;
            sm.bu[2] = ch;
        } else if (above + ch < rem && above + ch + cl >= rem) {
            sm.bu[0] = (unsigned)bl;
            sm.bu[1] = above + ch;
            sm.bu[2] = cl;
        }
        __syncthreads();
        const unsigned d = sm.bu[0], up = sm.bu[1], cnt = sm.bu[2];
        __syncthreads();
        prefix |= (u64)d << sh;
        mask |= dmask << sh;
        rem -= up;
        if (cnt == rem) break;
    }
    return prefix;
}

// Appends the rank of every element with take(i, v, R) to sm.cand (warp-aggregated slots);
// returns the count. The caller guarantees at most CAP are taken.
template <class F> __device__ unsigned compact(Smem& sm, const float* row, int vocab, F take) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) sm.bu[3] = 0;
    __syncthreads();
    for_each(row, vocab, [&](int i, float v, bool ok) {
        const u64 R = rank_of(i, v, vocab);
        const bool t = ok && take(i, v, R);
        const unsigned bal = __ballot_sync(FULL, t);
        if (bal) {
            const int leader = __ffs(bal) - 1;
            unsigned base = 0;
            if (lane == leader) base = atomicAdd(&sm.bu[3], (unsigned)__popc(bal));
            base = __shfl_sync(FULL, base, leader);
            const unsigned slot = base + __popc(bal & ((1u << lane) - 1u));
            if (t && slot < (unsigned)CAP) sm.cand[slot] = R;
        }
    });
    __syncthreads();
    const unsigned c = sm.bu[3];
    __syncthreads();
    return c < (unsigned)CAP ? c : (unsigned)CAP;
}

// Sorts sm.cand[0..count) descending (pads to a power of two with 0).
__device__ void sort_desc(Smem& sm, unsigned count) {
    unsigned p = 1;
    while (p < count) p <<= 1;
    for (unsigned i = count + threadIdx.x; i < p; i += NT) sm.cand[i] = 0;
    __syncthreads();
    for (unsigned k = 2; k <= p; k <<= 1) {
        for (unsigned j = k >> 1; j > 0; j >>= 1) {
            for (unsigned t = threadIdx.x; t < p / 2; t += NT) {
                const unsigned i = 2 * t - (t & (j - 1));  // t with a 0 inserted at bit log2(j)
                const unsigned l = i + j;
                const u64 x = sm.cand[i], y = sm.cand[l];
                if ((i & k) == 0 ? x < y : x > y) {
                    sm.cand[i] = y;
                    sm.cand[l] = x;
                }
            }
            __syncthreads();
        }
    }
}

// Smallest integer mass >= top_p * z, within [1, z].
__device__ __forceinline__ u64 mass_target(float top_p, u64 z) {
    const double t = ceil((double)top_p * (double)z);
    u64 r = t >= 18446744073709551615.0 ? z : (u64)t;
    if (r > z) r = z;
    if (r < 1) r = 1;
    return r;
}

template <class T> __device__ void sample_row(const T* __restrict__ logits, int vocab, const Params* __restrict__ params,
                                              const unsigned* __restrict__ ptok, const unsigned* __restrict__ pcnt,
                                              unsigned* __restrict__ out, float* scratch) {
    __shared__ Smem sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = blockIdx.x;
    const Params P = params[row];
    const T* lg = logits + (long long)row * vocab;
    float* s = scratch + (long long)row * ((vocab + 3) & ~3);
    const bool greedy = P.greedy != 0;
    const float temp = P.temperature;

    // 1. Scratch row, then penalties (the host list has each token once).
    for (int i = tid; i < vocab; i += NT) {
        const float v = to_f(lg[i]);
        s[i] = greedy ? v : __fdiv_rn(v, temp);
    }
    __syncthreads();
    const bool rep = P.repetition_penalty != 1.f;
    const bool pres = P.presence_penalty != 0.f || P.frequency_penalty != 0.f;
    for (unsigned j = tid; j < P.penalty_count; j += NT) {
        const unsigned t = ptok[P.penalty_offset + j];
        if (t >= (unsigned)vocab) continue;
        float v = to_f(lg[t]);
        if (rep) v = v > 0.f ? __fdiv_rn(v, P.repetition_penalty) : __fmul_rn(v, P.repetition_penalty);
        const unsigned c = pcnt[P.penalty_offset + j];
        if (pres && c > 0)
            v = __fsub_rn(v, __fadd_rn(P.presence_penalty, __fmul_rn(P.frequency_penalty, __uint2float_rn(c))));
        s[t] = greedy ? v : __fdiv_rn(v, temp);
    }
    __syncthreads();

    // 2./3. Max and argmax.
    float m = 0.f;
    unsigned am = NONE;
    for_each(s, vocab, [&](int i, float v, bool ok) {
        if (ok && !is_nan(v) && (am == NONE || v > m)) {
            m = v;
            am = (unsigned)i;
        }
    });
    block_argmax(m, am, sm.bufv, sm.bufu);
    const bool no_value = am == NONE;  // every value NaN
    if (no_value || is_nan(__ldcg(s))) am = 0;
    if (greedy || no_value || !isfinite(m)) {
        if (tid == 0) out[row] = am;
        return;
    }

    const unsigned V = (unsigned)vocab;
    const unsigned nk = (P.top_k > 0 && P.top_k < V) ? P.top_k : V;
    const bool topk = nk < V, topp = P.top_p < 1.f, minp = P.min_p > 0.f;
    const int low_bits = 32 - __clz((int)(V - 1));
    const int fshift = 62 - (32 - __clz((int)V));  // weights 2^fshift * e, e <= 1: sums < 2^62
    const float fscale = __uint_as_float((unsigned)(127 + fshift) << 23);
    const double inv_fscale = 1.0 / (double)fscale;
    auto expw = [&](float v) -> float { return is_nan(v) ? 0.f : expf(v - m); };
    auto fixw = [&](float e) -> u64 { return __float2ull_rn(e * fscale); };

    const u64 rk = topk ? radix_select(sm, s, vocab, nk, low_bits) : 0;
    u64 zfix = 0;  // sum of fixed-point weights over K (known when needed)
    bool have_z = false;
    u64 rthr = rk;  // the draw keeps rank >= rthr
    bool search_topp = false;
    unsigned key_c = 0;

    if ((topk && nk <= (unsigned)CAP) || topp) {
        // 5. The top c of K, sorted.
        const unsigned c = nk < (unsigned)CAP ? nk : (unsigned)CAP;
        const u64 rc = c == nk ? rk : radix_select(sm, s, vocab, c, low_bits);
        u64 zpart = 0;
        const bool need_z = c < nk;
        compact(sm, s, vocab, [&](int, float v, u64 R) {
            if (need_z && R >= rk) zpart += fixw(expw(v));
            return R >= rc;
        });
        if (need_z) {
            zfix = block_sum<u64>(zpart, sm.buf64);
            have_z = true;
        }
        sort_desc(sm, c);

        float e[PER];
        unsigned idx[PER];
        u64 w[PER];
        u64 wsum = 0;
        double esum = 0.0;
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const unsigned j = tid * PER + u;
            const u64 R = j < c ? sm.cand[j] : 0;
            idx[u] = (V - 1u) - (unsigned)(R & 0xFFFFFFFFull);
            e[u] = j < c ? expw(val_of((unsigned)(R >> 32))) : 0.f;
            w[u] = fixw(e[u]);
            wsum += w[u];
            esum += (double)e[u];
        }
        key_c = (unsigned)(sm.cand[c - 1] >> 32);
        double zd;
        if (c == nk) {
            zfix = block_sum<u64>(wsum, sm.buf64);
            have_z = true;
            zd = block_sum<double>(esum, sm.buff);
        } else {
            zd = (double)zfix * inv_fscale;
        }

        unsigned keep = c;  // positions [0, keep) survive top-p and min-p
        if (topp) {
            const u64 target = mass_target(P.top_p, zfix);
            u64 tot;
            u64 cum = block_scan<u64>(wsum, sm.buf64, tot);
            unsigned first = NONE;
#pragma unroll
            for (int u = 0; u < PER; ++u) {
                cum += w[u];
                const unsigned j = tid * PER + u;
                if (j < c && cum >= target && first == NONE) first = j;
            }
            first = block_min(first, sm.bufu);
            if (first != NONE) {
                keep = first + 1;
            } else if (c < nk) {
                search_topp = true;  // the top-p prefix is longer than CAP
            }
        }
        if (!search_topp) {
            float p[PER];
#pragma unroll
            for (int u = 0; u < PER; ++u) p[u] = __double2float_rn((double)e[u] / zd);
            if (minp) {
                const float thr = __fmul_rn(__double2float_rn(1.0 / zd), P.min_p);
                unsigned fail = NONE;
#pragma unroll
                for (int u = 0; u < PER; ++u) {
                    const unsigned j = tid * PER + u;
                    if (j < keep && p[u] < thr && fail == NONE) fail = j;
                }
                fail = block_min(fail, sm.bufu);
                if (fail < keep) keep = fail > 0 ? fail : 1;
            }
            // Draw: first position whose cumulative probability reaches u * total.
            double local = 0.0;
#pragma unroll
            for (int u = 0; u < PER; ++u)
                if (tid * PER + u < keep) local += (double)p[u];
            double total;
            double cum = block_scan<double>(local, sm.buff, total);
            const double r0 = P.uniform * total;
            unsigned pick = NONE;
#pragma unroll
            for (int u = 0; u < PER; ++u) {
                const unsigned j = tid * PER + u;
                if (j < keep) {
                    cum += (double)p[u];
                    if (cum >= r0 && pick == NONE) pick = j;
                }
            }
            pick = block_min(pick, sm.bufu);
            if (pick == NONE) pick = keep - 1;
            if (pick / PER == (unsigned)tid) {
#pragma unroll
                for (int u = 0; u < PER; ++u)
                    if (tid * PER + u == pick) out[row] = idx[u];
            }
            return;
        }
    }

    if (search_topp) {
        // The cut lies below every candidate: bracket keys [lo, hi) with F(lo) >= target > F(hi),
        // F(x) = fixed-point mass of K with key >= x, then resolve on <= CAP elements.
        const u64 target = mass_target(P.top_p, zfix);
        u64 lo = 0, hi = (u64)key_c + 1;
        u64 f_lo = zfix, f_hi = 0;
        unsigned n_lo = nk, n_hi = 0;
        bool hi_known = false;
        while (true) {
            if (hi_known && (n_lo - n_hi <= (unsigned)CAP || hi - lo <= 1)) break;
            u64 pts[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) pts[k] = hi_known ? lo + (hi - lo) * (k + 1) / 5 : lo + (hi - lo) * (k + 1) / 4;
            u64 fm[4] = {0, 0, 0, 0};
            unsigned cn[4] = {0, 0, 0, 0};
            for_each(s, vocab, [&](int i, float v, bool ok) {
                const u64 R = rank_of(i, v, vocab);
                if (ok && R >= rk) {
                    const u64 key = R >> 32;
                    const u64 wv = fixw(expw(v));
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        if (key >= pts[k]) {
                            fm[k] += wv;
                            cn[k] += 1;
                        }
                    }
                }
            });
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                fm[k] = block_sum<u64>(fm[k], sm.buf64);
                cn[k] = block_sum<unsigned>(cn[k], sm.bufu);
            }
            // Points ascend, F descends: lo = last point with F >= target, hi = first with F < target.
            u64 nlo = lo, nhi = hi, fnlo = f_lo, fnhi = f_hi;
            unsigned cnlo = n_lo, cnhi = n_hi;
            bool found_hi = false;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (fm[k] >= target) {
                    nlo = pts[k];
                    fnlo = fm[k];
                    cnlo = cn[k];
                } else if (!found_hi) {
                    found_hi = true;
                    nhi = pts[k];
                    fnhi = fm[k];
                    cnhi = cn[k];
                }
            }
            lo = nlo;
            f_lo = fnlo;
            n_lo = cnlo;
            hi = nhi;
            f_hi = fnhi;
            n_hi = cnhi;
            hi_known = true;  // on the first pass pts[3] == hi, and F(hi) < target there
        }
        if (n_lo - n_hi <= (unsigned)CAP) {
            const unsigned cnt = compact(sm, s, vocab, [&](int, float v, u64 R) {
                const u64 key = R >> 32;
                return R >= rk && key >= lo && key < hi;
            });
            sort_desc(sm, cnt);
            u64 w[PER], wsum = 0;
#pragma unroll
            for (int u = 0; u < PER; ++u) {
                const unsigned j = tid * PER + u;
                w[u] = j < cnt ? fixw(expw(val_of((unsigned)(sm.cand[j] >> 32)))) : 0;
                wsum += w[u];
            }
            u64 tot;
            u64 cum = f_hi + block_scan<u64>(wsum, sm.buf64, tot);
            unsigned first = NONE;
#pragma unroll
            for (int u = 0; u < PER; ++u) {
                cum += w[u];
                const unsigned j = tid * PER + u;
                if (j < cnt && cum >= target && first == NONE) first = j;
            }
            first = block_min(first, sm.bufu);
            if (first == NONE) first = cnt > 0 ? cnt - 1 : 0;  // unreachable: f_hi + all = f_lo >= target
            rthr = cnt > 0 ? sm.cand[first] : ((u64)lo << 32);
        } else {
            // One key value with more than CAP elements: keep the `need` lowest indices of it.
            const u64 wl = fixw(expw(val_of((unsigned)lo)));
            u64 need = wl > 0 ? (target - f_hi + wl - 1) / wl : 1;
            if (need > (u64)(n_lo - n_hi)) need = n_lo - n_hi;
            if (need < 1) need = 1;
            rthr = radix_select(sm, s, vocab, n_hi + (unsigned)need, low_bits);
        }
        if (rthr < rk) rthr = rk;
    }

    // 6. Draw over {rank >= rthr, p >= min-p threshold} in thread-major order.
    if (minp && !have_z) {
        u64 zpart = 0;
        for_each(s, vocab, [&](int i, float v, bool ok) {
            if (ok && rank_of(i, v, vocab) >= rk) zpart += fixw(expw(v));
        });
        zfix = block_sum<u64>(zpart, sm.buf64);
    }
    const double zd = (double)zfix * inv_fscale;
    const float thr = minp ? __fmul_rn(__double2float_rn(1.0 / zd), P.min_p) : 0.f;
    auto weight = [&](int i, float v, bool ok) -> u64 {
        if (!ok || rank_of(i, v, vocab) < rthr) return 0;
        const float e = expw(v);
        if (minp && __double2float_rn((double)e / zd) < thr) return 0;
        return fixw(e);
    };
    u64 mine = 0;
    for_each(s, vocab, [&](int i, float v, bool ok) { mine += weight(i, v, ok); });
    u64 total;
    const u64 before = block_scan<u64>(mine, sm.buf64, total);
    u64 target = (u64)(P.uniform * (double)total);
    if (total > 0 && target >= total) target = total - 1;
    if (tid == 0) {
        sm.bu[0] = NONE;
        sm.bu[1] = am;
    }
    __syncthreads();
    if (mine > 0 && before <= target && target - before < mine) {
        sm.bu[0] = (unsigned)tid;
        sm.b64[0] = target - before;
    }
    __syncthreads();
    const unsigned owner = sm.bu[0];
    if (owner != NONE && warp == 0) {
        // Walk the owner's chunks owner + NT * mm, 32 at a time, in the order of the sum above.
        const u64 local_target = sm.b64[0];
        const int nq = (vocab + 3) >> 2;
        const float4* r4 = reinterpret_cast<const float4*>(s);
        u64 base = 0;
        for (int m0 = 0; (long long)owner + (long long)NT * m0 < nq; m0 += 32) {
            const long long q = (long long)owner + (long long)NT * (m0 + lane);
            const bool qok = q < nq;
            const float4 v4 = qok ? __ldcg(r4 + q) : make_float4(0.f, 0.f, 0.f, 0.f);
            const int i0 = (int)(4 * q);
            u64 wv[4];
            wv[0] = qok ? weight(i0, v4.x, i0 < vocab) : 0;
            wv[1] = qok ? weight(i0 + 1, v4.y, i0 + 1 < vocab) : 0;
            wv[2] = qok ? weight(i0 + 2, v4.z, i0 + 2 < vocab) : 0;
            wv[3] = qok ? weight(i0 + 3, v4.w, i0 + 3 < vocab) : 0;
            const u64 ls = wv[0] + wv[1] + wv[2] + wv[3];
            const u64 incl = warp_incl_scan(ls);
            const unsigned bal = __ballot_sync(FULL, base + incl > local_target);
            if (bal) {
                if (lane == __ffs(bal) - 1) {
                    u64 run = base + incl - ls;
                    for (int k = 0; k < 4; ++k) {
                        run += wv[k];
                        if (run > local_target) {
                            sm.bu[1] = (unsigned)(i0 + k);
                            break;
                        }
                    }
                }
                break;
            }
            base += __shfl_sync(FULL, incl, 31);
        }
    }
    __syncthreads();
    if (tid == 0) out[row] = sm.bu[1];
}

// This thread's (value, index) of the host's argmax over logits [lo, hi) of row `lg`: NaNs
// skipped, a thread's indices visited in increasing order (so `>` keeps its first maximum); with
// (lg + lo) 16-byte aligned, 16 bytes of consecutive logits per load, four loads in flight.
template <class T>
__device__ void argmax_scan(const T* __restrict__ lg, int lo, int hi, float& m, unsigned& am) {
    auto take = [&](float v, int i) {
        if (!is_nan(v) && (am == NONE || v > m)) {
            m = v;
            am = (unsigned)i;
        }
    };
    constexpr int E = 16 / sizeof(T);
    int head = hi;  // elements from lo before the vector part
    if ((reinterpret_cast<unsigned long long>(lg + lo) & 15ull) == 0) {
        const int nv = (hi - lo) / E;
        const uint4* lv = reinterpret_cast<const uint4*>(lg + lo);
        for (int c0 = threadIdx.x; c0 < nv; c0 += 4 * NT) {
            uint4 u[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) u[k] = c0 + k * NT < nv ? __ldca(lv + c0 + k * NT) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (c0 + k * NT >= nv) break;
                const T* e = reinterpret_cast<const T*>(&u[k]);
#pragma unroll
                for (int j = 0; j < E; ++j) take(to_f(e[j]), lo + (c0 + k * NT) * E + j);
            }
        }
        head = lo;
        for (int i = lo + nv * E + threadIdx.x; i < hi; i += NT) take(to_f(lg[i]), i);
    }
    for (int i = lo + threadIdx.x; i < head; i += NT) take(to_f(lg[i]), i);
}

template <class T> __device__ void argmax_row(const T* __restrict__ logits, int vocab, unsigned* __restrict__ out) {
    __shared__ float bufv[NW];
    __shared__ unsigned bufi[NW];
    const T* lg = logits + (long long)blockIdx.x * vocab;
    float m = 0.f;
    unsigned am = NONE;
    argmax_scan(lg, 0, vocab, m, am);
    block_argmax(m, am, bufv, bufi);
    if (threadIdx.x == 0) out[blockIdx.x] = (am == NONE || is_nan(to_f(lg[0]))) ? 0u : am;
}

// Split argmax for large vocabularies (`argmax_part_T` then `argmax_final_T`): block (p, r) takes
// logits [p * chunk, min(vocab, (p + 1) * chunk)) of row r and writes its (value, index) to
// parts[r * gridDim.x + p] (index NONE when it saw only NaNs); one warp per row then picks the
// best of the row's `nparts` pairs by the same rule (larger value, then lower index), which is
// the host's argmax: the first index of the largest non-NaN value, 0 when logit 0 is NaN.
template <class T>
__device__ void argmax_part_row(const T* __restrict__ logits, int vocab, int chunk, float2* __restrict__ parts) {
    __shared__ float bufv[NW];
    __shared__ unsigned bufi[NW];
    const T* lg = logits + (long long)blockIdx.y * vocab;
    const int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    float m = 0.f;
    unsigned am = NONE;
    argmax_scan(lg, lo, hi, m, am);
    block_argmax(m, am, bufv, bufi);
    if (threadIdx.x == 0) parts[(long long)blockIdx.y * gridDim.x + blockIdx.x] = make_float2(m, __uint_as_float(am));
}

template <class T>
__device__ void argmax_final_row(const T* __restrict__ logits, int vocab, const float2* __restrict__ parts, int nparts,
                                 unsigned* __restrict__ out) {
    const int row = blockIdx.x, lane = threadIdx.x & 31;
    float v = 0.f;
    unsigned i = NONE;
    for (int p = lane; p < nparts; p += 32) {
        const float2 q = __ldcg(parts + (long long)row * nparts + p);  // coherent: never above the wait
        const unsigned qi = __float_as_uint(q.y);
        if (better(q.x, qi, v, i)) {
            v = q.x;
            i = qi;
        }
    }
    warp_argmax(v, i);
    if (lane == 0) out[row] = (i == NONE || is_nan(to_f(__ldcg(logits + (long long)row * vocab)))) ? 0u : i;
}

}  // namespace tms

#define TMS_KERNELS(SUF, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(tms::NT, 1)                                                     \
        sample_##SUF(const T* __restrict__ logits, int vocab, const tms::Params* __restrict__ params,            \
                     const unsigned* __restrict__ penalty_tokens, const unsigned* __restrict__ penalty_counts,   \
                     unsigned* __restrict__ out, float* scratch) {                                               \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tms::sample_row<T>(logits, vocab, params, penalty_tokens, penalty_counts, out, scratch);                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(tms::NT, 1)                                                     \
        argmax_##SUF(const T* __restrict__ logits, int vocab, unsigned* __restrict__ out) {                      \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tms::argmax_row<T>(logits, vocab, out);                                                                  \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(tms::NT, 1)                                                     \
        argmax_part_##SUF(const T* __restrict__ logits, int vocab, int chunk, float2* __restrict__ parts) {      \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tms::argmax_part_row<T>(logits, vocab, chunk, parts);                                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32, 1)                                                          \
        argmax_final_##SUF(const T* __restrict__ logits, int vocab, const float2* __restrict__ parts, int nparts, \
                           unsigned* __restrict__ out) {                                                         \
        tmk::pdl_launch_dependents();                                                                            \
        tmk::pdl_wait();                                                                                         \
        tms::argmax_final_row<T>(logits, vocab, parts, nparts, out);                                             \
    }

TMS_KERNELS(f32, float)
TMS_KERNELS(f16, __half)
TMS_KERNELS(bf16, __nv_bfloat16)
