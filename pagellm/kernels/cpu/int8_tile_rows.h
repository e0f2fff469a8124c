// What the int8 tile-order products share (quant_linear_int8_tiles.cpp: few rows and AMX tiles;
// quant_linear_int8_wide.cpp: many rows on AVX-512 VNNI): x rounded per 32 values, a (strip, block)'s codes
// unpacked, and the float work after a block's integer sums, the one place every path rounds. The layout is
// described in quant_linear_int8_tiles.cpp and kernels/int8_tiles.py.
#pragma once

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "quant_linear_vnni.h"

#ifdef PAGELLM_VNNI512
#include <algorithm>
#include <vector>

namespace int8_tile_rows {

constexpr int COLS = 16, BLOCK = 32;

template <bool Q8>
constexpr int CODE_BYTES = Q8 ? 512 : 256;  // one (strip, block)

// x rounded per block: planes of int8 [Mpad, K] (rows past M zero), 64-byte aligned for the tile loads.
struct Rows {
    int M = 0, Mpad = 0, K = 0, nb = 0;
    std::vector<int8_t> raw;
    int8_t* q[2] = {nullptr, nullptr};
    std::vector<float> scale;    // [Mpad, nb]: the block's x scale (d, or d / 128 with two planes); 0 past M
    std::vector<float> sum;      // [Mpad, nb]: the sum of the block's rounded x (q4_1's m term)
    std::vector<int32_t> bias;   // [Mpad, nb]: 128 x the integer sum the products see (q8_0's +128 codes)
};

// silu(g) * u for 16 values of a gate/up row (u K values after g): pagellm_silu_mul's operations, lane for lane.
inline __m512 silu_mul16(const float* g, int K) {
    const __m512 x = _mm512_loadu_ps(g);
    const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    return _mm512_mul_ps(silu, _mm512_loadu_ps(g + K));
}

// x [M, K] (row stride ldx) rounded per block; with silu_mul, x is the MLP's gate/up output [M, 2K] and the
// values rounded are silu(gate) * up, the bits of ops.silu_mul (one pass instead of two over the widest rows).
inline Rows prepare(const float* x, int64_t ldx, int M, int K, int planes, int pad, int nthreads,
                    bool silu_mul = false) {
    Rows r;
    r.M = M, r.K = K, r.nb = K / BLOCK, r.Mpad = (M + pad - 1) / pad * pad;
    const size_t plane = (size_t)r.Mpad * K;
    r.raw.assign(planes * plane + 64, 0);
    int8_t* base = aligned64(r.raw.data());
    r.q[0] = base, r.q[1] = planes == 2 ? base + plane : nullptr;
    r.scale.assign((size_t)r.Mpad * r.nb, 0.f);
    r.sum.assign((size_t)r.Mpad * r.nb, 0.f);
    r.bias.assign((size_t)r.Mpad * r.nb, 0);
    // rows in parallel past a few (prefill: 2,048 rows of 576 values took ~0.5 ms a product on one thread)
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 64)
    for (int i = 0; i < M; ++i)
        for (int b = 0; b < r.nb; ++b) {
            const float* xb = x + i * ldx + b * BLOCK;
            const __m512 x0 = silu_mul ? silu_mul16(xb, K) : _mm512_loadu_ps(xb);
            const __m512 x1 = silu_mul ? silu_mul16(xb + 16, K) : _mm512_loadu_ps(xb + 16);
            const size_t at = (size_t)i * r.nb + b;
            __m512 v0 = x0, v1 = x1;
            int8_t* q0 = r.q[0] + (size_t)i * K + b * BLOCK;
            const float d = vnni512::round_block(v0, v1, q0, q0 + 16);
            // the rounded values' sum: integers below 2^24 at every step, so the float sum is exact
            int32_t total = (int32_t)_mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            if (planes == 2) {  // the rounding error in steps of d / 128, as quant_linear_vnni.h's prepare
                int8_t* q1 = r.q[1] + (size_t)i * K + b * BLOCK;
                vnni512::round_error(x0, x1, v0, v1, d, q1, q1 + 16);
                total *= 128;
                for (int k = 0; k < BLOCK; ++k) total += q1[k];
            }
            r.scale[at] = planes == 2 ? d / 128.f : d;
            r.bias[at] = 128 * total;
            // q4_1's m term from the rounded x the codes meet, not x's exact sum: the codes are 0..15, so x's
            // rounding errors e came in as d q . e; with the m term on the same values they are w . e, centred
            // (one plane: a 2.5x smaller mean error on gguf-quantized weights, tests/test_int8_activations.py)
            r.sum[at] = r.scale[at] * (float)total;
        }
    return r;
}

// The float work after a block's integer sums s (16 columns of one row): the one place both paths round.
template <bool Q8>
inline __m512 accumulate(__m512 acc, __m512i s, const Rows& x, size_t at, __m512 dv, __m512 mv) {
    if constexpr (Q8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x.bias[at]));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(x.scale[at])), dv, acc);
    if constexpr (!Q8) acc = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sum[at]), acc);
    return acc;
}

// A (strip, block)'s codes as the 8 tile rows of unsigned bytes.
template <bool Q8>
inline void load_codes(const uint8_t* codes, __m512i* u) {
    if constexpr (Q8) {
        for (int j = 0; j < 8; ++j) u[j] = _mm512_loadu_si512(codes + 64 * j);
    } else {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {
            const __m512i w = _mm512_loadu_si512(codes + 64 * j);
            u[j] = _mm512_and_si512(w, low);
            u[j + 4] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        }
    }
}

// Many rows (M >= WIDE_MIN_ROWS) on AVX-512 VNNI, planes 1, the same bits as the few-row path
// (quant_linear_int8_wide.cpp). kind 0 q4_1, 1 q8_0.
constexpr int WIDE_MIN_ROWS = 48;
void wide_rows(bool q8, const Rows& x, const uint8_t* codes, const float* d, const float* m, int N, float* y,
               int64_t ldy, int nthreads);

}  // namespace int8_tile_rows
#endif
