// One-plane int8 products of prompt rows over q4_1 blocks in the int8 tile order, for AVX2 builds (no AVX-512
// VNNI): quant_linear_int8_avx2.cpp. quant_linear_int8_tiles.cpp's entry point calls it where its own paths are
// not built.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define PAGELLM_INT8_AVX2 1

namespace int8_avx2 {

// y[M, N] = x[M, K] @ W^T over q4_1 blocks in tile order (codes, d, m as int8_tiles.py packs them), x rounded to
// int8 per 32 values (llama.cpp's scheme, vnni512::round_block's values); silu_mul: x is the MLP's gate/up output
// [M, 2K] and the values rounded are pagellm_silu_mul's. N % 16 == 0, K % 32 == 0.
void linear(const float* x, int64_t ldx, int M, int K, const uint8_t* codes, const float* d, const float* m, int N,
            float* y, int64_t ldy, int nthreads, bool silu_mul);

}  // namespace int8_avx2
#endif
