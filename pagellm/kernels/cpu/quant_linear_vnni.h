// AVX-512 VNNI twins of quant_linear.cpp's int8-activation products (q4_1, q8_0, q8_1): one 512-bit
// vpdpbusd multiplies four q4 blocks (or two q8 blocks) by the row's int8 values, where the AVX2 path
// takes one block per 256-bit instruction and converts every block's sum to float on its own; with the
// weights prefetched ahead the one-row product (decode) runs at the memory bound (benchmarks/NOTES.md,
// thirteenth session). Two activation modes: planes 1 rounds x to int8 per 32-value block exactly as
// quantize_rows does (llama.cpp's scheme); planes 2 adds the rounding error as a second int8 plane (prepare).
// Every row is computed by the same operations in the same order whatever the number of rows.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGELLM_VNNI512 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace vnni512 {

// The rows' int8 values and per-block scales, regrouped for 512-bit products. Blocks go in groups of
// four (q4: 64 bytes of weights hold four blocks' nibbles) or two (q8: 64 bytes hold two blocks):
//   q4 layout, per group: the four blocks' elements 0..15 (64 bytes), then their elements 16..31, so a
//     block's low nibbles meet its first half and its high nibbles its second;
//   q8 layout: the natural order (two 32-byte blocks per vector).
// scale[r][g] (plane 0 only) holds each block's x scale repeated over the int32 lanes that carry its sums (4
// lanes per q4 block, 8 per q8 block); blocks past the end are zero, so a partial last group adds nothing.
struct Rows {
    int groups = 0;
    std::vector<int8_t> q;       // [M, groups, 64 (q8) or 128 (q4)]
    std::vector<float> scale;    // [M, groups, 16]
};

inline float inv_d(float d) { return d > 0.f ? 1.f / d : 0.f; }

// 32 values -> int8 with scale amax / 127 (rounded to nearest even, as quantize_rows), stored as two
// 16-byte halves at lo and hi; returns the scale, and the rounded values (as floats) in v (for the residual).
inline float round_block(__m512& v0, __m512& v1, int8_t* lo, int8_t* hi) {
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
    const float d = amax / 127.f, inv = inv_d(d);
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(i1));
    v0 = _mm512_cvtepi32_ps(i0);
    v1 = _mm512_cvtepi32_ps(i1);
    return d;
}

// The second plane of a block (two-plane mode): x's rounding error after round_block (x = d v + e, |e| <= d / 2)
// in steps of d / 128, within -64..64, stored as two 16-byte halves at lo and hi.
inline void round_error(__m512 x0, __m512 x1, __m512 v0, __m512 v1, float d, int8_t* lo, int8_t* hi) {
    const __m512 fine = _mm512_set1_ps(inv_d(d) * 128.f);
    const __m512 e0 = _mm512_sub_ps(x0, _mm512_mul_ps(_mm512_set1_ps(d), v0));
    const __m512 e1 = _mm512_sub_ps(x1, _mm512_mul_ps(_mm512_set1_ps(d), v1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(e0, fine))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(e1, fine))));
}

// x [M, K] (row stride ldx) rounded to int8 per 32-value block, straight into the layout above, with each
// block's sum over its rounded values (for q4_1/q8_1 minimums); planes 2 also rounds each block's rounding
// error to int8 in steps of d / 128 (x = d (q + q2 / 128) + e, |e| <= d / 256: ~15 bits of each block's
// largest value), and the scale stored is d / 128 (the products then sum 128 q + q2 in int32).
template <int PerGroup>  // 4: q4 layout, 2: q8 layout
void prepare(const float* x, int64_t ldx, int M, int K, int planes, Rows* out, std::vector<float>& sums) {
    const int nb = K / 32, groups = (nb + PerGroup - 1) / PerGroup, lanes = 16 / PerGroup;
    const int bytes = PerGroup * 32;
    sums.assign((size_t)M * nb, 0.f);
    for (int p = 0; p < planes; ++p)
        out[p] = Rows{groups, std::vector<int8_t>((size_t)M * groups * bytes, 0),
                      std::vector<float>(p ? 0 : (size_t)M * groups * 16, 0.f)};
    for (int r = 0; r < M; ++r)
        for (int b = 0; b < nb; ++b) {
            const int g = b / PerGroup, j = b % PerGroup;
            const size_t at = (size_t)r * groups + g;
            const int lo_at = PerGroup == 4 ? j * 16 : j * 32, hi_at = PerGroup == 4 ? 64 + j * 16 : j * 32 + 16;
            const __m512 x0 = _mm512_loadu_ps(x + r * ldx + b * 32), x1 = _mm512_loadu_ps(x + r * ldx + b * 32 + 16);
            __m512 v0 = x0, v1 = x1;
            int8_t* dst = out[0].q.data() + at * bytes;
            const float d = round_block(v0, v1, dst + lo_at, dst + hi_at);
            // the minimums' sums over the rounded x the codes meet, as quant_linear_int8_tiles.cpp's prepare
            int32_t total = (int32_t)_mm512_reduce_add_ps(_mm512_add_ps(v0, v1));  // integers: exact
            for (int l = 0; l < lanes; ++l) out[0].scale[at * 16 + j * lanes + l] = planes == 2 ? d / 128.f : d;
            if (planes == 2) {
                int8_t* dst2 = out[1].q.data() + at * bytes;
                round_error(x0, x1, v0, v1, d, dst2 + lo_at, dst2 + hi_at);
                total *= 128;
                for (int k = 0; k < 16; ++k) total += dst2[lo_at + k] + dst2[hi_at + k];
            }
            sums[(size_t)r * nb + b] = (planes == 2 ? d / 128.f : d) * (float)total;
        }
}

// Each weight block's scale over the lanes that carry its sums: `count` scales from dn (four per q4 group,
// two per q8 group; fewer in a partial last group, read with a mask) -> 16 lanes.
inline __m512 spread(const float* dn, int count, bool q4) {
    const __m512i q4_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i q8_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128 v = _mm_maskz_loadu_ps((__mmask8)((1u << count) - 1), dn);
    return _mm512_permutexvar_ps(q4 ? q4_lanes : q8_lanes, _mm512_castps128_ps512(v));
}

// Four totals at once: lane c of the result is the sum of v[c]'s 16 lanes (one reduction tree for four
// columns instead of four).
inline __m128 reduce4(const __m512* v) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold16(v[0]), fold16(v[1])), _mm256_hadd_ps(fold16(v[2]), fold16(v[3])));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// R rows against C consecutive output columns (C = 1 or 4). Q = uint8_t: q4_1 blocks (16 bytes, four per
// 64-byte group); int8_t: q8 blocks (32 bytes, two per group). qn, dn: column n's quants and scales, the
// next columns q_row / nb further; mins[r][c]: m . (x's block sums), added at the end.
template <int R, int C, int Planes, typename Q>
inline void columns(const Rows* x, int r0, int nb, const Q* qn, int64_t q_row, const float* dn,
                    const float (*mins)[4], float* y, int64_t ldy) {
    constexpr bool q4 = std::is_same_v<Q, uint8_t>;
    constexpr int per_group = q4 ? 4 : 2, x_bytes = q4 ? 128 : 64;
    const int groups = x[0].groups;
    const int64_t row_q = (int64_t)groups * x_bytes, row_s = (int64_t)groups * 16;
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    auto group = [&](int g, int count) {  // count < per_group: a partial last group, read with masks
        const __mmask64 mask = count == per_group ? ~0ull : (1ull << (count * (q4 ? 16 : 32))) - 1;
        for (int c = 0; c < C; ++c) {
            const Q* qg = qn + c * q_row + (size_t)g * 64;
            // the same bytes 16 columns on: decode streams every weight once, and with the hardware prefetcher
            // alone these loops wait on memory (1.4-1.6x from this line; benchmarks/NOTES.md, thirteenth session)
            _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * q_row), _MM_HINT_T0);
            const __m512i w = _mm512_maskz_loadu_epi8(mask, qg);
            const __m512 dw = spread(dn + (int64_t)c * nb + g * per_group, count, q4);
            __m512i u0, u1;  // unsigned weight bytes (q4: low and high nibbles; q8: |w|)
            __mmask64 negative = 0;
            if constexpr (q4) {
                const __m512i low = _mm512_set1_epi8(0x0F);
                u0 = _mm512_and_si512(w, low);
                u1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            } else {
                u0 = u1 = _mm512_abs_epi8(w);
                negative = _mm512_movepi8_mask(w);
            }
            for (int r = 0; r < R; ++r) {
                // plane 0 is x / d rounded, plane 1 its error in steps of 1/128: sum = 128 s0 + s1, exact in int32
                __m512i s = _mm512_setzero_si512();
                for (int p = 0; p < Planes; ++p) {
                    const int8_t* xq = x[p].q.data() + (r0 + r) * row_q + g * x_bytes;
                    if (p) s = _mm512_slli_epi32(s, 7);
                    if constexpr (q4) {
                        s = _mm512_dpbusd_epi32(s, u0, _mm512_loadu_si512(xq));
                        s = _mm512_dpbusd_epi32(s, u1, _mm512_loadu_si512(xq + 64));
                    } else {  // x takes w's sign (x is within -127..127: its negation never overflows)
                        const __m512i xv = _mm512_loadu_si512(xq);
                        s = _mm512_dpbusd_epi32(s, u0, _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv));
                    }
                }
                const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                                               _mm512_loadu_ps(x[0].scale.data() + (r0 + r) * row_s + g * 16));
                acc[r][c] = _mm512_fmadd_ps(t, dw, acc[r][c]);
            }
        }
    };
    const int full = nb / per_group;
    for (int g = 0; g < full; ++g) group(g, per_group);
    if (const int rest = nb - per_group * full) group(full, rest);
    for (int r = 0; r < R; ++r) {
        if constexpr (C == 4) {
            _mm_storeu_ps(y + r * ldy, _mm_add_ps(reduce4(acc[r]), _mm_loadu_ps(mins[r])));
        } else {
            y[r * ldy] = _mm512_reduce_add_ps(acc[r][0]) + mins[r][0];
        }
    }
}

template <int Planes, typename Q>
inline void dispatch(int rows, int cols, const Rows* x, int r0, int nb, const Q* qn, int64_t q_row, const float* dn,
                     const float (*mins)[4], float* y, int64_t ldy) {
    if (cols == 4) {
        switch (rows) {
            case 4: columns<4, 4, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            case 3: columns<3, 4, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            case 2: columns<2, 4, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            default: columns<1, 4, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
        }
    } else {
        switch (rows) {
            case 4: columns<4, 1, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            case 3: columns<3, 1, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            case 2: columns<2, 1, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
            default: columns<1, 1, Planes>(x, r0, nb, qn, q_row, dn, mins, y, ldy); break;
        }
    }
}

// y[M, N] = x [M, K] @ W^T with x rounded to int8 per 32-value block (prepare; planes 1: exactly
// quantize_rows' values, llama.cpp's scheme; 2: plus the rounding error as a second int8 plane); Q: uint8_t
// for q4_1 blocks (16 bytes), int8_t for q8 blocks (32 bytes); m: per-block minimums (times x's exact block
// sums) or null.
template <typename Q>
void linear(const float* xf, int64_t ldx, int M, int K, const Q* qs, const float* dw, const float* m, int N,
            float* y, int64_t ldy, int nthreads, int planes) {
    constexpr bool q4 = std::is_same_v<Q, uint8_t>;
    const int nb = K / 32;
    const int64_t q_row = (int64_t)nb * (q4 ? 16 : 32);
    Rows x[2];
    std::vector<float> sums;
    if (q4) prepare<4>(xf, ldx, M, K, planes, x, sums);
    else prepare<2>(xf, ldx, M, K, planes, x, sums);
    const float* sum = sums.data();
    const int quads = N / 4;  // columns in fours (one reduction for four), then the rest one by one
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int j = 0; j < quads + N % 4; ++j) {
        const int n = j < quads ? 4 * j : 4 * quads + (j - quads), cols = j < quads ? 4 : 1;
        const Q* qn = qs + n * q_row;
        const float* dn = dw + (int64_t)n * nb;
        for (int r = 0; r < M; r += 4) {
            const int rows = M - r < 4 ? M - r : 4;
            float mins[4][4] = {};
            if (m)
                for (int i = 0; i < rows; ++i)
                    for (int c = 0; c < cols; ++c)
                        mins[i][c] = dot(m + (int64_t)(n + c) * nb, sum + (size_t)(r + i) * nb, nb);
            float* yr = y + r * ldy + n;
            if (planes == 2) dispatch<2>(rows, cols, x, r, nb, qn, q_row, dn, mins, yr, ldy);
            else dispatch<1>(rows, cols, x, r, nb, qn, q_row, dn, mins, yr, ldy);
        }
    }
}

}  // namespace vnni512
#endif
