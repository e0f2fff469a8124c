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
#include "tile_dequant.h"

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
