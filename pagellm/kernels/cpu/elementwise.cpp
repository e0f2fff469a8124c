// The small per-token ops of a decoder layer, fused so that a decode step makes a few calls per
// layer instead of dozens of tensor ops. Arithmetic follows the torch modules they replace
// (pagellm/model/layers), operation by operation; only rounding differs (summation order, fused multiply-adds).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

// bfloat16 <-> float32 as torch converts: widening is exact; narrowing rounds to nearest, ties to even
// (NaN stays NaN: its payload gets the quiet bit).
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

namespace {
// out = x * rsqrt(mean(x^2) + eps) * weight for one row of C floats.
inline void rmsnorm_row(const float* xt, const float* weight, float* ot, int C, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < C; ++i) ss += xt[i] * xt[i];
    const float r = 1.f / std::sqrt(ss / C + eps);
#pragma omp simd
    for (int i = 0; i < C; ++i) ot[i] = weight[i] * (xt[i] * r);
}

// Row t of what the norms read, the residual added in place: a float32 x gets x += residual (x alone without
// one); a bfloat16 x (a bf16 product's output, read as the float32 it stands for: exact) is summed into the
// residual instead, which the caller passes.
inline float* summed_row(const void* x, bool x_bf16, float* residual, int t, int C) {
    float* rt = residual ? residual + (int64_t)t * C : nullptr;
    if (x_bf16) {
        const uint16_t* xt = static_cast<const uint16_t*>(x) + (int64_t)t * C;
#pragma omp simd
        for (int i = 0; i < C; ++i) rt[i] = bf16_to_f32(xt[i]) + rt[i];
        return rt;
    }
    float* xt = const_cast<float*>(static_cast<const float*>(x)) + (int64_t)t * C;
    if (rt) {
#pragma omp simd
        for (int i = 0; i < C; ++i) xt[i] += rt[i];
    }
    return xt;
}

// C floats to bfloat16 as f32_to_bf16 rounds them (16 lanes at a time on AVX-512, on the bits: vcvtneps2bf16
// would flush subnormals, which torch's cast keeps).
inline void store_bf16_row(const float* row, uint16_t* ot, int C) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512i round = _mm512_set1_epi32(0x7fff), lsb = _mm512_set1_epi32(1);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= C; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(row + i));
        const __m512i up = _mm512_srli_epi32(u, 16);
        const __m512i near = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(up, lsb))),
                                               16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
        const __m512i b = _mm512_mask_or_epi32(near, nan, up, _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i*)(ot + i), _mm512_cvtepi32_epi16(b));
    }
#endif
    for (; i < C; ++i) ot[i] = f32_to_bf16(row[i]);
}
}  // namespace

// x (in place) += residual when residual is given; out = x * rsqrt(mean(x^2) + eps) * weight.
extern "C" void pagellm_add_rmsnorm(float* x, const float* residual, const float* weight, float* out, int T, int C,
                                    float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 1)
    for (int t = 0; t < T; ++t)
        rmsnorm_row(summed_row(x, false, const_cast<float*>(residual), t, C), weight, out + (int64_t)t * C, C, eps);
}

// The same for a bfloat16 x, summed into residual (in place) instead: residual += x; out = rmsnorm(residual) *
// weight. The same bits as casting x to float32 and calling pagellm_add_rmsnorm, without the cast's pass and its
// tensor.
extern "C" void pagellm_add_bf16_rmsnorm(const uint16_t* x, float* residual, const float* weight, float* out, int T,
                                         int C, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 1)
    for (int t = 0; t < T; ++t) rmsnorm_row(summed_row(x, true, residual, t, C), weight, out + (int64_t)t * C, C, eps);
}

// Either norm above with its output rounded to bfloat16 as torch's .to(torch.bfloat16) rounds (subnormals kept,
// a NaN stays a NaN): the input of a bf16 product (`--dtype auto`, many rows), which would round a float32 input
// itself, without the float32 tensor and the cast pass between them. x: bfloat16 (x_bf16) or float32.
extern "C" void pagellm_rmsnorm_to_bf16(const void* x, int x_bf16, float* residual, const float* weight,
                                        uint16_t* out, int T, int C, float eps, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (T > 1)
    {
        std::vector<float> row(C);
#pragma omp for schedule(static)
        for (int t = 0; t < T; ++t) {
            rmsnorm_row(summed_row(x, x_bf16, residual, t, C), weight, row.data(), C, eps);
            store_bf16_row(row.data(), out + (int64_t)t * C, C);
        }
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

// pagellm_rope on a float32 copy of a bfloat16 qkv (a bf16 product's output, read exactly): src [T, cols]
// bf16 rows of stride lds -> dst [T, cols] float32 rows of stride ldd, its first `heads` heads rotated.
// The same bits as casting src and rotating in place, in one pass.
extern "C" void pagellm_rope_bf16(const uint16_t* src, int64_t lds, float* dst, int64_t ldd, int T, int cols,
                                  int heads, int D, const float* cos_table, const float* sin_table,
                                  const int64_t* positions, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 4)
    for (int t = 0; t < T; ++t) {
        const uint16_t* s_row = src + t * lds;
        float* d_row = dst + t * ldd;
#pragma omp simd
        for (int i = 0; i < cols; ++i) {
            const uint32_t bits = (uint32_t)s_row[i] << 16;
            __builtin_memcpy(d_row + i, &bits, 4);
        }
        const float* c = cos_table + positions[t] * D;
        const float* s = sin_table + positions[t] * D;
        for (int h = 0; h < heads; ++h) {
            float* v = d_row + (int64_t)h * D;
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

// The bfloat16 MLP of `--dtype auto` (many-row steps): out[t, i] = bf16(silu(g) * u) of the bf16 gate/up
// GEMM output, in float32 arithmetic; out feeds the down projection's bf16 GEMM without a cast pass.
extern "C" void pagellm_silu_mul_bf16(const uint16_t* gate_up, int T, int I, uint16_t* out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 1)
    for (int t = 0; t < T; ++t) {
        const uint16_t* g = gate_up + (int64_t)t * 2 * I;
        uint16_t* o = out + (int64_t)t * I;
        int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        // the AVX2 loop's operations 16 lanes at a time (exp16 = exp8 lane for lane, the same division, and
        // bf16's nearest-even rounding in one instruction): the same bits in half the instructions
        for (; i + 16 <= I; i += 16) {
            const __m512 x = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(g + i))), 16));
            const __m512 u = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(g + I + i))), 16));
            const __m512 y = _mm512_mul_ps(
                _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))), u);
            const __m256bh b = _mm512_cvtneps_pbh(y);
            _mm256_storeu_si256((__m256i*)(o + i), reinterpret_cast<const __m256i&>(b));
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        const __m256i round = _mm256_set1_epi32(0x7fff), lsb = _mm256_set1_epi32(1);
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(g + i))), 16));
            __m256 u = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(g + I + i))), 16));
            __m256 y = _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x)))), u);
            // round to nearest even on the bits; silu(g) * u of finite bf16 inputs is finite or +-inf
            __m256i b = _mm256_castps_si256(y);
            b = _mm256_add_epi32(b, _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32(b, 16), lsb)));
            b = _mm256_srli_epi32(b, 16);
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_storeu_si128((__m128i*)(o + i), packed);
        }
#endif
        for (; i < I; ++i) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(x / (1.f + std::exp(-x)) * bf16_to_f32(g[I + i]));
        }
    }
}

// Each row's index of its largest value, the first of equal ones (rows x + r * ldx of n > 0 floats), as torch's
// max(dim).indices. Returns 0, or 1 where a row holds a NaN (torch's max takes the NaN: the caller asks torch).
// The sampler's greedy pick over a step's logits: torch's reduction costs ~13 us per 49,152-value row here
// against the ~2 us that reading it takes.
extern "C" int pagellm_argmax_rows(const float* x, int64_t ldx, int rows, int n, int64_t* out, int nthreads) {
    int nan = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 1) reduction(| : nan)
    for (int r = 0; r < rows; ++r) {
        const float* row = x + r * ldx;
        int64_t best = 0;
        float top = row[0];
        int i = 0;
#if defined(__AVX512F__)
        if (n >= 16) {  // per lane the first index of its largest value, then the smallest index of the top lanes
            const __m512i step = _mm512_set1_epi32(16);
            __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = idx;
            __m512 v = _mm512_loadu_ps(row);
            __mmask16 unordered = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            for (i = 16; i + 16 <= n; i += 16) {
                at = _mm512_add_epi32(at, step);
                const __m512 w = _mm512_loadu_ps(row + i);
                unordered |= _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
                const __mmask16 gt = _mm512_cmp_ps_mask(w, v, _CMP_GT_OQ);
                v = _mm512_mask_mov_ps(v, gt, w);
                idx = _mm512_mask_mov_epi32(idx, gt, at);
            }
            if (unordered) {
                nan = 1;
                continue;
            }
            top = _mm512_reduce_max_ps(v);
            const __mmask16 tops = _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(tops, idx);
        }
#elif defined(__AVX2__)
        if (n >= 8) {  // the same on 8 lanes
            const __m256i step = _mm256_set1_epi32(8);
            __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = idx;
            __m256 v = _mm256_loadu_ps(row);
            __m256 unordered = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
            for (i = 8; i + 8 <= n; i += 8) {
                at = _mm256_add_epi32(at, step);
                const __m256 w = _mm256_loadu_ps(row + i);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(w, w, _CMP_UNORD_Q));
                const __m256 gt = _mm256_cmp_ps(w, v, _CMP_GT_OQ);
                v = _mm256_blendv_ps(v, w, gt);
                idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(at), gt));
            }
            if (_mm256_movemask_ps(unordered)) {
                nan = 1;
                continue;
            }
            alignas(32) float vals[8];
            alignas(32) int32_t ids[8];
            _mm256_store_ps(vals, v);
            _mm256_store_si256(reinterpret_cast<__m256i*>(ids), idx);
            top = vals[0], best = ids[0];
            for (int l = 1; l < 8; ++l)
                if (vals[l] > top || (vals[l] == top && ids[l] < best)) top = vals[l], best = ids[l];
        }
#endif
        for (; i < n; ++i) {
            if (row[i] != row[i]) {
                nan = 1;
                break;
            }
            if (row[i] > top) top = row[i], best = i;
        }
        if (top != top) nan = 1;
        out[r] = best;
    }
    return nan;
}

// Categorical draws by inverse CDF: row r's token is the first i whose running sum of p passes u[r] times the row's
// total, an exact draw from the unnormalized p with one uniform per row (an exponential race needs a logarithm per
// token: 62 ms for 64 x 49,152 on the Xeon VM against this 0.35 ms, benchmarks/microbench_sampling.py). Sums in double, in blocks of 64
// skipped whole while the running sum stays at or under the target; only a token with p > 0 is chosen (where
// rounding leaves the target unreached, the last such token). A row whose total is not a positive finite number
// (NaN, inf, all zero) gets -1 and the call returns 1: the caller decides those.
static constexpr int DRAW_BLOCK = 64;

static inline double block_sum(const float* p) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 independent lanes: vectorizes without reassociation
    for (int i = 0; i < DRAW_BLOCK; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += p[i + j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static int64_t draw_row(const float* row, int n, double u) {
    const int whole = n / DRAW_BLOCK * DRAW_BLOCK;
    double total = 0;
    for (int i = 0; i < whole; i += DRAW_BLOCK) total += block_sum(row + i);
    for (int i = whole; i < n; ++i) total += row[i];
    if (!(total > 0) || !std::isfinite(total)) return -1;
    const double target = u * total;
    double acc = 0;
    for (int i = 0; i < n; i += DRAW_BLOCK) {
        if (i < whole) {
            const double s = block_sum(row + i);
            if (acc + s <= target) {
                acc += s;
                continue;
            }
        }
        for (int j = i; j < std::min(i + DRAW_BLOCK, n); ++j) {
            acc += row[j];
            if (acc > target && row[j] > 0) return j;
        }
    }
    for (int j = n - 1; j >= 0; --j)
        if (row[j] > 0) return j;
    return -1;
}

extern "C" int pagellm_sample_rows(const float* p, int64_t ldp, int rows, int n, const double* u, int64_t* out,
                                   int nthreads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 1) reduction(| : bad)
    for (int r = 0; r < rows; ++r) {
        out[r] = draw_row(p + r * ldp, n, u[r]);
        bad |= out[r] < 0;
    }
    return bad;
}

// Temperature, softmax and the draw in one call, for rows that sample from the plain softmax of their logits (no
// top-k, top-p or min-p): row r's weights exp((x - max) / T[r]) go to a per-thread buffer (one read of x for the
// max, one for the weights, which then stay in L2 for draw_row's two passes), instead of torch's copy, division
// and softmax over the whole batch. A weight under exp(-87) is 0 (torch's float softmax gives those 1e-38 at most).
// Returns 1 where a row holds a NaN or +inf, only -inf, or no positive finite total (its out is -1): the caller
// decides.
extern "C" int pagellm_softmax_draw(const float* x, int64_t ldx, int rows, int n, const float* inv_temp,
                                    const double* u, int64_t* out, int nthreads) {
    int bad = 0;
#pragma omp parallel num_threads(nthreads) if (rows > 1) reduction(| : bad)
    {
        std::vector<float> w(n);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; ++r) {
            const float* row = x + r * ldx;
            // the maximum, and whether the row holds a NaN (max_ps passes NaN over: it is counted apart)
            float m = -INFINITY;
            bool nan = false;
            int j = 0;
#if defined(__AVX512F__)
            __m512 mx = _mm512_set1_ps(-INFINITY);
            __mmask16 unordered = 0;
            for (; j + 16 <= n; j += 16) {
                const __m512 v = _mm512_loadu_ps(row + j);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                mx = _mm512_max_ps(v, mx);
            }
            m = _mm512_reduce_max_ps(mx);
            nan = unordered != 0;
#elif defined(__AVX2__)
            __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
            for (; j + 8 <= n; j += 8) {
                const __m256 v = _mm256_loadu_ps(row + j);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                mx = _mm256_max_ps(v, mx);
            }
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, mx);
            for (float v : lanes) m = v > m ? v : m;
            nan = _mm256_movemask_ps(unordered) != 0;
#endif
            for (; j < n; ++j) {
                nan |= row[j] != row[j];
                m = row[j] > m ? row[j] : m;
            }
            if (nan || !std::isfinite(m)) {  // NaN, +inf or nothing but -inf: the caller decides
                out[r] = -1;
                bad = 1;
                continue;
            }
            const float s = inv_temp[r];
            int i = 0;
#if defined(__AVX512F__)
            const __m512 mv = _mm512_set1_ps(m), sv = _mm512_set1_ps(s), floor = _mm512_set1_ps(-87.f);
            for (; i + 16 <= n; i += 16) {
                const __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mv), sv);
                _mm512_storeu_ps(w.data() + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, floor, _CMP_GE_OQ), exp16(z)));
            }
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(s), floor = _mm256_set1_ps(-87.f);
            for (; i + 8 <= n; i += 8) {
                const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), mv), sv);
                _mm256_storeu_ps(w.data() + i, _mm256_and_ps(_mm256_cmp_ps(z, floor, _CMP_GE_OQ), exp8(z)));
            }
#endif
            for (; i < n; ++i) {
                const float z = (row[i] - m) * s;
                w[i] = z >= -87.f ? std::exp(z) : 0.f;
            }
            out[r] = draw_row(w.data(), n, u[r]);
            bad |= out[r] < 0;
        }
    }
    return bad;
}
