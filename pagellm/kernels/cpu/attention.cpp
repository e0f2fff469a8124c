// Paged attention over a float32 KV cache, reading each request's blocks in place (no gather).
// Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).
// Every query row names its request (a row of block_tables) and its position; it attends to keys
// 0..pos of that request (the last `window` of them when window > 0): one rule that serves decode
// rows, speculative verification rows and prefill chunks alike.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int kMaxHeads = 128;  // query heads

inline void axpy(float a, const float* x, float* y, int n) {
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale(float a, float* y, int n) {
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

#if defined(__AVX2__) && defined(__FMA__)
namespace {

inline float softmax_numerators(float* p, int64_t n, float max) {
    __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmax));
        _mm256_storeu_ps(p + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; i < n; ++i) {
        p[i] = std::exp(p[i] - max);
        sum += p[i];
    }
    return sum;
}

}  // namespace
#else
namespace {
inline float softmax_numerators(float* p, int64_t n, float max) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        p[i] = std::exp(p[i] - max);
        sum += p[i];
    }
    return sum;
}
}  // namespace
#endif

namespace {

struct AttentionArgs {
    const float* q;
    int64_t ldq;
    int H, D, G, KV, block_size, window;
    const float* kv;
    int64_t plane, stride;  // offset of the values; distance between consecutive tokens of a block
    const int64_t* block_tables;
    int64_t table_stride;
    const int64_t* row_seq;
    const int64_t* row_pos;
    float scale;
    float* out;
};

// Query row t against its keys, for KV heads [h0, h1). Two passes: every score (each key read once
// for all its query heads), a vectorized softmax, then the weighted sum of values. Keys are walked
// block by block; with all heads at once, each block is one contiguous read the prefetcher follows.
void attend_row(const AttentionArgs& a, int t, int h0, int h1, float* scores, int64_t max_keys) {
    const int D = a.D, G = a.G, bs = a.block_size;
    const int64_t* table = a.block_tables + a.row_seq[t] * a.table_stride;
    const int64_t pos = a.row_pos[t];
    const int64_t first = a.window > 0 && pos + 1 > a.window ? pos + 1 - a.window : 0;
    const int heads = (h1 - h0) * G;
    float row_max[kMaxHeads], inv_sum[kMaxHeads];
    for (int i = 0; i < heads; ++i) row_max[i] = -INFINITY;
    for (int64_t j = first; j <= pos;) {
        const int64_t count = std::min<int64_t>(bs - j % bs, pos + 1 - j);
        const float* k = a.kv + (table[j / bs] * bs + j % bs) * a.stride;
        for (int64_t i = j - first; i < j - first + count; ++i, k += a.stride) {
            for (int h = h0; h < h1; ++h) {
                for (int g = 0; g < G; ++g) {
                    const int head = (h - h0) * G + g;
                    const float s = dot(a.q + t * a.ldq + (int64_t)(h * G + g) * D, k + (int64_t)h * D, D) * a.scale;
                    scores[head * max_keys + i] = s;
                    row_max[head] = s > row_max[head] ? s : row_max[head];
                }
            }
        }
        j += count;
    }
    const int64_t n = pos + 1 - first;
    for (int i = 0; i < heads; ++i) inv_sum[i] = 1.f / softmax_numerators(scores + i * max_keys, n, row_max[i]);
    float* o = a.out + ((int64_t)t * a.H + h0 * G) * D;
    std::memset(o, 0, sizeof(float) * heads * D);
    for (int64_t j = first; j <= pos;) {
        const int64_t count = std::min<int64_t>(bs - j % bs, pos + 1 - j);
        const float* v = a.kv + a.plane + (table[j / bs] * bs + j % bs) * a.stride;
        for (int64_t i = j - first; i < j - first + count; ++i, v += a.stride)
            for (int h = h0; h < h1; ++h)
                for (int g = 0; g < G; ++g) {
                    const int head = (h - h0) * G + g;
                    axpy(scores[head * max_keys + i], v + (int64_t)h * D, o + head * D, D);
                }
        j += count;
    }
    for (int i = 0; i < heads; ++i) scale(inv_sum[i], o + i * D, D);
}

}  // namespace

// q: [T, H, D] with row stride ldq; out: [T, H, D] contiguous. Returns 0, or -1 for unsupported shapes.
extern "C" int pagellm_paged_attention(const float* q, int64_t ldq, int T, int H, int D, const float* kv,
                                       int64_t num_blocks, int block_size, int KV, const int64_t* block_tables,
                                       int64_t table_stride, const int64_t* row_seq, const int64_t* row_pos,
                                       int window, float softmax_scale, float* out, int nthreads) {
    if (H > kMaxHeads || H % KV) return -1;
    const AttentionArgs a{q, ldq, H, D, H / KV, KV, block_size, window, kv, num_blocks * block_size * KV * D,
                          (int64_t)KV * D, block_tables, table_stride, row_seq, row_pos, softmax_scale, out};
    int64_t max_keys = 0;
    for (int t = 0; t < T; ++t) max_keys = std::max(max_keys, row_pos[t] + 1);
    // Enough rows: one row (all heads) per work item, for contiguous reads. Few rows (batch-1 decode):
    // split heads across threads too, or the other threads would idle.
    const bool by_row = T >= 2 * nthreads;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores((size_t)(by_row ? H : H / KV) * max_keys);
        if (by_row) {
#pragma omp for schedule(dynamic, 1)
            for (int t = 0; t < T; ++t) attend_row(a, t, 0, KV, scores.data(), max_keys);
        } else {
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int t = 0; t < T; ++t)
                for (int h = 0; h < KV; ++h) attend_row(a, t, h, h + 1, scores.data(), max_keys);
        }
    }
    return 0;
}
