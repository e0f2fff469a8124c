// Many-row products over q4_1 and q8_0 blocks on AMX bf16 tiles (Intel Sapphire Rapids and later): each
// 16-column x 32-weight block group is dequantized straight into a B tile's pair-interleaved (VNNI) layout,
// in bf16, and multiplied against bf16 rows of x with float32 accumulation. The weights are the same bf16
// values as the bf16 copy the oneDNN path multiplies (w = d * q + m in float32, rounded to nearest even),
// so the products match that path up to summation order, while reading 0.8 (q4_1) or 1.1 (q8_0) bytes per
// weight instead of 2: decode steps of 5-64 rows stream every weight once and wait on memory (benchmarks/NOTES.md,
// fourteenth session); with every pass 2 x 2 C tiles and bf16 x read in place, steps up to 1,024 rows run faster
// here than oneDNN's product (seventeenth session).
//
// Codes come in the tile order pagellm/kernels/amx.py packs them: per strip of 32 output columns, block of
// 32 inputs and group of 16 columns (in that order: a product reads them front to back), 16 rows (one B tile
// row each: 16 columns x one input pair, lane L being column L / 2, input 2 r + L % 2 of the block) of 16
// bytes for q4_1 (byte i: lane i in the low nibble, lane 16 + i in the high one) or 32 for q8_0 (lane L's
// byte at L); d and m in the same order, 16 floats in column order.
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGELLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

namespace {

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

// Tiles (configure_full_tiles) 0-3: C (rows 0-15 / 16-31 of a pass times columns 0-15 / 16-31 of the strip),
// 4-5: A, 6-7: B.

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

// Stores row tiles' results (c: 16-float rows, stride ldc floats) as rows r0.. of out's columns col..col+w.
inline void store_rows(const float* c, int ldc, int rows, int w, void* out, int64_t ldy, bool out_bf16, int r0,
                       int64_t col) {
    for (int r = 0; r < rows; ++r) {
        const float* src = c + r * ldc;
        const int64_t at = (int64_t)(r0 + r) * ldy + col;
        for (int j = 0; j < w; j += 16) {
            if (out_bf16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at + j),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
            else
                _mm512_storeu_ps(static_cast<float*>(out) + at + j, _mm512_loadu_ps(src + j));
        }
    }
}

// x's rows in bf16 as the A tiles read them: row tile t (rows 16 t ..) at base + 16 t ld (ld elements per
// row), except a last partial one, which is a copy padded with zero rows at `tail` (same row stride).
struct XRows {
    const uint16_t* base;
    int64_t ld;
    int full;  // whole row tiles at base
    const uint16_t* tail;
    const uint16_t* tile(int t) const { return t < full ? base + (int64_t)t * 16 * ld : tail; }
};

// Block b's products for a pass of row tiles t, t + 1 (t alone where `two` is false) against the strip's two
// B tiles at tb: two A and two B tiles for four products.
inline void pass_block(const XRows& x, int t, int b, const uint16_t* tb, bool two) {
    const int64_t stride = x.ld * 2;
    _tile_loadd(4, x.tile(t) + b * 32, stride);
    _tile_loadd(6, tb, 64);
    _tile_loadd(7, tb + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
        _tile_loadd(5, x.tile(t + 1) + b * 32, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// A pass's C tiles out as rows r0.. of the strip's 32 columns of out.
inline void finish_pass(float* c, bool two, int rows, void* out, int64_t ldy, bool out_bf16, int r0, int s) {
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 512, 128);
        _tile_stored(3, c + 528, 128);
    }
    store_rows(c, 32, rows, 32, out, ldy, out_bf16, r0, (int64_t)s * 32);
}

inline void zero_c() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

// One strip of 32 columns, 32 rows x 32 columns per pass over its blocks (2 x 2 C tiles: every tile loaded
// serves two products). The first pass dequantizes the blocks into `tiles` (nb x 2 B tiles) as it reaches
// them, one block ahead of the products so that the tile loads do not wait on the stores just made; later
// passes reuse them from L1/L2 while x's rows stream at half a tile per product (a 4 x 1 arrangement for the
// later rows loaded a whole A tile per product, and L2 could not keep up: benchmarks/microbench_amx.py at 128
// rows 21.5-22.3 -> 18.6-18.8 ms). out: float32 or bf16 rows of N (row stride ldy).
template <bool Q8>
void strip(const XRows& x, int Mpad, int K, const uint8_t* codes, const float* d, const float* m, int s,
           void* out, int64_t ldy, bool out_bf16, int M, uint16_t* tiles, float* c) {
    const int nb = K / 32;
    dequantize_block<Q8>(codes, d, m, s, nb, 0, tiles);
    zero_c();
    for (int b = 0; b < nb; ++b) {
        if (b + 1 < nb) dequantize_block<Q8>(codes, d, m, s, nb, b + 1, tiles);
        pass_block(x, 0, b, tiles + (int64_t)b * 1024, Mpad >= 32);
    }
    finish_pass(c, Mpad >= 32, std::min(M, 32), out, ldy, out_bf16, 0, s);
    for (int r0 = 32; r0 < Mpad; r0 += 32) {
        const bool two = Mpad - r0 >= 32;
        zero_c();
        for (int b = 0; b < nb; ++b) pass_block(x, r0 / 16, b, tiles + (int64_t)b * 1024, two);
        finish_pass(c, two, std::min(M - r0, 32), out, ldy, out_bf16, r0, s);
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

// Whether this process may use AMX tiles: the build has them and Linux granted the tile state (asked once).
extern "C" int pagellm_amx_ready() {
#ifdef PAGELLM_AMX
    static const int ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ok;
#else
    return 0;
#endif
}

// y[M, N] = x[M, K] @ W^T, W in q4_1 (kind 0) or q8_0 (kind 1: m NULL) blocks packed in tile order (above).
// x: float32 (x_bf16 0) or bf16 rows with stride ldx elements; y: float32 or bf16 (y_bf16) rows with stride
// ldy. N % 32 == 0, K % 32 == 0. Returns 0, or -1 where the build or the OS has no AMX, or for another kind.
extern "C" int pagellm_packed_linear_amx(int kind, const void* x, int64_t ldx, int x_bf16, int M, int K,
                                         const uint8_t* codes, const float* d, const float* m, int N, void* y,
                                         int64_t ldy, int y_bf16, int nthreads) {
#ifdef PAGELLM_AMX
    if (!pagellm_amx_ready() || N % 32 || K % 32 || M < 1 || kind < 0 || kind > 1) return -1;
    const int Mpad = (M + 15) / 16 * 16;
    // bf16 rows whose tile rows never straddle a cache line are read in place (a row split across two lines
    // costs every A tile load twice); other x is copied (float32: rounded) by the threads themselves into an
    // aligned buffer, the single-threaded copy cost ~1.5 of a 128-token prefill's ~45 ms
    const bool in_place = x_bf16 && reinterpret_cast<uintptr_t>(x) % 64 == 0 && ldx * 2 % 64 == 0;
    const int64_t ld = in_place ? ldx : K;
    const int full = in_place ? M / 16 : 0, copied = Mpad - 16 * full;
    std::unique_ptr<uint16_t[]> buf(new uint16_t[(size_t)copied * ld + 32]);
    uint16_t* own = aligned64(buf.get());
    const XRows rows{in_place ? static_cast<const uint16_t*>(x) : own, ld, in_place ? full : Mpad / 16, own};
    const int nstrips = N / 32;
    nthreads = std::max(1, std::min(nthreads, nstrips));
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int r = 16 * full; r < Mpad; ++r) {
            uint16_t* dst = own + (int64_t)(r - 16 * full) * ld;
            if (r < M)
                row_to_bf16(x, ldx, x_bf16, r, K, dst);
            else
                std::memset(dst, 0, (size_t)K * 2);
        }
        std::unique_ptr<uint16_t[]> tiles_buf(new uint16_t[(size_t)K / 32 * 1024 + 32]);  // a strip's B tiles
        uint16_t* tiles = aligned64(tiles_buf.get());
        alignas(64) float c[32 * 32];  // a pass's results
        configure_full_tiles();
#pragma omp for schedule(static)
        for (int s = 0; s < nstrips; ++s) {
            if (kind == 1)
                strip<true>(rows, Mpad, K, codes, d, m, s, y, ldy, y_bf16, M, tiles, c);
            else
                strip<false>(rows, Mpad, K, codes, d, m, s, y, ldy, y_bf16, M, tiles, c);
        }
        _tile_release();
    }
    return 0;
#else
    (void)kind, (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)codes, (void)d, (void)m, (void)N;
    (void)y, (void)ldy, (void)y_bf16, (void)nthreads;
    return -1;
#endif
}
