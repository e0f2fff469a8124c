// Many-row products over q4_1 and q8_0 blocks in tile order (kernels/amx.py packs them) on AVX-512 BF16's
// vdpbf16ps, for CPUs with bf16 dot products but no AMX (AMD Zen 4 and Zen 5). The AMX kernel's arithmetic
// (quant_linear_amx.cpp): each block group dequantized into the pair-interleaved bf16 layout (tile_dequant.h),
// which is exactly one vdpbf16ps operand per input pair (lane i: column i's weights for inputs 2p, 2p + 1), times
// a broadcast of the row's two bf16 inputs, float32 sums; the same bf16 weights as the oneDNN path's copy, so the
// same products up to summation order. Where it pays: decode steps of a few dozen rows, where oneDNN's bf16 GEMM
// runs well below its many-row rate and reads 2 bytes per weight against 0.8 (q4_1) here (benchmarks/NOTES.md,
// twentieth session; benchmarks/microbench_amx.py --vdpbf16ps).
//
// Per strip of 32 columns: chunks of up to ROWS rows (as even as they come) keep 2 x ROWS accumulators in
// registers over all of K; the first chunk dequantizes each block just before it multiplies it, later chunks
// reuse the strip's dequantized blocks from L1/L2.
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "tile_dequant.h"

#if defined(PAGELLM_TILE_DEQUANT)
#define PAGELLM_BF16DP 1
#include <algorithm>
#include <memory>
#include <utility>

namespace {

constexpr int ROWS = 12;  // rows per chunk: 24 accumulators, two weight vectors and a broadcast in 32 registers

template <int R>
inline void chunk(const uint16_t* x, int64_t ld, int nb, uint16_t* tiles, void* out, int64_t ldy,
                  bool out_bf16, int64_t col, const uint8_t* codes, const float* d, const float* m, int s, int kind,
                  bool dequantize) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        if (dequantize) {
            if (kind == 1)
                dequantize_block<true>(codes, d, m, s, nb, b, tiles);
            else
                dequantize_block<false>(codes, d, m, s, nb, b, tiles);
        }
        const uint16_t* t = tiles + (int64_t)b * 1024;
        const uint16_t* xb = x + (int64_t)b * 32;
        for (int p = 0; p < 16; ++p) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512(t + 32 * p);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(t + 512 + 32 * p);
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, xb + r * ld + 2 * p, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int g = 0; g < 2; ++g) {
            const int64_t at = (int64_t)r * ldy + col + 16 * g;
            if (out_bf16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at),
                                    (__m256i)_mm512_cvtneps_pbh(acc[r][g]));
            else
                _mm512_storeu_ps(static_cast<float*>(out) + at, acc[r][g]);
        }
    }
}

using ChunkFn = void (*)(const uint16_t*, int64_t, int, uint16_t*, void*, int64_t, bool, int64_t,
                         const uint8_t*, const float*, const float*, int, int, bool);

template <int... R>
constexpr ChunkFn chunks_by_rows(int rows, std::integer_sequence<int, R...>) {
    constexpr ChunkFn fns[] = {chunk<R + 1>...};
    return fns[rows - 1];
}

// One strip of 32 columns for all M rows of x (bf16, row stride ld): output rows of out (stride ldy).
void strip(const uint16_t* x, int64_t ld, int M, int K, const uint8_t* codes, const float* d, const float* m,
           int kind, int s, void* out, int64_t ldy, bool out_bf16, uint16_t* tiles) {
    const int nb = K / 32;
    // chunks of equal size (64 rows: 6 x 10-11, not 5 x 12 + 4): each reloads the strip's weights once
    const int nchunks = (M + ROWS - 1) / ROWS, per = (M + nchunks - 1) / nchunks;
    for (int r0 = 0; r0 < M; r0 += per) {
        const int rows = std::min(per, M - r0);
        const int64_t at = (int64_t)r0 * ldy;
        void* o = out_bf16 ? static_cast<void*>(static_cast<uint16_t*>(out) + at)
                           : static_cast<void*>(static_cast<float*>(out) + at);
        chunks_by_rows(rows, std::make_integer_sequence<int, ROWS>{})(
            x + (int64_t)r0 * ld, ld, nb, tiles, o, ldy, out_bf16, (int64_t)s * 32, codes, d, m, s, kind, r0 == 0);
    }
}

}  // namespace
#endif

// y[M, N] = x[M, K] @ W^T as pagellm_packed_linear_amx (same arguments, same tile order), on vdpbf16ps. Returns 0,
// or -1 where the build has no AVX-512 BF16 or for another kind.
extern "C" int pagellm_packed_linear_bf16dp(int kind, const void* x, int64_t ldx, int x_bf16, int M, int K,
                                            const uint8_t* codes, const float* d, const float* m, int N, void* y,
                                            int64_t ldy, int y_bf16, int nthreads) {
#ifdef PAGELLM_BF16DP
    if (N % 32 || K % 32 || M < 1 || kind < 0 || kind > 1) return -1;
    // float32 x is rounded to bf16 rows once (by the threads together); bf16 x is read in place
    std::unique_ptr<uint16_t[]> buf(x_bf16 ? nullptr : new uint16_t[(size_t)M * K]);
    const uint16_t* rows = x_bf16 ? static_cast<const uint16_t*>(x) : buf.get();
    const int64_t ld = x_bf16 ? ldx : K;
    const int nstrips = N / 32;
    nthreads = std::max(1, std::min(nthreads, nstrips));
#pragma omp parallel num_threads(nthreads)
    {
        if (!x_bf16) {
#pragma omp for schedule(static)
            for (int r = 0; r < M; ++r) row_to_bf16(x, ldx, false, r, K, buf.get() + (int64_t)r * K);
        }
        std::unique_ptr<uint16_t[]> tiles_buf(new uint16_t[(size_t)K / 32 * 1024 + 32]);  // a strip's blocks
        uint16_t* tiles = aligned64(tiles_buf.get());
#pragma omp for schedule(static)
        for (int s = 0; s < nstrips; ++s) strip(rows, ld, M, K, codes, d, m, kind, s, y, ldy, y_bf16, tiles);
    }
    return 0;
#else
    (void)kind, (void)x, (void)ldx, (void)x_bf16, (void)M, (void)K, (void)codes, (void)d, (void)m, (void)N;
    (void)y, (void)ldy, (void)y_bf16, (void)nthreads;
    return -1;
#endif
}
