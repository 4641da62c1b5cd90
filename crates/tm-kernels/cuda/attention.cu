// Causal paged attention (prefill chunks, prefix-cache hits and decode alike).
//
// It must also compile under NVRTC, so it includes only the CUDA half/bfloat16/fp8 headers,
// common.cuh (for the programmatic-dependent-launch hooks) and rope.cuh (for
// rope_write_kv_e4m3); the rest of the helpers here are its own. The parameter lists are
// documented in ABI.md; the launch configuration lives in crates/tm-cuda/src/kernels/attention.rs
// (rope_write_kv_e4m3: crates/tm-cuda/src/kernels/elementwise.rs, shared with rope_write_kv).
//
// Kernels (T = f32/f16/bf16 suffix, D = head_dim):
// - attn_decode_d<D>_<T> (f16, bf16): split-K flash decoding for sequences with q_len == 1.
//   One CTA (4 warps) per (split, kv head x head sub-group, sequence); the CTA's query rows are
//   the (up to 16) query heads of one KV-head group, so every K/V tile is read once per group.
//   K/V tiles of 64 tokens go through shared memory (cp.async; double buffered for D <= 112, one
//   stage above so that several CTAs fit on an SM); warp w takes
//   tokens 16w..16w+15 of each tile with tensor-core mma (m16n8k16), keeps its own online
//   softmax, and the four warps are merged at the end. A sequence whose keys fit in one
//   partition is written straight to `out`; otherwise each split writes a normalised partial
//   output and its (max, sum) to scratch, and either the last split CTA of each (sequence, head
//   group) to finish merges them (fused combine: a per-group counter in `counters`, counted with
//   an acquire-release atomic, the last CTA merges and zeroes the counter again) or, with
//   `counters` null, attn_combine_<T> does in a second launch.
// - attn_prefill_d<D>_<T> (f16, bf16): flash-attention-2 for sequences with q_len > 1. One CTA
//   (4 warps x 32 rows for D <= 128, 4 x 16 above: BM = 128 or 64 rows) per (query tile, kv head
//   x head sub-group); rows are token-major over the group's query heads (row r = token r / GS,
//   head r % GS), so a tile covers BM / GS tokens. 64 keys per K/V tile (32 for D > 128).
//   K/V tiles through shared memory (cp.async, double buffered), online softmax, causal and
//   sliding-window masks, tensor-core mma. The tiles of all sequences are numbered flat (a warp
//   scan over q_len finds a CTA's sequence), the longest (last) tiles of a sequence first.
// - attn_combine_<T> (f16, bf16, f32): merges the split-K partials of attn_decode when it ran
//   without counters (the same merge, combine_splits, as the fused path).
// - attn_simple_<T> (f32, f16, bf16): CUDA-core reference path for any head_dim <= 256, one warp
//   per (query token, head), 8 keys per step. Used for f32 and as the fallback.
//
// Arithmetic is in f32; the tensor-core kernels round the softmax weights P to T before P.V
// (as flash-attention does). Output rows that belong to no sequence are not written.
//
// 8-bit KV cache (`_kv8` kernels, C = __nv_fp8_e4m3, scale 1.0): the same kernels, templated on
// the cache element C; codes are decoded exactly (every E4M3 value is an f16 and a bf16 value).
// The tensor-core kernels copy each K/V tile of fp8 codes into raw shared-memory stages with
// 16-byte cp.async (16 codes per copy). Decode keeps a ring of NS raw stages (NS - 1 tiles in
// flight, one barrier per tile) and decodes the codes straight into the mma B fragments
// (flash_step_kv8), so it moves half the bytes of a 16-bit cache with no extra shared-memory
// pass. Prefill converts the raw stage to T in registers into one T stage and issues the next
// tile's copies before computing on it, so the loads of tile t + 1 overlap the math of tile t.
// write_kv_e4m3_<T> converts K and V to E4M3 (round to nearest even, saturating at +-448,
// NaN -> 0x7f) as it writes them; see crates/tm-core/src/fp8.rs for the format.
// rope_write_kv_e4m3_<T> is elementwise.cu's rope_write_kv with that conversion into the caches.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common.cuh"  // tmk::pdl_launch_dependents, tmk::pdl_wait (every entry point starts with them)
#include "rope.cuh"    // tmk::rope_write_kv_tokens (rope_write_kv_e4m3 rotates exactly as elementwise.cu's rope)

namespace tm_attn {

#define TM_FULL_MASK 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

// The 8-bit KV-cache element.
typedef __nv_fp8_e4m3 kv8;
template <typename C> struct IsKv8 {
    static constexpr bool value = false;
};
template <> struct IsKv8<kv8> {
    static constexpr bool value = true;
};

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Two floats packed as a T pair in one 32-bit register: `lo` in the low half (lower column).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// Two E4M3 codes (`v`: element 0 in the low byte) as a T pair in one register, exactly.
template <typename T> __device__ __forceinline__ unsigned fp8x2_to(unsigned v);
template <> __device__ __forceinline__ unsigned fp8x2_to<__half>(unsigned v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
    return (unsigned)h.x | ((unsigned)h.y << 16);
}
template <> __device__ __forceinline__ unsigned fp8x2_to<__nv_bfloat16>(unsigned v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return pack2<__nv_bfloat16>(f.x, f.y);
}

// Sequence metadata, read once per CTA.
struct Seq {
    int q_start, q_len, ctx_len, bt_start;
};

__device__ __forceinline__ Seq load_seq(const int* q_start, const int* q_len, const int* ctx_len, const int* bt_start,
                                        int s) {
    Seq r;
    r.q_start = q_start[s];
    r.q_len = q_len[s];
    r.ctx_len = ctx_len[s];
    r.bt_start = bt_start[s];
    return r;
}

// Element offset of (key position `key`, kv head `kvh`, d = 0) in a KV cache.
// Block sizes are powers of two in practice: shift and mask then, instead of an integer division
// (on the H200 this alone took the fp8 decode kernel from 138 to 122 us at 256 x 768 keys).
__device__ __forceinline__ long long kv_offset(const unsigned* block_tables, int bt_start, int key, int block_size,
                                               int kv_heads, int kvh, int head_dim) {
    long long slot;
    if ((block_size & (block_size - 1)) == 0) {
        const int shift = __ffs(block_size) - 1;
        slot = ((long long)block_tables[bt_start + (key >> shift)] << shift) + (key & (block_size - 1));
    } else {
        slot = (long long)block_tables[bt_start + key / block_size] * block_size + key % block_size;
    }
    return (slot * kv_heads + kvh) * (long long)head_dim;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TM_ATTN_TC 1
#else
#define TM_ATTN_TC 0
#endif

#if TM_ATTN_TC
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy; `src_bytes` = 0 fills the 16 bytes with zeros (`src` must still
// be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c += a (16x16, row major) * b (16x8, "col": b0/b1 hold B^T row gid) in f32.
template <typename T> __device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// One warp's flash step on 16 * MT query rows x 16 * KP keys held in shared memory.
//
// sQ: the warp's rows (row stride LD = D + 8 elements; m-tile mt = rows 16mt..16mt+15); sK/sV:
// the step's keys, key i at row i (stride LD). Updates the running max `m` (log2 domain), the
// per-thread partial row sums `l` and the accumulators `o` (m16n8 C layout: o[mt][nt][0..1] row
// 16mt + gid, o[mt][nt][2..3] row 16mt + gid + 8, columns nt*8 + 2*tig + {0,1}).
// `mask(mt, row_half, key_index, score)` returns the (possibly -inf) masked score.
// ---------------------------------------------------------------------------------------------
template <typename T, int D, int MT, int KP, typename Mask>
__device__ __forceinline__ void flash_step(const T* sQ, const T* sK, const T* sV, float scale_log2, float m[MT][2],
                                           float l[MT][2], float o[MT][D / 8][4], Mask mask) {
    constexpr int LD = D + 8;
    const int lane = threadIdx.x & 31;
    float s[MT][2 * KP][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2 * KP; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
        }
    }
    // S = Q K^T
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(a[mt], sQ + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < KP; ++np) {
            unsigned b[4];
            ldmatrix_x4(b, sK + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
                mma16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        // scale, mask, running max
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int nt = 0; nt < 2 * KP; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = nt * 8 + 2 * (lane & 3) + (e & 1);
                const float v = mask(mt, e >> 1, key, s[mt][nt][e] * scale_log2);
                s[mt][nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(TM_FULL_MASK, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(TM_FULL_MASK, mx[i], 2));
            const float m_new = fmaxf(m[mt][i], mx[i]);
            m_use[i] = m_new == neg_inf() ? 0.f : m_new;
            alpha[i] = exp2f(m[mt][i] - m_use[i]);
            m[mt][i] = m_new;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < 2 * KP; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[mt][nt][e] - m_use[e >> 1]);
                s[mt][nt][e] = p;
                rs[e >> 1] += p;
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) l[mt][i] = l[mt][i] * alpha[i] + rs[i];
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            o[mt][nt][0] *= alpha[0];
            o[mt][nt][1] *= alpha[0];
            o[mt][nt][2] *= alpha[1];
            o[mt][nt][3] *= alpha[1];
        }
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < KP; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            unsigned b[4];
            ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
                mma16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// The rows of a decode CTA's first tile (keys k_begin .. k_end - 1, `tile` rows) that precede the
// sequence's newest key (ctx_len - 1, written by this step's previous kernel): the decode kernels
// copy these before their PDL wait.
__device__ __forceinline__ int rows_before_newest(int k_begin, int k_end, int ctx_len, int tile) {
    return max(0, min(tile, min(k_end, ctx_len - 1) - k_begin));
}

// Issues the cp.async copies of keys [k0 + first_row, k0 + rows) of one KV head into rows
// first_row .. rows - 1 of sK/sV (row stride LDS elements of C: D + 8 for a T cache, D for the raw
// stage of an fp8 cache); rows at or past `k_end` are zero-filled. 16 bytes per copy. All 128
// threads take part.
template <typename C, int D, int LDS>
__device__ __forceinline__ void load_kv_tile(C* sK, C* sV, const C* k_cache, const C* v_cache,
                                             const unsigned* block_tables, int bt_start, int block_size, int kv_heads,
                                             int kvh, int k0, int k_end, int rows, int first_row = 0) {
    constexpr int EPC = 16 / sizeof(C);  // elements per 16-byte chunk
    constexpr int CH = D / EPC;          // chunks per row
    for (int c = first_row * CH + threadIdx.x; c < rows * CH; c += 128) {
        const int r = c / CH;
        const int ch = c - r * CH;
        const int key = k0 + r;
        C* dk = sK + r * LDS + ch * EPC;
        C* dv = sV + r * LDS + ch * EPC;
        if (key < k_end) {
            const long long off = kv_offset(block_tables, bt_start, key, block_size, kv_heads, kvh, D) + ch * EPC;
            cp_async16(dk, k_cache + off, 16);
            cp_async16(dv, v_cache + off, 16);
        } else {
            cp_async16(dk, k_cache, 0);
            cp_async16(dv, v_cache, 0);
        }
    }
}

// Converts `rows` keys and values of fp8 codes (the raw stage, row stride D bytes) to T in sK/sV
// (row stride D + 8). 16 codes per thread and step: one 16-byte shared load, two 16-byte stores.
template <typename T, int D>
__device__ __forceinline__ void convert_kv_tile(T* sK, T* sV, const unsigned char* rK, const unsigned char* rV,
                                                int rows) {
    constexpr int LD = D + 8;
    constexpr int CH = D / 16;
    const int n = rows * CH;
    for (int c = threadIdx.x; c < 2 * n; c += 128) {
        const bool is_v = c >= n;
        const int cc = is_v ? c - n : c;
        const int r = cc / CH, ch = cc - r * CH;
        const uint4 raw = *reinterpret_cast<const uint4*>((is_v ? rV : rK) + r * D + ch * 16);
        uint4 lo, hi;
        lo.x = fp8x2_to<T>(raw.x);
        lo.y = fp8x2_to<T>(raw.x >> 16);
        lo.z = fp8x2_to<T>(raw.y);
        lo.w = fp8x2_to<T>(raw.y >> 16);
        hi.x = fp8x2_to<T>(raw.z);
        hi.y = fp8x2_to<T>(raw.z >> 16);
        hi.z = fp8x2_to<T>(raw.w);
        hi.w = fp8x2_to<T>(raw.w >> 16);
        uint4* dst = reinterpret_cast<uint4*>((is_v ? sV : sK) + r * LD + ch * 16);
        dst[0] = lo;
        dst[1] = hi;
    }
}

// Row stride in bytes of a raw fp8 K/V stage of the decode kernel: D, plus 16 when D / 16 is even,
// so that RS / 16 is odd and the fragment loads of flash_step_kv8 are free of bank conflicts
// (rows gid = 0..7 at word offsets RS / 4 * gid fall in 8 distinct groups of 4 banks).
template <int D> struct Kv8Row {
    static constexpr int RS = (D / 16) % 2 == 0 ? D + 16 : D;
};

// The head-dim column held by element `e` (0/1 of a pair) of column pair `2 * tig` of n-tile `nt`
// of flash_step_kv8's output accumulators: a thread's 32-bit V load covers 4 consecutive columns,
// which land in 4 consecutive n-tiles (the last D % 32 = 16 columns: 2 columns, 2 n-tiles).
template <int D> __device__ __forceinline__ int kv8_col(int nt, int c) {
    const int g = nt >> 2, i = nt & 3;
    return g < D / 32 ? g * 32 + 4 * c + i : g * 32 + 2 * c + i;
}

// flash_step for MT = KP = 1 (16 query rows x 16 keys) with K and V as E4M3 codes in shared
// memory (key i at byte row i, stride RS), decoded to f16 (for every T: see pair_to_f16) while
// building the mma B fragments, with no T copy of the tile:
// - S = Q K^T: in k-step ks the mma k indices 2*tig + {0, 1} stand for d = 16*ks + 4*tig + {0, 1}
//   and 2*tig + 8 + {0, 1} for d = 16*ks + 4*tig + {2, 3} (a dot product does not depend on the
//   order of its terms), so one 32-bit load brings a thread's four K codes; Q's A fragment is in
//   the same order (kv8_q_frag): held in registers (`qf`, QREG) or read from sQ per step.
// - O += P V: P's A fragment is the usual one (keys 2*tig + {0, 1} and 2*tig + 8 + {0, 1}); the
//   output columns are permuted (kv8_col) so that one 32-bit load per key row brings the codes of
//   4 n-tiles, paired across rows with byte permutes.
// A T pair (one register) as an f16 pair: the fp8 decode path multiplies in f16 for every T,
// since E4M3 codes convert to f16 in one instruction (to bf16 it takes four) and exactly, P in
// [0, 1] is finer in f16 than in bf16, and a bf16 query is exact in f16 within its range (it is
// clamped to +-65504 beyond; |q| that large does not occur after the projections).
template <typename T> __device__ __forceinline__ unsigned pair_to_f16(unsigned v);
template <> __device__ __forceinline__ unsigned pair_to_f16<__half>(unsigned v) { return v; }
template <> __device__ __forceinline__ unsigned pair_to_f16<__nv_bfloat16>(unsigned v) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
    return pack2<__half>(fminf(fmaxf(f.x, -65504.f), 65504.f), fminf(fmaxf(f.y, -65504.f), 65504.f));
}

// Q's A fragment for k-step `ks` of flash_step_kv8, as f16 pairs (see pair_to_f16).
template <typename T, int D>
__device__ __forceinline__ void kv8_q_frag(unsigned a[4], const T* sQ, int ks) {
    constexpr int LD = D + 8;
    const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const uint2 q0 = *reinterpret_cast<const uint2*>(sQ + gid * LD + ks * 16 + 4 * tig);
    const uint2 q1 = *reinterpret_cast<const uint2*>(sQ + (gid + 8) * LD + ks * 16 + 4 * tig);
    a[0] = pair_to_f16<T>(q0.x);
    a[1] = pair_to_f16<T>(q1.x);
    a[2] = pair_to_f16<T>(q0.y);
    a[3] = pair_to_f16<T>(q1.y);
}

template <typename T, int D, bool QREG, typename Mask>
__device__ __forceinline__ void flash_step_kv8(const T* sQ, const unsigned (&qf)[D / 16][4], const unsigned char* rK,
                                               const unsigned char* rV, float scale_log2, float m[2], float l[2],
                                               float o[D / 8][4], Mask mask) {
    constexpr int RS = Kv8Row<D>::RS;
    const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    // S = Q K^T
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        unsigned a[4];
        if constexpr (QREG) {
            a[0] = qf[ks][0];
            a[1] = qf[ks][1];
            a[2] = qf[ks][2];
            a[3] = qf[ks][3];
        } else {
            kv8_q_frag<T, D>(a, sQ, ks);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const unsigned k = *reinterpret_cast<const unsigned*>(rK + (nt * 8 + gid) * RS + ks * 16 + 4 * tig);
            mma16816<__half>(s[nt], a, fp8x2_to<__half>(k), fp8x2_to<__half>(k >> 16));
        }
    }
    // scale, mask, running max
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = nt * 8 + 2 * tig + (e & 1);
            const float v = mask(0, e >> 1, key, s[nt][e] * scale_log2);
            s[nt][e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(TM_FULL_MASK, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(TM_FULL_MASK, mx[i], 2));
        const float m_new = fmaxf(m[i], mx[i]);
        m_use[i] = m_new == neg_inf() ? 0.f : m_new;
        alpha[i] = exp2f(m[i] - m_use[i]);
        m[i] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = exp2f(s[nt][e] - m_use[e >> 1]);
            s[nt][e] = p;
            rs[e >> 1] += p;
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
    }
    // O += P V
    const unsigned a[4] = {pack2<__half>(s[0][0], s[0][1]), pack2<__half>(s[0][2], s[0][3]), pack2<__half>(s[1][0], s[1][1]),
                           pack2<__half>(s[1][2], s[1][3])};
    // this thread's B rows: keys 2*tig, 2*tig + 1 (b0) and 2*tig + 8, 2*tig + 9 (b1)
    const unsigned char* v0 = rV + 2 * tig * RS;
#pragma unroll
    for (int g = 0; g < D / 32; ++g) {
        const int off = g * 32 + 4 * gid;
        const unsigned x0 = *reinterpret_cast<const unsigned*>(v0 + off);
        const unsigned x1 = *reinterpret_cast<const unsigned*>(v0 + RS + off);
        const unsigned x2 = *reinterpret_cast<const unsigned*>(v0 + 8 * RS + off);
        const unsigned x3 = *reinterpret_cast<const unsigned*>(v0 + 9 * RS + off);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // byte i of the first row in the low byte, byte i of the second row above it
            const unsigned sel = i | ((4 + i) << 4);
            mma16816<__half>(o[4 * g + i], a, fp8x2_to<__half>(__byte_perm(x0, x1, sel)),
                        fp8x2_to<__half>(__byte_perm(x2, x3, sel)));
        }
    }
    if constexpr (D % 32 != 0) {
        // the last 16 columns: 2 codes per row and load, n-tiles D / 8 - 2 and D / 8 - 1
        constexpr int g = D / 32;
        const int off = g * 32 + 2 * gid;
        const unsigned x0 = *reinterpret_cast<const unsigned short*>(v0 + off);
        const unsigned x1 = *reinterpret_cast<const unsigned short*>(v0 + RS + off);
        const unsigned x2 = *reinterpret_cast<const unsigned short*>(v0 + 8 * RS + off);
        const unsigned x3 = *reinterpret_cast<const unsigned short*>(v0 + 9 * RS + off);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const unsigned sel = i | ((4 + i) << 4);
            mma16816<__half>(o[4 * g + i], a, fp8x2_to<__half>(__byte_perm(x0, x1, sel)),
                        fp8x2_to<__half>(__byte_perm(x2, x3, sel)));
        }
    }
}
#endif  // TM_ATTN_TC

// ---------------------------------------------------------------------------------------------
// Decode (q_len == 1), split-K.
// grid (num_splits, kv_heads * n_sub, num_seqs), block 128,
// dynamic smem (16 + 2 * ST * 64) * (D + 8) * sizeof(T); fp8 cache: 16 * (D + 8) * sizeof(T)
// + NS * 2 * 64 * RS (NS = DecodeCfg::NS8 raw stages, RS = Kv8Row::RS).
// ---------------------------------------------------------------------------------------------
// Tuning knob (the launcher mirrors it): largest head_dim whose K/V tiles are double buffered;
// above it one stage keeps the shared memory small enough for several CTAs per SM.
#ifndef TM_ATTN_DECODE_2STAGE_MAX_D
#define TM_ATTN_DECODE_2STAGE_MAX_D 112
#endif
// fp8 cache (the launcher mirrors it): raw K/V stages of the decode ring for D <= 128 (2 above, to
// stay within 99 KB of shared memory); at least 2, as the final merge reuses the ring.
#ifndef TM_ATTN_DECODE_KV8_STAGES
#define TM_ATTN_DECODE_KV8_STAGES 3
#endif
template <int D> struct DecodeCfg {
    static constexpr int BN = 64;  // keys per CTA tile (16 per warp)
    static constexpr int LD = D + 8;
    static constexpr int ST = D <= TM_ATTN_DECODE_2STAGE_MAX_D ? 2 : 1;  // K/V stages
    static constexpr int NS8 = D <= 128 ? TM_ATTN_DECODE_KV8_STAGES : 2;  // fp8: raw K/V stages
    static_assert(NS8 >= 2, "the merge needs 256 * D bytes of the raw ring");
};

// The split plan of one decode sequence, shared by attn_decode and attn_combine.
struct DecodeRange {
    int lo, end;  // keys [lo, end)
    int used;     // splits with work
    bool direct;  // one partition holds every key: the decode kernel writes `out` itself
};

__device__ __forceinline__ DecodeRange decode_range(int ctx_len, int window, int num_splits, int partition) {
    DecodeRange r;
    const int pos = ctx_len - 1;
    r.end = pos + 1;
    r.lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int n = r.end - r.lo;
    r.direct = n <= partition;
    r.used = r.direct ? 1 : min((n + partition - 1) / partition, num_splits);
    return r;
}

// The keys [k_begin, k_end) of split `split` of a decode sequence (split < r.used).
__device__ __forceinline__ void split_keys(const DecodeRange& r, int split, int partition, int& k_begin, int& k_end) {
    k_begin = r.lo + split * partition;
    k_end = split == r.used - 1 ? r.end : k_begin + partition;
}

// Most splits of one decode sequence (the launcher mirrors it as MAX_SPLITS and sizes the
// partials' scratch by it).
#define TM_ATTN_MAX_SPLITS 64

// Splits whose partials `combine_splits` loads at once in a decode kernel of head dim D: as many
// as its registers allow without lowering the kernel's occupancy (shared memory or the kernel's
// own body bound it first; ptxas -v for sm_90a, every decode kernel): 12 from D = 96 (one L2 round
// trip up to 768 keys in 64-key partitions), 4 for D = 64 and 80, 2 below. The register-resident
// merge costs one L2 round trip per chunk, where the shared-memory one before it took two (the
// (max, sum) pairs, then the partials) and two barriers in the tail that decode waits for: AWQ 8B
// batch-1 step on the H200 (9-10 splits) 1972.9-1985.5 us against 1990.6-1991.9 (alternated
// runs); with 8 splits per chunk (two trips) no gain; concurrency 64: 3305 against 3263 tok/s.
__host__ __device__ constexpr int combine_chunk(int D) { return D >= 96 ? 12 : D >= 64 ? 4 : 2; }

// Merges the split-K partials of query heads h0 .. h0 + rows - 1 of decode sequence `seq` (their
// first `used` splits) into row `q_row` of `out`: the partials' average weighted by
// sum_k * exp2(max_k - max). Each thread takes 4 consecutive elements of one head and loads, per
// chunk of CH splits (`combine_chunk`), every split's (max, sum) pair and its 4 partial elements
// at once, into registers: no shared memory, no barrier. Later chunks rescale what the earlier
// ones summed (as flash attention does); for used <= CH the sums are those of a one-pass merge.
// head_dim is a multiple of 4 (the partials are read as float4). The partials are read through L2
// (__ldcg): in the fused path other CTAs of the same grid wrote them. Shared by attn_combine (one
// head per CTA) and the last split CTA of a fused decode (every head of its group). Not inlined:
// inlined into the decode kernels it raised their register counts (e.g. 96 -> 123 for
// attn_decode_gqa) for code that runs once at the end.
template <typename T, int CH>
__device__ __noinline__ void combine_splits(T* out, const float* part_o, const float* part_ml, int seq, int h0,
                                            int rows, int heads, int head_dim, int num_splits, int used, int q_row) {
    const int q4 = head_dim / 4;
    for (int c = threadIdx.x; c < rows * q4; c += blockDim.x) {
        const int i = c / q4, d = 4 * (c - i * q4);
        const long long hs = ((long long)seq * heads + h0 + i) * num_splits;  // (head, split 0)
        const float2* ml = reinterpret_cast<const float2*>(part_ml) + hs;
        const float* src = part_o + hs * head_dim + d;
        float mu = neg_inf(), ll = 0.f;  // the running max (log2 domain) and sum of weights
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0; k0 < used; k0 += CH) {
            float2 p[CH];
            float4 v[CH];
#pragma unroll
            for (int k = 0; k < CH; ++k) {
                if (k0 + k < used) {
                    p[k] = __ldcg(ml + k0 + k);
                    v[k] = __ldcg(reinterpret_cast<const float4*>(src + (long long)(k0 + k) * head_dim));
                }
            }
            float mm = mu;
#pragma unroll
            for (int k = 0; k < CH; ++k)
                if (k0 + k < used) mm = fmaxf(mm, p[k].x);
            const float base = mm == neg_inf() ? 0.f : mm;
            // what earlier chunks summed, relative to the new max (nothing before the first)
            const float r = mu == neg_inf() ? 0.f : exp2f(mu - base);
            ll *= r;
            acc.x *= r, acc.y *= r, acc.z *= r, acc.w *= r;
#pragma unroll
            for (int k = 0; k < CH; ++k) {
                if (k0 + k < used) {
                    const float w = p[k].y * exp2f(p[k].x - base);
                    ll += w;
                    acc.x += w * v[k].x;
                    acc.y += w * v[k].y;
                    acc.z += w * v[k].z;
                    acc.w += w * v[k].w;
                }
            }
            mu = mm;
        }
        const float inv = ll > 0.f ? 1.f / ll : 0.f;
        T* dst = out + ((long long)q_row * heads + h0 + i) * head_dim + d;
        dst[0] = from_float<T>(acc.x * inv);
        dst[1] = from_float<T>(acc.y * inv);
        dst[2] = from_float<T>(acc.z * inv);
        dst[3] = from_float<T>(acc.w * inv);
    }
}

// The end of a split-K decode CTA of 4 warps with R query rows each: merges the warps' unnormalised
// rows (sO [4][R][D] floats), maxima s_m and partial sums s_l into rows i < rows (query head
// h0 + i): the output row itself when one partition holds every key (rg.direct), else the split's
// normalised partial and its (max, sum) in part_o / part_ml. Then, with `counters` (the fused
// combine), the split counts itself in counters[seq * gridDim.y + blockIdx.y] and the last split
// of the (sequence, head group) to finish merges all of them into `out` (`combine_splits`) and
// sets the counter back to 0 for the next launch; without (null), attn_combine merges them in a
// second launch. CH: the merge's splits per chunk. Every thread of the CTA calls it after the
// barrier that follows the writes of sO, s_m and s_l.
template <typename T, int D, int R, int CH = combine_chunk(D)>
__device__ __forceinline__ void decode_merge(float* sO, const float (*s_m)[R], const float (*s_l)[R],
                                             float (*s_f)[R], int rows, int h0, const DecodeRange& rg, int q_row,
                                             int seq, int heads, int num_splits, int split, T* out, float* part_o,
                                             float* part_ml, unsigned* counters) {
    __shared__ int s_last;
    const int tid = threadIdx.x;
    if (tid < R) {
        float mm = neg_inf();
        for (int w = 0; w < 4; ++w) mm = fmaxf(mm, s_m[w][tid]);
        const float mu = mm == neg_inf() ? 0.f : mm;
        float ll = 0.f;
        for (int w = 0; w < 4; ++w) ll += s_l[w][tid] * exp2f(s_m[w][tid] - mu);
        const float inv = ll > 0.f ? 1.f / ll : 0.f;
        for (int w = 0; w < 4; ++w) s_f[w][tid] = exp2f(s_m[w][tid] - mu) * inv;
        if (!rg.direct && tid < rows) {
            const long long idx = ((long long)seq * heads + h0 + tid) * num_splits + split;
            part_ml[2 * idx] = mm;
            part_ml[2 * idx + 1] = ll;
        }
    }
    __syncthreads();
    for (int c = tid; c < R * D; c += 128) {
        const int i = c / D, d = c - i * D;
        if (i >= rows) continue;
        const float v = sO[i * D + d] * s_f[0][i] + sO[(R + i) * D + d] * s_f[1][i] +
                        sO[(2 * R + i) * D + d] * s_f[2][i] + sO[(3 * R + i) * D + d] * s_f[3][i];
        const int h = h0 + i;
        if (rg.direct) {
            out[((long long)q_row * heads + h) * D + d] = from_float<T>(v);
        } else {
            part_o[(((long long)seq * heads + h) * num_splits + split) * D + d] = v;
        }
    }
    if (rg.direct || counters == nullptr) return;
    // The barrier orders every thread's partials before thread 0's count (and ends every read of
    // sO, which the merge below overwrites); the count is an acquire-release atomic at device
    // scope: release (cumulative through the barrier) publishes this CTA's partials, acquire makes
    // the earlier splits' visible to the last one, whose barrier below passes them on to its
    // threads. One atomic in one thread instead of a sequentially consistent fence in every
    // thread, an atomicAdd, an atomicExch and a second fence: AWQ 8B b1 replay on the H200
    // 1999.8-2006.6 us against 2011.8-2014.3 (four runs each).
    __syncthreads();
    if (tid == 0) {
        unsigned* counter = counters + ((unsigned)seq * gridDim.y + blockIdx.y);
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
        const bool last = before == (unsigned)(rg.used - 1);
        // every split has counted: leave the counter zero for the next launch (or graph replay);
        // no split of this launch touches it again, and the launch's end publishes the store
        if (last) asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(counter) : "memory");
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    combine_splits<T, CH>(out, part_o, part_ml, seq, h0, rows, heads, D, num_splits, rg.used, q_row);
}

template <typename T, typename C, int D, class Wait>
__device__ __forceinline__ void attn_decode(const T* __restrict__ q, const C* __restrict__ k_cache,
                                            const C* __restrict__ v_cache, T* __restrict__ out,
                                            float* __restrict__ part_o, float* __restrict__ part_ml,
                                            unsigned* __restrict__ counters, const int* q_start, const int* q_len,
                                            const int* ctx_len, const int* bt_start,
                                            const unsigned* __restrict__ block_tables, int heads, int kv_heads, int gs,
                                            int block_size, float scale_log2, int window, int num_splits,
                                            int partition, Wait wait) {
    // The CTA copies the keys of its first tile that precede the newest one before `wait`
    // (programmatic dependent launch: the previous kernel, q/k/v with RoPE, writes only the
    // newest key and Q; the older keys and the step's metadata were written before any of the
    // step's kernels could start), then Q and the newest key after it. The copies overlap the
    // previous kernel's end: AWQ 8B batch-1 decode on the H200, 1950-1957 us per step against
    // 1970-1975 with an f16 cache, 2047.5-2048.3 against 2069.5-2069.8 with fp8 (the gqa kernel;
    // scripts/gpu/q4_decode_chain.cu, session 17).
#if TM_ATTN_TC
    constexpr int BN = DecodeCfg<D>::BN;
    constexpr int LD = DecodeCfg<D>::LD;
    constexpr int CH = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    __shared__ float s_m[4][16], s_l[4][16], s_f[4][16];
    T* sQ = reinterpret_cast<T*>(attn_smem);
    constexpr bool KV8 = IsKv8<C>::value;
    constexpr int ST = DecodeCfg<D>::ST;  // T stages (T cache only)
    T* sK = sQ + 16 * LD;
    T* sV = sK + ST * BN * LD;  // directly after the K stages (the final merge spans both)
    // fp8 cache only: a ring of NS stages of raw codes right after Q, stage s = K [BN][RS] then V
    // [BN][RS] at raw + s * SB (no T stage; the final merge reuses the ring)
    constexpr int NS = DecodeCfg<D>::NS8;
    constexpr int RS = Kv8Row<D>::RS;
    constexpr int SB = 2 * BN * RS;
    unsigned char* raw = attn_smem + 16 * LD * sizeof(T);

    const int seq = blockIdx.z;
    const int split = blockIdx.x;
    if (q_len[seq] != 1) {
        wait();
        return;
    }
    const Seq sq = load_seq(q_start, q_len, ctx_len, bt_start, seq);
    const DecodeRange rg = decode_range(sq.ctx_len, window, num_splits, partition);
    if (split >= rg.used) {
        wait();
        return;
    }
    int k_begin, k_end;
    split_keys(rg, split, partition, k_begin, k_end);

    const int group = heads / kv_heads;
    const int n_sub = (group + gs - 1) / gs;
    const int kvh = blockIdx.y / n_sub;
    const int g0 = (blockIdx.y - kvh * n_sub) * gs;  // first group member of this CTA
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int ntiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;
    int pre_rows = 0;  // rows of the first tile copied before `wait`
    if (ntiles > 0) {
        pre_rows = rows_before_newest(k_begin, k_end, sq.ctx_len, BN);
        if constexpr (KV8)
            load_kv_tile<C, D, RS>(reinterpret_cast<C*>(raw), reinterpret_cast<C*>(raw + BN * RS), k_cache, v_cache,
                                   block_tables, sq.bt_start, block_size, kv_heads, kvh, k_begin, k_end, pre_rows);
        else
            load_kv_tile<C, D, LD>(sK, sV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                   k_begin, k_end, pre_rows);
    }
    wait();

    // Q rows: row i = group member g0 + i (query head kvh * group + g0 + i).
    for (int c = tid; c < 16 * CH; c += 128) {
        const int i = c / CH, ch = c - i * CH;
        const bool valid = i < gs && g0 + i < group;
        const T* src = valid ? q + ((long long)sq.q_start * heads + kvh * group + g0 + i) * D + ch * 8 : q;
        cp_async16(sQ + i * LD + ch * 8, src, valid ? 16 : 0);
    }
    if constexpr (KV8) {
        // Q is group 0; tiles 0 .. NS - 2 in flight, one commit group each
        cp_async_commit();
#pragma unroll
        for (int p = 0; p < NS - 1; ++p) {
            if (p < ntiles)
                load_kv_tile<C, D, RS>(reinterpret_cast<C*>(raw + p * SB), reinterpret_cast<C*>(raw + p * SB + BN * RS),
                                       k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                       k_begin + p * BN, k_end, BN, p == 0 ? pre_rows : 0);
            cp_async_commit();
        }
    } else {
        if (ntiles > 0)
            load_kv_tile<C, D, LD>(sK, sV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                   k_begin, k_end, BN, pre_rows);
        cp_async_commit();
    }

    float o[1][D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[0][nt][0] = o[0][nt][1] = o[0][nt][2] = o[0][nt][3] = 0.f;
    float m[1][2] = {{neg_inf(), neg_inf()}}, l[1][2] = {{0.f, 0.f}};

    if constexpr (KV8) {
        // Q's A fragments in registers for D <= 80 and D = 128 (ptxas -v: at D = 96 they spill, as
        // ptxas stops at 128 registers; above 128 the registers are better spent on o)
        constexpr bool QREG = D <= 80 || D == 128;
        unsigned qf[D / 16][4];
        cp_async_wait<NS - 1>();  // group 0 (Q) landed; the NS - 1 tile groups may be pending
        __syncthreads();
        if constexpr (QREG) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) kv8_q_frag<T, D>(qf[ks], sQ, ks);
        }
        // One barrier per tile. Before iteration t, NS + t groups are committed (Q, then one per
        // tile); waiting until at most NS - 2 are pending completes groups 0 .. t + 1, i.e. Q and
        // tile t. The barrier publishes every thread's copies and tells that every warp is done
        // with tile t - 1, whose stage ((t - 1) % NS) then receives tile t + NS - 1.
        for (int t = 0; t < ntiles; ++t) {
            cp_async_wait<NS - 2>();
            __syncthreads();
            const int tn = t + NS - 1;
            if (tn < ntiles) {
                unsigned char* dst = raw + (tn % NS) * SB;
                load_kv_tile<C, D, RS>(reinterpret_cast<C*>(dst), reinterpret_cast<C*>(dst + BN * RS), k_cache,
                                       v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                       k_begin + tn * BN, k_end, BN);
            }
            cp_async_commit();
            const int kw = k_begin + t * BN + warp * 16;  // the warp's first key
            if (kw < k_end) {
                const int valid = k_end - kw;  // keys at index >= valid are masked
                const unsigned char* stage = raw + (t % NS) * SB + warp * 16 * RS;
                flash_step_kv8<T, D, QREG>(sQ, qf, stage, stage + BN * RS, scale_log2, m[0], l[0], o[0],
                                           [valid](int, int, int key, float v) { return key < valid ? v : neg_inf(); });
            }
        }
    } else {
        for (int t = 0; t < ntiles; ++t) {
            const int st = ST == 2 ? (t & 1) : 0;
            if (ST == 2) {
                // prefetch tile t + 1 into the other stage while tile t is used
                if (t + 1 < ntiles)
                    load_kv_tile<C, D, LD>(sK + (st ^ 1) * BN * LD, sV + (st ^ 1) * BN * LD, k_cache, v_cache,
                                           block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                           k_begin + (t + 1) * BN, k_end, BN);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                // one stage: tile 0 came with Q; tile t is loaded after everyone finished tile t - 1
                if (t > 0)
                    load_kv_tile<C, D, LD>(sK, sV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads,
                                           kvh, k_begin + t * BN, k_end, BN);
                cp_async_commit();
                cp_async_wait<0>();
            }
            __syncthreads();
            const int kw = k_begin + t * BN + warp * 16;  // the warp's first key
            if (kw < k_end) {
                const int valid = k_end - kw;  // keys at index >= valid are masked
                flash_step<T, D, 1, 1>(sQ, sK + st * BN * LD + warp * 16 * LD, sV + st * BN * LD + warp * 16 * LD,
                                       scale_log2, m, l, o,
                                       [valid](int, int, int key, float v) { return key < valid ? v : neg_inf(); });
            }
            __syncthreads();
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Merge the four warps: each writes its unnormalised rows, max and partial sums.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[0][i] += __shfl_xor_sync(TM_FULL_MASK, l[0][i], 1);
        l[0][i] += __shfl_xor_sync(TM_FULL_MASK, l[0][i], 2);
    }
    // [4][16][D] floats = 256 * D bytes; the K and V stages hold 4 * ST * BN * LD >= 256 * (D + 8)
    // (fp8: the raw ring holds NS * 2 * BN * RS >= 256 * D bytes).
    float* sO = KV8 ? reinterpret_cast<float*>(raw) : reinterpret_cast<float*>(sK);
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int col = KV8 ? kv8_col<D>(nt, 2 * tig) : nt * 8 + 2 * tig;
        const int col1 = KV8 ? kv8_col<D>(nt, 2 * tig + 1) : col + 1;
        sO[(warp * 16 + gid) * D + col] = o[0][nt][0];
        sO[(warp * 16 + gid) * D + col1] = o[0][nt][1];
        sO[(warp * 16 + gid + 8) * D + col] = o[0][nt][2];
        sO[(warp * 16 + gid + 8) * D + col1] = o[0][nt][3];
    }
    if (tig == 0) {
        s_m[warp][gid] = m[0][0];
        s_l[warp][gid] = l[0][0];
        s_m[warp][gid + 8] = m[0][1];
        s_l[warp][gid + 8] = l[0][1];
    }
    __syncthreads();
    decode_merge<T, D, 16>(sO, s_m, s_l, s_f, min(gs, group - g0), kvh * group + g0, rg, sq.q_start, seq, heads,
                           num_splits, split, out, part_o, part_ml, counters);
#else
    wait();  // no body before sm_80, but the wait stays
#endif
}

// ---------------------------------------------------------------------------------------------
// Decode with an fp8 cache, D = 128, GQA groups of at most 8 query heads: the transposed product.
// grid (num_splits, kv_heads, num_seqs) (gs = group <= 8), block 128, dynamic smem
// 8 * (D + 8) * sizeof(T) + NS * 64 * 2 * D (GqaKv8Cfg; NS = 3, or 2 / 4 for the `_s2` / `_s4`
// kernels).
//
// attn_decode puts the group's query heads in the 16 rows of the mma's A operand, so with a group
// of 4 three quarters of every S = Q K^T and O += P V product is padding. Here the keys are the
// rows instead: S^T = K Q^T (A = 16 keys x 16 head dims, B = Q^T with the heads as its 8
// columns) and O^T += V^T P^T (A = 16 head dims x 16 keys, B = P^T), which halves the mma count
// and the fragment work per key. Per warp and 16 keys (thread gid = lane / 4, tig = lane % 4):
// - K: the reduction index of each k-step is permuted so that a thread's four d values are four
//   consecutive codes: k-step ks, k-slots 2 tig + {0, 1} / 2 tig + 8 + {0, 1} stand for
//   d = 32 tig + 4 ks + {0, 1} / {2, 3}; two 16-byte loads per key row (rows gid and gid + 8) bring
//   all eight k-steps. Q^T's B fragments use the same order and stay in registers.
// - S^T lands as keys gid, gid + 8 x heads 2 tig, 2 tig + 1: the softmax max over keys is a
//   reduction over gid (shuffles 4, 8, 16); each thread keeps the running max and partial sum of
//   its two heads, which are also the heads of its O^T accumulators.
// - P^T as PV's B operand needs head gid and four keys per thread: the keys of the PV reduction
//   are permuted (k-slot 2 t -> key t, 2 t + 1 -> t + 8, 2 t + 8 -> t + 4, 2 t + 9 -> t + 12), so
//   each B register is one f16 pair (key a, key a + 8) of one head that a single lane holds: four
//   shuffles per 16 keys.
// - V^T's rows (the output's head dims) are permuted too: row r of m-tile mt is
//   d = 16 (r % 8) + 2 mt + r / 8, so a thread's dims are 16 consecutive codes of each of its four
//   key rows (one 16-byte load each), paired across rows with byte permutes.
// K and V rows are 128 bytes with XOR-swizzled 16-byte chunks (gqa_k_chunk, gqa_v_chunk), which
// keeps the fragment loads free of bank conflicts with no padding: a stage is 16 KB, so three
// stages leave room for four CTAs per SM. Codes become f16 (for every T, as in flash_step_kv8).
// ---------------------------------------------------------------------------------------------
template <int NS_> struct GqaKv8Cfg {
    static constexpr int D = 128;
    static constexpr int BN = 64;     // keys per CTA tile (16 per warp)
    static constexpr int LD = D + 8;  // Q row stride (elements of T)
    static constexpr int NS = NS_;    // raw K/V stages
    static constexpr int SB = BN * 2 * D;  // one stage: 64 K rows, then 64 V rows, 128 bytes each
    static_assert(NS * SB >= 4 * 8 * D * 4, "the merge reuses the ring");
};

// Byte offset of 16-byte chunk `ch` (0..7) of K row `r` / V row `r` in a stage of the transposed
// kernel: rows are 128 bytes, unpadded; the chunk index is XOR-swizzled so that the fragment
// loads (K: chunks 2 tig, 2 tig + 1 of rows gid; V: chunk gid of rows = tig mod 4) and the
// cp.async stores each touch 8 distinct 16-byte bank groups per quarter warp.
__device__ __forceinline__ int gqa_k_chunk(int r, int ch) { return r * 128 + ((ch ^ (r & 7)) << 4); }
__device__ __forceinline__ int gqa_v_chunk(int r, int ch) { return r * 128 + ((ch ^ ((r & 3) << 1)) << 4); }

// Issues the cp.async copies of keys [k0 + first_row, k0 + rows) of KV head `kvh` into a stage (K
// at `st`, V at st + 64 * 128), swizzled as above; keys at or past `k_end` are zero-filled (the
// row range as `load_kv_tile`'s).
__device__ __forceinline__ void gqa_load_tile(unsigned char* st, const kv8* k_cache, const kv8* v_cache,
                                              const unsigned* block_tables, int bt_start, int block_size,
                                              int kv_heads, int kvh, int k0, int k_end, int rows = 64,
                                              int first_row = 0) {
    const int ch = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = (threadIdx.x >> 3) + 16 * i;
        if (r < first_row || r >= rows) continue;
        const int key = k0 + r;
        unsigned char* dk = st + gqa_k_chunk(r, ch);
        unsigned char* dv = st + 64 * 128 + gqa_v_chunk(r, ch);
        if (key < k_end) {
            const long long off = kv_offset(block_tables, bt_start, key, block_size, kv_heads, kvh, 128) + ch * 16;
            cp_async16(dk, k_cache + off, 16);
            cp_async16(dv, v_cache + off, 16);
        } else {
            cp_async16(dk, k_cache, 0);
            cp_async16(dv, v_cache, 0);
        }
    }
}

template <typename T, int NS_, class Wait>
__device__ __forceinline__ void attn_decode_gqa_kv8(const T* __restrict__ q, const kv8* __restrict__ k_cache,
                                                    const kv8* __restrict__ v_cache, T* __restrict__ out,
                                                    float* __restrict__ part_o, float* __restrict__ part_ml,
                                                    unsigned* __restrict__ counters, const int* q_start,
                                                    const int* q_len, const int* ctx_len, const int* bt_start,
                                                    const unsigned* __restrict__ block_tables,
                                                    int heads, int kv_heads, int gs, int block_size, float scale_log2,
                                                    int window, int num_splits, int partition, Wait wait) {
#if TM_ATTN_TC
    typedef GqaKv8Cfg<NS_> G;
    constexpr int D = G::D, BN = G::BN, LD = G::LD, NS = G::NS, SB = G::SB;
    constexpr int CH = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    __shared__ float s_m[4][8], s_l[4][8], s_f[4][8];
    T* sQ = reinterpret_cast<T*>(attn_smem);
    unsigned char* raw = attn_smem + 8 * LD * sizeof(T);

    const int seq = blockIdx.z;
    const int split = blockIdx.x;
    if (q_len[seq] != 1) {
        wait();
        return;
    }
    const Seq sq = load_seq(q_start, q_len, ctx_len, bt_start, seq);
    const DecodeRange rg = decode_range(sq.ctx_len, window, num_splits, partition);
    if (split >= rg.used) {
        wait();
        return;
    }
    int k_begin, k_end;
    split_keys(rg, split, partition, k_begin, k_end);
    const int group = heads / kv_heads;
    const int kvh = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const int ntiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;
    // As attn_decode: the first tile's keys before the newest one are copied before `wait`.
    const int pre_rows = ntiles > 0 ? rows_before_newest(k_begin, k_end, sq.ctx_len, BN) : 0;
    if (pre_rows > 0)
        gqa_load_tile(raw, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh, k_begin, k_end,
                      pre_rows);
    wait();

    // Q rows: row i = query head kvh * group + i (rows i >= gs are zeros).
    for (int c = tid; c < 8 * CH; c += 128) {
        const int i = c / CH, ch = c - i * CH;
        const bool valid = i < gs && i < group;
        const T* src = valid ? q + ((long long)sq.q_start * heads + kvh * group + i) * D + ch * 8 : q;
        cp_async16(sQ + i * LD + ch * 8, src, valid ? 16 : 0);
    }
    cp_async_commit();
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (p < ntiles)
            gqa_load_tile(raw + p * SB, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                          k_begin + p * BN, k_end, 64, p == 0 ? pre_rows : 0);
        cp_async_commit();
    }

    float o[D / 16][4];
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // heads 2 tig, 2 tig + 1

    cp_async_wait<NS - 1>();  // Q landed
    __syncthreads();
    // Q^T's B fragments: head gid, d = 32 tig + 4 ks + {0, 1} (b0) and + {2, 3} (b1), as f16
    unsigned qb[D / 16][2];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const T* p = sQ + gid * LD + 32 * tig + 4 * ks;
        qb[ks][0] = pair_to_f16<T>(*reinterpret_cast<const unsigned*>(p));
        qb[ks][1] = pair_to_f16<T>(*reinterpret_cast<const unsigned*>(p + 2));
    }
    // The lanes holding the P pairs of this thread's B fragments (keys tig, tig + 8 and
    // tig + 4, tig + 12 of head gid).
    const int src_a = tig * 4 + (gid >> 1), src_b = src_a + 16;

    // One barrier per tile, as attn_decode's fp8 ring.
    for (int t = 0; t < ntiles; ++t) {
        cp_async_wait<NS - 2>();
        __syncthreads();
        const int tn = t + NS - 1;
        if (tn < ntiles)
            gqa_load_tile(raw + (tn % NS) * SB, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads,
                          kvh, k_begin + tn * BN, k_end);
        cp_async_commit();
        const int kw = k_begin + t * BN + warp * 16;  // the warp's first key
        if (kw >= k_end) continue;
        const int valid = k_end - kw;  // keys at index >= valid are masked
        const unsigned char* sk = raw + (t % NS) * SB + warp * 16 * 128;  // the warp's 16 K rows
        const unsigned char* sv = raw + (t % NS) * SB + BN * 128 + warp * 16 * 128;

        // S^T = K Q^T: s[0], s[1] key gid (heads 2 tig, 2 tig + 1), s[2], s[3] key gid + 8
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        {
            // (warp row offsets are multiples of 16 rows: the swizzle of row gid + 16 w is that of gid)
            const uint4 k0 = *reinterpret_cast<const uint4*>(sk + gqa_k_chunk(gid, 2 * tig));
            const uint4 k1 = *reinterpret_cast<const uint4*>(sk + gqa_k_chunk(gid, 2 * tig + 1));
            const uint4 k2 = *reinterpret_cast<const uint4*>(sk + gqa_k_chunk(gid + 8, 2 * tig));
            const uint4 k3 = *reinterpret_cast<const uint4*>(sk + gqa_k_chunk(gid + 8, 2 * tig + 1));
            const unsigned r0[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
            const unsigned r1[8] = {k2.x, k2.y, k2.z, k2.w, k3.x, k3.y, k3.z, k3.w};
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                const unsigned a[4] = {fp8x2_to<__half>(r0[ks]), fp8x2_to<__half>(r1[ks]),
                                       fp8x2_to<__half>(r0[ks] >> 16), fp8x2_to<__half>(r1[ks] >> 16)};
                mma16816<__half>(s, a, qb[ks][0], qb[ks][1]);
            }
        }
        // scale, mask, running max per head (over the 16 keys: this thread's two, then gid)
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = gid + 8 * (e >> 1);
            s[e] = key < valid ? s[e] * scale_log2 : neg_inf();
            mx[e & 1] = fmaxf(mx[e & 1], s[e]);
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(TM_FULL_MASK, mx[h], 4));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(TM_FULL_MASK, mx[h], 8));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(TM_FULL_MASK, mx[h], 16));
            const float m_new = fmaxf(m[h], mx[h]);
            m_use[h] = m_new == neg_inf() ? 0.f : m_new;
            alpha[h] = exp2f(m[h] - m_use[h]);
            m[h] = m_new;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[e] = exp2f(s[e] - m_use[e & 1]);
            rs[e & 1] += s[e];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rs[h];
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
            o[mt][0] *= alpha[0];
            o[mt][1] *= alpha[1];
            o[mt][2] *= alpha[0];
            o[mt][3] *= alpha[1];
        }
        // P^T's B fragments: (key a, key a + 8) pairs of head gid from lanes src_a / src_b
        const unsigned pe = pack2<__half>(s[0], s[2]), po = pack2<__half>(s[1], s[3]);
        const unsigned ea = __shfl_sync(TM_FULL_MASK, pe, src_a), oa = __shfl_sync(TM_FULL_MASK, po, src_a);
        const unsigned eb = __shfl_sync(TM_FULL_MASK, pe, src_b), ob = __shfl_sync(TM_FULL_MASK, po, src_b);
        const unsigned b0 = (gid & 1) ? oa : ea, b1 = (gid & 1) ? ob : eb;
        // O^T += V^T P^T: this thread's 16 dims of keys tig, tig + 8, tig + 4, tig + 12
        const uint4 va = *reinterpret_cast<const uint4*>(sv + gqa_v_chunk(tig, gid));
        const uint4 vb = *reinterpret_cast<const uint4*>(sv + gqa_v_chunk(tig + 8, gid));
        const uint4 vc = *reinterpret_cast<const uint4*>(sv + gqa_v_chunk(tig + 4, gid));
        const uint4 vd = *reinterpret_cast<const uint4*>(sv + gqa_v_chunk(tig + 12, gid));
        const unsigned wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
        const unsigned wc[4] = {vc.x, vc.y, vc.z, vc.w}, wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
            const int w = mt >> 1, b = 2 * (mt & 1);
            // bytes b, b + 1 (dims 16 gid + 2 mt + {0, 1}) of two key rows, interleaved
            const unsigned sel = b | ((4 + b) << 4) | ((b + 1) << 8) | ((5 + b) << 12);
            const unsigned lo = __byte_perm(wa[w], wb[w], sel), hi = __byte_perm(wc[w], wd[w], sel);
            const unsigned a[4] = {fp8x2_to<__half>(lo), fp8x2_to<__half>(lo >> 16), fp8x2_to<__half>(hi),
                                   fp8x2_to<__half>(hi >> 16)};
            mma16816<__half>(o[mt], a, b0, b1);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Merge the four warps: partial sums over gid, then unnormalised rows, maxima and sums.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(TM_FULL_MASK, l[h], 4);
        l[h] += __shfl_xor_sync(TM_FULL_MASK, l[h], 8);
        l[h] += __shfl_xor_sync(TM_FULL_MASK, l[h], 16);
    }
    float* sO = reinterpret_cast<float*>(raw);  // [warp][head 0..7][D]
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
        const int d = 16 * gid + 2 * mt;
        float* r0 = sO + (warp * 8 + 2 * tig) * D;
        float* r1 = r0 + D;
        r0[d] = o[mt][0];
        r1[d] = o[mt][1];
        r0[d + 1] = o[mt][2];
        r1[d + 1] = o[mt][3];
    }
    if (gid == 0) {
        s_m[warp][2 * tig] = m[0];
        s_l[warp][2 * tig] = l[0];
        s_m[warp][2 * tig + 1] = m[1];
        s_l[warp][2 * tig + 1] = l[1];
    }
    __syncthreads();
    // two stages: 8 splits per merge chunk (12 would take the bf16 build from 5 to 4 CTAs per SM)
    constexpr int MERGE_CH = NS == 2 ? 8 : combine_chunk(D);
    decode_merge<T, D, 8, MERGE_CH>(sO, s_m, s_l, s_f, min(gs, group), kvh * group, rg, sq.q_start, seq, heads,
                                    num_splits, split, out, part_o, part_ml, counters);
#else
    wait();  // no body before sm_80, but the wait stays
#endif
}

// Merges split-K partials (the two-launch path: attn_decode without counters). grid (heads,
// num_seqs), block 128.
template <typename T>
__device__ __forceinline__ void attn_combine(T* __restrict__ out, const float* __restrict__ part_o,
                                             const float* __restrict__ part_ml, const int* q_start, const int* q_len,
                                             const int* ctx_len, int heads, int head_dim, int window,
                                             int num_splits, int partition) {
    const int h = blockIdx.x, seq = blockIdx.y;
    if (q_len[seq] != 1) return;
    const DecodeRange rg = decode_range(ctx_len[seq], window, num_splits, partition);
    if (rg.direct) return;
    // head_dim is a runtime value here; 8 splits per chunk (96 registers in this small kernel)
    combine_splits<T, 8>(out, part_o, part_ml, seq, h, 1, heads, head_dim, num_splits,
                         min(rg.used, TM_ATTN_MAX_SPLITS), q_start[seq]);
}

// ---------------------------------------------------------------------------------------------
// Prefill (q_len > 1).
// grid (num_tiles_bound, kv_heads * n_sub), block 128, dynamic smem (BM + 4 * BN) * (D + 8) * sizeof(T);
// fp8 cache: (BM + 2 * BN) * (D + 8) * sizeof(T) + 2 * BN * D.
// ---------------------------------------------------------------------------------------------
// Tuning knobs (the launcher mirrors the defaults): largest head_dim with 2 m16 tiles per warp,
// largest head_dim with 64-key tiles (32 above).
#ifndef TM_ATTN_PREFILL_MT2_MAX_D
#define TM_ATTN_PREFILL_MT2_MAX_D 128
#endif
#ifndef TM_ATTN_PREFILL_BN64_MAX_D
#define TM_ATTN_PREFILL_BN64_MAX_D 128
#endif
template <int D> struct PrefillCfg {
    static constexpr int MT = D <= TM_ATTN_PREFILL_MT2_MAX_D ? 2 : 1;    // m16 tiles per warp
    static constexpr int BM = 4 * 16 * MT;                               // query rows per CTA
    static constexpr int BN = D <= TM_ATTN_PREFILL_BN64_MAX_D ? 64 : 32;  // keys per tile
    static constexpr int LD = D + 8;
};

// Finds the CTA's (sequence, tile) among the flat-numbered tiles of all sequences with
// q_len > 1 (ceil(q_len / tq) tiles each). Every lane of the warp must call it; all get the same.
__device__ __forceinline__ bool find_tile(const int* q_len, int num_seqs, int tq, int tile, int& seq, int& tile_in_seq,
                                          int& seq_tiles) {
    const int lane = threadIdx.x & 31;
    int base = 0;
    for (int s0 = 0; s0 < num_seqs; s0 += 32) {
        const int s = s0 + lane;
        int n = 0;
        if (s < num_seqs) {
            const int ql = q_len[s];
            n = ql > 1 ? (ql + tq - 1) / tq : 0;
        }
        int inc = n;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int v = __shfl_up_sync(TM_FULL_MASK, inc, off);
            if (lane >= off) inc += v;
        }
        const unsigned hit = __ballot_sync(TM_FULL_MASK, base + inc > tile);
        if (hit != 0u) {
            const int src = __ffs(hit) - 1;
            seq = s0 + src;
            seq_tiles = __shfl_sync(TM_FULL_MASK, n, src);
            tile_in_seq = tile - base - __shfl_sync(TM_FULL_MASK, inc - n, src);
            return true;
        }
        base += __shfl_sync(TM_FULL_MASK, inc, 31);
    }
    return false;
}

template <typename T, typename C, int D>
__device__ __forceinline__ void attn_prefill(const T* __restrict__ q, const C* __restrict__ k_cache,
                                             const C* __restrict__ v_cache, T* __restrict__ out, const int* q_start,
                                             const int* q_len, const int* ctx_len, const int* bt_start,
                                             const unsigned* __restrict__ block_tables, int num_seqs, int heads,
                                             int kv_heads, int gs, int block_size, float scale_log2, int window) {
#if TM_ATTN_TC
    constexpr int MT = PrefillCfg<D>::MT;
    constexpr int BM = PrefillCfg<D>::BM;
    constexpr int BN = PrefillCfg<D>::BN;
    constexpr int LD = PrefillCfg<D>::LD;
    constexpr int CH = D / 8;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    T* sQ = reinterpret_cast<T*>(attn_smem);
    constexpr bool KV8 = IsKv8<C>::value;
    constexpr int ST = KV8 ? 1 : 2;  // T stages (fp8: one, fed by the raw stage)
    T* sK = sQ + BM * LD;
    T* sV = sK + ST * BN * LD;
    C* rK = reinterpret_cast<C*>(sV + ST * BN * LD);  // fp8 only: the raw stage, [BN][D] codes
    C* rV = rK + BN * D;

    const int tq = BM / gs;  // tokens per tile
    int seq = 0, tile = 0, seq_tiles = 0;
    if (!find_tile(q_len, num_seqs, tq, blockIdx.x, seq, tile, seq_tiles)) return;
    const Seq sq = load_seq(q_start, q_len, ctx_len, bt_start, seq);
    const int group = heads / kv_heads;
    const int n_sub = (group + gs - 1) / gs;
    const int kvh = blockIdx.y / n_sub;
    const int g0 = (blockIdx.y - kvh * n_sub) * gs;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    const int j0 = (seq_tiles - 1 - tile) * tq;  // the sequence's last tile first
    const int jn = min(tq, sq.q_len - j0);       // tokens in this tile
    const int pos0 = sq.ctx_len - sq.q_len + j0;  // position of token j0
    const int nrows = jn * gs;
    const int hi = pos0 + jn;  // keys [lo, hi)
    const int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;

    // Q rows: row r = token j0 + r / gs, group member g0 + r % gs.
    for (int c = tid; c < BM * CH; c += 128) {
        const int r = c / CH, ch = c - r * CH;
        const int j = r / gs, g = g0 + (r - j * gs);
        const bool valid = r < nrows && g < group;
        const T* src =
            valid ? q + ((long long)(sq.q_start + j0 + j) * heads + kvh * group + g) * D + ch * 8 : q;
        cp_async16(sQ + r * LD + ch * 8, src, valid ? 16 : 0);
    }
    const int ntiles = hi > lo ? (hi - lo + BN - 1) / BN : 0;
    if (ntiles > 0) {
        if constexpr (KV8)
            load_kv_tile<C, D, D>(rK, rV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh, lo,
                                  hi, BN);
        else
            load_kv_tile<C, D, LD>(sK, sV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh, lo,
                                   hi, BN);
    }
    cp_async_commit();

    // This thread's rows (wr0 + 16 * mt + gid + 8 * i) and the warp's position range.
    const int gid = lane >> 2, tig = lane & 3;
    const int wr0 = warp * 16 * MT;
    int rpos[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = wr0 + 16 * mt + gid + 8 * i;
            const int j = r / gs, g = g0 + (r - j * gs);
            rpos[mt][i] = (r < nrows && g < group) ? pos0 + j : -1;
        }
    }
    const bool warp_active = wr0 < nrows;
    const int wmin = pos0 + wr0 / gs;  // valid only if warp_active
    const int wmax = pos0 + min(wr0 + 16 * MT - 1, nrows - 1) / gs;

    float o[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;
    }
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int t = 0; t < ntiles; ++t) {
        const int st = KV8 ? 0 : (t & 1);
        if constexpr (KV8) {
            // raw tile t (with Q at t = 0) landed, and every warp is done with the T stage
            cp_async_wait<0>();
            __syncthreads();
            convert_kv_tile<T, D>(sK, sV, reinterpret_cast<const unsigned char*>(rK),
                                  reinterpret_cast<const unsigned char*>(rV), BN);
            __syncthreads();
            // the raw stage is free: fetch tile t + 1 while tile t is used
            if (t + 1 < ntiles)
                load_kv_tile<C, D, D>(rK, rV, k_cache, v_cache, block_tables, sq.bt_start, block_size, kv_heads, kvh,
                                      lo + (t + 1) * BN, hi, BN);
            cp_async_commit();
        } else {
            if (t + 1 < ntiles)
                load_kv_tile<C, D, LD>(sK + (st ^ 1) * BN * LD, sV + (st ^ 1) * BN * LD, k_cache, v_cache,
                                       block_tables, sq.bt_start, block_size, kv_heads, kvh, lo + (t + 1) * BN, hi,
                                       BN);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
        }
        const int k0 = lo + t * BN;
        const bool any = warp_active && k0 <= wmax && (window <= 0 || k0 + BN - 1 > wmin - window);
        if (any) {
            const bool full = k0 + BN - 1 <= wmin && (window <= 0 || k0 > wmax - window);
            const T* tk = sK + st * BN * LD;
            const T* tv = sV + st * BN * LD;
            const T* wq = sQ + wr0 * LD;
            if (full) {
                flash_step<T, D, MT, BN / 16>(wq, tk, tv, scale_log2, m, l, o,
                                              [](int, int, int, float v) { return v; });
            } else {
                int last[MT][2];  // last visible key index of each row in this tile
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    last[mt][0] = rpos[mt][0] - k0;
                    last[mt][1] = rpos[mt][1] - k0;
                }
                const int w = window;
                flash_step<T, D, MT, BN / 16>(wq, tk, tv, scale_log2, m, l, o,
                                              [&last, w](int mt, int i, int key, float v) {
                                                  const int p = last[mt][i];
                                                  return (key <= p && (w <= 0 || key > p - w)) ? v : neg_inf();
                                              });
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float li = l[mt][i];
            li += __shfl_xor_sync(TM_FULL_MASK, li, 1);
            li += __shfl_xor_sync(TM_FULL_MASK, li, 2);
            if (rpos[mt][i] < 0) continue;
            const int r = wr0 + 16 * mt + gid + 8 * i;
            const int j = r / gs, g = g0 + (r - j * gs);
            const float inv = li > 0.f ? 1.f / li : 0.f;
            T* dst = out + ((long long)(sq.q_start + j0 + j) * heads + kvh * group + g) * D + 2 * tig;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                *reinterpret_cast<unsigned*>(dst + nt * 8) =
                    pack2<T>(o[mt][nt][2 * i] * inv, o[mt][nt][2 * i + 1] * inv);
            }
        }
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// CUDA-core path for any head_dim <= 256: one warp per (query token, head).
// grid (total_q, ceil(heads / 4)), block 128, no dynamic shared memory.
// ---------------------------------------------------------------------------------------------
template <typename T, typename C>
__device__ __forceinline__ void attn_simple(const T* __restrict__ q, const C* __restrict__ k_cache,
                                            const C* __restrict__ v_cache, T* __restrict__ out, const int* q_start,
                                            const int* q_len, const int* ctx_len, const int* bt_start,
                                            const unsigned* __restrict__ block_tables, int num_seqs, int heads,
                                            int kv_heads, int head_dim, int block_size, float scale, int window) {
    constexpr int ND = 8;  // head_dim / 32, rounded up, at most
    constexpr int KS = 8;  // keys per step
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.y * 4 + (threadIdx.x >> 5);
    const int t = blockIdx.x;
    if (h >= heads) return;
    // The sequence owning query row t.
    int seq = -1;
    for (int s0 = 0; s0 < num_seqs && seq < 0; s0 += 32) {
        const int s = s0 + lane;
        bool own = false;
        if (s < num_seqs) {
            const int qs = q_start[s];
            own = qs <= t && t < qs + q_len[s];
        }
        const unsigned hit = __ballot_sync(TM_FULL_MASK, own);
        if (hit != 0u) seq = s0 + __ffs(hit) - 1;
    }
    if (seq < 0) return;
    const Seq sq = load_seq(q_start, q_len, ctx_len, bt_start, seq);
    const int pos = sq.ctx_len - sq.q_len + (t - sq.q_start);
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int kvh = h / (heads / kv_heads);

    float qv[ND], acc[ND];
    const T* qrow = q + ((long long)t * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? to_float(qrow[d]) : 0.f;
        acc[i] = 0.f;
    }
    float m = neg_inf(), l = 0.f;
    for (int k0 = lo; k0 <= pos; k0 += KS) {
        long long off[KS];
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            const int key = min(k0 + j, pos);
            off[j] = kv_offset(block_tables, sq.bt_start, key, block_size, kv_heads, kvh, head_dim);
        }
        float s[KS];
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            float part = 0.f;
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) part += qv[i] * to_float(k_cache[off[j] + d]);
            }
            s[j] = part;
        }
#pragma unroll
        for (int off_ = 16; off_ > 0; off_ >>= 1) {
#pragma unroll
            for (int j = 0; j < KS; ++j) s[j] += __shfl_xor_sync(TM_FULL_MASK, s[j], off_);
        }
        float mx = m;
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            s[j] = k0 + j <= pos ? s[j] * scale : neg_inf();
            mx = fmaxf(mx, s[j]);
        }
        // mx is finite: key k0 <= pos is always visible.
        const float alpha = expf(m - mx);
        m = mx;
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            s[j] = expf(s[j] - mx);
            ps += s[j];
        }
        l = l * alpha + ps;
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] *= alpha;
#pragma unroll
        for (int j = 0; j < KS; ++j) {
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) acc[i] += s[j] * to_float(v_cache[off[j] + d]);
            }
        }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* orow = out + ((long long)t * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) orow[d] = from_float<T>(acc[i] * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// KV-cache write into an fp8 cache: one block per token row (grid.x = rows, loops), K and V rows
// of `kv_dim` elements to slots `slots[t]` (0xffffffff: a padding token, not written).
// 16 elements per thread and step when `kv_dim % 16 == 0` and every pointer is 16-byte aligned.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ unsigned short to_fp8x2(T lo, T hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(to_float(lo), to_float(hi)), __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
__device__ __forceinline__ unsigned char to_fp8(T x) {
    return (unsigned char)__nv_cvt_float_to_fp8(to_float(x), __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
__device__ __forceinline__ void write_row_fp8(unsigned char* __restrict__ dst, const T* __restrict__ src, int cols,
                                              bool vec) {
    if (vec) {
        for (int i = threadIdx.x; i < cols / 16; i += blockDim.x) {
            const T* s = src + (long long)i * 16;
            unsigned w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                w[j] = (unsigned)to_fp8x2(s[4 * j], s[4 * j + 1]) | ((unsigned)to_fp8x2(s[4 * j + 2], s[4 * j + 3]) << 16);
            *reinterpret_cast<uint4*>(dst + (long long)i * 16) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = to_fp8(src[i]);
    }
}

template <typename T>
__device__ __forceinline__ void write_kv_fp8(unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                                             const T* __restrict__ k, const T* __restrict__ v,
                                             const unsigned* __restrict__ slots, int tokens, int kv_dim) {
    const bool vec = kv_dim % 16 == 0 &&
                     ((reinterpret_cast<unsigned long long>(k) | reinterpret_cast<unsigned long long>(v) |
                       reinterpret_cast<unsigned long long>(k_cache) | reinterpret_cast<unsigned long long>(v_cache)) &
                      15) == 0;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const unsigned slot = slots[t];
        if (slot == 0xffffffffu) continue;
        const unsigned long long dst = (unsigned long long)slot * (unsigned long long)kv_dim;
        const long long src = (long long)t * kv_dim;
        write_row_fp8(k_cache + dst, k + src, kv_dim, vec);
        write_row_fp8(v_cache + dst, v + src, kv_dim, vec);
    }
}

/// The fp8 cache of `rope_write_kv_e4m3` (`tmk::rope_write_kv_tokens`, rope.cuh): elements are
/// converted as `write_kv_fp8` converts them.
template <typename T>
struct CacheE4m3 {
    static __device__ __forceinline__ void put(unsigned char* dst, T x) { *dst = to_fp8(x); }
    static __device__ __forceinline__ void row(unsigned char* dst, const T* src, int n) {
        const bool vec =
            n % 16 == 0 && ((reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src)) & 15) == 0;
        write_row_fp8(dst, src, n, vec);
    }
};

}  // namespace tm_attn

// ---------------------------------------------------------------------------------------------
// Entry points (parameter lists: ABI.md).
// ---------------------------------------------------------------------------------------------
// KV = the cache element type, KSUF = "" (cache in T) or "_kv8" (fp8 cache).
#define TM_ATTN_TC_KERNELS(D, SUF, T, KV, KSUF)                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        attn_decode_d##D##_##SUF##KSUF(const T* q, const KV* k_cache, const KV* v_cache, T* out, float* part_o,       \
                                 float* part_ml, unsigned* counters, const int* q_start, const int* q_len,            \
                                 const int* ctx_len, const int* bt_start, const unsigned* block_tables, int heads,    \
                                 int kv_heads, int gs, int block_size, float scale_log2, int window, int num_splits,  \
                                 int partition) {                                                                      \
        tmk::pdl_launch_dependents_early();                                                                            \
        tm_attn::attn_decode<T, KV, D>(q, k_cache, v_cache, out, part_o, part_ml, counters, q_start, q_len,            \
                                   ctx_len, bt_start, block_tables, heads, kv_heads, gs, block_size, scale_log2,      \
                                   window, num_splits, partition, [] { tmk::pdl_wait(); });                           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        attn_prefill_d##D##_##SUF##KSUF(const T* q, const KV* k_cache, const KV* v_cache, T* out, const int* q_start,  \
                                  const int* q_len, const int* ctx_len, const int* bt_start,                          \
                                  const unsigned* block_tables, int num_seqs, int heads, int kv_heads, int gs,        \
                                  int block_size, float scale_log2, int window) {                                     \
        tmk::pdl_launch_dependents();                                                                                  \
        tmk::pdl_wait();                                                                                               \
        tm_attn::attn_prefill<T, KV, D>(q, k_cache, v_cache, out, q_start, q_len, ctx_len, bt_start, block_tables,       \
                                    num_seqs, heads, kv_heads, gs, block_size, scale_log2, window);                   \
    }

#define TM_ATTN_TC_ALL_D(SUF, T, KV, KSUF)    \
    TM_ATTN_TC_KERNELS(32, SUF, T, KV, KSUF)  \
    TM_ATTN_TC_KERNELS(64, SUF, T, KV, KSUF)  \
    TM_ATTN_TC_KERNELS(80, SUF, T, KV, KSUF)  \
    TM_ATTN_TC_KERNELS(96, SUF, T, KV, KSUF)  \
    TM_ATTN_TC_KERNELS(112, SUF, T, KV, KSUF) \
    TM_ATTN_TC_KERNELS(128, SUF, T, KV, KSUF) \
    TM_ATTN_TC_KERNELS(160, SUF, T, KV, KSUF) \
    TM_ATTN_TC_KERNELS(192, SUF, T, KV, KSUF) \
    TM_ATTN_TC_KERNELS(256, SUF, T, KV, KSUF)

TM_ATTN_TC_ALL_D(f16, __half, __half, )
TM_ATTN_TC_ALL_D(bf16, __nv_bfloat16, __nv_bfloat16, )
TM_ATTN_TC_ALL_D(f16, __half, tm_attn::kv8, _kv8)
TM_ATTN_TC_ALL_D(bf16, __nv_bfloat16, tm_attn::kv8, _kv8)

#define TM_ATTN_GQA_KV8_KERNEL(SUF, T, NS, NSUF)                                                                       \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        attn_decode_gqa_d128_##SUF##_kv8##NSUF(const T* q, const tm_attn::kv8* k_cache, const tm_attn::kv8* v_cache,   \
                                               T* out, float* part_o, float* part_ml, unsigned* counters,              \
                                               const int* q_start, const int* q_len, const int* ctx_len,               \
                                               const int* bt_start, const unsigned* block_tables, int heads,           \
                                               int kv_heads, int gs, int block_size, float scale_log2, int window,     \
                                               int num_splits, int partition) {                                        \
        tmk::pdl_launch_dependents_early();                                                                            \
        tm_attn::attn_decode_gqa_kv8<T, NS>(q, k_cache, v_cache, out, part_o, part_ml, counters, q_start, q_len,       \
                                            ctx_len, bt_start, block_tables, heads, kv_heads, gs, block_size,          \
                                            scale_log2, window, num_splits, partition, [] { tmk::pdl_wait(); });       \
    }

TM_ATTN_GQA_KV8_KERNEL(f16, __half, 3, )
TM_ATTN_GQA_KV8_KERNEL(bf16, __nv_bfloat16, 3, )
TM_ATTN_GQA_KV8_KERNEL(f16, __half, 4, _s4)
TM_ATTN_GQA_KV8_KERNEL(bf16, __nv_bfloat16, 4, _s4)
TM_ATTN_GQA_KV8_KERNEL(f16, __half, 2, _s2)
TM_ATTN_GQA_KV8_KERNEL(bf16, __nv_bfloat16, 2, _s2)

#define TM_ATTN_SIMPLE_KERNEL(SUF, T, KV, KSUF)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        attn_simple_##SUF##KSUF(const T* q, const KV* k_cache, const KV* v_cache, T* out, const int* q_start,         \
                                const int* q_len, const int* ctx_len, const int* bt_start,                            \
                                const unsigned* block_tables, int num_seqs, int heads, int kv_heads, int head_dim,    \
                                int block_size, float scale, int window) {                                            \
        tmk::pdl_launch_dependents();                                                                                  \
        tmk::pdl_wait();                                                                                               \
        tm_attn::attn_simple<T, KV>(q, k_cache, v_cache, out, q_start, q_len, ctx_len, bt_start, block_tables,        \
                                    num_seqs, heads, kv_heads, head_dim, block_size, scale, window);                  \
    }

#define TM_ATTN_GENERIC_KERNELS(SUF, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        attn_combine_##SUF(T* out, const float* part_o, const float* part_ml, const int* q_start, const int* q_len,    \
                           const int* ctx_len, int heads, int head_dim, int window, int num_splits, int partition) {  \
        tmk::pdl_launch_dependents();                                                                                  \
        tmk::pdl_wait();                                                                                               \
        tm_attn::attn_combine<T>(out, part_o, part_ml, q_start, q_len, ctx_len, heads, head_dim, window, num_splits,  \
                                 partition);                                                                           \
    }                                                                                                                  \
    TM_ATTN_SIMPLE_KERNEL(SUF, T, T, )                                                                                 \
    TM_ATTN_SIMPLE_KERNEL(SUF, T, tm_attn::kv8, _kv8)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                                                  \
        write_kv_e4m3_##SUF(unsigned char* k_cache, unsigned char* v_cache, const T* k, const T* v,                   \
                            const unsigned* slots, int tokens, int kv_dim) {                                          \
        tmk::pdl_launch_dependents();                                                                                  \
        tmk::pdl_wait();                                                                                               \
        tm_attn::write_kv_fp8<T>(k_cache, v_cache, k, v, slots, tokens, kv_dim);                                      \
    }                                                                                                                  \
    extern "C" __global__ void rope_write_kv_e4m3_##SUF(                                                               \
        T* q, T* k, const T* v, unsigned char* k_cache, unsigned char* v_cache, const unsigned* positions,             \
        const unsigned* slots, const float* inv_freq, float attention_factor, int tokens, int heads, int kv_heads,     \
        int head_dim, int interleaved) {                                                                               \
        tmk::pdl_launch_dependents_early();                                                                            \
        tmk::pdl_wait();                                                                                               \
        tmk::rope_write_kv_tokens<T, unsigned char, tm_attn::CacheE4m3<T>>(q, k, v, k_cache, v_cache, positions,       \
                                                                           slots, inv_freq, attention_factor, tokens,  \
                                                                           heads, kv_heads, head_dim, interleaved);    \
    }

TM_ATTN_GENERIC_KERNELS(f32, float)
TM_ATTN_GENERIC_KERNELS(f16, __half)
TM_ATTN_GENERIC_KERNELS(bf16, __nv_bfloat16)
