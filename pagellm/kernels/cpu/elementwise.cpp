// The small per-token ops of a decoder layer, fused so that a decode step makes a few calls per
// layer instead of dozens of tensor ops. Arithmetic follows the torch modules they replace
// (pagellm/model/layers), operation by operation; only rounding differs (summation order, fused multiply-adds).
#include <cmath>
#include <cstdint>

#include "simd.h"

// x (in place) += residual when residual is given; out = x * rsqrt(mean(x^2) + eps) * weight.
extern "C" void pagellm_add_rmsnorm(float* x, const float* residual, const float* weight, float* out, int T, int C,
                                    float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 1)
    for (int t = 0; t < T; ++t) {
        float* xt = x + (int64_t)t * C;
        if (residual) {
            const float* rt = residual + (int64_t)t * C;
#pragma omp simd
            for (int i = 0; i < C; ++i) xt[i] += rt[i];
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < C; ++i) ss += xt[i] * xt[i];
        const float r = 1.f / std::sqrt(ss / C + eps);
        float* ot = out + (int64_t)t * C;
#pragma omp simd
        for (int i = 0; i < C; ++i) ot[i] = weight[i] * (xt[i] * r);
    }
}

// Rotate-half RoPE in place on `heads` heads of each row (q and k of the fused qkv output).
// cos, sin: [max_pos, D] tables (the two halves repeat the same frequencies).
extern "C" void pagellm_rope(float* x, int64_t ldx, int T, int heads, int D, const float* cos_table,
                             const float* sin_table, const int64_t* positions, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 4)
    for (int t = 0; t < T; ++t) {
        const float* c = cos_table + positions[t] * D;
        const float* s = sin_table + positions[t] * D;
        for (int h = 0; h < heads; ++h) {
            float* v = x + t * ldx + (int64_t)h * D;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
extern "C" void pagellm_silu_mul(const float* gate_up, int T, int I, float* out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 1)
    for (int t = 0; t < T; ++t) {
        const float* g = gate_up + (int64_t)t * 2 * I;
        float* o = out + (int64_t)t * I;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
}
