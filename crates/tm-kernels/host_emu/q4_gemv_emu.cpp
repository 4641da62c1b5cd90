// Runs q4_gemv.cu's kernels on the host (see README.md): one std::thread per CUDA thread of a CTA,
// mma.sync emulated per warp from the PTX fragment layouts, __syncthreads as a barrier. Each case
// compares the kernel's output with a double-precision product of the dequantized weights, within
// the conformance tolerances (f16 2e-3, bf16 2e-2, SiLU twice that, relative to rms(row) + |want|),
// and requires every output element to be written. Exit status 1 if any case fails.
#include <thread>
#include <vector>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <functional>
#include <cstring>
#include "q4_gemv_emu.inc"  // q4_gemv.cu with its inline PTX replaced (gen.py)

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
static std::unique_ptr<std::barrier<>> cta_bar;
struct WarpX { std::unique_ptr<std::barrier<>> bar; unsigned a[32][4]; unsigned b[32][2]; float f[32]; };
static WarpX warps[8];
void __syncthreads() { cta_bar->arrive_and_wait(); }
// Every lane of the warp calls it (as the kernels do): lane l gets lane (l ^ lane_mask)'s value.
float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    int lane = threadIdx.x & 31;
    WarpX& W = warps[threadIdx.x >> 5];
    W.f[lane] = v;
    W.bar->arrive_and_wait();
    const float r = W.f[lane ^ lane_mask];
    W.bar->arrive_and_wait();
    return r;
}

static float elem(unsigned reg, int hi, bool bf16) {
    uint16_t v = hi ? reg >> 16 : reg & 0xffff;
    return bf16 ? __bfloat162float(__nv_bfloat16{v}) : __half2float(__half{v});
}
void emu_mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1, bool bf16) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    WarpX& W = warps[w];
    for (int i = 0; i < 4; ++i) W.a[lane][i] = a[i];
    W.b[lane][0] = b0; W.b[lane][1] = b1;
    W.bar->arrive_and_wait();
    int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; ++e) {
        int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float sum = c[e];
        for (int k = 0; k < 16; ++k) {
            // A[row][k]: lane (row%8)*4 + (k%8)/2, reg (row>=8) + 2*(k>=8), half k%2
            float av = elem(W.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2, bf16);
            // B[k][col]: lane col*4 + (k%8)/2, reg k>=8, half k%2
            float bv = elem(W.b[col * 4 + (k % 8) / 2][k >= 8], k % 2, bf16);
            sum += av * bv;
        }
        c[e] = sum;
    }
    W.bar->arrive_and_wait();
}

static void run_grid(int ctas, const std::function<void()>& body) {
    for (int b = 0; b < ctas; ++b) {
        cta_bar = std::make_unique<std::barrier<>>(256);
        for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
        std::vector<std::thread> th;
        for (int t = 0; t < 256; ++t)
            th.emplace_back([=, &body] { threadIdx = dim3{(unsigned)t, 0, 0}; blockIdx = dim3{(unsigned)b, 0, 0}; body(); });
        for (auto& t : th) t.join();
    }
}

static std::mt19937_64 rng(7);
struct Q { int rows, cols, group; std::vector<uint8_t> packed; std::vector<__half> s, m; std::vector<double> w; };
static float amp = 0;  // when set: weights like tm_quant's of uniform(-amp, amp)
static Q make_q(int rows, int cols, int group) {
    if (cols % group != 0 || group % 32 != 0) {  // the launcher's requirements: a case must meet them
        fprintf(stderr, "bad case: cols %d, group %d\n", cols, group);
        std::exit(2);
    }
    Q q{rows, cols, group};
    q.packed.resize((size_t)rows * cols / 2);
    int groups = cols / group;
    q.s.resize((size_t)rows * groups); q.m.resize(q.s.size());
    std::uniform_real_distribution<float> su(0.01f, 0.03f), mu(-0.25f, 0.05f);
    for (auto& v : q.s) v = __float2half_rn(amp > 0 ? 2 * amp / 15 * (0.9f + 0.1f * su(rng) / 0.03f) : su(rng));
    for (size_t i = 0; i < q.m.size(); ++i) q.m[i] = __float2half_rn(amp > 0 ? -7.5f * __half2float(q.s[i]) * (0.95f + 0.1f * (rng() % 100) / 100.f) : mu(rng));
    std::vector<int> qq((size_t)rows * cols);
    for (auto& v : qq) v = rng() % 16;
    for (int r = 0; r < rows; ++r)
        for (int c0 = 0; c0 < cols; c0 += 32)
            for (int i = 0; i < 16; ++i)
                q.packed[(size_t)r * cols / 2 + c0 / 2 + i] = qq[(size_t)r * cols + c0 + i] | (qq[(size_t)r * cols + c0 + 16 + i] << 4);
    q.w.resize((size_t)rows * cols);
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
            size_t gi = (size_t)r * groups + c / group;
            const double sv = __half2float(q.s[gi]), mv = __half2float(q.m[gi]);
            q.w[(size_t)r * cols + c] = qq[(size_t)r * cols + c] * sv + mv;
        }
    return q;
}

// The tile-major copy of a row-major packed weight (tm-core `tile_int4`, via the kernels' own
// `tmk::q4_chunk_offset`), for the lean kernels' `*t` forms.
static std::vector<uint8_t> tiled(const Q& q) {
    std::vector<uint8_t> t(q.packed.size());
    for (int r = 0; r < q.rows; ++r)
        for (int b = 0; b < q.cols / 32; ++b)
            std::memcpy(&t[tmk::q4_chunk_offset(r, b, q.cols, 1)], &q.packed[(size_t)r * q.cols / 2 + 16 * b], 16);
    return t;
}

// Row-major per-group values [rows][groups] in tile order (tm-core `Int4Layout::TilesAndScales16x128`,
// what `silu_lnts` reads), via the kernels' own `tmk::q4_scale_index`.
static std::vector<__half> tile_order(const std::vector<__half>& v, int rows, int groups) {
    std::vector<__half> t(v.size());
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < groups; ++g) t[tmk::q4_scale_index(r, g, groups, 2)] = v[(size_t)r * groups + g];
    return t;
}

// x . W^T in double from the dequantized weights: [n][rows] for x [n][cols].
static std::vector<double> product(const Q& q, const std::vector<double>& xd, int n) {
    std::vector<double> y((size_t)n * q.rows);
    for (int j = 0; j < n; ++j)
        for (int r = 0; r < q.rows; ++r) {
            double acc = 0;
            for (int c = 0; c < q.cols; ++c) acc += xd[(size_t)j * q.cols + c] * q.w[(size_t)r * q.cols + c];
            y[(size_t)j * q.rows + r] = acc;
        }
    return y;
}

// The kernel form a case code U names (the cases' U): 2 u2, 16 n16, 7 / 67 ln, 8 / 68 ln4,
// 17 / 77 lnt, 18 / 78 ln4t (SiLU / plain and join), 19 lnts.
static const char* form_name(int U) {
    switch (U) {
    case 16: return "n16";
    case 7: case 67: return "ln";
    case 8: case 68: return "ln4";
    case 17: case 77: return "lnt";
    case 18: case 78: return "ln4t";
    case 19: return "lnts";
    default: return "u2";
    }
}

template <class T> static T to_t(float v);
template <> __half to_t<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
static float from_t(__half v) { return __half2float(v); }
static float from_t(__nv_bfloat16 v) { return __bfloat162float(v); }

static int failures = 0;
template <class T>
static void check(const char* what, const std::vector<T>& got, const std::vector<double>& want, int n, int rows, double tol) {
    double worst = 0; int bad = 0, nan = 0;
    for (int j = 0; j < n; ++j) {
        double rms = 0;
        for (int r = 0; r < rows; ++r) rms += want[(size_t)j * rows + r] * want[(size_t)j * rows + r];
        rms = std::sqrt(rms / rows);
        for (int r = 0; r < rows; ++r) {
            double g = from_t(got[(size_t)j * rows + r]), w = want[(size_t)j * rows + r];
            if (std::isnan(g)) { ++nan; continue; }
            double e = std::fabs(g - w) / (rms + std::fabs(w));
            worst = std::max(worst, e);
            if (e > tol) ++bad;
        }
    }
    bool ok = bad == 0 && nan == 0;
    if (!ok) ++failures;
    printf("%s %s: worst %.2e (tol %.0e), %d bad, %d unwritten\n", ok ? "ok  " : "FAIL", what, worst, tol, bad, nan);
}

template <class T>
static void case_plain(const char* dt, int U, int n, std::vector<int> rowsv, int cols, int group, bool bias) {
    std::vector<Q> qs; for (int r : rowsv) qs.push_back(make_q(r, cols, group));
    std::normal_distribution<float> nd(0, 1);
    std::vector<T> x((size_t)n * cols); std::vector<double> xd(x.size());
    for (size_t i = 0; i < x.size(); ++i) { x[i] = to_t<T>(nd(rng)); xd[i] = from_t(x[i]); }
    std::vector<std::vector<T>> outs, biases; std::vector<std::vector<double>> bd;
    for (int r : rowsv) {
        outs.emplace_back((size_t)n * r, to_t<T>(NAN));
        std::vector<T> b(r); std::vector<double> bdd(r);
        for (int i = 0; i < r; ++i) { b[i] = to_t<T>(nd(rng)); bdd[i] = from_t(b[i]); }
        biases.push_back(b); bd.push_back(bdd);
    }
    int k = rowsv.size();
    auto O = [&](int i) { return i < k ? outs[i].data() : nullptr; };
    const bool tl = U == 77 || U == 78;  // the tile-major forms, on tiled copies of the weights
    std::vector<std::vector<uint8_t>> tw;
    for (auto& q : qs) tw.push_back(tl ? tiled(q) : q.packed);
    auto W = [&](int i) { return i < k ? tw[i].data() : nullptr; };
    auto S = [&](int i) { return i < k ? qs[i].s.data() : nullptr; };
    auto M = [&](int i) { return i < k ? qs[i].m.data() : nullptr; };
    auto B = [&](int i) { return i < k && bias && i % 2 == 0 ? biases[i].data() : nullptr; };
    auto R = [&](int i) { return i < k ? rowsv[i] : 0; };
    const int per = U >= 16 ? 16 : 32;  // U = 16: the n16 variant, 67: ln, 68: ln4
    int ctas = 0; for (int r : rowsv) ctas += (r + per - 1) / per;
    run_grid(ctas, [&] {
        if constexpr (std::is_same_v<T, __half>) {
            (U == 2 ? q4_gemv_u2_f16 : U == 16 ? q4_gemv_n16_f16 : U == 67 ? q4_gemv_ln_f16 : U == 68 ? q4_gemv_ln4_f16 : U == 77 ? q4_gemv_lnt_f16 : q4_gemv_ln4t_f16)(x.data(), n, cols, group, O(0), O(1), O(2), W(0), W(1), W(2), S(0), S(1), S(2), M(0), M(1), M(2), B(0), B(1), B(2), R(0), R(1), R(2));
        } else {
            (U == 2 ? q4_gemv_u2_bf16 : U == 16 ? q4_gemv_n16_bf16 : U == 67 ? q4_gemv_ln_bf16 : U == 68 ? q4_gemv_ln4_bf16 : U == 77 ? q4_gemv_lnt_bf16 : q4_gemv_ln4t_bf16)(x.data(), n, cols, group, O(0), O(1), O(2), W(0), W(1), W(2), S(0), S(1), S(2), M(0), M(1), M(2), B(0), B(1), B(2), R(0), R(1), R(2));
        }
    });
    for (int i = 0; i < k; ++i) {
        int rows = rowsv[i];
        std::vector<double> want = product(qs[i], xd, n);
        if (B(i))
            for (int j = 0; j < n; ++j)
                for (int r = 0; r < rows; ++r) want[(size_t)j * rows + r] += bd[i][r];
        char what[200];
        snprintf(what, sizeof what, "%s %s plain n=%d rows=%d (slot %d of %d) cols=%d g=%d%s", dt, form_name(U), n, rows, i, k, cols, group, B(i) ? " +bias" : "");
        check(what, outs[i], want, n, rows, std::is_same_v<T, __half> ? 2e-3 : 2e-2);
    }
}

template <class T>
static void case_silu(const char* dt, int U, int n, int rows, int cols, int group) {
    Q g = make_q(rows, cols, group), u = make_q(rows, cols, group);
    std::normal_distribution<float> nd(0, 1);
    std::vector<T> x((size_t)n * cols); std::vector<double> xd(x.size());
    for (size_t i = 0; i < x.size(); ++i) { x[i] = to_t<T>(nd(rng)); xd[i] = from_t(x[i]); }
    std::vector<T> out((size_t)n * rows, to_t<T>(NAN));
    const bool tl = U == 17 || U == 18 || U == 19;  // the tile-major forms, on tiled copies of the weights
    const std::vector<uint8_t> gp = tl ? tiled(g) : g.packed, up = tl ? tiled(u) : u.packed;
    // 19, silu_lnts: scales and mins in tile order too
    auto order = [&](const std::vector<__half>& v) { return U == 19 ? tile_order(v, rows, cols / group) : v; };
    const std::vector<__half> gs = order(g.s), gm = order(g.m), us = order(u.s), um = order(u.m);
    run_grid((rows + 15) / 16, [&] {
        // no deferred norm (null sums)
        if constexpr (std::is_same_v<T, __half>) {
            (U == 2 ? q4_gemv_silu_u2_f16 : U == 7 ? q4_gemv_silu_ln_f16 : U == 8 ? q4_gemv_silu_ln4_f16 : U == 17 ? q4_gemv_silu_lnt_f16 : U == 19 ? q4_gemv_silu_lnts_f16 : q4_gemv_silu_ln4t_f16)(out.data(), x.data(), n, cols, group, gp.data(), gs.data(), gm.data(), up.data(), us.data(), um.data(), rows, nullptr, 0.f);
        } else {
            (U == 2 ? q4_gemv_silu_u2_bf16 : U == 7 ? q4_gemv_silu_ln_bf16 : U == 8 ? q4_gemv_silu_ln4_bf16 : U == 17 ? q4_gemv_silu_lnt_bf16 : U == 19 ? q4_gemv_silu_lnts_bf16 : q4_gemv_silu_ln4t_bf16)(out.data(), x.data(), n, cols, group, gp.data(), gs.data(), gm.data(), up.data(), us.data(), um.data(), rows, nullptr, 0.f);
        }
    });
    std::vector<double> want = product(g, xd, n);
    const std::vector<double> b = product(u, xd, n);
    for (size_t i = 0; i < want.size(); ++i) want[i] = want[i] / (1 + std::exp(-want[i])) * b[i];
    char what[200];
    snprintf(what, sizeof what, "%s %s silu n=%d rows=%d cols=%d g=%d", dt, form_name(U), n, rows, cols, group);
    check(what, out, want, n, rows, std::is_same_v<T, __half> ? 4e-3 : 4e-2);
}

// The deferred-norm producers (`*_join`): y = x . W^T, then per batch row j and row r:
// resid = T(resid + T(y)) (written back), normed = T(resid * gamma), sums[j] += the squares of the
// new resid (f64 atomics). U: 16 n16_join, 67 ln_join, 68 ln4_join, 77 lnt_join, 78 ln4t_join.
template <class T>
static void case_join(const char* dt, int U, int n, int rows, int cols, int group) {
    Q q = make_q(rows, cols, group);
    std::normal_distribution<float> nd(0, 1);
    std::vector<T> x((size_t)n * cols), resid((size_t)n * rows), gamma(rows);
    std::vector<double> xd(x.size()), rd(resid.size()), gd(rows);
    for (size_t i = 0; i < x.size(); ++i) { x[i] = to_t<T>(nd(rng)); xd[i] = from_t(x[i]); }
    for (size_t i = 0; i < resid.size(); ++i) { resid[i] = to_t<T>(nd(rng)); rd[i] = from_t(resid[i]); }
    for (int r = 0; r < rows; ++r) { gamma[r] = to_t<T>(1 + 0.1f * nd(rng)); gd[r] = from_t(gamma[r]); }
    std::vector<T> normed((size_t)n * rows, to_t<T>(NAN));
    std::vector<double> sums(8, 0.0);
    const bool tl = U == 77 || U == 78;
    const std::vector<uint8_t> w = tl ? tiled(q) : q.packed;
    run_grid((rows + 15) / 16, [&] {
        if constexpr (std::is_same_v<T, __half>) {
            (U == 16 ? q4_gemv_n16_join_f16 : U == 67 ? q4_gemv_ln_join_f16 : U == 68 ? q4_gemv_ln4_join_f16 : U == 77 ? q4_gemv_lnt_join_f16 : q4_gemv_ln4t_join_f16)(x.data(), n, cols, group, w.data(), q.s.data(), q.m.data(), rows, resid.data(), normed.data(), gamma.data(), sums.data());
        } else {
            (U == 16 ? q4_gemv_n16_join_bf16 : U == 67 ? q4_gemv_ln_join_bf16 : U == 68 ? q4_gemv_ln4_join_bf16 : U == 77 ? q4_gemv_lnt_join_bf16 : q4_gemv_ln4t_join_bf16)(x.data(), n, cols, group, w.data(), q.s.data(), q.m.data(), rows, resid.data(), normed.data(), gamma.data(), sums.data());
        }
    });
    // The new residual against resid + y in double (one rounding of y and of the sum to T
    // allowed: the tolerance), normed against the kernel's own residual times gamma, and the
    // sums against the kernel's own residual's squares.
    std::vector<double> want = product(q, xd, n), want_normed((size_t)n * rows);
    for (int j = 0; j < n; ++j)
        for (int r = 0; r < rows; ++r) {
            want[(size_t)j * rows + r] += rd[(size_t)j * rows + r];
            want_normed[(size_t)j * rows + r] = from_t(resid[(size_t)j * rows + r]) * gd[r];
        }
    const double tol = std::is_same_v<T, __half> ? 2e-3 : 2e-2;
    char what[200];
    const char* name = form_name(U);
    snprintf(what, sizeof what, "%s %s join residual n=%d rows=%d cols=%d g=%d", dt, name, n, rows, cols, group);
    check(what, resid, want, n, rows, tol);
    snprintf(what, sizeof what, "%s %s join normed n=%d rows=%d cols=%d g=%d", dt, name, n, rows, cols, group);
    check(what, normed, want_normed, n, rows, tol);
    double worst = 0;
    for (int j = 0; j < 8; ++j) {
        double ss = 0;
        for (int r = 0; r < rows && j < n; ++r) ss += std::pow(from_t(resid[(size_t)j * rows + r]), 2);
        worst = std::max(worst, std::fabs(sums[j] - ss) / std::max(ss, 1e-30));
        if (j >= n && sums[j] != 0) worst = 1;  // batch rows past n stay untouched
    }
    const bool ok = worst < 1e-6;
    if (!ok) ++failures;
    printf("%s %s %s join sums n=%d rows=%d: worst relative error %.2e (tol 1e-06)\n", ok ? "ok  " : "FAIL", dt, name, n, rows, worst);
}

int main() {
    // Varied scales and mins (not zero-centred), odd shapes: every batch size class, slot counts,
    // partial steps, row tails, a group size that is not a power-of-two number of blocks.
    // Plain: 2 u2, 16 n16. SiLU: 2 u2.
    for (int U : {2, 16}) {
        case_plain<__half>("f16", U, 1, {40}, 96, 32, false);
        case_plain<__half>("f16", U, 3, {33, 17, 8}, 160, 32, true);
        case_plain<__half>("f16", U, 8, {64}, 1024, 128, true);
        case_plain<__half>("f16", U, 5, {17, 40}, 1536, 64, false);
        case_plain<__half>("f16", U, 2, {20}, 4096 + 96, 32, false);
        case_plain<__half>("f16", U, 1, {16}, 2304, 192, false);
        case_plain<__nv_bfloat16>("bf16", U, 1, {40}, 96, 32, true);
        case_plain<__nv_bfloat16>("bf16", U, 7, {70, 9}, 640, 128, false);
        case_plain<__nv_bfloat16>("bf16", U, 8, {33}, 2048 + 32, 32, true);
        if (U >= 16) continue;
        case_silu<__half>("f16", U, 1, 40, 256, 64);
        case_silu<__half>("f16", U, 8, 17, 1056, 32);
        case_silu<__nv_bfloat16>("bf16", U, 4, 33, 640, 128);
    }
    // Zero-centred groups like tm_quant's of uniform weights (mins about -7.5 scales), 4096 columns.
    amp = 3 * std::sqrt(3.f / 4096);
    case_silu<__nv_bfloat16>("bf16 centred", 2, 8, 64, 4096, 128);
    case_silu<__half>("f16 centred", 2, 8, 64, 4096, 128);
    amp = std::sqrt(3.f / 4096);
    case_plain<__nv_bfloat16>("bf16 centred", 2, 8, {64}, 4096, 128, false);
    case_plain<__half>("f16 centred", 2, 6, {64}, 4096, 64, false);
    case_plain<__half>("f16 centred", 16, 8, {24, 8}, 4096, 128, true);
    case_plain<__nv_bfloat16>("bf16 centred", 16, 1, {48}, 4096 + 160, 32, false);
    case_plain<__half>("f16 centred", 16, 3, {40, 16}, 4096 + 192, 64, true);
    case_plain<__nv_bfloat16>("bf16 centred", 16, 8, {32}, 8192, 128, false);
    case_plain<__half>("f16 centred", 16, 1, {48, 16, 16}, 4096, 128, false);
    case_plain<__nv_bfloat16>("bf16 centred", 2, 4, {40}, 4096 + 96, 32, true);
    case_plain<__nv_bfloat16>("bf16 centred", 16, 2, {16}, 14336, 128, false);
    // K long enough for the step ring to wrap several times (35 steps: 4 or 5 per warp).
    amp = 0;
    case_silu<__half>("f16", 2, 2, 16, 4480, 128);
    for (int U : {2, 16}) case_plain<__nv_bfloat16>("bf16", U, 3, {40, 8}, 14336 + 192, 64, true);
    // The lean kernels (group 128, cols % 1024 == 0, whole 16-row tiles): plain 67 ln, 68 ln4;
    // SiLU 7 ln, 8 ln4. Uncentred and centred groups, every batch-size class, 1 to 14 steps per warp.
    amp = 0;
    for (int U : {67, 68, 77, 78}) {
        case_plain<__half>("f16", U, 1, {48}, 1024, 128, false);
        case_plain<__half>("f16", U, 3, {32, 16, 16}, 2048, 128, true);
        case_plain<__nv_bfloat16>("bf16", U, 7, {64, 16}, 3072, 128, false);
        case_plain<__half>("f16", U, 8, {16}, 7168, 128, true);
    }
    for (int U : {7, 8, 17, 18, 19}) {
        case_silu<__half>("f16", U, 1, 48, 1024, 128);
        case_silu<__nv_bfloat16>("bf16", U, 4, 32, 5120, 128);
        case_silu<__half>("f16", U, 8, 16, 4096, 128);
    }
    amp = 3 * std::sqrt(3.f / 4096);
    for (int U : {67, 68, 77, 78}) {
        case_plain<__nv_bfloat16>("bf16 centred", U, 1, {64, 16, 16}, 4096, 128, false);
        case_plain<__half>("f16 centred", U, 2, {32}, 14336, 128, true);
    }
    for (int U : {7, 8, 17, 18, 19}) {
        case_silu<__nv_bfloat16>("bf16 centred", U, 8, 32, 4096, 128);
        case_silu<__half>("f16 centred", U, 1, 64, 4096, 128);
    }
    // The join producers (o and down at batch 1 run ln4t_join): random and centred weights.
    amp = 0;
    for (int U : {16, 67, 68, 77, 78}) {
        case_join<__half>("f16", U, 1, 32, 1024, 128);
        case_join<__nv_bfloat16>("bf16", U, 3, 16, 2048, 128);
        case_join<__half>("f16", U, 8, 48, 4096, 128);
    }
    amp = std::sqrt(3.f / 4096);
    case_join<__nv_bfloat16>("bf16 centred", 78, 1, 64, 14336, 128);
    case_join<__half>("f16 centred", 78, 2, 32, 4096, 128);
    printf("%d failure(s)\n", failures);
    return failures != 0;
}
