// Float32 GEMM through a single-threaded BLAS sgemm (numpy's OpenBLAS, found by pagellm/kernels/blas.py),
// split over the threads of the OpenMP pool torch and the other kernels use. Letting OpenBLAS run its
// own pthread pool beside torch's made the offline workload 3x slower on 2 cores: each pool's threads
// spin while the other's work, so one pool does all the threading.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "simd.h"

namespace {
// cblas_sgemm with 64-bit integers (OpenBLAS's ILP64 build, as numpy ships it).
using sgemm64_t = void (*)(int order, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                           int64_t ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
}  // namespace

// y[M, N] = x[M, K] @ B, where B is w[K, N] (ldw >= N) or, when w_transposed, w[N, K]^T (ldw >= K).
// Threads take slices of N (multiples of 16 columns), or of M when N is too narrow to share.
extern "C" void pagellm_sgemm(void* sgemm, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                              int64_t ldw, int w_transposed, int64_t N, float* y, int64_t ldy, int nthreads) {
    auto fn = reinterpret_cast<sgemm64_t>(sgemm);
    const int tb = w_transposed ? kTrans : kNoTrans;
    const bool split_n = N >= 64 * nthreads || M < 2 * nthreads;
    const int nt = std::max(1, nthreads);
#pragma omp parallel for schedule(static, 1) num_threads(nt)
    for (int t = 0; t < nt; ++t) {
        if (split_n) {
            const int64_t chunk = ((N + nt - 1) / nt + 15) / 16 * 16;
            const int64_t n0 = std::min<int64_t>(N, t * chunk), n1 = std::min<int64_t>(N, n0 + chunk);
            if (n1 > n0) {
                const float* b = w_transposed ? w + n0 * ldw : w + n0;
                fn(kRowMajor, kNoTrans, tb, M, n1 - n0, K, 1.f, x, ldx, b, ldw, 0.f, y + n0, ldy);
            }
        } else {
            const int64_t chunk = (M + nt - 1) / nt;
            const int64_t m0 = std::min<int64_t>(M, t * chunk), m1 = std::min<int64_t>(M, m0 + chunk);
            if (m1 > m0)
                fn(kRowMajor, kNoTrans, tb, m1 - m0, N, K, 1.f, x + m0 * ldx, ldx, w, ldw, 0.f, y + m0 * ldy, ldy);
        }
    }
}

namespace {
// Rows [n0, n1) of a packed weight (layout of PackedWeight in pagellm/quant/formats.py; kind codes of
// pagellm/kernels/ops.py KIND_CODES) as float32 [n, K], equal, bit for bit, to PackedWeight.dequantize()
// and so to the float32 weights the GGUF loader produces (q * d, then + m): for the integer kinds q * d
// is exact in float32 (an f16-derived scale of at most 17 significant bits times a code of at most 8),
// so fusing the multiply and add changes nothing; fp8 is one rounded product, d * f8(q).
void dequantize_rows(int kind, const void* qs, const float* d, const float* m, int64_t K, int64_t n0, int64_t n1,
                     float* out) {
    const int64_t nb = K / 32;
    const bool nibbles = kind == 0 || kind == 4, per16 = kind >= 4;
    const int64_t q_per_block = nibbles ? 16 : 32;
    for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t blk = n * nb + b;
            const int64_t g0 = per16 ? 2 * blk : blk, g1 = per16 ? 2 * blk + 1 : blk;  // the two halves' scales
            float* o = out + (n - n0) * K + b * 32;
            const auto* u8 = static_cast<const uint8_t*>(qs) + blk * q_per_block;
            const auto* i8 = static_cast<const int8_t*>(qs) + blk * q_per_block;
#if defined(__AVX2__) && defined(__FMA__)
            const Quants q = nibbles ? unpack_q4(u8) : kind == 3 ? unpack_fp8(u8) : unpack_q8(i8);
            for (int i = 0; i < 4; ++i) {
                const int64_t g = i < 2 ? g0 : g1;
                const __m256 vd = _mm256_set1_ps(d[g]);
                _mm256_storeu_ps(o + 8 * i, m ? _mm256_fmadd_ps(q.q[i], vd, _mm256_set1_ps(m[g]))
                                              : _mm256_mul_ps(q.q[i], vd));
            }
#else
            for (int j = 0; j < 32; ++j) {
                const int64_t g = j < 16 ? g0 : g1;
                const float q = nibbles ? (float)(j < 16 ? u8[j] & 15 : u8[j - 16] >> 4)
                                        : kind == 3 ? fp8_e4m3_value(u8[j]) : (float)i8[j];
                o[j] = m ? q * d[g] + m[g] : q * d[g];
            }
#endif
        }
}
}  // namespace

// y[M, N] = x[M, K] @ W^T for a packed weight W [N, K] (any kind code) with no float32 copy in
// memory: each thread dequantizes slices of kSlice output columns into a small buffer (cache-resident)
// and multiplies it with the single-threaded sgemm. For many rows the dequantization is a small part
// of the work (K multiply-adds per weight vs 2*M*K for the product).
extern "C" void pagellm_packed_sgemm(void* sgemm, const float* x, int64_t ldx, int64_t M, int64_t K, int kind,
                                     const void* qs, const float* d, const float* m, int64_t N, float* y,
                                     int64_t ldy, int nthreads) {
    constexpr int64_t kSlice = 128;
    auto fn = reinterpret_cast<sgemm64_t>(sgemm);
    const int64_t slices = (N + kSlice - 1) / kSlice;
#pragma omp parallel num_threads(std::max(1, nthreads))
    {
        std::unique_ptr<float[]> buf(new float[kSlice * K]);  // no zero-fill: every value is written
#pragma omp for schedule(static)
        for (int64_t s = 0; s < slices; ++s) {
            const int64_t n0 = s * kSlice, n1 = std::min(N, n0 + kSlice);
            dequantize_rows(kind, qs, d, m, K, n0, n1, buf.get());
            fn(kRowMajor, kNoTrans, kTrans, M, n1 - n0, K, 1.f, x, ldx, buf.get(), K, 0.f, y + n0, ldy);
        }
    }
}
