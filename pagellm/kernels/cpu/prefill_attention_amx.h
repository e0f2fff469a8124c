// The prefill attention's work item on AMX bf16 tiles (included by prefill_attention.cpp: Packed, the packed K and V
// layouts, reset_rows and write_rows are that file's, exp16_bf16 too). 16 query rows of one head per item; per
// step of AMX_STEP = 64 keys:
//   S = Q K^T   four C tiles (16 rows x 16 keys each), D / 32 products apiece: A = 32 dimensions of the 16
//               bf16 query rows, B = 16 dimension pairs of 16 keys, which is the packed K layout as it is;
//   softmax     on S read back from the tiles: masks (only on the diagonal's steps), the rows' maxima (moved
//               lazily: LAZY_MAX), their rescale factors in one vector exp where one moved, exponentials and sums;
//               probabilities rounded to bf16 as rows of 64 keys: the two A tiles of the next product;
//   O += P V    one C tile per 16 output dimensions, B = 16 key pairs x 16 dimensions of the packed V (row stride
//               D words), added to the running output on the tiles (rows whose max moved rescaled in memory
//               first: every row's arithmetic is its own, whatever the other rows of its item do).
// The vdpbf16ps item spends ~1,000 instructions per row and step on the two products; here they are tile
// products, and the softmax is what is left.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGELLM_AMX_ATTENTION 1
#include <immintrin.h>

#include "amx_tiles.h"

extern "C" int pagellm_amx_ready();

constexpr int TILE_ROWS = 16;  // query rows per AMX work item

constexpr int AMX_STEP = 64;  // keys per step: four S tiles
static_assert(PACK_KEYS % AMX_STEP == 0, "a step may read keys up to its end: the packing pads that far");

// The step's P (tiles 2 and 5: keys 0-31, 32-63) times its V for output dimension tiles j0.. (up to 4; C tiles
// 0, 1, 6, 7), added on the tiles to the running output o (16 rows of 256 floats). vs: the step's first key pair
// in the packed V (D words per key pair).
inline void pv_tiles(const uint32_t* vs, int D, int j0, int nj, float* o) {
    const int64_t stride = (int64_t)D * 4, o_stride = 256 * 4, half = 16 * (int64_t)D;  // 16 key pairs on
#define PAGELLM_PV(C, j)                                  \
    do {                                                  \
        _tile_loadd(C, o + 16 * (j), o_stride);           \
        _tile_loadd(3, vs + 16 * (j), stride);            \
        _tile_loadd(4, vs + half + 16 * (j), stride);     \
        _tile_dpbf16ps(C, 2, 3);                          \
        _tile_dpbf16ps(C, 5, 4);                          \
        _tile_stored(C, o + 16 * (j), o_stride);          \
    } while (0)
    PAGELLM_PV(0, j0);
    if (nj > 1) PAGELLM_PV(1, j0 + 1);
    if (nj > 2) PAGELLM_PV(6, j0 + 2);
    if (nj > 3) PAGELLM_PV(7, j0 + 3);
#undef PAGELLM_PV
}

// A row's reference max moves only when a step's score passes it by more than this (FlashAttention-4's lazy
// rescaling): exponentials stay below e^8 (~3,000, far inside float32 and bf16), and most steps rescale no row.
// A row's sum of exponentials adds the bf16 values its P V multiplies (its top key's weight is no longer exactly
// 1: an unrounded sum left peaked rows off by up to bf16's 2^-9).
constexpr float LAZY_MAX = 8.0f;

// One work item on tiles: query head `head`, rows r0..r0+n-1 (n <= 16) at positions first_pos + r. The caller
// configured this thread's tiles.
inline void attend_rows_amx(const float* q, int64_t ldq, float* out, int64_t ldo, int head, int kv_head, int D,
                            int r0, int n, int64_t first_pos, const Packed& p, float scale) {
    const int pairs = D / 2;
    alignas(64) uint16_t qb[TILE_ROWS][256];     // bf16 query rows (zero past n), D <= 256
    alignas(64) float s[TILE_ROWS][AMX_STEP];    // a step's scores
    alignas(64) uint16_t pb[TILE_ROWS][AMX_STEP];  // a step's probabilities in bf16
    alignas(64) float o[TILE_ROWS][256];
    alignas(64) float m[TILE_ROWS];
    __m512 l[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) {
        const float* qr = q + (int64_t)(r0 + r) * ldq + (int64_t)head * D;
        for (int d = 0; d < D; d += 32)
            _mm512_store_si512(qb[r] + d, r < n ? as_si(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + d + 16),
                                                                            _mm512_loadu_ps(qr + d)))
                                                : _mm512_setzero_si512());
    }
    reset_rows(o, m, l, TILE_ROWS, D);
    const int64_t last = first_pos + r0 + n - 1;  // the item's last row sees keys 0..last
    const uint32_t* kh = p.k.data() + kv_head * p.k_head;
    const uint32_t* vh = p.v.data() + kv_head * p.v_head;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t q_stride = sizeof(qb[0]), tile_words = 16 * (int64_t)pairs;  // one key tile of K
    for (int64_t key0 = 0; key0 <= last; key0 += AMX_STEP) {
        const uint32_t* k0 = kh + key0 * pairs;  // 4 key tiles: D / 32 B tiles of 16 pairs each, 1 KiB apiece
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(6);
        _tile_zero(7);
        for (int c = 0; c < D / 32; ++c) {
            _tile_loadd(2, qb[0] + 32 * c, q_stride);
            _tile_loadd(3, k0 + 256 * c, 64);
            _tile_loadd(4, k0 + tile_words + 256 * c, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
            _tile_loadd(3, k0 + 2 * tile_words + 256 * c, 64);
            _tile_loadd(4, k0 + 3 * tile_words + 256 * c, 64);
            _tile_dpbf16ps(6, 2, 3);
            _tile_dpbf16ps(7, 2, 4);
        }
        _tile_stored(0, s[0], sizeof(s[0]));
        _tile_stored(1, s[0] + 16, sizeof(s[0]));
        _tile_stored(6, s[0] + 32, sizeof(s[0]));
        _tile_stored(7, s[0] + 48, sizeof(s[0]));
        // Each row's step max (masked keys -inf, only on the diagonal's steps; raw scores, scaled by the FMA that
        // subtracts the max), its reference max moved only past LAZY_MAX, and if any row's moved every row's
        // rescale factor in one vector exp (a row's first step has m = -inf: a factor of ~0 on its zero output and
        // sum); then the probabilities.
        const bool whole = key0 + AMX_STEP - 1 <= first_pos + r0;
        const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
        alignas(64) float m_new[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; ++r) {
            // keys key0 + 16 t + lane visible to row r: those <= its position (padding keys are beyond it)
            const __m512i limit = _mm512_set1_epi32((int)(first_pos + r0 + r - key0));
            __m512 x[4];
            for (int t = 0; t < 4; ++t) {
                x[t] = _mm512_load_ps(s[r] + 16 * t);
                if (!whole) {
                    x[t] = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(
                                                          _mm512_add_epi32(iota, _mm512_set1_epi32(16 * t)), limit),
                                              x[t]);
                    _mm512_store_ps(s[r] + 16 * t, x[t]);
                }
            }
            // scale > 0: the max of the scaled scores is the scaled max (-inf where the row sees none of them)
            const float top =
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]))) * scale;
            m_new[r] = top > m[r] + LAZY_MAX ? top : m[r];  // m = -inf before the first step: that step's max
        }
        const __m512 mv = _mm512_load_ps(m_new);
        const __mmask16 moved = _mm512_cmpneq_ps_mask(_mm512_load_ps(m), mv);
        if (moved) {  // those rows' output and sum rescaled in place (every other row's factor would be 1)
            alignas(64) float alpha[TILE_ROWS];
            _mm512_store_ps(alpha, exp16_bf16(_mm512_sub_ps(_mm512_load_ps(m), mv)));
            _mm512_store_ps(m, mv);
            for (int r = 0; r < TILE_ROWS; ++r) {
                if (!(moved >> r & 1)) continue;
                const __m512 al = _mm512_set1_ps(alpha[r]);
                l[r] = _mm512_mul_ps(l[r], al);
                for (int d = 0; d < D; d += 16) _mm512_store_ps(o[r] + d, _mm512_mul_ps(_mm512_load_ps(o[r] + d), al));
            }
        }
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int r = 0; r < TILE_ROWS; ++r) {
            const __m512 mx = _mm512_set1_ps(m[r]);
            __m512 x[4];
            for (int t = 0; t < 4; ++t) {
                const __m512 raw = _mm512_load_ps(s[r] + 16 * t);
                x[t] = exp16_bf16(_mm512_fmsub_ps(raw, sc, mx));
                if (!whole)  // exactly 0 for the masked keys (exp16 clamps: -inf would give ~1e-38)
                    x[t] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(raw, ninf, _CMP_NEQ_OQ), x[t]);
            }
            const __m512i p0 = as_si(_mm512_cvtne2ps_pbh(x[1], x[0])), p1 = as_si(_mm512_cvtne2ps_pbh(x[3], x[2]));
            _mm512_store_si512(pb[r], p0);  // keys 0-15, then 16-31
            _mm512_store_si512(pb[r] + 32, p1);
            // the sum of the bf16 probabilities: each 32-bit lane's two halves widened back to float32
            const __m512 sum = _mm512_add_ps(
                _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(p0, 16)),
                              _mm512_castsi512_ps(_mm512_and_si512(p0, high))),
                _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(p1, 16)),
                              _mm512_castsi512_ps(_mm512_and_si512(p1, high))));
            l[r] = _mm512_add_ps(l[r], sum);
        }
        _tile_loadd(2, pb[0], sizeof(pb[0]));
        _tile_loadd(5, pb[0] + 32, sizeof(pb[0]));
        const uint32_t* vs = vh + key0 / 2 * D;
        for (int j0 = 0; j0 < D / 16; j0 += 4) pv_tiles(vs, D, j0, std::min(4, D / 16 - j0), o[0]);
    }
    write_rows(o, l, n, out, ldo, r0, head, D);
}

#endif
