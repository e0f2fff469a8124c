// Int8-activation products over q4_1 and q8_0 blocks in one weight layout that AVX-512 VNNI and AMX-INT8 both
// read, with the same arithmetic: every (row, 16 columns, block of 32 inputs) gets its integer dot product
// exactly (vpdpbusd or tdpbsud: the same int32), then the same float operations in the same order. So a row's
// result does not depend on how many rows the call has or which unit ran it: a speculative verification step
// of 5 rows can run on the tiles, nearly as cheap as one row, and still give exactly the tokens that one-row
// decode steps (VNNI) give. x is rounded per 32 values as quant_linear_vnni.h does (planes 1: llama.cpp's
// scheme; planes 2: plus the rounding error as a second int8 plane in steps of d / 128).
//
// Layout (pagellm/kernels/int8_tiles.py packs it): per strip of 16 output columns, per block of 32 inputs,
// the block's codes as an AMX B tile in VNNI order: tile row j (inputs 4j .. 4j + 3) holds, for column c, bytes
// 4c .. 4c + 3. q8_0: 8 rows of 64 bytes, each code + 128 (unsigned); q4_1: 4 rows of 64 bytes, byte i of row
// j holding row j's code in its low nibble and row j + 4's in its high one. d and q4_1's m: 16 floats per
// (strip, block), in column order.
#include <cstdint>
#include <cstring>

#include "int8_tile_rows.h"
#include "quant_linear_int8_avx2.h"

#ifdef PAGELLM_VNNI512
#include <algorithm>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGELLM_AMX_INT8 1
extern "C" int pagellm_amx_ready();
#endif

namespace {

using namespace int8_tile_rows;
// Up to this many rows the VNNI path runs, past it the tiles where the build and the OS have them. A decode
// step's 121 products (30 layers + LM head, cold weights) on the Xeon VM, VNNI vs tiles, ms, two runs
// (benchmarks/microbench_int8_tiles.py 10 12 16 20 24 28 32): 10 rows 10.6-10.8 vs 12.8-13.4, 16 15.0-15.4 vs
// 15.6-16.3, 20 18.0-18.4 vs 20.3-20.4, 24 20.8-21.0 vs 22.3-23.3, 28 23.5-23.6 vs 22.9-23.4, 32 26.8-27.1 vs
// 24.7-25.3. The tiles wait on each block's sums before its float work (computing a chunk of sums ahead did
// not help: the tile stores and loads are the cost), and VNNI's passes of up to 6 rows made it cheaper
// (the sixteenth session had the crossover at 10-12 rows).
constexpr int VNNI_MAX_ROWS = 24;

// The rows' integer sums against one block (u: its tile rows): two chains per plane (latency), then
// 128 * plane 0 + plane 1, exact in int32.
template <int Planes>
inline __m512i block_sum(const __m512i* u, const int8_t* x0, const int8_t* x1) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        a = _mm512_dpbusd_epi32(a, u[j], broadcast4(x0 + 4 * j));
        b = _mm512_dpbusd_epi32(b, u[j + 1], broadcast4(x0 + 4 * j + 4));
    }
    __m512i s = _mm512_add_epi32(a, b);
    if constexpr (Planes == 2) {
        __m512i c = _mm512_setzero_si512(), e = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            c = _mm512_dpbusd_epi32(c, u[j], broadcast4(x1 + 4 * j));
            e = _mm512_dpbusd_epi32(e, u[j + 1], broadcast4(x1 + 4 * j + 4));
        }
        s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), _mm512_add_epi32(c, e));
    }
    return s;
}

// Rows r0 .. r0 + R - 1 against one strip on AVX-512 VNNI.
template <int R, int Planes, bool Q8>
void vnni_strip(const Rows& x, int r0, const uint8_t* codes, const float* d, const float* m, float* y, int64_t ldy) {
    __m512 acc[R];  // in registers only if the row loops unroll fully (GCC kept 6 rows' on the stack otherwise)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < x.nb; ++b) {
        const uint8_t* cb = codes + (size_t)b * CODE_BYTES<Q8>;
        // weights stream once per decode step: ask for them 8 blocks ahead (the next strip's when near the end)
        for (int l = 0; l < CODE_BYTES<Q8>; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(cb + 8 * CODE_BYTES<Q8> + l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(d + (b + 8) * COLS), _MM_HINT_T0);
        if constexpr (!Q8) _mm_prefetch(reinterpret_cast<const char*>(m + (b + 8) * COLS), _MM_HINT_T0);
        __m512i u[8];
        load_codes<Q8>(cb, u);
        const __m512 dv = _mm512_loadu_ps(d + b * COLS), mv = Q8 ? dv : _mm512_loadu_ps(m + b * COLS);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const size_t row = (size_t)(r0 + r) * x.K + b * BLOCK;
            const __m512i s = block_sum<Planes>(u, x.q[0] + row, Planes == 2 ? x.q[1] + row : nullptr);
            acc[r] = accumulate<Q8>(acc[r], s, x, (size_t)(r0 + r) * x.nb + b, dv, mv);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

// The rows in as few passes over the strip as the registers allow (up to MAX_PASS_ROWS each, the passes even:
// 12 rows one pass, 13 rows 6 + 7), since each pass unpacks every block again: a speculative step of 4 drafts
// (5 rows) had run as 4 + 1. A row's arithmetic is the same in any pass, so its bits do not change. 12 rows'
// accumulators, the block's 8 code vectors and 4 sums fit the 32 registers. One decode step's 121 products
// (benchmarks/microbench_int8_tiles.py, builds alternating, ms): up to 6 rows a pass -> up to 8: 7 rows
// 8.9-9.3 -> 7.5-7.7, 8 rows 9.1-9.3 -> 7.9-8.2; up to 10: 9 rows 9.6-9.8 -> 8.6-8.7, 10 rows 10.1-10.3 ->
// 9.2-9.4; up to 12: 11 rows 10.9-11.1 -> 10.5, 12 rows 11.4-11.7 -> 10.8-11.1; then the row loops unrolled 16
// deep, not 8 (so that 9-12 rows unroll fully too): 11 rows 10.5 -> 9.5-9.9, 12 rows
// 10.9-11.0 -> 10.2-10.4.
constexpr int MAX_PASS_ROWS = 12;

template <int Planes, bool Q8>
void vnni_rows(const Rows& x, const uint8_t* codes, const float* d, const float* m, float* y, int64_t ldy) {
    const int passes = (x.M + MAX_PASS_ROWS - 1) / MAX_PASS_ROWS;
    for (int p = 0, r = 0; p < passes; ++p) {
        const int n = (x.M - r) / (passes - p);  // the remaining rows spread evenly over the remaining passes
        switch (n) {
            case 12: vnni_strip<12, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 11: vnni_strip<11, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 10: vnni_strip<10, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 9: vnni_strip<9, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 8: vnni_strip<8, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 7: vnni_strip<7, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 6: vnni_strip<6, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 5: vnni_strip<5, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 4: vnni_strip<4, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 3: vnni_strip<3, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            case 2: vnni_strip<2, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
            default: vnni_strip<1, Planes, Q8>(x, r, codes, d, m, y, ldy); break;
        }
        r += n;
    }
}

#ifdef PAGELLM_AMX_INT8
// Tiles 0-1: A (16 rows of x's block, planes 0 and 1: 32 bytes), 2: B (the block's 8 rows of 64 bytes),
// 3-4: C (16 rows x 16 int32 sums, per plane).
void configure_int8_tiles() {
    TileConfig c{};
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16, c.colsb[0] = c.colsb[1] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    c.rows[3] = c.rows[4] = 16, c.colsb[3] = c.colsb[4] = 64;
    _tile_loadconfig(&c);
}

// Every row (in 16s) against one strip on AMX tiles; q4_1 codes unpacked once per strip into `unpacked`.
template <int Planes, bool Q8>
void amx_strip(const Rows& x, const uint8_t* codes, const float* d, const float* m, float* y, int64_t ldy,
               uint8_t* unpacked) {
    const uint8_t* b_tiles = codes;
    if constexpr (!Q8) {
        for (int b = 0; b < x.nb; ++b) {
            __m512i u[8];
            load_codes<false>(codes + (size_t)b * 256, u);
            for (int j = 0; j < 8; ++j) _mm512_store_si512(unpacked + (size_t)b * 512 + 64 * j, u[j]);
        }
        b_tiles = unpacked;
    }
    alignas(64) int32_t c[2][16 * 16];
    for (int r0 = 0; r0 < x.Mpad; r0 += 16) {
        const int rows = std::min(16, x.M - r0);  // the float work only for rows that exist
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int b = 0; b < x.nb; ++b) {
            const size_t row = (size_t)r0 * x.K + b * BLOCK;
            _tile_loadd(2, b_tiles + (size_t)b * 512, 64);
            _tile_zero(3);
            _tile_loadd(0, x.q[0] + row, x.K);
            _tile_dpbsud(3, 0, 2);
            _tile_stored(3, c[0], 64);
            if constexpr (Planes == 2) {
                _tile_zero(4);
                _tile_loadd(1, x.q[1] + row, x.K);
                _tile_dpbsud(4, 1, 2);
                _tile_stored(4, c[1], 64);
            }
            const __m512 dv = _mm512_loadu_ps(d + b * COLS), mv = Q8 ? dv : _mm512_loadu_ps(m + b * COLS);
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) {
                if (r == rows) break;
                __m512i s = _mm512_load_si512(c[0] + 16 * r);
                if constexpr (Planes == 2) s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), _mm512_load_si512(c[1] + 16 * r));
                acc[r] = accumulate<Q8>(acc[r], s, x, (size_t)(r0 + r) * x.nb + b, dv, mv);
            }
        }
        for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
    }
}
#endif

template <int Planes, bool Q8>
int run(const float* xf, int64_t ldx, int M, int K, const uint8_t* codes, const float* d, const float* m, int N,
        float* y, int64_t ldy, int nthreads, bool tiles, bool silu_mul) {
    const Rows x = prepare(xf, ldx, M, K, Planes, tiles ? 16 : 1, nthreads, silu_mul);
    if (Planes == 1 && !tiles && M >= WIDE_MIN_ROWS) {
        wide_rows(Q8, x, codes, d, m, N, y, ldy, nthreads);
        return 0;
    }
    const int strips = N / COLS, nb = K / BLOCK;
    const size_t code_stride = (size_t)nb * CODE_BYTES<Q8>, scale_stride = (size_t)nb * COLS;
    nthreads = std::max(1, std::min(nthreads, strips));
#pragma omp parallel num_threads(nthreads)
    {
#ifdef PAGELLM_AMX_INT8
        std::vector<uint8_t> raw(tiles && !Q8 ? (size_t)nb * 512 + 64 : 0);
        uint8_t* unpacked = aligned64(raw.data());
        if (tiles) configure_int8_tiles();
#endif
#pragma omp for schedule(static)
        for (int s = 0; s < strips; ++s) {
            const uint8_t* cs = codes + s * code_stride;
            const float* ds = d + s * scale_stride;
            const float* ms = Q8 ? nullptr : m + s * scale_stride;
#ifdef PAGELLM_AMX_INT8
            if (tiles) {
                amx_strip<Planes, Q8>(x, cs, ds, ms, y + s * COLS, ldy, unpacked);
                continue;
            }
#endif
            vnni_rows<Planes, Q8>(x, cs, ds, ms, y + s * COLS, ldy);
        }
#ifdef PAGELLM_AMX_INT8
        if (tiles) _tile_release();
#endif
    }
    return 0;
}

}  // namespace
#endif

// Whether this build and process can run the AMX-INT8 half of the tile products (the VNNI half needs only the
// build: pagellm_build_features bit 6).
extern "C" int pagellm_int8_tiles_amx_ready() {
#ifdef PAGELLM_AMX_INT8
    return pagellm_amx_ready();
#else
    return 0;
#endif
}

namespace {
int tiles_linear(int kind, int planes, int method, const float* x, int64_t ldx, int M, int K, const uint8_t* codes,
                 const float* d, const float* m, int N, float* y, int64_t ldy, int nthreads, bool silu_mul) {
#ifdef PAGELLM_VNNI512
    if (N % COLS || K % BLOCK || M < 1 || kind < 0 || kind > 1 || planes < 1 || planes > 2 || method < 0 ||
        method > 2 || (kind == 0 && m == nullptr))
        return -1;
    const bool ready = pagellm_int8_tiles_amx_ready();
    if (method == 2 && !ready) return -1;
    const bool tiles = method == 2 || (method == 0 && ready && M > VNNI_MAX_ROWS);
    if (kind == 1)
        return planes == 2 ? run<2, true>(x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, tiles, silu_mul)
                           : run<1, true>(x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, tiles, silu_mul);
    return planes == 2 ? run<2, false>(x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, tiles, silu_mul)
                       : run<1, false>(x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, tiles, silu_mul);
#elif defined(PAGELLM_INT8_AVX2)
    // AVX2 builds: one plane over q4_1 blocks only (q8_0's codes + 128 would overflow vpmaddubsw's int16 pairs)
    if (N % 16 || K % 32 || M < 1 || kind != 0 || planes != 1 || method < 0 || method > 1 || m == nullptr)
        return -1;
    int8_avx2::linear(x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, silu_mul);
    return 0;
#else
    (void)kind, (void)planes, (void)method, (void)x, (void)ldx, (void)M, (void)K, (void)codes, (void)d, (void)m;
    (void)N, (void)y, (void)ldy, (void)nthreads, (void)silu_mul;
    return -1;
#endif
}
}  // namespace

// y[M, N] = x[M, K] @ W^T over q4_1 (kind 0) or q8_0 (kind 1: m NULL) blocks in the layout above, x rounded
// to int8 per 32 values (planes 1 or 2). method 0: VNNI up to VNNI_MAX_ROWS rows, else tiles where ready;
// 1: VNNI; 2: tiles. The same bits whichever runs. N % 16 == 0, K % 32 == 0. Returns 0, or -1 where the
// build lacks the path (or the tiles, for method 2) or an argument is out of range.
extern "C" int pagellm_int8_tiles_linear(int kind, int planes, int method, const float* x, int64_t ldx, int M, int K,
                                         const uint8_t* codes, const float* d, const float* m, int N, float* y,
                                         int64_t ldy, int nthreads) {
    return tiles_linear(kind, planes, method, x, ldx, M, K, codes, d, m, N, y, ldy, nthreads, false);
}

// The same with x = silu(gate) * up of the MLP's gate/up output [M, 2K] (row stride ldx), computed as
// pagellm_silu_mul does while x is rounded: the bits of pagellm_int8_tiles_linear on pagellm_silu_mul's output.
extern "C" int pagellm_int8_tiles_linear_silu_mul(int kind, int planes, int method, const float* gate_up,
                                                  int64_t ldx, int M, int K, const uint8_t* codes, const float* d,
                                                  const float* m, int N, float* y, int64_t ldy, int nthreads) {
    return tiles_linear(kind, planes, method, gate_up, ldx, M, K, codes, d, m, N, y, ldy, nthreads, true);
}
