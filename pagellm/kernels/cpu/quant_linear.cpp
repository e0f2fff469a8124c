// y[M, N] = x[M, K] @ W^T for weights kept in block formats (PackedWeight, pagellm/quant/formats.py),
// 32 weights per block along K:
//   q4_1:     w = d * q + m, q in 0..15 (16 bytes per block: byte j holds element j low, element j + 16 high)
//   q8_0:     w = d * q,     q in -128..127 (32 bytes per block)
//   q8_1:     w = d * q + m, q int8
//   fp8_e4m3: w = d * f8(q), q the e4m3 bit pattern (decoded exactly, simd.h)
//   q4_1_16, q8_0_16, q8_1_16: as q4_1, q8_0, q8_1 with d (and m) per 16 weights (GGUF's K-quant scale
//             groups): two scales per 32-block, elements 0..15 and 16..31
// The arithmetic is float32 throughout (y = sum over groups of d * (q . x) + m * sum(x)): the same
// weights as the dequantized float32 path, reading 2.7-5.3x fewer bytes (0.75-1.5 bytes per weight,
// benchmarks/microbench_kinds.py prints them), differing only in rounding order.
// Meant for few rows (decode, speculative verification): each block's quants are converted once per
// tile of up to 8 rows, so cost grows with M where a float32 GEMM's does not. Every row is computed by
// the same operations whatever M, so a row's result does not depend on the rows beside it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_linear_vnni.h"
#include "quant_linear_wide.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// R rows of x against output column n. Per group of G (32 or 16) weights, y += d * (q . x) (+ m * sum(x),
// added at the end from per-group row sums computed once per call): each block's quants are converted
// once and used for all R rows, and no weight is ever materialised.
template <int R, int G, typename Q, Quants (*Unpack)(const Q*)>
inline void column(const float* x, int64_t ldx, int K, const Q* qs, int64_t q_per_block, const float* d,
                   const float* m, const float* xsum, float* y, int64_t ldy) {
#ifdef PAGELLM_WIDE_PACKED
    if constexpr (Wide16<Unpack>::has) {  // AVX-512: 16 lanes (quant_linear_wide.h)
        column16<R, G, Q, Wide16<Unpack>>(x, ldx, K, qs, q_per_block, d, m, xsum, y, ldy);
        return;
    }
#endif
    const int nb = K / 32, ng = K / G;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        // columns lie one after another: fetch 4 KiB ahead (decode streams each weight once; NOTES)
        _mm_prefetch(reinterpret_cast<const char*>(qs + b * q_per_block) + 4096, _MM_HINT_T0);
        Quants w = Unpack(qs + b * q_per_block);
        const __m256 d0 = _mm256_set1_ps(d[b * 32 / G]), d1 = _mm256_set1_ps(d[b * 32 / G + (G == 16)]);
        for (int r = 0; r < R; ++r) {
            const float* xb = x + r * ldx + b * 32;
            __m256 t = _mm256_mul_ps(w.q[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(w.q[1], _mm256_loadu_ps(xb + 8), t);
            if (G == 16) {  // the block's first group is complete: scale it, start the second
                acc[r] = _mm256_fmadd_ps(d0, t, acc[r]);
                t = _mm256_mul_ps(w.q[2], _mm256_loadu_ps(xb + 16));
            } else {
                t = _mm256_fmadd_ps(w.q[2], _mm256_loadu_ps(xb + 16), t);
            }
            t = _mm256_fmadd_ps(w.q[3], _mm256_loadu_ps(xb + 24), t);
            acc[r] = _mm256_fmadd_ps(d1, t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        y[r * ldy] = hsum8(acc[r]) + (m ? dot(m, xsum + r * ng, ng) : 0.f);
    }
}

template <int G, typename Q, Quants (*Unpack)(const Q*)>
void linear(const float* x, int64_t ldx, int M, int K, const Q* qs, int64_t q_per_block, const float* d,
            const float* m, int N, float* y, int64_t ldy, int nthreads) {
    const int nb = K / 32, ng = K / G;
    const int64_t q_row = nb * q_per_block;
    float* xsum = nullptr;
    if (m) {  // per-row, per-group sums of x for the minimums
        xsum = new float[(int64_t)M * ng];
        for (int r = 0; r < M; ++r)
            for (int g = 0; g < ng; ++g) {
                float s = 0.f;
                for (int j = 0; j < G; ++j) s += x[r * ldx + g * G + j];
                xsum[r * ng + g] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; ++n) {
        const Q* qn = qs + n * q_row;
        const float* dn = d + (int64_t)n * ng;
        const float* mn = m ? m + (int64_t)n * ng : nullptr;
        int r = 0;
        for (; r + 8 <= M; r += 8)
            column<8, G, Q, Unpack>(x + r * ldx, ldx, K, qn, q_per_block, dn, mn, xsum ? xsum + r * ng : nullptr,
                                    y + r * ldy + n, ldy);
        const float* xr = x + r * ldx;
        const float* sr = xsum ? xsum + r * ng : nullptr;
        float* yr = y + r * ldy + n;
        switch (M - r) {
            case 7: column<7, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 6: column<6, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 5: column<5, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 4: column<4, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 3: column<3, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 2: column<2, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            case 1: column<1, G, Q, Unpack>(xr, ldx, K, qn, q_per_block, dn, mn, sr, yr, ldy); break;
            default: break;
        }
    }
    delete[] xsum;
}

// --- int8 activations (llama.cpp's scheme, opt-in): each 32-value block of a row of x becomes int8
// with its own scale, and blocks are multiplied with integer dot products (vpmaddubsw): fewer
// instructions per block than the float path, at the cost of rounding x to 8 bits. Each row's result
// is computed by the same operations in the same order whatever the number of rows, so a row's output
// does not depend on the rows beside it (speculative verification agrees with one-row decoding).

struct QuantizedRows {
    std::vector<int8_t> q;  // [M, K]
    std::vector<float> d, sum;  // [M, K/32]: scale, and the sum of the block's rounded values (q4_1's minimums)
};

QuantizedRows quantize_rows(const float* x, int64_t ldx, int M, int K) {
    const int nb = K / 32;
    QuantizedRows out{std::vector<int8_t>((size_t)M * K), std::vector<float>((size_t)M * nb),
                      std::vector<float>((size_t)M * nb)};
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int r = 0; r < M; ++r)
        for (int b = 0; b < nb; ++b) {
            const float* xb = x + r * ldx + b * 32;
            __m256 v[4];
            for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
            __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i i[4];
            for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));  // round to nearest
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + (size_t)r * K + b * 32),
                                _mm256_permutevar8x32_epi32(packed, order));
            out.d[(size_t)r * nb + b] = d;
            // q4_1's minimums meet the rounded x, as the codes do (their errors then enter as w . e, centred;
            // with x's exact sum as d q . e, q in 0..15: quant_linear_int8_tiles.cpp's prepare)
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            out.sum[(size_t)r * nb + b] = d * hsum8(_mm256_cvtepi32_ps(total));
        }
    return out;
}

// One weight block prepared once for every row of a tile: q4_1's nibbles as 32 unsigned bytes; q8_0's
// quants as |q| and q (vpmaddubsw wants one unsigned operand: |q| times x carrying q's sign).
struct BlockQ4 { __m256i q; };
struct BlockQ8 { __m256i abs, q; };

inline BlockQ4 prepare(const uint8_t* qs) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return {_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F))};
}

inline BlockQ8 prepare(const int8_t* qs) {
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    return {_mm256_sign_epi8(q, q), q};
}

// u8 x s8 products summed in fours into 8 int32 lanes. VNNI (AVX-VNNI, or AVX-512 VNNI with VL) does it in
// one instruction (vpdpbusd); without it, vpmaddubsw + vpmaddwd. The sums are equal: no pair of products
// here reaches vpmaddubsw's int16 saturation (15 * 127 * 2 for q4, 128 * 127 * 2 for q8).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Sum over the block's 32 products, as 8 int32 lanes converted to float.
inline __m256 block_dot(const BlockQ4& w, __m256i x) { return _mm256_cvtepi32_ps(dot_u8s8(w.q, x)); }

inline __m256 block_dot(const BlockQ8& w, __m256i x) {
    return _mm256_cvtepi32_ps(dot_u8s8(w.abs, _mm256_sign_epi8(x, w.q)));
}

// R rows of quantized x against output column n: each weight block is prepared once for all R rows.
// Per row, even blocks accumulate in one register and odd ones in another (two chains hide the FMA
// latency), summed at the end.
template <int R, typename Q>
inline void column_i8(const QuantizedRows& xr, int r0, int K, const Q* qn, int64_t q_per_block, const float* dn,
                      const float* mn, float* y, int64_t ldy) {
    const int nb = K / 32;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int8_t* xq = xr.q.data() + (size_t)r0 * K;
    const float* dx = xr.d.data() + (size_t)r0 * nb;
    auto step = [&](int b, int h) {  // h: which chain (b's parity, a constant after unrolling)
        _mm_prefetch(reinterpret_cast<const char*>(qn + b * q_per_block) + 4096, _MM_HINT_T0);  // as in column
        const auto w = prepare(qn + b * q_per_block);
        for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (size_t)r * K + b * 32));
            acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(dn[b] * dx[r * nb + b]), block_dot(w, xv), acc[r][h]);
        }
    };
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        step(b, 0);
        step(b + 1, 1);
    }
    if (b < nb) step(b, 0);
    for (int r = 0; r < R; ++r) {
        const float mins = mn ? dot(mn, xr.sum.data() + (size_t)(r0 + r) * nb, nb) : 0.f;  // q4_1: m * sum(x)
        y[r * ldy] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + mins;
    }
}

template <typename Q>
void linear_i8(const float* x, int64_t ldx, int M, int K, const Q* qs, int64_t q_per_block, const float* d,
               const float* m, int N, float* y, int64_t ldy, int nthreads) {
#ifdef PAGELLM_VNNI512  // four q4 blocks (two q8) per instruction: quant_linear_vnni.h
    vnni512::linear<Q>(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads, 1);
    return;
#endif
    const int nb = K / 32;
    const QuantizedRows xr = quantize_rows(x, ldx, M, K);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; ++n) {
        const Q* qn = qs + (int64_t)n * nb * q_per_block;
        const float* dn = d + (int64_t)n * nb;
        const float* mn = m ? m + (int64_t)n * nb : nullptr;
        int r = 0;
        for (; r + 4 <= M; r += 4) column_i8<4>(xr, r, K, qn, q_per_block, dn, mn, y + r * ldy + n, ldy);
        switch (M - r) {
            case 3: column_i8<3>(xr, r, K, qn, q_per_block, dn, mn, y + r * ldy + n, ldy); break;
            case 2: column_i8<2>(xr, r, K, qn, q_per_block, dn, mn, y + r * ldy + n, ldy); break;
            case 1: column_i8<1>(xr, r, K, qn, q_per_block, dn, mn, y + r * ldy + n, ldy); break;
            default: break;
        }
    }
}

}  // namespace

extern "C" int pagellm_has_simd() { return 1; }

extern "C" void pagellm_q4_1_linear_i8(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear_i8<uint8_t>(x, ldx, M, K, qs, 16, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       int N, float* y, int64_t ldy, int nthreads) {
    linear_i8<int8_t>(x, ldx, M, K, qs, 32, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_1_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear_i8<int8_t>(x, ldx, M, K, qs, 32, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q4_1_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear<32, uint8_t, unpack_q4>(x, ldx, M, K, qs, 16, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    int N, float* y, int64_t ldy, int nthreads) {
    linear<32, int8_t, unpack_q8>(x, ldx, M, K, qs, 32, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_1_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear<32, int8_t, unpack_q8>(x, ldx, M, K, qs, 32, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_fp8_e4m3_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs,
                                        const float* d, int N, float* y, int64_t ldy, int nthreads) {
    linear<32, uint8_t, unpack_fp8>(x, ldx, M, K, qs, 32, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q4_1_16_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear<16, uint8_t, unpack_q4>(x, ldx, M, K, qs, 16, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       int N, float* y, int64_t ldy, int nthreads) {
    linear<16, int8_t, unpack_q8>(x, ldx, M, K, qs, 32, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_1_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    linear<16, int8_t, unpack_q8>(x, ldx, M, K, qs, 32, d, m, N, y, ldy, nthreads);
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

// G: weights per scale (32, or 16 for the *_16 kinds); code: element j of block b of row n as a float.
#define PORTABLE_LINEAR(name, Q, G, code, with_m)                                                             \
    static void name(const float* x, int64_t ldx, int M, int K, const Q* qs, const float* d,                   \
                         const float* m, int N, float* y, int64_t ldy, int nthreads) {                         \
        linear_portable(x, ldx, M, K, N, y, ldy, nthreads, [=](int n, int b, int j) {                          \
            const int64_t g = (int64_t)n * (K / G) + (b * 32 + j) / G;                                          \
            const float q = code;                                                                               \
            return with_m ? q * d[g] + m[g] : q * d[g];                                                         \
        });                                                                                                     \
    }
#define NIBBLE(qs) (float)(j < 16 ? qs[((int64_t)n * (K / 32) + b) * 16 + j] & 15 : qs[((int64_t)n * (K / 32) + b) * 16 + j - 16] >> 4)
#define BYTE(qs) qs[((int64_t)n * (K / 32) + b) * 32 + j]
PORTABLE_LINEAR(q4_1_portable, uint8_t, 32, NIBBLE(qs), true)
PORTABLE_LINEAR(q8_0_portable, int8_t, 32, (float)BYTE(qs), false)
PORTABLE_LINEAR(q8_1_portable, int8_t, 32, (float)BYTE(qs), true)
PORTABLE_LINEAR(fp8_portable, uint8_t, 32, fp8_e4m3_value(BYTE(qs)), false)
PORTABLE_LINEAR(q4_1_16_portable, uint8_t, 16, NIBBLE(qs), true)
PORTABLE_LINEAR(q8_0_16_portable, int8_t, 16, (float)BYTE(qs), false)
PORTABLE_LINEAR(q8_1_16_portable, int8_t, 16, (float)BYTE(qs), true)

extern "C" void pagellm_q8_1_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    q8_1_16_portable(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q4_1_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    q4_1_portable(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    int N, float* y, int64_t ldy, int nthreads) {
    q8_0_portable(x, ldx, M, K, qs, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_1_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                    const float* m, int N, float* y, int64_t ldy, int nthreads) {
    q8_1_portable(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q4_1_16_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    q4_1_16_portable(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_fp8_e4m3_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs,
                                        const float* d, int N, float* y, int64_t ldy, int nthreads) {
    fp8_portable(x, ldx, M, K, qs, d, nullptr, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       int N, float* y, int64_t ldy, int nthreads) {
    q8_0_16_portable(x, ldx, M, K, qs, d, nullptr, N, y, ldy, nthreads);
}

// No integer dot products here: the int8-activation entry points run the float path.
extern "C" void pagellm_q4_1_linear_i8(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    pagellm_q4_1_linear(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_0_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       int N, float* y, int64_t ldy, int nthreads) {
    pagellm_q8_0_linear(x, ldx, M, K, qs, d, N, y, ldy, nthreads);
}

extern "C" void pagellm_q8_1_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                                       const float* m, int N, float* y, int64_t ldy, int nthreads) {
    pagellm_q8_1_linear(x, ldx, M, K, qs, d, m, N, y, ldy, nthreads);
}
#endif
