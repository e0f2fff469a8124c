// What the many-row products over blocks in tile order share (quant_linear_amx.cpp on AMX tiles,
// quant_linear_bf16dp.cpp on AVX-512 BF16 vdpbf16ps): a 16-column x 32-weight group's codes dequantized into the
// pair-interleaved (VNNI) bf16 layout both multiply (kernels/amx.py packs it), and x's rows rounded to bf16.
// w = d * q + m in float32, rounded to nearest even: the bf16 copy's values, so either product matches the
// oneDNN path up to summation order.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGELLM_TILE_DEQUANT 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// Code bytes per group of 16 columns and block of 32 inputs: q4_1 nibbles, q8_0 bytes.
template <bool Q8>
constexpr int64_t TILE_CODES = Q8 ? 512 : 256;
constexpr int64_t PREFETCH_TILES = 16;  // how far ahead a product asks for the weights

// One B tile (16 rows x 32 bf16) from a group's block: codes TILE_CODES<Q8> bytes, d (and q4_1's m) 16 floats.
template <bool Q8>
inline void dequantize_tile(const uint8_t* codes, const float* d, const float* m, uint16_t* tile) {
    alignas(64) static const int lo_cols[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    const __m512i lo_idx = _mm512_load_si512(lo_cols), hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __m512 dv = _mm512_loadu_ps(d);
    const __m512 dlo = _mm512_permutexvar_ps(lo_idx, dv), dhi = _mm512_permutexvar_ps(hi_idx, dv);
    if constexpr (Q8) {  // w = d * q: exact in float32 (an 11-bit scale times 8 bits), then rounded to bf16
        for (int r = 0; r < 16; ++r) {
            const auto* row = reinterpret_cast<const __m128i*>(codes + 32 * r);  // lanes 0-15, then 16-31
            const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), dlo);
            const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), dhi);
            _mm512_store_si512(tile + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        return;
    }
    const __m512 mv = _mm512_loadu_ps(m);
    const __m512 mlo = _mm512_permutexvar_ps(lo_idx, mv), mhi = _mm512_permutexvar_ps(hi_idx, mv);
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int r = 0; r < 16; ++r) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
        // d * q + m as two roundings, as the loader's float32 weights (formats.py dequantize)
        const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low4)), dlo), mlo);
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), dhi), mhi);
        _mm512_store_si512(tile + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Both groups' block b of strip s into tiles[b] (2 x 512 bf16).
template <bool Q8>
inline void dequantize_block(const uint8_t* codes, const float* d, const float* m, int s, int nb, int b,
                             uint16_t* tiles) {
    for (int g = 0; g < 2; ++g) {
        const int64_t at = ((int64_t)s * nb + b) * 2 + g;
        const uint8_t* c = codes + at * TILE_CODES<Q8>;
        // every line of the tile PREFETCH_TILES ahead, and of its scales (and minimums): the weights stream
        // from memory once per product
        for (int64_t line = 0; line < TILE_CODES<Q8>; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(c + PREFETCH_TILES * TILE_CODES<Q8> + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(d + (at + PREFETCH_TILES) * 16), _MM_HINT_T0);
        if constexpr (!Q8) _mm_prefetch(reinterpret_cast<const char*>(m + (at + PREFETCH_TILES) * 16), _MM_HINT_T0);
        dequantize_tile<Q8>(c, d + at * 16, Q8 ? nullptr : m + at * 16, tiles + ((int64_t)b * 2 + g) * 512);
    }
}

// Row r of x (float32 or bf16, row stride ldx) into dst as K bf16 values.
inline void row_to_bf16(const void* x, int64_t ldx, bool x_bf16, int r, int K, uint16_t* dst) {
    if (x_bf16) {
        std::memcpy(dst, static_cast<const uint16_t*>(x) + r * ldx, (size_t)K * 2);
        return;
    }
    const float* src = static_cast<const float*>(x) + r * ldx;
    for (int k = 0; k < K; k += 32)  // nearest even, as torch's .to(torch.bfloat16)
        _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16),
                                                                  _mm512_loadu_ps(src + k)));
}

}  // namespace
#endif
