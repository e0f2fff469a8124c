// Paged attention over a float32 KV cache, reading each request's blocks in place (no gather).
// Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
// Every query row names its request (a row of block_tables) and its position; it attends to keys
// 0..pos of that request (the last `window` of them when window > 0): one rule that serves decode
// rows, speculative verification rows and prefill chunks alike.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxGroup = 16;     // query heads per KV head
constexpr int kMaxHeadDim = 256;

inline float dot(const float* a, const float* b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale(float a, float* y, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] *= a;
}

}  // namespace

// Writes the step's new keys/values into their slots. k, v: [T, KV, D] with row strides ldk, ldv.
extern "C" void pagellm_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int T, int KV, int D,
                                 float* kv, int64_t num_blocks, int block_size, const int64_t* slots) {
    const int64_t plane = num_blocks * block_size * KV * D;  // offset of the value half
    for (int t = 0; t < T; ++t) {
        std::memcpy(kv + slots[t] * KV * D, k + t * ldk, sizeof(float) * KV * D);
        std::memcpy(kv + plane + slots[t] * KV * D, v + t * ldv, sizeof(float) * KV * D);
    }
}

// q: [T, H, D] with row stride ldq; out: [T, H, D] contiguous. Returns 0, or -1 for unsupported shapes.
extern "C" int pagellm_paged_attention(const float* q, int64_t ldq, int T, int H, int D, const float* kv,
                                       int64_t num_blocks, int block_size, int KV, const int64_t* block_tables,
                                       int64_t table_stride, const int64_t* row_seq, const int64_t* row_pos,
                                       int window, float softmax_scale, float* out, int nthreads) {
    const int G = H / KV;
    if (G > kMaxGroup || D > kMaxHeadDim || H % KV) return -1;
    const int64_t plane = num_blocks * block_size * KV * D;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(nthreads)
    for (int t = 0; t < T; ++t) {
        for (int h = 0; h < KV; ++h) {
            const int64_t* table = block_tables + row_seq[t] * table_stride;
            const int64_t pos = row_pos[t];
            const int64_t first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
            const float* qh = q + t * ldq + (int64_t)h * G * D;
            float acc[kMaxGroup][kMaxHeadDim];
            float run_max[kMaxGroup], run_sum[kMaxGroup];
            for (int g = 0; g < G; ++g) {
                run_max[g] = -INFINITY;
                run_sum[g] = 0.f;
                std::memset(acc[g], 0, sizeof(float) * D);
            }
            // One block at a time: score its keys, rescale the running sums once, then add the values.
            for (int64_t j0 = first; j0 <= pos; ) {
                const int64_t block = table[j0 / block_size];
                const int off0 = (int)(j0 % block_size);
                const int n = (int)std::min<int64_t>(block_size - off0, pos + 1 - j0);
                const float* kb = kv + (block * block_size + off0) * KV * D + (int64_t)h * D;
                const float* vb = kb + plane;
                float s[kMaxGroup][256];
                for (int g = 0; g < G; ++g) {
                    float bmax = -INFINITY;
                    for (int i = 0; i < n; ++i) {
                        s[g][i] = dot(qh + g * D, kb + (int64_t)i * KV * D, D) * softmax_scale;
                        bmax = s[g][i] > bmax ? s[g][i] : bmax;
                    }
                    const float new_max = bmax > run_max[g] ? bmax : run_max[g];
                    const float correction = std::exp(run_max[g] - new_max);
                    run_sum[g] *= correction;
                    scale(correction, acc[g], D);
                    run_max[g] = new_max;
                    for (int i = 0; i < n; ++i) {
                        const float p = std::exp(s[g][i] - new_max);
                        run_sum[g] += p;
                        axpy(p, vb + (int64_t)i * KV * D, acc[g], D);
                    }
                }
                j0 += n;
            }
            for (int g = 0; g < G; ++g) {
                float* o = out + ((int64_t)t * H + h * G + g) * D;
                const float inv = 1.f / run_sum[g];
#pragma omp simd
                for (int i = 0; i < D; ++i) o[i] = acc[g][i] * inv;
            }
        }
    }
    return 0;
}
