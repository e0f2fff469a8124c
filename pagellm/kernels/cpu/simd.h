// Shared AVX2 helpers for the kernels (included only; build.py compiles the .cpp files).
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
// A 16-lane vector's halves added: 8 lanes of partial sums (for the AVX2 reductions), and its total.
inline __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline float hsum16(__m512 v) { return hsum8(fold16(v)); }
// 4 consecutive int8 values as one 32-bit lane, repeated: the broadcast operand of vpdpbusd.
inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#endif

// The 32 quants of one GGUF block as four vectors of 8 floats (exact: small integers). q4_1: byte j
// holds element j (low nibble) and j + 16 (high); q8_0: 32 int8.
struct Quants { __m256 q[4]; };

// 8 bytes from memory, each widened to a 32-bit lane (the load folds into the widening instruction).
inline __m256i widen_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i widen_i8(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Each byte is widened to its own 32-bit lane first, and the nibbles are split there (mask, shift):
// 10 vector ops per block where splitting bytes first and then widening took 13 (and 6 lane-crossing
// shuffles instead of 2). The one-row product is instruction-bound, so this is ~1.25x on it.
inline Quants unpack_q4(const uint8_t* qs) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i a = widen_u8(qs), b = widen_u8(qs + 8);
    return {{_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask)),
             _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))}};
}

inline Quants unpack_q8(const int8_t* qs) {
    return {{_mm256_cvtepi32_ps(widen_i8(qs)), _mm256_cvtepi32_ps(widen_i8(qs + 8)),
             _mm256_cvtepi32_ps(widen_i8(qs + 16)), _mm256_cvtepi32_ps(widen_i8(qs + 24))}};
}

// 8 e4m3 bit patterns -> 8 floats, exactly, with integer ops only (no F16C, and no subnormal float is
// ever formed, so flush-to-zero modes cannot change it): a normal pattern's 7 magnitude bits become a
// float32 exponent and mantissa (bias 7 -> 127), a subnormal one (exponent 0) is its 3 mantissa bits
// times 2^-9, 0x7F/0xFF are NaN (e4m3 has no infinities); the sign bit moves to bit 31.
inline __m256 fp8_e4m3_8(const uint8_t* p) {
    const __m256i b = widen_u8(p);
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))),
                                     _mm256_set1_ps(1.f / 512));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), is_nan);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

#if defined(__F16C__)
// With F16C, 16 patterns at a time in fewer instructions: the 7 magnitude bits placed as an f16's
// exponent and mantissa (0eeee mmm0000000: bias 15 instead of 7, subnormals alike), the sign at bit 15,
// 0x7F/0xFF made an f16 NaN; converted exactly, then scaled by 2^8 (exact).
inline __m256i fp8_e4m3_as_f16(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3F80)),
                                      _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(-0x8000)));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
}

inline Quants unpack_fp8(const uint8_t* qs) {
    const __m256i a = fp8_e4m3_as_f16(qs), b = fp8_e4m3_as_f16(qs + 16);
    const __m256 s = _mm256_set1_ps(256.f);
    return {{_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), s),
             _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)), s),
             _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(b)), s),
             _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(b, 1)), s)}};
}
#else
inline Quants unpack_fp8(const uint8_t* qs) {
    return {{fp8_e4m3_8(qs), fp8_e4m3_8(qs + 8), fp8_e4m3_8(qs + 16), fp8_e4m3_8(qs + 24)}};
}
#endif

// exp for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (relative error
// about 2e-7, like expf's). Inputs are clamped to [-87, 88], where the result is a normal float. The constant
// is max/min's first operand: for a NaN they return the second, so NaN stays NaN (exp(inf - inf) is NaN, as
// std::exp gives, instead of ~0).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp8's operations on 16 floats: lane for lane the same results.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif


// p[i] = exp(p[i] - max) for i < n; returns their sum.

#endif

// One e4m3 bit pattern as a float (the portable twin of fp8_e4m3_8, same values).
inline float fp8_e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    if ((b & 0x7F) == 0x7F) return __builtin_nanf("");
    const float mag = e == 0 ? (float)m / 512.f : (float)(8 + m) * ((float)(1 << e) / 1024.f);
    return b & 0x80 ? -mag : mag;
}

// sum over i < n of a[i] * b[i] (two vector chains, then the scalar tail).
inline float dot(const float* a, const float* b, int n) {
    int i = 0;
    float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}
