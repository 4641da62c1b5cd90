// RMSNorm of one row, shared by elementwise.cu (`rms_norm`, `add_rms_norm`) and collectives.cu
// (`peer_all_reduce_add_rms_norm`), so that the fused collective rounds exactly as the separate
// kernels do. The result depends on `blockDim.x` (the order of the sum of squares): callers that
// must agree bit for bit launch the same block width for the same row length.
#pragma once

#include "common.cuh"

/// Sum over the threads sharing a row: a warp when `blockDim.x == 32`, else the whole block
/// (then `blockDim.y == 1`). Uniform per block, so every thread reaches the same barriers.
__device__ __forceinline__ float row_sum(float v) { return blockDim.x == 32 ? tmk::warp_sum(v) : tmk::block_sum(v); }

/// Vectors per thread kept in registers between the two passes; longer rows are re-read.
constexpr int NORM_CACHED = 4;
/// The largest block the launcher uses for the norms (`bx * by`).
#define NORM_MAX_THREADS 512

/// `add`: `residual += x` first (rounded to `T`, written back), then the norm of `residual`.
template <typename T, bool ADD>
__device__ __forceinline__ void norm_row(T* o, T* resid, const T* x, const T* w, float eps, int cols) {
    constexpr int N = tmk::Vec16<T>::N;
    const int tid = threadIdx.x, nt = blockDim.x;
    // For rms_norm the input row is `x`; for add_rms_norm it is `resid` (after the addition).
    const T* in = ADD ? resid : x;
    float ss = 0.0f;
    const bool vec = tmk::aligned16(o) && tmk::aligned16(in) && tmk::aligned16(x) && tmk::aligned16(w) && cols % N == 0;
    if (vec) {
        const int nvec = cols / N;
        tmk::Vec16<T> cached[NORM_CACHED];
#pragma unroll
        for (int k = 0; k < NORM_CACHED; ++k) {
            const int i = tid + k * nt;
            if (i < nvec) {
                tmk::Vec16<T> v = tmk::load16(in + (tmk::i64)i * N);
                if (ADD) {
                    const tmk::Vec16<T> a = tmk::load16(x + (tmk::i64)i * N);
#pragma unroll
                    for (int j = 0; j < N; ++j) v.v[j] = tmk::from_float<T>(tmk::to_float(v.v[j]) + tmk::to_float(a.v[j]));
                    tmk::store16(resid + (tmk::i64)i * N, v);
                }
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float f = tmk::to_float(v.v[j]);
                    ss += f * f;
                }
                cached[k] = v;
            }
        }
        for (int i = tid + NORM_CACHED * nt; i < nvec; i += nt) {
            tmk::Vec16<T> v = tmk::load16(in + (tmk::i64)i * N);
            if (ADD) {
                const tmk::Vec16<T> a = tmk::load16(x + (tmk::i64)i * N);
#pragma unroll
                for (int j = 0; j < N; ++j) v.v[j] = tmk::from_float<T>(tmk::to_float(v.v[j]) + tmk::to_float(a.v[j]));
                tmk::store16(resid + (tmk::i64)i * N, v);
            }
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const float f = tmk::to_float(v.v[j]);
                ss += f * f;
            }
        }
        ss = row_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int k = 0; k < NORM_CACHED; ++k) {
            const int i = tid + k * nt;
            if (i < nvec) {
                const tmk::Vec16<T> wv = tmk::load16(w + (tmk::i64)i * N);
                tmk::Vec16<T> r;
#pragma unroll
                for (int j = 0; j < N; ++j) r.v[j] = tmk::from_float<T>(tmk::to_float(cached[k].v[j]) * inv * tmk::to_float(wv.v[j]));
                tmk::store16(o + (tmk::i64)i * N, r);
            }
        }
        // Rows longer than the cache: re-read (this thread wrote `resid` there itself).
        for (int i = tid + NORM_CACHED * nt; i < nvec; i += nt) {
            const tmk::Vec16<T> v = tmk::load16(in + (tmk::i64)i * N);
            const tmk::Vec16<T> wv = tmk::load16(w + (tmk::i64)i * N);
            tmk::Vec16<T> r;
#pragma unroll
            for (int j = 0; j < N; ++j) r.v[j] = tmk::from_float<T>(tmk::to_float(v.v[j]) * inv * tmk::to_float(wv.v[j]));
            tmk::store16(o + (tmk::i64)i * N, r);
        }
    } else {
        for (int i = tid; i < cols; i += nt) {
            float f = tmk::to_float(in[i]);
            if (ADD) {
                const T s = tmk::from_float<T>(f + tmk::to_float(x[i]));
                resid[i] = s;
                f = tmk::to_float(s);
            }
            ss += f * f;
        }
        ss = row_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        for (int i = tid; i < cols; i += nt) o[i] = tmk::from_float<T>(tmk::to_float(in[i]) * inv * tmk::to_float(w[i]));
    }
}
