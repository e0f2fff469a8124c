// KV cache element formats for attention.cpp: how one [D] row of a key or value is stored and read.
// The same formats as pagellm/quant/kv_cache.py, bit for bit on write (tests/test_kv_quant.py):
//   float32 (code 0), float16 (1, F16C builds only), int8 (2: D int8 then a float16 scale, row width
//   D + 2), fp8 e4m3fn (3) and fp8 e5m2 (4): round to nearest even, saturated to the largest finite value.
// Reads convert exactly (every stored value is a float32); the int8 scale is applied per key by the
// caller (score = scale * (q . k_int), value weight = p * scale), not per element.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGELLM_SIMD_ATTENTION 1
#endif

enum KvFormat { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

// Distinct element types, so that overloads pick the conversion (all one byte but int8_t).
struct e4m3_t { uint8_t bits; };
struct e5m2_t { uint8_t bits; };

template <typename T>
constexpr int row_extra() { return std::is_same_v<T, int8_t> ? 2 : 0; }  // the int8 row's scale bytes

inline uint32_t f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bits_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// float16 <-> float32 for the int8 scale, which the writer keeps in float16's normal range.
inline uint16_t normal_to_half(float x) {  // x in [2^-14, 65504]: round to nearest even
    const uint32_t u = f32_bits(x);
    const uint32_t r = u + 0xFFF + ((u >> 13) & 1);
    return static_cast<uint16_t>((r >> 13) - ((127 - 15) << 10));
}
inline float half_to_float(uint16_t h) {  // any float16 (an unwritten row's scale is 0)
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) return std::ldexp((float)m, -24) * (sign ? -1.f : 1.f);
    if (e == 31) return bits_f32(sign | 0x7F800000 | (m << 13));
    return bits_f32(sign | ((e + 127 - 15) << 23) | (m << 13));
}

// float32 -> fp8 with MB mantissa bits and exponent bias BIAS; |x| >= max_value saturates (inf too).
template <int MB, int BIAS>
inline uint8_t float_to_fp8(float x, float max_value, uint8_t max_code, uint8_t nan_code) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const float a = std::fabs(x);
    if (std::isnan(x)) return sign | nan_code;
    if (a >= max_value) return sign | max_code;
    if (a < std::ldexp(1.f, 1 - BIAS))  // subnormal (or a normal the rounding reaches): steps of 2^(1-BIAS-MB)
        return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, BIAS - 1 + MB)));
    const uint32_t u = f32_bits(a), shift = 23 - MB;
    const uint32_t r = u + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1);
    const uint32_t code = (((r >> 23) - 127 + BIAS) << MB) | ((r >> shift) & ((1u << MB) - 1));
    return sign | static_cast<uint8_t>(code > max_code ? max_code : code);
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return (float)x; }
inline float to_float(e4m3_t x) { return fp8_e4m3_value(x.bits); }  // simd.h: the weights' decoder
inline float to_float(e5m2_t x) { return half_to_float((uint16_t)(x.bits << 8)); }
#ifdef PAGELLM_SIMD_ATTENTION
inline float to_float(uint16_t x) { return _cvtsh_ss(x); }
#endif

// The int8 row's scale; 1 for the other formats.
template <typename T>
inline float row_scale(const T* row, int D) {
    if constexpr (std::is_same_v<T, int8_t>) {
        uint16_t h;
        std::memcpy(&h, row + D, 2);
#ifdef PAGELLM_SIMD_ATTENTION
        return _cvtsh_ss(h);  // exact, as half_to_float, in one instruction (the decode kernel reads one per key)
#else
        return half_to_float(h);
#endif
    } else {
        (void)row, (void)D;
        return 1.f;
    }
}

#if defined(PAGELLM_SIMD_ATTENTION) && defined(__AVX512F__)
// store_token's int8 row, vectorized: the same maximum (a NaN never wins it: max_ps returns its second operand
// then), the same scale, the same division and rounding to nearest even, the clamp to +-127 done first (the
// same codes: 127 is an integer) and NaN to 0.
inline void store_int8_row16(const float* src, int8_t* dst, int D) {
    __m512 m = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(src + d)), m);
    const float amax = _mm512_reduce_max_ps(m);
    const uint16_t sh = normal_to_half(std::min(std::max(amax / 127.f, 0x1p-14f), 65504.f));
    const __m512 s = _mm512_set1_ps(_cvtsh_ss(sh)), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_div_ps(_mm512_loadu_ps(src + d), s);
        const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
        const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
        const __m512i q = _mm512_maskz_mov_epi32(number, _mm512_cvt_roundps_epi32(c, _MM_FROUND_TO_NEAREST_INT |
                                                                                         _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(q));
    }
    std::memcpy(dst + D, &sh, 2);
}
#endif

// Stores one token's KV heads (src: KV rows of D floats, contiguous) into dst (KV rows of D + row_extra).
template <typename T>
inline void store_token(const float* src, T* dst, int KV, int D) {
    if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, src, sizeof(float) * KV * D);
    } else if constexpr (std::is_same_v<T, uint16_t>) {
#ifdef PAGELLM_SIMD_ATTENTION
        const int n = KV * D;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; ++i) dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
#endif
    } else if constexpr (std::is_same_v<T, int8_t>) {
#if defined(PAGELLM_SIMD_ATTENTION) && defined(__AVX512F__)
        if (D % 16 == 0) {  // the same bits 16 at a time (a prefill chunk writes thousands of rows)
            for (int h = 0; h < KV; ++h, src += D, dst += D + 2) store_int8_row16(src, dst, D);
            return;
        }
#endif
        for (int h = 0; h < KV; ++h, src += D, dst += D + 2) {
            float amax = 0.f;
            for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
            const uint16_t sh = normal_to_half(std::min(std::max(amax / 127.f, 0x1p-14f), 65504.f));
            const float s = half_to_float(sh);
            for (int d = 0; d < D; ++d) {
                const float q = std::nearbyint(src[d] / s);  // the default rounding mode: to nearest even
                dst[d] = static_cast<int8_t>(q >= 127.f ? 127 : q <= -127.f ? -127 : q == q ? (int)q : 0);
            }
            std::memcpy(dst + D, &sh, 2);
        }
    } else if constexpr (std::is_same_v<T, e4m3_t>) {
        for (int i = 0; i < KV * D; ++i) dst[i].bits = float_to_fp8<3, 7>(src[i], 448.f, 0x7E, 0x7F);
    } else {
        for (int i = 0; i < KV * D; ++i) dst[i].bits = float_to_fp8<2, 15>(src[i], 57344.f, 0x7B, 0x7F);
    }
}

#ifdef PAGELLM_SIMD_ATTENTION
// 8 consecutive elements as floats (int8: the codes, unscaled).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(widen_i8(p)); }
inline __m128i load8_bytes_to_u16(const void* p) {
    return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// e5m2 is the upper byte of a float16.
inline __m256 load8(const e5m2_t* p) { return _mm256_cvtph_ps(_mm_slli_epi16(load8_bytes_to_u16(p), 8)); }
// e4m3 (bias 7) shifted into float16's fields (bias 15) is the value / 256, subnormals included (the
// caller multiplies by E4M3_READ_SCALE once per key: exact, a power of two). The sign-extended byte
// shifted by 7 puts the sign at bit 15 and a stray copy at bit 14, cleared; 0x7F (NaN) becomes the
// all-ones float16 NaN.
constexpr float E4M3_READ_SCALE = 256.f;
inline __m256 load8(const e4m3_t* p) {
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16((short)0xBFFF));
    h = _mm_or_si128(h, _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80)));
    return _mm256_cvtph_ps(h);
}
#endif

#if defined(PAGELLM_SIMD_ATTENTION) && defined(__AVX512F__)
// 16 elements at a time for float32, float16 and int8 (two instructions): half the instructions of two load8 on
// the decode kernel's products (attention.cpp).
#define PAGELLM_WIDE_ATTENTION 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// int8: the codes, unscaled (the caller applies the row's scale per key, as with load8).
inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
constexpr bool loads16() {
    return std::is_same_v<T, float> || std::is_same_v<T, uint16_t> || std::is_same_v<T, int8_t>;
}
// dot4 16 lanes at a time (D % 16 == 0), for float32, float16 and int8 caches (int8: unscaled).
template <typename T>
inline __m128 dot4_16(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int D) {
    __m512 qv = _mm512_loadu_ps(q);
    __m512 a0 = _mm512_mul_ps(qv, load16(k0)), a1 = _mm512_mul_ps(qv, load16(k1));
    __m512 a2 = _mm512_mul_ps(qv, load16(k2)), a3 = _mm512_mul_ps(qv, load16(k3));
    for (int d = 16; d < D; d += 16) {
        qv = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qv, load16(k0 + d), a0);
        a1 = _mm512_fmadd_ps(qv, load16(k1 + d), a1);
        a2 = _mm512_fmadd_ps(qv, load16(k2 + d), a2);
        a3 = _mm512_fmadd_ps(qv, load16(k3 + d), a3);
    }
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold16(a0), fold16(a1)), _mm256_hadd_ps(fold16(a2), fold16(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif
