// y[M, N] = x[M, K] @ W^T for weights kept in GGUF block formats (32 weights per block along K):
//   q4_1: w = d * q + m, q in 0..15 (16 bytes per block: byte j holds element j low, element j + 16 high)
//   q8_0: w = d * q,     q in -128..127 (32 bytes per block)
// The arithmetic is float32 throughout (y = sum over blocks of d * (q . x) + m * sum(x)): the same
// weights as the dequantized float32 path, reading 4-6x fewer bytes, differing only in rounding order.
// Meant for few rows (decode, speculative verification): each block's quants are converted once per
// tile of up to 8 rows, so cost grows with M where a float32 GEMM's does not.
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 u8x8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// The 32 quants of one block as four vectors of 8 floats (exact: small integers).
struct Quants { __m256 q[4]; };

inline Quants unpack_q4(const uint8_t* qs) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    return {{u8x8_to_f32(lo), u8x8_to_f32(_mm_srli_si128(lo, 8)), u8x8_to_f32(hi), u8x8_to_f32(_mm_srli_si128(hi, 8))}};
}

inline Quants unpack_q8(const int8_t* qs) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
    return {{i8x8_to_f32(a), i8x8_to_f32(_mm_srli_si128(a, 8)), i8x8_to_f32(c), i8x8_to_f32(_mm_srli_si128(c, 8))}};
}

// R rows of x against output column n. Per block, y += d * (q . x) (+ m * sum(x), added at the end
// from per-block row sums computed once per call): each block's quants are converted once and used
// for all R rows, and no weight is ever materialised.
template <int R, typename Q, Quants (*Unpack)(const Q*)>
inline void column(const float* x, int64_t ldx, int K, const Q* qs, int64_t q_per_block, const float* d,
                   const float* m, const float* xsum, float* y, int64_t ldy) {
    const int nb = K / 32;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        Quants w = Unpack(qs + b * q_per_block);
        __m256 vd = _mm256_set1_ps(d[b]);
        for (int r = 0; r < R; ++r) {
            const float* xb = x + r * ldx + b * 32;
            __m256 t = _mm256_mul_ps(w.q[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(w.q[1], _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(w.q[2], _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(w.q[3], _mm256_loadu_ps(xb + 24), t);
            acc[r] = _mm256_fmadd_ps(vd, t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float out = hsum(acc[r]);
        if (m) {
            const float* xs = xsum + r * nb;
            for (int b = 0; b < nb; ++b) out += m[b] * xs[b];
        }
        y[r * ldy] = out;
    }
}

template <typename Q, Quants (*Unpack)(const Q*)>
void linear(const float* x, int64_t ldx, int M, int K, const Q* qs, int64_t q_per_block, const float* d,
            const float* m, int N, float* y, int64_t ldy, int nthreads) {
    const int nb = K / 32;
    const int64_t q_row = nb * q_per_block;
    float* xsum = nullptr;
    if (m) {  // per-row, per-block sums of x for the q4_1 minimums
        xsum = new float[(int64_t)M * nb];
        for (int r = 0; r < M; ++r)
            for (int b = 0; b < nb; ++b) {
                float s = 0.f;
                for (int j = 0; j < 32; ++j) s += x[r * ldx + b * 32 + j];
                xsum[r * nb + b] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; ++n) {
        const Q* qn = qs + n * q_row;
        const float* dn = d + (int64_t)n * nb;
        const float* mn = m ? m + (int64_t)n * nb : nullptr;
        int r = 0;
        for (; r + 8 <= M; r += 8)
            column<8, Q, Unpack>(x + r * ldx, ldx, K, qn, q_per_block, dn, mn, xsum ? xsum + r * nb : nullptr,
                                 y + r * ldy + n, ldy);
        const float* xr = x + r * ldx;
        const float* sr = xsum ? xsum + r * nb : nullptr;
        float* yr = y + r * ldy + n;
        switch (M - r) {
            case 7: column<7, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 6: column<6, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 5: column<5, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 4: column<4, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 3: column<3, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 2: column<2, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 1: column<1, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            default: break;
        }
    }
    delete[] xsum;
}

}  // namespace

extern "C" int pagellm_has_simd() { return 1; }

extern "C" void pagellm_q4_1_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear<uint8_t, unpack_q4>(x, ldx, M, K, qs, 16, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    int N, float* y, int64_t ldy, int nthreads) {
    linear<int8_t, unpack_q8>(x, ldx, M, K, qs, 32, d, nullptr, N, y, ldy, nthreads);
}

#else  // portable version: the same arithmetic, left to the compiler's vectorizer

namespace {
template <typename WeightAt>
void linear_portable(const float* x, int64_t ldx, int M, int K, int N, float* y, int64_t ldy, int nthreads,
                     WeightAt weight_at) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; ++n) {
        float w[32];
        for (int r = 0; r < M; ++r) y[r * ldy + n] = 0.f;
        for (int b = 0; b < K / 32; ++b) {
            for (int j = 0; j < 32; ++j) w[j] = weight_at(n, b, j);
            for (int r = 0; r < M; ++r) {
                float s = 0.f;
                for (int j = 0; j < 32; ++j) s += w[j] * x[r * ldx + b * 32 + j];
                y[r * ldy + n] += s;
            }
        }
    }
}
}  // namespace

extern "C" int pagellm_has_simd() { return 0; }

extern "C" void pagellm_q4_1_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    const int nb = K / 32;
    linear_portable(x, ldx, M, K, N, y, ldy, nthreads, [=](int n, int b, int j) {
        uint8_t byte = qs[((int64_t)n * nb + b) * 16 + (j & 15)];
        float q = (float)(j < 16 ? byte & 15 : byte >> 4);
        return d[(int64_t)n * nb + b] * q + m[(int64_t)n * nb + b];
    });
}

extern "C" void pagellm_q8_0_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    int N, float* y, int64_t ldy, int nthreads) {
    const int nb = K / 32;
    linear_portable(x, ldx, M, K, N, y, ldy, nthreads, [=](int n, int b, int j) {
        return (float)qs[((int64_t)n * nb + b) * 32 + j] * d[(int64_t)n * nb + b];
    });
}
#endif
