// AVX-512 twins of quant_linear.cpp's float32 column products for q4 and q8 blocks: a block's 32 quants
// become two vectors of 16 floats (5 instructions for q4_1 where the AVX2 unpack takes 10) and each row
// takes 2 FMAs per block instead of 4. The one-row (decode) product is bound by these per-block
// instructions, not by memory (benchmarks/NOTES.md), so this is its lever on AVX-512 CPUs. Same contract as
// the AVX2 code: float32 throughout, every row computed by the same operations whatever the number of rows.
#pragma once

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
#define PAGELLM_WIDE_PACKED 1
#include <immintrin.h>

struct Quants16 { __m512 lo, hi; };  // elements 0..15 and 16..31 of the block

// Which unpack has a 16-lane twin: Wide16<unpack_q4>::unpack etc. (fp8 keeps the AVX2 path).
template <auto Unpack>
struct Wide16 { static constexpr bool has = false; };

template <>
struct Wide16<unpack_q4> {
    static constexpr bool has = true;
    static Quants16 unpack(const uint8_t* qs) {  // byte j: element j (low nibble), element j + 16 (high)
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        return {_mm512_cvtepi32_ps(_mm512_and_si512(a, _mm512_set1_epi32(0x0F))),
                _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4))};
    }
};

template <>
struct Wide16<unpack_q8> {
    static constexpr bool has = true;
    static Quants16 unpack(const int8_t* qs) {
        return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)))),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))))};
    }
};

// As quant_linear.cpp's column: R rows of x against output column n, groups of G (32 or 16) weights.
template <int R, int G, typename Q, typename W>
inline void column16(const float* x, int64_t ldx, int K, const Q* qs, int64_t q_per_block, const float* d,
                     const float* m, const float* xsum, float* y, int64_t ldy) {
    const int nb = K / 32, ng = K / G;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        // columns lie one after another: fetch 4 KiB ahead (decode streams each weight once; NOTES)
        _mm_prefetch(reinterpret_cast<const char*>(qs + b * q_per_block) + 4096, _MM_HINT_T0);
        const Quants16 w = W::unpack(qs + b * q_per_block);
        const __m512 d0 = _mm512_set1_ps(d[b * 32 / G]), d1 = _mm512_set1_ps(d[b * 32 / G + (G == 16)]);
        for (int r = 0; r < R; ++r) {
            const float* xb = x + r * ldx + b * 32;
            __m512 t = _mm512_mul_ps(w.lo, _mm512_loadu_ps(xb));
            if (G == 16) {  // elements 0..15 are the first group: scale it, start the second
                acc[r] = _mm512_fmadd_ps(d0, t, acc[r]);
                t = _mm512_mul_ps(w.hi, _mm512_loadu_ps(xb + 16));
            } else {
                t = _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(xb + 16), t);
            }
            acc[r] = _mm512_fmadd_ps(d1, t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum16(acc[r]) + (m ? dot(m, xsum + r * ng, ng) : 0.f);
}
#endif
