// Runs the split-K merge of attention.cu's decode kernels on the host (see README.md): the end of
// a decode CTA (decode_merge: the four warps' merge, the partial writes, the fused combine's
// counter and the last CTA's combine_splits) and the standalone attn_combine, extracted by
// attn_merge_gen.py. One std::thread per CUDA thread, __syncthreads as a per-CTA barrier,
// atomicAdd/atomicExch as std::atomic_ref, __threadfence as a seq_cst fence; the CTAs of a launch
// run in a shuffled order, several at once. The warps' state before the merge (unnormalised rows,
// maxima, sums; empty warps past a split's last key) is random; each case compares the output with
// a double-precision merge of that state, requires every decode row written and nothing else, and
// requires the split counters to be zero after every launch (each case launches twice). Exit
// status 1 if any case fails.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
};
thread_local dim3 threadIdx, blockIdx;
static dim3 gridDim;
constexpr dim3 blockDim{128, 1, 1};
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __restrict__
struct float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
template <class T> inline T __ldcg(const T* p) { return *p; }
using std::max;
using std::min;

// One CTA: its barrier and its shared memory (by variable name).
struct Cta {
    std::barrier<> bar{128};
    std::mutex m;
    std::map<std::string, std::vector<double>> shared;  // doubles: 8-byte aligned, float4 below is fine
};
thread_local Cta* cta;
void __syncthreads() { cta->bar.arrive_and_wait(); }
void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
unsigned atomicExch(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).exchange(v); }
template <class T> T* emu_shared(const char* name, int n) {
    std::lock_guard<std::mutex> g(cta->m);
    auto& v = cta->shared[name];
    if (v.empty()) v.resize((n * sizeof(T) + 7) / 8 + 2);
    return reinterpret_cast<T*>(v.data());
}

namespace tm_attn {
template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
#include "attn_merge_emu.inc"
}  // namespace tm_attn
using tm_attn::DecodeRange;

// Runs `body` on every CTA of `grid` (128 threads each), in a shuffled order, `wave` CTAs at once.
static std::mt19937_64 rng(11);
static void run_grid(dim3 grid, const std::function<void()>& body, int wave = 6) {
    gridDim = grid;
    std::vector<dim3> ctas;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) ctas.push_back(dim3{x, y, z});
    std::shuffle(ctas.begin(), ctas.end(), rng);
    for (size_t first = 0; first < ctas.size(); first += wave) {
        std::vector<std::unique_ptr<Cta>> group;
        std::vector<std::thread> th;
        for (size_t c = first; c < std::min(ctas.size(), first + wave); ++c) {
            group.push_back(std::make_unique<Cta>());
            Cta* k = group.back().get();
            for (unsigned t = 0; t < 128; ++t)
                th.emplace_back([=, &body] {
                    cta = k;
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = ctas[c];
                    body();
                });
        }
        for (auto& t : th) t.join();
    }
}

// The random state of warp w of CTA (seq, y, split) before the merge: row i's max (log2 domain),
// sum, and unnormalised output value at d. Deterministic, so the reference can recompute it.
static double hash01(uint64_t a) {
    a ^= a >> 33;
    a *= 0xff51afd7ed558ccdull;
    a ^= a >> 33;
    a *= 0xc4ceb9fe1a85ec53ull;
    a ^= a >> 33;
    return (double)(a >> 11) / (double)(1ull << 53);
}
static uint64_t key(int seq, int y, int split, int w, int i, int d, int what) {
    return ((((((uint64_t)seq * 131 + y) * 257 + split) * 5 + w) * 17 + i) * 263 + d) * 3 + what + 0x9e3779b97f4a7c15ull;
}
struct Case {
    const char* what;
    int heads, kv_heads, window, num_splits, partition;
    std::vector<int> q_len, ctx_len;
};
static bool warp_empty(const DecodeRange& rg, int split, int partition, int w) {
    int kb, ke;
    tm_attn::split_keys(rg, split, partition, kb, ke);
    return ke - kb <= 16 * w;  // one tile: warp w takes keys 16w .. 16w + 15
}
static float st_m(int seq, int y, int split, int w, int i) { return (float)(8 * hash01(key(seq, y, split, w, i, 0, 0)) - 4); }
static float st_l(int seq, int y, int split, int w, int i) { return (float)(1 + 63 * hash01(key(seq, y, split, w, i, 0, 1))); }
static float st_o(int seq, int y, int split, int w, int i, int d) {
    return st_l(seq, y, split, w, i) * (float)(2 * hash01(key(seq, y, split, w, i, d, 2)) - 1);
}

static int failures = 0;

// The grid's head sub-groups: (heads per CTA gs, sub-groups per KV head).
template <int R> static void sub_groups(int group, int& gs, int& n_sub) {
    gs = std::min(group, R);
    n_sub = (group + gs - 1) / gs;
}

template <int D, int R> static void run_case(const Case& c, bool fused) {
    const int seqs = (int)c.q_len.size(), group = c.heads / c.kv_heads;
    int gs, n_sub;
    sub_groups<R>(group, gs, n_sub);
    std::vector<int> q_start(seqs);
    int total_q = 0;
    for (int s = 0; s < seqs; ++s) q_start[s] = total_q, total_q += c.q_len[s];
    std::vector<float> out((size_t)total_q * c.heads * D);
    std::vector<float> part_o((size_t)seqs * c.heads * c.num_splits * D, NAN);
    std::vector<float> part_ml((size_t)seqs * c.heads * c.num_splits * 2, NAN);
    std::vector<unsigned> counters((size_t)seqs * c.kv_heads * n_sub, 0);
    for (int launch = 0; launch < 2; ++launch) {
        std::fill(out.begin(), out.end(), NAN);
        // the decode kernel's end (the key loop's results drawn at random)
        run_grid(dim3{(unsigned)c.num_splits, (unsigned)(c.kv_heads * n_sub), (unsigned)seqs}, [&] {
            const int seq = blockIdx.z, split = blockIdx.x, y = blockIdx.y;
            if (c.q_len[seq] != 1) return;
            const DecodeRange rg = tm_attn::decode_range(c.ctx_len[seq], c.window, c.num_splits, c.partition);
            if (split >= rg.used) return;
            const int kvh = y / n_sub, g0 = (y - kvh * n_sub) * gs;
            float* sO = emu_shared<float>("sO", 4 * R * D);
            auto s_m = reinterpret_cast<float(*)[R]>(emu_shared<float>("s_m", 4 * R));
            auto s_l = reinterpret_cast<float(*)[R]>(emu_shared<float>("s_l", 4 * R));
            auto s_f = reinterpret_cast<float(*)[R]>(emu_shared<float>("s_f", 4 * R));
            if (threadIdx.x == 0) {
                for (int w = 0; w < 4; ++w)
                    for (int i = 0; i < R; ++i) {
                        const bool empty = warp_empty(rg, split, c.partition, w);
                        s_m[w][i] = empty ? tm_attn::neg_inf() : st_m(seq, y, split, w, i);
                        s_l[w][i] = empty ? 0.f : st_l(seq, y, split, w, i);
                        for (int d = 0; d < D; ++d) sO[(w * R + i) * D + d] = empty ? 0.f : st_o(seq, y, split, w, i, d);
                    }
            }
            __syncthreads();
            tm_attn::decode_merge<float, D, R>(sO, s_m, s_l, s_f, std::min(gs, group - g0), kvh * group + g0, rg,
                                               q_start[seq], seq, c.heads, c.num_splits, split, out.data(),
                                               part_o.data(), part_ml.data(), fused ? counters.data() : nullptr);
        });
        if (!fused) {
            run_grid(dim3{(unsigned)c.heads, (unsigned)seqs, 1}, [&] {
                tm_attn::attn_combine<float>(out.data(), part_o.data(), part_ml.data(), q_start.data(), c.q_len.data(),
                                             c.ctx_len.data(), c.heads, D, c.window, c.num_splits, c.partition);
            });
        }
        // the reference
        double worst = 0;
        int bad = 0, unwritten = 0, stray = 0;
        for (int s = 0; s < seqs; ++s) {
            for (int r = 0; r < c.q_len[s]; ++r)
                for (int h = 0; h < c.heads; ++h)
                    for (int d = 0; d < D; ++d) {
                        const float g = out[((size_t)(q_start[s] + r) * c.heads + h) * D + d];
                        if (c.q_len[s] != 1) {
                            stray += !std::isnan(g);
                            continue;
                        }
                        const DecodeRange rg = tm_attn::decode_range(c.ctx_len[s], c.window, c.num_splits, c.partition);
                        const int kvh = h / group, member = h - kvh * group, y = kvh * n_sub + member / gs,
                                  i = member % gs;
                        double mx = -INFINITY;
                        for (int k = 0; k < rg.used; ++k)
                            for (int w = 0; w < 4; ++w)
                                if (!warp_empty(rg, k, c.partition, w)) mx = std::max(mx, (double)st_m(s, y, k, w, i));
                        double num = 0, den = 0;
                        for (int k = 0; k < rg.used; ++k)
                            for (int w = 0; w < 4; ++w) {
                                if (warp_empty(rg, k, c.partition, w)) continue;
                                const double e = std::exp2((double)st_m(s, y, k, w, i) - mx);
                                num += e * st_o(s, y, k, w, i, d);
                                den += e * st_l(s, y, k, w, i);
                            }
                        const double want = num / den;
                        if (std::isnan(g)) {
                            ++unwritten;
                            continue;
                        }
                        const double e = std::fabs(g - want) / (1 + std::fabs(want));
                        worst = std::max(worst, e);
                        bad += e > 1e-5;
                    }
        }
        int dirty = 0;
        for (unsigned v : counters) dirty += v != 0;
        const bool ok = bad == 0 && unwritten == 0 && stray == 0 && dirty == 0;
        failures += !ok;
        printf("%s %s D %d R %d %s launch %d: worst %.1e, %d bad, %d unwritten, %d stray, %d counters left non-zero\n",
               ok ? "ok  " : "FAIL", c.what, D, R, fused ? "fused" : "attn_combine", launch + 1, worst, bad, unwritten,
               stray, dirty);
    }
}

template <int D, int R> static void both(const Case& c) {
    run_case<D, R>(c, true);
    run_case<D, R>(c, false);
}

int main() {
    // (what, heads, kv_heads, window, num_splits, partition, q_len, ctx_len)
    const Case llama_b1{"GQA 4 batch 1, 550 keys, 9 splits", 32, 8, 0, 9, 64, {1}, {550}};
    const Case gqa8_64{"GQA 8 batch 1, 4096 keys, 64 splits", 32, 4, 0, 64, 64, {1}, {4096}};
    const Case uneven{"GQA 4, 4 seqs of 3000/1/200/1300 keys (direct, 4, 21, 47 splits)", 32, 8, 0, 47, 64,
                      {1, 1, 1, 1}, {3000, 1, 200, 1300}};
    const Case mixed{"GQA 4, decode + prefill (the prefill rows untouched), partition 128", 32, 8, 0, 32, 128,
                     {1, 1, 40, 1}, {37, 4000, 90, 650}};
    const Case windowed{"GQA 8, window 1000 of 3000 keys, 16 splits", 32, 4, 1000, 16, 64, {1, 1}, {3000, 700}};
    const Case subgroups{"GQA 32 (two 16-head sub-groups), 24 splits", 32, 1, 0, 24, 64, {1, 1}, {1500, 700}};
    const Case gqa7{"GQA 7, 47 splits, a 2-key last split (empty warps)", 14, 2, 0, 47, 64, {1}, {2946}};
    const Case two{"GQA 4, 2 splits", 32, 8, 0, 2, 64, {1}, {100}};
    // the 16-row kernel (R = 16)
    both<128, 16>(llama_b1);
    both<128, 16>(uneven);
    both<128, 16>(mixed);
    both<64, 16>(subgroups);
    both<64, 16>(gqa7);
    both<32, 16>(two);
    both<32, 16>(subgroups);
    both<128, 16>(gqa8_64);
    // the transposed fp8 kernel (R = 8, groups up to 8)
    both<128, 8>(llama_b1);
    both<128, 8>(gqa8_64);
    both<128, 8>(windowed);
    both<128, 8>(uneven);
    both<128, 8>(two);
    printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
}
