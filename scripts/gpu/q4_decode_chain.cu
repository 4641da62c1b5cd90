// Development harness for the batch-1 int4 decode chain (q4_gemv.cu's lean kernels and the
// add_rms_norm joins between them), compiled with the GPU machine's own nvcc (no Rust build):
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I crates/tm-kernels/cuda \
//        -o /tmp/q4c scripts/gpu/q4_decode_chain.cu crates/tm-kernels/cuda/attention.cu && /tmp/q4c
//
// (or here, with the pip nvcc: add `-cudart static -L<cu13>/lib` and carry the binary)
//
// It builds 32 Llama-3-8B-shaped int4 layers (random nibbles, group 128) and captures one decode
// step of their products into a CUDA graph, every launch with programmatic stream serialization as
// tm's CUDA backend launches them: add_rms_norm, q/k/v (ln), o (ln4), add_rms_norm, gate/up+SiLU
// (ln), down (ln4) per layer. Forms:
//   early: the joins as built (add_rms_norm triggers its dependents first thing,
//          `tmk::pdl_launch_dependents_early`), so the next GEMV's first weight loads overlap it;
//   late:  the same join with the ordinary (late, implicit) trigger;
//   none:  no joins (the most that removing them could save).
// Optionally with a stand-in for decode attention before o (72 CTAs busy for 6 us), triggering
// early or late, and with `rope_write_kv` after q/k/v. Attention and the LM head themselves are
// not in the chain.
//
// Measured (H200, 2026-12-01, us per step, f16; bf16 within 1%), GEMVs triggering at exit
// (-DTM_Q4_GEMV_EARLY_TRIGGER=0) / after their main loop (the default): late 1768 / 1722, early
// 1703 / 1638, none 1635 / 1566; with the attention stand-in, both late 1984 / 1950, both early
// 1858 / 1814. Also tried here and dropped: the RMSNorm computed again by every CTA of the next
// GEMV in its prologue (x staged in shared memory, o and down adding into the residual): 1796-1818
// against 1761-1768 for the separate kernel; a persistent gate/up grid whose warps' rings run on
// across tiles (grids of 132-448 CTAs): 1649-1985 against 1641; scales and mins staged in shared
// memory per CTA: 1642-1650 against 1646-1653. rope_write_kv in the early chain with the stand-in:
// 1914-1924 against 1813-1820 without it; folded into the q/k/v GEMV in the engine
// (`q4_gemv_ln_rope`) it saved only 9-15 us of a 2.30 ms step, so most of it was already hidden.
//
// `g4`: gate/up+SiLU on tile-major weights with more steps in flight at two CTAs per SM (x loaded
// at use): U = 3 (8 bytes of spills) 1708-1713 us and U = 4 (208 bytes) 1907-1918 us against
// 1686-1699 for silu_lnt's U = 2, early chain with the stand-in (2026-12-01, f16; bf16 alike).
// `at`: decode attention itself (attn_decode_d128, 600 keys in 10 splits, fused combine) between
// q/k/v and o: 1786-1795 us against 1516-1526 without attention and 1687-1699 with the 6-us
// stand-in. Engine ablations on the same day (AWQ b1 replay 2088-2092 us; the kernels cut short,
// garbage out): attention returning right after its wait 1924, after loading Q and its tile 1927,
// skipping only the combine tail (fence, counter, last-CTA merge) 1988; add_rms_norm returning at
// once 1989, both 1837. Tried here and in the engine, not kept: the combine's partials copied
// into shared memory with the (max, sum) pairs (one L2 trip): harness 1790 -> 1772, engine
// 2148 -> 2155; attention copying its first K/V tile before its wait (all but the newest key):
// harness none, engine 2142 -> 2148; the splits merged through distributed shared memory in a
// thread-block cluster (committed and reverted, see `git log -S cluster_combine`: attn_decode_bench 11.3 -> 9.6 us at 550
// keys, engine 2172 -> 2247 us). The RMSNorm folded into q/k/v and gate/up (x = the residual
// times the norm weight per step, squares summed on the side, the sums scaled by the CTA's rsqrt
// at the end; no add_rms_norm kernels; mode `nf` of commit 78579e0, removed since: a copy of the
// lean loop): 1846-1856 us against 1728-1734 with the joins and 1608-1615 without them: the norm
// weight's load and the multiply sit on the at-use x path of every step. This harness's q/k/v is `lnt` at three CTAs per SM, the engine's
// `lnt_rope` at two, so attention's start is not modelled exactly.
//
// Mode `dn` of commit 7feb5e9 (reverted after it; 2026-12-01, H200, f16, the chain
// as the engine runs it: lnt_rope, attn_decode, ln4t, silu_lnt, ln4t): the RMSNorm deferred into
// the products. The producer (o, down: `q4_gemv_ln4t_join`) ends with the join's elementwise part,
// residual = T(residual + T(y)), x = T(residual * gamma), and per CTA the sum of squares of its
// rows; the consumers (lnt_rope, silu_lnt) read x as usual and multiply their sums by the row's
// 1 / rms before their epilogue; no add_rms_norm kernels. Joins 1825-1845 us, no norm at all
// 1732-1775. The producer's part costs ~5 us in all (joins off, producers joining: 1741-1784); the
// consumers' part is what decides, because every cycle added to a consumer's epilogue is paid
// per CTA wave (silu_lnt: 896 CTAs, 3.4 waves) with the next kernel waiting: scaling by a constant
// +0 us; one L2 load in the epilogue +49-70 us (the weight stream makes L2 latency long); the
// partial sums staged by cp.async after the wait and reduced in shared memory +145 us (two extra
// barriers +150); a float2 of partials per thread loaded after the wait and warp-reduced +62-86;
// thread 0's load only (a stand-in for one pre-reduced sum per batch row) +40, which would make the
// deferred chain 1759-1786 us against 1831 with joins (-45..-72). That design, built (a scratch copy
// of 7feb5e9: each producer CTA atomicAdds its sum into one float per batch row of its slot, o's
// slot A and down's B, and zeroes the other slot; the consumers __ldcg their row's sum right
// after the wait and scale by rsqrtf at the end): 1792-1798 us against 1822-1832 with joins, four
// alternations, i.e. -30..-38 us per step (1.6-2%); not bit-reproducible (float atomics), and the
// slot protocol needs every step's producers all deferred or none (a last down deferred too).
// Also: ptxas hoisted an `__ldg` of the sums above `griddepcontrol.wait` (ld.global.nc promises the
// data does not change while the kernel runs), which is how the same hoisting of q4_gemv.cu's x
// loads was found (ABI.md, PDL). The SiLU epilogue's IEEE division against `__fdividef`: -3 us.
//
// Arguments: none (the forms above), `tl` (the lean kernels against their tile-major forms, `lnt`,
// `ln4t`, `silu_lnt`, the weights read as if stored tile-major: the layout's speed is the same for
// random nibbles), `g4`, `at` (above), `pf` (the attention stand-in issuing `cp.async.bulk.prefetch.L2` of the first
// MiBs of the next gate and up weights). Measured 2026-12-01 (f16; bf16 within 1%): tile-major
// 1567 -> 1438 us per step without joins, 1814 -> 1698 us early with the stand-in (now the CUDA
// backend's layout for these shapes); L2 prefetch of 4 / 8 / 12 / 16 MiB of each: 1820 -> 1790 /
// 1783 / 1769 / 1790 us (from row 4224: 1802-1796), not pursued. Staged x (each CTA copying x into
// shared memory once, pre-permuted into the mma B operands with per-group sums, so the loop needs
// no PRMT, ones-mma or high-nibble shifts: 25-31% fewer SASS instructions per step) was slower,
// 1572 -> 1635 us without joins: the staging adds a dependent load, reduction and barrier before
// each CTA's first step, and the loop is bound by the weights' DRAM pattern, not by issue.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
#include <cuda_runtime.h>
#include "q4_gemv.cu"
#include "elementwise.cu"
// attention.cu is a second translation unit (its helpers clash with elementwise.cu's in one):
//   nvcc ... -o /tmp/q4c scripts/gpu/q4_decode_chain.cu crates/tm-kernels/cuda/attention.cu
#define TM_ATTN_DECL(SUF, T)                                                                                            \
    extern "C" __global__ void attn_decode_d128_##SUF(                                                                 \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_o, float* part_ml, unsigned* counters,    \
        const int* q_start, const int* q_len, const int* ctx_len, const int* bt_start, const unsigned* block_tables,  \
        int heads, int kv_heads, int gs, int block_size, float scale_log2, int window, int num_splits, int partition);
TM_ATTN_DECL(f16, __half)
TM_ATTN_DECL(bf16, __nv_bfloat16)

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ unsigned hash(unsigned x) { x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16; return x; }
__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = hash(i * 2654435761u + seed) & 0xFF;
}
template <class T> __global__ void fill_x(T* p, size_t n, unsigned seed, float amp) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = tmk::from_float<T>(amp * ((hash(i * 747796405u + seed) & 0xFFFF) / 32768.0f - 1.0f));
}
__global__ void fill_sm(__half* s, __half* m, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sc = 0.0005f + (hash(i + seed) & 0xFF) / 256000.0f;
        s[i] = __float2half(sc);
        m[i] = __float2half(-7.5f * sc);
    }
}

struct W { unsigned char* p; __half* s; __half* m; int rows, cols; };
static W make_w(int rows, int cols, unsigned seed) {
    W w{nullptr, nullptr, nullptr, rows, cols};
    size_t pb = (size_t)rows * cols / 2, ng = (size_t)rows * (cols / 128);
    CK(cudaMalloc(&w.p, pb)); CK(cudaMalloc(&w.s, ng * 2)); CK(cudaMalloc(&w.m, ng * 2));
    fill_bytes<<<1024, 256>>>(w.p, pb, seed);
    fill_sm<<<256, 256>>>(w.s, w.m, ng, seed * 7 + 1);
    return w;
}
struct Layer { W q, k, v, o, gate, up, down; };

template <class... A> static void launch(void (*f)(A...), dim3 grid, int threads, size_t smem, cudaStream_t st, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem; cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, f, args...));
}

// gate/up+SiLU on tile-major weights with U steps in flight per warp and x loaded at use, two
// CTAs per SM (mode `g4`; silu_lnt is U = 2, silu_ln4t U = 4 with x buffered at one CTA per SM).
#define SILU_X(NAME, T, U, XPRE) TM_Q4_GEMV_SILU_X(NAME, T, U, 2, LEAN_TILED, XPRE)
SILU_X(silu_t3a_f16, __half, 3, false)
SILU_X(silu_t4a_f16, __half, 4, false)
SILU_X(silu_t3a_bf16, __nv_bfloat16, 3, false)
SILU_X(silu_t4a_bf16, __nv_bfloat16, 4, false)

template <class T> struct Ks;
#define KS(SUF, TY) template <> struct Ks<TY> { \
    static constexpr auto ln = q4_gemv_ln_##SUF; static constexpr auto ln4 = q4_gemv_ln4_##SUF; \
    static constexpr auto silu = q4_gemv_silu_ln_##SUF; \
    static constexpr auto tl = q4_gemv_lnt_##SUF; static constexpr auto tl4 = q4_gemv_ln4t_##SUF; \
    static constexpr auto silu_tl = q4_gemv_silu_lnt_##SUF; \
    static constexpr auto silu_t3a = silu_t3a_##SUF; static constexpr auto silu_t4a = silu_t4a_##SUF; \
    static constexpr auto attn = attn_decode_d128_##SUF; \
    static constexpr auto rope = tm_kernel_rope_write_kv_##SUF::rope_write_kv_##SUF; static constexpr auto arn = tm_kernel_add_rms_norm_##SUF::add_rms_norm_##SUF; };
KS(f16, __half)
KS(bf16, __nv_bfloat16)

enum Form { EARLY, LATE, NONE };
const char* form_names[] = {"early", "late", "none"};

// add_rms_norm with the ordinary (late) trigger.
template <class T> __global__ void __launch_bounds__(512) arn_late(T* out, T* resid, const T* x, const T* w, float eps, int rows, int cols) {
    tmk::pdl_wait();
    add_rms_norm_impl<T>(out, resid, x, w, eps, rows, cols);
}
// Stands in for decode attention at batch 1 (72 CTAs busy for `ns` nanoseconds), with or without
// an early trigger.
__global__ void __launch_bounds__(256) att_standin(int early, long long ns, float* sink, const char* pa, const char* pb,
                                                   long long pbytes) {
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // L2 prefetch of pbytes of each of pa and pb (64 KiB bulk prefetches spread over the CTAs)
    if (threadIdx.x == 0 && pbytes > 0) {
        for (long long off = (long long)blockIdx.x * 65536; off < pbytes; off += (long long)gridDim.x * 65536) {
            const unsigned n = (unsigned)min(65536LL, pbytes - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pa + off), "r"(n) : "memory");
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pb + off), "r"(n) : "memory");
        }
    }
    tmk::pdl_wait();
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    if (threadIdx.x == 0 && t == 0) sink[blockIdx.x] = 1.f;
}
int g_rope = 0;  // 1: rope_write_kv after q/k/v (as the engine runs it)
int g_att = 0;  // 0: no stand-in, 1: stand-in, 2: stand-in with an early trigger, 3: attn_decode itself
bool g_at_only = false;
// Decode attention itself (g_att = 3): per layer a paged cache of ACTX keys of 8 KV heads of 128
// in blocks of 64 (one shuffled block table), one sequence, split as the CUDA backend splits it at
// batch 1 (one 64-key tile per split CTA, the last CTA of each head group merging).
constexpr int ACTX = 600, ABLK = 64, APART = 64, ASPLITS = (ACTX + APART - 1) / APART;
struct AttnBufs {
    std::vector<void*> kc, vc;  // per layer
    int* meta;                  // q_start, q_len, ctx_len, bt_start
    unsigned *bt, *cnt;
    float *po, *pml;
    void* out;
};
AttnBufs g_ab;
long long g_pf = 0;    // bytes of the gate and of the up weight the stand-in prefetches into L2
long long g_pf_off = 0;  // from this byte offset
bool g_pf_only = false;
bool g_tl_only = false;
int g_silu = 0;  // gate/up on tile-major weights: 0 silu_lnt, 1 silu_t3a, 2 silu_t4a
bool g_g4_only = false;
int g_tl = 0;  // 1: the tile-major kernels (lnt, ln4t, silu_lnt: the weights read as tile-major)

template <class T> struct Bufs {
    T *resid, *delta, *normed, *q, *k, *v, *act, *gamma, *kc, *vc;
    float *sink, *inv_freq;
    unsigned *pos, *slot;
};

template <class T> static void join(Form form, Bufs<T>& b, cudaStream_t st) {
    const int H = 4096;
    const float eps = 1e-5f;
    if (form == EARLY) launch(Ks<T>::arn, 1, 512, 0, st, b.normed, b.resid, (const T*)b.delta, (const T*)b.gamma, eps, 1, H);
    if (form == LATE) launch(arn_late<T>, 1, 512, 0, st, b.normed, b.resid, (const T*)b.delta, (const T*)b.gamma, eps, 1, H);
}

template <class T> static void step(const std::vector<Layer>& Ls, Bufs<T>& b, Form form, cudaStream_t st) {
    const int H = 4096, F = 14336;
    const T* nul = nullptr;
    for (const Layer& L : Ls) {
        join(form, b, st);
        launch(g_tl ? Ks<T>::tl : Ks<T>::ln, 384, 256, 0, st, (const T*)b.normed, 1, H, 128, b.q, b.k, b.v, (const unsigned char*)L.q.p,
               (const unsigned char*)L.k.p, (const unsigned char*)L.v.p, (const __half*)L.q.s, (const __half*)L.k.s,
               (const __half*)L.v.s, (const __half*)L.q.m, (const __half*)L.k.m, (const __half*)L.v.m, nul, nul, nul,
               4096, 1024, 1024);
        if (g_rope)
            launch(Ks<T>::rope, dim3(1, 10), 256, 512, st, b.q, b.k, (const T*)b.v, b.kc, b.vc, (const unsigned*)b.pos,
                   (const unsigned*)b.slot, (const float*)b.inv_freq, 1.0f, 1, 32, 8, 128, 0);
        if (g_att && g_att < 3)
            launch(att_standin, 72, 256, 0, st, g_att == 2 ? 1 : 0, 6000LL, b.sink, (const char*)L.gate.p + g_pf_off,
                   (const char*)L.up.p + g_pf_off, g_pf);
        const T* ox = b.q;  // o's input: attention's output, or q standing in for it
        if (g_att == 3) {
            const size_t li = &L - &Ls[0];
            const AttnBufs& a = g_ab;
            launch(Ks<T>::attn, dim3(ASPLITS, 8, 1), 128, (16 + 64) * 136 * sizeof(T) * 1 + 64 * 136 * sizeof(T), st,
                   (const T*)b.q, (const T*)a.kc[li], (const T*)a.vc[li], (T*)a.out, a.po, a.pml, a.cnt,
                   (const int*)a.meta, (const int*)a.meta + 1, (const int*)a.meta + 2, (const int*)a.meta + 3,
                   (const unsigned*)a.bt, 32, 8, 4, ABLK, 1.4426950f / sqrtf(128.f), 0, ASPLITS, APART);
            ox = (const T*)a.out;
        }
        launch(g_tl ? Ks<T>::tl4 : Ks<T>::ln4, 256, 256, 0, st, ox, 1, H, 128, b.delta, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.o.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.o.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.o.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
        join(form, b, st);
        auto silu = !g_tl ? Ks<T>::silu : g_silu == 1 ? Ks<T>::silu_t3a : g_silu == 2 ? Ks<T>::silu_t4a : Ks<T>::silu_tl;
        launch(silu, 896, 256, 0, st, b.act, (const T*)b.normed, 1, H, 128, (const unsigned char*)L.gate.p,
               (const __half*)L.gate.s, (const __half*)L.gate.m, (const unsigned char*)L.up.p, (const __half*)L.up.s,
               (const __half*)L.up.m, F);
        launch(g_tl ? Ks<T>::tl4 : Ks<T>::ln4, 256, 256, 0, st, (const T*)b.act, 1, F, 128, b.delta, (T*)nullptr, (T*)nullptr,
               (const unsigned char*)L.down.p, (const unsigned char*)nullptr, (const unsigned char*)nullptr,
               (const __half*)L.down.s, (const __half*)nullptr, (const __half*)nullptr, (const __half*)L.down.m,
               (const __half*)nullptr, (const __half*)nullptr, nul, nul, nul, 4096, 0, 0);
    }
}

template <class T> static void run(const char* dt, const std::vector<Layer>& Ls) {
    const int H = 4096, F = 14336;
    Bufs<T> b;
    for (T** p : {&b.resid, &b.delta, &b.normed, &b.q, &b.act, &b.gamma}) CK(cudaMalloc(p, F * sizeof(T)));
    CK(cudaMalloc(&b.sink, 1024 * sizeof(float)));
    CK(cudaMalloc(&b.inv_freq, 64 * sizeof(float)));
    CK(cudaMemset(b.inv_freq, 0, 64 * sizeof(float)));
    CK(cudaMalloc(&b.pos, 4)); CK(cudaMemset(b.pos, 0, 4));
    CK(cudaMalloc(&b.slot, 4)); CK(cudaMemset(b.slot, 0, 4));
    CK(cudaMalloc(&b.kc, 64 * 1024 * sizeof(T))); CK(cudaMalloc(&b.vc, 64 * 1024 * sizeof(T)));
    CK(cudaMalloc(&b.k, 1024 * sizeof(T))); CK(cudaMalloc(&b.v, 1024 * sizeof(T)));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto reset = [&] {
        fill_x<T><<<64, 256>>>(b.resid, H, 11, 1.0f);
        fill_x<T><<<64, 256>>>(b.gamma, H, 13, 1.0f);
        CK(cudaMemset(b.delta, 0, H * sizeof(T)));
        CK(cudaDeviceSynchronize());
    };
    struct Case { Form form; int att; int rope; int pf_mb; int pf_off_rows; int tl; int silu; };
    const Case all[] = {{LATE, 0, 0}, {EARLY, 0, 0}, {NONE, 0, 0}, {LATE, 1, 0}, {EARLY, 2, 0}, {NONE, 2, 0},
                        {EARLY, 2, 1}, {LATE, 0, 0}, {EARLY, 0, 0}, {LATE, 1, 0}, {EARLY, 2, 0}, {EARLY, 2, 1}};
    // L2 prefetch of gate/up rows during the attention stand-in: MiB of each weight, first row.
    const Case pfc[] = {{EARLY, 2, 0, 0, 0},    {EARLY, 2, 0, 4, 0},    {EARLY, 2, 0, 8, 0}, {EARLY, 2, 0, 12, 0},
                        {EARLY, 2, 0, 16, 0},   {EARLY, 2, 0, 4, 4224}, {EARLY, 2, 0, 8, 4224}, {EARLY, 2, 0, 12, 4224},
                        {EARLY, 2, 0, 0, 0}, {EARLY, 2, 1, 0, 0}, {EARLY, 2, 1, 8, 0}};
    const Case tlc[] = {{EARLY, 2, 0, 0, 0, 0}, {EARLY, 2, 0, 0, 0, 1}, {NONE, 0, 0, 0, 0, 0}, {NONE, 0, 0, 0, 0, 1},
                        {EARLY, 2, 0, 0, 0, 0}, {EARLY, 2, 0, 0, 0, 1}, {NONE, 0, 0, 0, 0, 0}, {NONE, 0, 0, 0, 0, 1}};
    std::vector<Case> cases(g_pf_only ? std::begin(pfc) : std::begin(all), g_pf_only ? std::end(pfc) : std::end(all));
    if (g_tl_only) cases.assign(std::begin(tlc), std::end(tlc));
    const Case g4c[] = {{EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 2, 0, 0, 0, 1, 1}, {EARLY, 2, 0, 0, 0, 1, 2},
                        {NONE, 0, 0, 0, 0, 1, 0},  {NONE, 0, 0, 0, 0, 1, 1},  {NONE, 0, 0, 0, 0, 1, 2},
                        {EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 2, 0, 0, 0, 1, 1}, {EARLY, 2, 0, 0, 0, 1, 2}};
    if (g_g4_only) cases.assign(std::begin(g4c), std::end(g4c));
    const Case atc[] = {{EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 0, 0, 0, 0, 1, 0},
                        {EARLY, 2, 0, 0, 0, 1, 0}, {EARLY, 3, 0, 0, 0, 1, 0}, {EARLY, 0, 0, 0, 0, 1, 0}};
    if (g_at_only) {
        cases.assign(std::begin(atc), std::end(atc));
        AttnBufs& a = g_ab;
        const size_t per = (size_t)ASPLITS * ABLK * 8 * 128;  // elements of one layer's K (or V) cache
        a.kc.clear(); a.vc.clear();
        for (int l = 0; l < 32; ++l) {
            T *k, *v;
            CK(cudaMalloc(&k, per * sizeof(T))); CK(cudaMalloc(&v, per * sizeof(T)));
            fill_x<T><<<256, 256>>>(k, per, 1000 + l, 1.0f);
            fill_x<T><<<256, 256>>>(v, per, 2000 + l, 1.0f);
            a.kc.push_back(k); a.vc.push_back(v);
        }
        const int meta[4] = {0, 1, ACTX, 0};
        unsigned bt[ASPLITS];
        for (int i = 0; i < ASPLITS; ++i) bt[i] = (i * 7 + 3) % ASPLITS;  // a shuffled table
        CK(cudaMalloc(&a.meta, sizeof meta)); CK(cudaMemcpy(a.meta, meta, sizeof meta, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&a.bt, sizeof bt)); CK(cudaMemcpy(a.bt, bt, sizeof bt, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&a.cnt, 64 * 4)); CK(cudaMemset(a.cnt, 0, 64 * 4));
        CK(cudaMalloc(&a.po, 32 * ASPLITS * 128 * 4)); CK(cudaMalloc(&a.pml, 32 * ASPLITS * 2 * 4));
        CK(cudaMalloc(&a.out, 4096 * sizeof(T)));
    }
    printf("GEMVs trigger after their loops: %d\n", TM_Q4_GEMV_EARLY_TRIGGER);
    for (const Case& c : cases) {
        const Form form = c.form;
        g_att = c.att;
        g_rope = c.rope;
        g_pf = (long long)c.pf_mb << 20;
        g_tl = c.tl;
        g_silu = c.silu;
        g_pf_off = (long long)c.pf_off_rows * 2048;
        reset();
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        step<T>(Ls, b, form, st);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        const int iters = 50;
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        const char* att[] = {"", " + attention stand-in", " + attention stand-in (early trigger)",
                             " + attn_decode (600 keys, 10 splits)"};
        printf("%s %-9s: %7.1f us per step%s%s", dt, form_names[form], 1000.f * ms / iters, g_rope ? " + rope_write_kv" : "",
               att[g_att]);
        if (g_tl) printf(" [tile-major]");
        if (g_silu) printf(" [gate/up U = %d, x at use, 2 CTAs/SM]", g_silu + 2);
        if (g_pf) printf(", L2 prefetch of %lld MiB of gate and of up from row %d", g_pf >> 20, c.pf_off_rows);
        printf("\n");
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
}

int main(int argc, char** argv) {
    g_pf_only = argc > 1 && std::string(argv[1]) == "pf";
    g_tl_only = argc > 1 && std::string(argv[1]) == "tl";
    g_g4_only = argc > 1 && std::string(argv[1]) == "g4";
    g_at_only = argc > 1 && std::string(argv[1]) == "at";
    setvbuf(stdout, nullptr, _IONBF, 0);
    std::vector<Layer> Ls;
    for (int l = 0; l < 32; ++l) {
        unsigned s = 100 * l;
        Ls.push_back(Layer{make_w(4096, 4096, s + 1), make_w(1024, 4096, s + 2), make_w(1024, 4096, s + 3),
                           make_w(4096, 4096, s + 4), make_w(14336, 4096, s + 5), make_w(14336, 4096, s + 6),
                           make_w(4096, 14336, s + 7)});
    }
    CK(cudaDeviceSynchronize());
    run<__half>("f16", Ls);
    run<__nv_bfloat16>("bf16", Ls);
    return 0;
}
