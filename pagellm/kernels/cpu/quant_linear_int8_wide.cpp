// Many-row int8-activation products over the int8 tile order (q4_1 / q8_0 blocks) on AVX-512 VNNI, one plane:
// under --dtype auto on a CPU with AVX-512 BF16 and VNNI but no AMX, prefill runs here instead of on oneDNN's bf16
// GEMM. vpdpbusd does 64 multiply-adds where vdpbf16ps does 32, so the integer sums run at up to twice the bf16
// rate; what costs is the float work after each block of 32 (accumulate: convert, scale, two FMAs per 8
// vpdpbusd).
//
// The few-row path (quant_linear_int8_tiles.cpp) takes one strip of 16 columns past up to 12 rows and unpacks
// q4_1's nibbles for every pass; here a register tile is 6 rows x 2 strips: each code vector of a block (unpacked
// once per chunk of rows into a thread's buffer) is loaded once per input quad for the 6 rows, and x's 4 bytes are
// broadcast once for both strips. Rows go in equal chunks of up to CHUNK_ROWS, whose rounded x stays in L2 across
// the strips; the threads share (chunk, strip pair) items, chunk by chunk, with no barrier between chunks. The
// integer sums are exact and the float work is accumulate's, in the same order, so
// a row's result has the same bits as on the few-row path.
#include "int8_tile_rows.h"

#ifdef PAGELLM_VNNI512

namespace int8_tile_rows {
namespace {

constexpr int TILE_ROWS = 6, CHUNK_ROWS = 240;

// Rows r0 .. r0 + R - 1 against C strips (u[c]: strip c's blocks, 8 rows of 64 unsigned bytes each).
template <int R, int C, bool Q8>
void wide_tile(const Rows& x, int r0, const uint8_t* const* u, const float* const* d, const float* const* m,
               float* y, int64_t ldy) {
    __m512 acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < x.nb; ++b) {
        // input quad j outside, rows inside: R x C independent sums in flight, each code vector loaded once
        __m512i s[R][C];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
            for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i w[C];
#pragma GCC unroll 2
            for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(u[c] + (size_t)b * 512 + 64 * j);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512i xb = broadcast4(x.q[0] + (size_t)(r0 + r) * x.K + b * BLOCK + 4 * j);
#pragma GCC unroll 2
                for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], w[c], xb);
            }
        }
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) {
            const __m512 dv = _mm512_loadu_ps(d[c] + b * COLS), mv = Q8 ? dv : _mm512_loadu_ps(m[c] + b * COLS);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
                acc[r][c] = accumulate<Q8>(acc[r][c], s[r][c], x, (size_t)(r0 + r) * x.nb + b, dv, mv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + c * COLS, acc[r][c]);
}

// Rows r .. end - 1 against C strips: TILE_ROWS at a time, then the rest.
template <int C, bool Q8>
void wide_rows_of(const Rows& x, int r, int end, const uint8_t* const* u, const float* const* d,
                  const float* const* m, float* y, int64_t ldy) {
    for (; r + TILE_ROWS <= end; r += TILE_ROWS) wide_tile<TILE_ROWS, C, Q8>(x, r, u, d, m, y, ldy);
    switch (end - r) {
        case 5: wide_tile<5, C, Q8>(x, r, u, d, m, y, ldy); break;
        case 4: wide_tile<4, C, Q8>(x, r, u, d, m, y, ldy); break;
        case 3: wide_tile<3, C, Q8>(x, r, u, d, m, y, ldy); break;
        case 2: wide_tile<2, C, Q8>(x, r, u, d, m, y, ldy); break;
        case 1: wide_tile<1, C, Q8>(x, r, u, d, m, y, ldy); break;
        default: break;
    }
}

template <bool Q8>
void wide(const Rows& x, const uint8_t* codes, const float* d, const float* m, int N, float* y, int64_t ldy,
          int nthreads) {
    const int strips = N / COLS, pairs = (strips + 1) / 2, nb = x.nb;
    const size_t code_stride = (size_t)nb * CODE_BYTES<Q8>, scale_stride = (size_t)nb * COLS;
    // chunks of equal rows (2,048 rows: 9 x 228, not 8 x 240 + 128): the threads take equal runs of items, and a
    // short last chunk had left the thread that got it waiting less than the other
    const int chunks = (x.M + CHUNK_ROWS - 1) / CHUNK_ROWS, chunk_rows = (x.M + chunks - 1) / chunks;
    nthreads = std::max(1, std::min(nthreads, chunks * pairs));
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<uint8_t> raw(Q8 ? 0 : 2 * (size_t)nb * 512 + 64);  // a pair's q4_1 codes, unpacked
        uint8_t* unpacked = aligned64(raw.data());
#pragma omp for schedule(static)
        for (int item = 0; item < chunks * pairs; ++item) {
            const int c0 = item / pairs * chunk_rows, c1 = std::min(x.M, c0 + chunk_rows), p = item % pairs;
            const int s0 = 2 * p, n = std::min(2, strips - s0);
            const uint8_t* u[2] = {nullptr, nullptr};
            const float* ds[2] = {nullptr, nullptr};
            const float* ms[2] = {nullptr, nullptr};
            for (int c = 0; c < n; ++c) {
                const uint8_t* cs = codes + (s0 + c) * code_stride;
                ds[c] = d + (s0 + c) * scale_stride;
                if constexpr (Q8) {
                    u[c] = cs;
                } else {
                    ms[c] = m + (s0 + c) * scale_stride;
                    uint8_t* out = unpacked + (size_t)c * nb * 512;
                    for (int b = 0; b < nb; ++b) {
                        __m512i w[8];
                        load_codes<false>(cs + (size_t)b * 256, w);
                        for (int j = 0; j < 8; ++j) _mm512_store_si512(out + (size_t)b * 512 + 64 * j, w[j]);
                    }
                    u[c] = out;
                }
            }
            float* ys = y + s0 * COLS;
            if (n == 2)
                wide_rows_of<2, Q8>(x, c0, c1, u, ds, ms, ys, ldy);
            else
                wide_rows_of<1, Q8>(x, c0, c1, u, ds, ms, ys, ldy);
        }
    }
}

}  // namespace

void wide_rows(bool q8, const Rows& x, const uint8_t* codes, const float* d, const float* m, int N, float* y,
               int64_t ldy, int nthreads) {
    if (q8)
        wide<true>(x, codes, d, m, N, y, ldy, nthreads);
    else
        wide<false>(x, codes, d, m, N, y, ldy, nthreads);
}

}  // namespace int8_tile_rows
#endif
