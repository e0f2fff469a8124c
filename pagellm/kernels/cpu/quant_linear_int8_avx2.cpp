// Prompt rows on one-plane int8 over q4_1 blocks on AVX2 (no VNNI): under --dtype auto on an AVX2 CPU, the
// q4_1 layer products of prompt chunks run here instead of OpenBLAS's float32 sgemm over dequantized slices.
// x is rounded per 32 values (llama.cpp's scheme; the values vnni512::round_block gives) and the integer sums
// come from vpmaddubsw (unsigned codes 0..15 times signed x, pairs summed to int16), as llama.cpp's AVX2 q4
// kernels do: vpmaddubsw does 32 multiply-adds where an FMA does 8.
//
// Why int16 holds a block's sums: |x| <= 127 and codes <= 15, so a vpmaddubsw lane (two products) is at most
// 3,810 in magnitude and a block's eight of them at most 30,480 < 32,767. So the eight are added as int16 and
// widened once per block (vpmaddwd with ones), exact; the float work after each block is
// int8_tile_rows.h's accumulate, lane for lane (a row's result has the bits the AVX-512 paths give it).
//
// Layout (int8_tiles.py): per strip of 16 columns and block of 32 inputs, 4 rows of 64 bytes; row j's low
// nibbles are inputs 4j .. 4j + 3 and its high nibbles inputs 16 + 4j .., column c at bytes 4c .. 4c + 3. A
// 256-bit half holds columns 0-7 or 8-15. A register tile is 3 rows x one strip (2, 4 and 6 rows were
// slower on the Zen 4 VM capped to AVX2); each thread unpacks a strip's
// nibbles once per chunk of rows. Every row takes the same operations whatever M, so a row's result does not
// depend on the rows beside it.
#include "quant_linear_int8_avx2.h"

#ifdef PAGELLM_INT8_AVX2
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "simd.h"

namespace int8_avx2 {
namespace {

constexpr int COLS = 16, BLOCK = 32, TILE_ROWS = 3, CHUNK_ROWS = 240;

struct Rows {
    int M = 0, K = 0, nb = 0;
    std::vector<int8_t> q;       // [M, K]
    std::vector<float> scale;    // [M, nb]: the block's x scale d
    std::vector<float> sum;      // [M, nb]: d x the sum of the block's rounded values (q4_1's m term)
};

// silu(g) * u for 8 values of a gate/up row (u K values after g): pagellm_silu_mul's operations, lane for lane.
inline __m256 silu_mul8(const float* g, int K) {
    const __m256 x = _mm256_loadu_ps(g);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    return _mm256_mul_ps(silu, _mm256_loadu_ps(g + K));
}

inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 values -> int8 at q with scale amax / 127 (nearest even: vnni512::round_block's values); returns d, and the
// rounded values' sum in *total.
inline float round_block(const __m256* v, int8_t* q, int32_t* total) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 a = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
    const __m256 b = _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask));
    const float d = max8(_mm256_max_ps(a, b)) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));
    // int32 -> int8 with saturation; packs interleave 128-bit lanes, the permute puts the dwords back in order
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *total = _mm_cvtsi128_si32(t);
    return d;
}

Rows prepare(const float* x, int64_t ldx, int M, int K, int nthreads, bool silu_mul) {
    Rows r;
    r.M = M, r.K = K, r.nb = K / BLOCK;
    r.q.assign((size_t)M * K, 0);
    r.scale.assign((size_t)M * r.nb, 0.f);
    r.sum.assign((size_t)M * r.nb, 0.f);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 64)
    for (int i = 0; i < M; ++i)
        for (int b = 0; b < r.nb; ++b) {
            const float* xb = x + i * ldx + b * BLOCK;
            __m256 v[4];
            for (int k = 0; k < 4; ++k) v[k] = silu_mul ? silu_mul8(xb + 8 * k, K) : _mm256_loadu_ps(xb + 8 * k);
            int32_t total;
            const size_t at = (size_t)i * r.nb + b;
            r.scale[at] = round_block(v, r.q.data() + (size_t)i * K + b * BLOCK, &total);
            r.sum[at] = r.scale[at] * (float)total;  // as int8_tile_rows.h: the rounded x the codes meet
        }
    return r;
}

inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Rows r0 .. r0 + R - 1 against one strip (u: its unpacked codes, 8 rows of 64 bytes per block).
template <int R>
void tile(const Rows& x, int r0, const uint8_t* u, const float* d, const float* m, float* y, int64_t ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < x.nb; ++b) {
        __m256i s[R][2];  // int16 sums (see the top: a block's fit)
        for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
        const uint8_t* ub = u + (size_t)b * 512;
        // unrolled fully, GCC reassociated the int16 adds into a tree and spilled every product to the stack
#pragma GCC unroll 2
        for (int j = 0; j < 8; ++j) {
            const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(ub + 64 * j));
            const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(ub + 64 * j + 32));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m256i xb = broadcast4(x.q.data() + (size_t)(r0 + r) * x.K + b * BLOCK + 4 * j);
                s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, xb));
                s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, xb));
            }
        }
        for (int c = 0; c < 2; ++c) {
            const __m256 dv = _mm256_loadu_ps(d + b * COLS + 8 * c), mv = _mm256_loadu_ps(m + b * COLS + 8 * c);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {  // int8_tile_rows.h's accumulate, 8 lanes
                const size_t at = (size_t)(r0 + r) * x.nb + b;
                const __m256 t = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][c], ones));
                acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(t, _mm256_set1_ps(x.scale[at])), dv, acc[r][c]);
                acc[r][c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sum[at]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy, acc[r][0]);
        _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + 8, acc[r][1]);
    }
}

void rows_of(const Rows& x, int r, int end, const uint8_t* u, const float* d, const float* m, float* y, int64_t ldy) {
    for (; r + TILE_ROWS <= end; r += TILE_ROWS) tile<TILE_ROWS>(x, r, u, d, m, y, ldy);
    switch (end - r) {
        case 2: tile<2>(x, r, u, d, m, y, ldy); break;
        case 1: tile<1>(x, r, u, d, m, y, ldy); break;
        default: break;
    }
}

}  // namespace

void linear(const float* xf, int64_t ldx, int M, int K, const uint8_t* codes, const float* d, const float* m, int N,
            float* y, int64_t ldy, int nthreads, bool silu_mul) {
    const Rows x = prepare(xf, ldx, M, K, nthreads, silu_mul);
    const int strips = N / COLS, nb = x.nb;
    const size_t code_stride = (size_t)nb * 256, scale_stride = (size_t)nb * COLS;
    // equal chunks of rows whose int8 x stays in L2 across the strips; the threads share (chunk, strip) items
    const int chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS, chunk_rows = (M + chunks - 1) / chunks;
    nthreads = std::max(1, std::min(nthreads, chunks * strips));
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<uint8_t> raw((size_t)nb * 512 + 64);  // a strip's codes, one byte each
        uint8_t* unpacked = aligned64(raw.data());
        int last = -1;  // the strip in `unpacked`
#pragma omp for schedule(static)
        for (int item = 0; item < chunks * strips; ++item) {
            const int c0 = item / strips * chunk_rows, c1 = std::min(M, c0 + chunk_rows), s = item % strips;
            if (s != last) {
                const uint8_t* cs = codes + s * code_stride;
                const __m256i low = _mm256_set1_epi8(0x0F);
                for (int b = 0; b < nb; ++b)
                    for (int j = 0; j < 4; ++j)
                        for (int h = 0; h < 2; ++h) {
                            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cs + b * 256 + 64 * j + 32 * h));
                            uint8_t* out = unpacked + (size_t)b * 512 + 32 * h;
                            _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * j), _mm256_and_si256(w, low));
                            _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * (j + 4)),
                                               _mm256_and_si256(_mm256_srli_epi16(w, 4), low));
                        }
                last = s;
            }
            rows_of(x, c0, c1, unpacked, d + s * scale_stride, m + s * scale_stride, y + s * COLS, ldy);
        }
    }
}

}  // namespace int8_avx2
#endif
