// The one entry of the packed products for every kind and activation mode (pagellm/kernels/ops.py
// packed_linear; the native decoder calls it too): the kernels themselves are quant_linear.cpp (float32 and
// int8 activations) and quant_linear_vnni.h (AVX-512 VNNI int8, one- and two-plane).
#include <cstdint>

#include "quant_linear_vnni.h"

extern "C" {
void pagellm_q4_1_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d, const float* m,
                         int N, float* y, int64_t ldy, int nthreads);
void pagellm_q4_1_linear_i8(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                            const float* m, int N, float* y, int64_t ldy, int nthreads);
void pagellm_q8_0_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d, int N, float* y,
                         int64_t ldy, int nthreads);
void pagellm_q8_0_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d, int N,
                            float* y, int64_t ldy, int nthreads);
void pagellm_q8_1_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d, const float* m,
                         int N, float* y, int64_t ldy, int nthreads);
void pagellm_q8_1_linear_i8(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                            const float* m, int N, float* y, int64_t ldy, int nthreads);
void pagellm_fp8_e4m3_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d, int N,
                             float* y, int64_t ldy, int nthreads);
void pagellm_q4_1_16_linear(const float* x, int64_t ldx, int M, int K, const uint8_t* qs, const float* d,
                            const float* m, int N, float* y, int64_t ldy, int nthreads);
void pagellm_q8_0_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d, int N,
                            float* y, int64_t ldy, int nthreads);
void pagellm_q8_1_16_linear(const float* x, int64_t ldx, int M, int K, const int8_t* qs, const float* d,
                            const float* m, int N, float* y, int64_t ldy, int nthreads);
}

// One entry for every kind (codes: pagellm/kernels/ops.py KIND_CODES; the native decoder calls it too).
// int8_x 1 selects the int8-activation kernel where the kind has one (q4_1, q8_0, q8_1), else the float one;
// 2: int8 activations with their rounding error as a second plane (~16-bit accurate, quant_linear_vnni.h),
// on AVX-512 VNNI builds; elsewhere the float kernel, which is at least as accurate.
extern "C" void pagellm_packed_linear(int kind, int int8_x, const float* x, int64_t ldx, int M, int K,
                                      const void* qs, const float* d, const float* m, int N, float* y, int64_t ldy,
                                      int nthreads) {
    const auto* u8 = static_cast<const uint8_t*>(qs);
    const auto* i8 = static_cast<const int8_t*>(qs);
    if (int8_x == 2) {
#ifdef PAGELLM_VNNI512
        switch (kind) {
            case 0: vnni512::linear<uint8_t>(x, ldx, M, K, u8, d, m, N, y, ldy, nthreads, 2); return;
            case 1: vnni512::linear<int8_t>(x, ldx, M, K, i8, d, nullptr, N, y, ldy, nthreads, 2); return;
            case 2: vnni512::linear<int8_t>(x, ldx, M, K, i8, d, m, N, y, ldy, nthreads, 2); return;
            default: break;
        }
#endif
        int8_x = 0;
    }
    switch (kind) {
        case 0: (int8_x ? pagellm_q4_1_linear_i8 : pagellm_q4_1_linear)(x, ldx, M, K, u8, d, m, N, y, ldy, nthreads);
            break;
        case 1: (int8_x ? pagellm_q8_0_linear_i8 : pagellm_q8_0_linear)(x, ldx, M, K, i8, d, N, y, ldy, nthreads);
            break;
        case 2: (int8_x ? pagellm_q8_1_linear_i8 : pagellm_q8_1_linear)(x, ldx, M, K, i8, d, m, N, y, ldy, nthreads);
            break;
        case 3: pagellm_fp8_e4m3_linear(x, ldx, M, K, u8, d, N, y, ldy, nthreads); break;
        case 4: pagellm_q4_1_16_linear(x, ldx, M, K, u8, d, m, N, y, ldy, nthreads); break;
        case 5: pagellm_q8_0_16_linear(x, ldx, M, K, i8, d, N, y, ldy, nthreads); break;
        case 6: pagellm_q8_1_16_linear(x, ldx, M, K, i8, d, m, N, y, ldy, nthreads); break;
        default: break;
    }
}
