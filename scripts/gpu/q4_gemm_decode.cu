// Development harness for the sm_90a int4 GEMM (q4_gemm.cu's wgmma kernels) at decode batches
// of 16-64 tokens, where a Llama-3-8B layer's products are small grids: compiled with the GPU
// machine's own nvcc (no Rust build):
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I crates/tm-kernels/cuda \
//        -o /tmp/q4d scripts/gpu/q4_gemm_decode.cu && /tmp/q4d 64
//
// It builds 32 Llama-3-8B-shaped int4 layers (random nibbles, group 128, the CUDA backend's
// layouts: tile-major, gate and up with tile-ordered scales) and captures one decode step of
// their products (q, k, v, o, gate, up, down; no attention, norms or SiLU) into a CUDA graph,
// every launch with programmatic stream serialization as tm's CUDA backend launches them, then
// times its replays. Configurations differ in the tile (`v`: 128 tokens, one block per SM; `u`:
// 64 tokens, two), in the split-K rule's target (blocks the grid should fill: the SMs, or twice
// them for `u`), and in whether q/k/v and gate/up run as one launch each (`multi`: the blocks of
// up to three weights in one grid). Each configuration's outputs are compared with the first's.
// `q4d N REPS C` instead launches configuration C's gate/up products once per layer without a
// graph (for ncu: --launch-skip 4 --launch-count 1 -k regex:multi_gemm).
//
// Measured (H200, 2026-12-04, f16, us per step of the 32 layers' products; the shipped choices in
// q4_gemm.rs): 64 tokens `v` per weight 6313-6335, `u` 5200, `u` with q/k/v and gate/up one launch
// each 4282-4284, `y` so 3606-3618 (u6 / u8: six / eight stages 4340 / 4456; `y` with the split-K
// target at the SMs 3605, three / four times them 4046 / 4629; gate/up as two launches 4266; three
// stages 3588); 32 tokens `y` 3348-3367, the 32-token `z` 2916 (six stages 3009; three blocks per
// SM at 85 registers 4464); 16 tokens `u` per weight 4792, `y` 3237-3249, `z` 2794-2809, the
// 16-token `q` 2658-2664 (three blocks per SM at 80 registers, 72 B spilled, 3676; six stages 2725;
// the split-K target at the SMs 2750); 9 tokens `z` 2765, `q` 2626-2633. Not kept: the
// split-K sums added up by each tile's last slice (an arrival counter per tile, the
// threadFenceReduction pattern) instead of `matmul_q4_gemm_reduce`: 64 tokens 4182 against 3893
// (o with 8 slices 639 against 493), 32 tokens (`z`) 3132 against 3048, 16 tokens 2941 against
// 2936: one block summing a tile's 5-8 slices serially is slower than the reduce kernel's grid.
// ncu of `y`'s gate/up at 64 tokens (224 blocks, 50.4 us): issue slots 50% busy, 0.95 of 3.32
// warps eligible per scheduler; stalls per issue: wait 1.28, long scoreboard 1.04, not selected
// 0.89, dispatch 0.68, math pipe 0.65, gmma 0.35, barrier 0.23; DRAM 27% of peak.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string>
#include <algorithm>
#include <cuda_runtime.h>
#include "q4_gemm.cu"

#define CK(x)                                                                                \
    do {                                                                                     \
        cudaError_t e = (x);                                                                 \
        if (e != cudaSuccess) {                                                              \
            printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e));              \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

__device__ unsigned hash(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352d;
    x ^= x >> 15;
    x *= 0x846ca68b;
    x ^= x >> 16;
    return x;
}
__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = hash(i * 2654435761u + seed) & 0xFF;
}
__global__ void fill_x(__half* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = __float2half((hash(i * 747796405u + seed) & 0xFFFF) / 32768.0f - 1.0f);
}
__global__ void fill_sm(__half* s, __half* m, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float sc = 0.002f + (hash(i + seed) & 0xFF) / 65536.0f;
        s[i] = __float2half(sc);
        m[i] = __float2half(-8.f * sc);
    }
}

// Up to three products of one x in one grid: weight i owns nblk[i] * splits[i] blocks (block b of
// them: rows bx = b % nblk, K slice bz = b / nblk).
struct Multi {
    __half* out[3];
    const unsigned char* packed[3];
    const __half* s[3];
    const __half* m[3];
    float* partial[3];
    int rows[3], tiled[3], kcols[3], nblk[3], splits[3];
    int count;
};

template <int NTOK, int ST, int SUBS, int MINB>
__global__ void __launch_bounds__(256, MINB) multi_gemm(Multi p, const __half* x, int n, int cols, int group) {
    tmk::pdl_wait();
    int b = blockIdx.x, i = 0;
    const int nb0 = p.nblk[0] * p.splits[0], nb1 = p.nblk[1] * p.splits[1];
    if (b >= nb0) {
        b -= nb0;
        i = 1;
        if (b >= nb1) {
            b -= nb1;
            i = 2;
        }
    }
#define PICK(f) (i == 0 ? p.f[0] : i == 1 ? p.f[1] : p.f[2])
    const int nblk = PICK(nblk);
    tmw::q4_gemm_wgmma<__half, NTOK, ST, SUBS>(PICK(out), PICK(partial), x, PICK(packed), PICK(s), PICK(m), n,
                                                 PICK(rows), cols, group, PICK(tiled), PICK(kcols), b % nblk,
                                                 b / nblk);
#undef PICK
}

// The split sums of up to three products: out_i = sum over z of partial_i[z count_i + ...].
struct MultiReduce {
    __half* out[3];
    const float* partial[3];
    int splits[3], count[3];
    int n;
};
__global__ void multi_reduce(MultiReduce p) {
    tmk::pdl_wait();
    for (int i = 0; i < p.n; ++i) {
        const int quads = p.count[i] >> 2;
        for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < quads; q += gridDim.x * blockDim.x) {
            float4 v = __ldcg(reinterpret_cast<const float4*>(p.partial[i]) + q);
            for (int z = 1; z < p.splits[i]; ++z) {
                const float4 w = __ldcg(reinterpret_cast<const float4*>(p.partial[i] + (long long)z * p.count[i]) + q);
                v.x += w.x;
                v.y += w.y;
                v.z += w.z;
                v.w += w.w;
            }
            __half* o = p.out[i] + 4ll * q;
            o[0] = __float2half(v.x);
            o[1] = __float2half(v.y);
            o[2] = __float2half(v.z);
            o[3] = __float2half(v.w);
        }
    }
}

struct Weight {
    unsigned char* packed;
    __half *s, *m;
    int rows, cols, tiled;
};

static Weight make_weight(int rows, int cols, int tiled, unsigned seed) {
    Weight w{nullptr, nullptr, nullptr, rows, cols, tiled};
    size_t pb = (size_t)rows * cols / 2, ng = (size_t)rows * (cols / 128);
    CK(cudaMalloc(&w.packed, pb));
    CK(cudaMalloc(&w.s, ng * 2));
    CK(cudaMalloc(&w.m, ng * 2));
    fill_bytes<<<1024, 256>>>(w.packed, pb, seed);
    fill_sm<<<256, 256>>>(w.s, w.m, ng, seed * 7 + 1);
    return w;
}

struct Kern {
    const char* name;
    const void* f;
    int ntok, smem, minb;
};

template <int NTOK, int ST, int SUBS, int MINB> Kern kern(const char* name) {
    const void* f = (const void*)multi_gemm<NTOK, ST, SUBS, MINB>;
    const int smem = tmw::Shape<NTOK, ST, SUBS>::SMEM;
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, f));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, f, 256, smem));
    printf("kernel %-4s NTOK %3d stages %d subs %d: %3d registers, %3d B local, %6d B shared, %d blocks per SM\n", name,
           NTOK, ST, SUBS, a.numRegs, (int)a.localSizeBytes, smem, occ);
    return Kern{name, f, NTOK, smem, occ};
}

static int SMS = 132;

// The engine's split rule (q4_gemm.rs `split_k`) with `target` blocks to fill instead of the SMs.
static int split_for(int blocks, int cols, int target) {
    if (cols % 128 || blocks * 2 > target) return 1;
    int want = std::min(std::min(target / blocks, 16), cols / 256);
    if (want < 2) return 1;
    int units = (cols / 128 + want - 1) / want;
    int kc = units * 128;
    return (cols + kc - 1) / kc;
}

static void launch(const void* f, dim3 grid, int smem, void** args, cudaStream_t st) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelExC(&cfg, f, args));
}

// One launch of up to three products of x [n, cols] (and its reduce when split).
static void products(const Kern& k, int target, const std::vector<Weight*>& ws, const std::vector<__half*>& outs,
                     const __half* x, int n, float* scratch, cudaStream_t st) {
    Multi p = {};
    MultiReduce r = {};
    const int cols = ws[0]->cols;
    int blocks = 0;
    for (size_t i = 0; i < ws.size(); ++i) blocks += (ws[i]->rows + 127) / 128;
    const int splits = split_for(blocks, cols, target);
    const int kcols = splits > 1 ? ((cols / 128 + splits - 1) / splits) * 128 : cols;
    const int splits_real = (cols + kcols - 1) / kcols;
    size_t off = 0;
    int total = 0;
    for (int i = 0; i < 3; ++i) {
        const int j = i < (int)ws.size() ? i : (int)ws.size() - 1;
        const Weight& w = *ws[j];
        p.out[i] = outs[j];
        p.packed[i] = w.packed;
        p.s[i] = w.s;
        p.m[i] = w.m;
        p.rows[i] = w.rows;
        p.tiled[i] = w.tiled;
        p.kcols[i] = kcols;
        p.nblk[i] = (w.rows + 127) / 128;
        p.splits[i] = i < (int)ws.size() ? splits_real : 0;
        p.partial[i] = nullptr;
        if (i < (int)ws.size()) {
            if (splits_real > 1) {
                p.partial[i] = scratch + off;
                r.out[i] = outs[j];
                r.partial[i] = scratch + off;
                r.splits[i] = splits_real;
                r.count[i] = n * w.rows;
                off += (size_t)splits_real * n * w.rows;
            }
            total += p.nblk[i] * splits_real;
        }
    }
    p.count = (int)ws.size();
    r.n = splits_real > 1 ? (int)ws.size() : 0;
    int group = 128;
    void* args[] = {&p, (void*)&x, &n, (void*)&cols, &group};
    launch(k.f, dim3(total, (n + k.ntok - 1) / k.ntok, 1), k.smem, args, st);
    if (r.n) {
        int quads = 0;
        for (int i = 0; i < r.n; ++i) quads += r.count[i] / 4;
        int blocks_r = std::min((quads + 255) / 256, SMS * 8);
        void* rargs[] = {&r};
        launch((const void*)multi_reduce, dim3(blocks_r), 0, rargs, st);
    }
}

struct Layer {
    Weight q, k, v, o, gate, up, down;
};

struct Config {
    std::string name;
    Kern k;
    int target;
    bool fuse_qkv, fuse_gu;
};

struct Bufs {
    __half *x4, *x14, *q, *k, *v, *o, *gate, *up, *down;
    float* scratch;
};

// What a step's products are: all, or one class (q/k/v, o, gate/up, down) for the breakdown.
enum Part { ALL, QKV, O, GU, DOWN };

static void step(const Config& c, std::vector<Layer>& L, Bufs& b, int n, Part part, cudaStream_t st) {
    for (auto& l : L) {
        if (part == ALL || part == QKV) {
            if (c.fuse_qkv)
                products(c.k, c.target, {&l.q, &l.k, &l.v}, {b.q, b.k, b.v}, b.x4, n, b.scratch, st);
            else {
                products(c.k, c.target, {&l.q}, {b.q}, b.x4, n, b.scratch, st);
                products(c.k, c.target, {&l.k}, {b.k}, b.x4, n, b.scratch, st);
                products(c.k, c.target, {&l.v}, {b.v}, b.x4, n, b.scratch, st);
            }
        }
        if (part == ALL || part == O) products(c.k, c.target, {&l.o}, {b.o}, b.x4, n, b.scratch, st);
        if (part == ALL || part == GU) {
            if (c.fuse_gu)
                products(c.k, c.target, {&l.gate, &l.up}, {b.gate, b.up}, b.x4, n, b.scratch, st);
            else {
                products(c.k, c.target, {&l.gate}, {b.gate}, b.x4, n, b.scratch, st);
                products(c.k, c.target, {&l.up}, {b.up}, b.x4, n, b.scratch, st);
            }
        }
        if (part == ALL || part == DOWN) products(c.k, c.target, {&l.down}, {b.down}, b.x14, n, b.scratch, st);
    }
}

static float time_graph(const Config& c, std::vector<Layer>& L, Bufs& b, int n, Part part, cudaStream_t st, int reps) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    step(c, L, b, n, part, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return t[t.size() / 2];
}

static std::vector<__half> host(const __half* d, size_t count) {
    std::vector<__half> h(count);
    CK(cudaMemcpy(h.data(), d, count * 2, cudaMemcpyDeviceToHost));
    return h;
}

int main(int argc, char** argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 64;
    const int reps = argc > 2 ? atoi(argv[2]) : 20;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    SMS = prop.multiProcessorCount;
    printf("%s, %d SMs, n = %d\n", prop.name, SMS, n);
    std::vector<Layer> L(32);
    unsigned seed = 1;
    for (auto& l : L) {
        l.q = make_weight(4096, 4096, 1, seed++);
        l.k = make_weight(1024, 4096, 1, seed++);
        l.v = make_weight(1024, 4096, 1, seed++);
        l.o = make_weight(4096, 4096, 1, seed++);
        l.gate = make_weight(14336, 4096, 2, seed++);
        l.up = make_weight(14336, 4096, 2, seed++);
        l.down = make_weight(4096, 14336, 1, seed++);
    }
    Bufs b;
    CK(cudaMalloc(&b.x4, (size_t)n * 4096 * 2));
    CK(cudaMalloc(&b.x14, (size_t)n * 14336 * 2));
    fill_x<<<256, 256>>>(b.x4, (size_t)n * 4096, 11);
    fill_x<<<256, 256>>>(b.x14, (size_t)n * 14336, 12);
    for (__half** o : {&b.q, &b.o, &b.down}) CK(cudaMalloc(o, (size_t)n * 4096 * 2));
    for (__half** o : {&b.k, &b.v}) CK(cudaMalloc(o, (size_t)n * 1024 * 2));
    for (__half** o : {&b.gate, &b.up}) CK(cudaMalloc(o, (size_t)n * 14336 * 2));
    CK(cudaMalloc(&b.scratch, (size_t)16 * n * 28672 * 4));
    CK(cudaDeviceSynchronize());

    Kern v = kern<128, 4, 1, 1>("v");
    Kern u = kern<64, 4, 1, 1>("u");
    Kern y = kern<64, 4, 2, 2>("y");    // the shipped y: 128-column k-tiles
    Kern y3 = kern<64, 3, 2, 2>("y3");  // three stages
    Kern t = kern<32, 4, 2, 2>("t");    // the shipped z: 32 tokens, two blocks per SM
    Kern t3 = kern<32, 4, 2, 3>("t3");  // 32 tokens, three blocks per SM
    Kern t6 = kern<32, 6, 2, 2>("t6");  // 32 tokens, six stages
    Kern q = kern<16, 4, 2, 2>("q");    // 16 tokens, two blocks per SM
    Kern q3 = kern<16, 4, 2, 3>("q3");  // 16 tokens, three blocks per SM
    Kern q6 = kern<16, 6, 2, 2>("q6");  // 16 tokens, six stages

    std::vector<Config> cs = {
        {"v engine-old", v, SMS, false, false},
        {"y 2x gu qkv", y, 2 * SMS, true, true},
        {"t 2x gu qkv", t, 2 * SMS, true, true},
        {"q 2x gu qkv", q, 2 * SMS, true, true},
        {"q 1x gu qkv", q, SMS, true, true},
        {"q3 3x gu qkv", q3, 3 * SMS, true, true},
        {"q3 2x gu qkv", q3, 2 * SMS, true, true},
        {"q6 2x gu qkv", q6, 2 * SMS, true, true},
        {"t 2x gu qkv", t, 2 * SMS, true, true},
        {"q 2x gu qkv", q, 2 * SMS, true, true},
    };
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    if (argc > 3) {  // `q4d N REPS C`: configuration C's gate/up launches once per layer, no graph (for ncu)
        const Config& c = cs[std::min((size_t)atoi(argv[3]), cs.size() - 1)];
        printf("eager gate/up of %s\n", c.name.c_str());
        step(c, L, b, n, GU, st);
        CK(cudaStreamSynchronize(st));
        return 0;
    }
    std::vector<std::vector<__half>> ref;
    for (auto& c : cs) {
        if (c.k.minb < 1 || c.k.ntok < n) continue;  // shapes narrower than the batch: not candidates
        float t[5];
        for (int p = 0; p < 5; ++p) t[p] = time_graph(c, L, b, n, (Part)p, st, reps);
        // Outputs of the last layer, against the first configuration's.
        std::vector<std::pair<__half*, size_t>> outs = {{b.q, (size_t)n * 4096},  {b.k, (size_t)n * 1024},
                                                        {b.v, (size_t)n * 1024},  {b.o, (size_t)n * 4096},
                                                        {b.gate, (size_t)n * 14336}, {b.up, (size_t)n * 14336},
                                                        {b.down, (size_t)n * 4096}};
        CK(cudaDeviceSynchronize());
        double worst = 0;
        size_t diff = 0;
        for (size_t i = 0; i < outs.size(); ++i) {
            auto h = host(outs[i].first, outs[i].second);
            if (ref.size() < outs.size()) {
                ref.push_back(h);
                continue;
            }
            double mx = 0;
            for (auto& e : ref[i]) mx = std::max(mx, (double)fabsf(__half2float(e)));
            for (size_t j = 0; j < h.size(); ++j) {
                double d = fabs((double)__half2float(h[j]) - (double)__half2float(ref[i][j]));
                if (d > 0) ++diff;
                worst = std::max(worst, d / (mx > 0 ? mx : 1));
            }
        }
        printf("%-16s step %8.1f us | qkv %7.1f o %7.1f gu %7.1f down %7.1f (32 layers) | outputs differing %zu, worst %.2e of max\n",
               c.name.c_str(), t[0], t[1], t[2], t[3], t[4], diff, worst);
    }
    return 0;
}
