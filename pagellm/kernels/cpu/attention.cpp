// Paged attention over a float32, float16, int8 or fp8 KV cache, reading each request's blocks in place
// (no gather). Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, W] (keys, then values),
// W = head_dim, or head_dim + 2 for int8 rows with their float16 scale (kv_format.h).
// Every query row names its request (a row of block_tables) and its position; it attends to keys
// 0..pos of that request (the last `window` of them when window > 0): one rule that serves decode
// rows, speculative verification rows and prefill chunks alike.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kv_format.h"

namespace {

template <typename T>
void write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int T_, int KV, int D, T* kv,
              int64_t num_blocks, int block_size, const int64_t* slots, int nthreads) {
    const int64_t row = (int64_t)KV * (D + row_extra<T>());  // elements per token
    const int64_t plane = num_blocks * block_size * row;  // offset of the value half
    // tokens have slots of their own; a prefill chunk's conversions (and the first touches of fresh blocks'
    // pages) split across the threads
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T_ >= 64)
    for (int t = 0; t < T_; ++t) {
        store_token(k + t * ldk, kv + slots[t] * row, KV, D);
        store_token(v + t * ldv, kv + plane + slots[t] * row, KV, D);
    }
}

}  // namespace

// Whether this build reads and writes float16 KV caches (AVX2 + FMA + F16C).
extern "C" int pagellm_has_f16_kv() {
#ifdef PAGELLM_SIMD_ATTENTION
    return 1;
#else
    return 0;
#endif
}

// Bit f set: this build reads and writes KV format f (KvFormat in kv_format.h). float16 needs F16C; the
// others have a portable path.
extern "C" int pagellm_kv_formats() {
    return 1 << KV_F32 | pagellm_has_f16_kv() << KV_F16 | 1 << KV_I8 | 1 << KV_E4M3 | 1 << KV_E5M2;
}

// Writes the step's new keys/values into their slots. k, v: [T, KV, D] with row strides ldk, ldv;
// kv_format: the cache's KvFormat (0 float32, 1 float16, as the old kv_half flag). Returns 0, or -1 for
// a format this build lacks. Steps of 64 tokens or more split them across nthreads threads.
extern "C" int pagellm_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int T, int KV, int D,
                                void* kv, int64_t num_blocks, int block_size, const int64_t* slots, int kv_format,
                                int nthreads) {
    if (!(pagellm_kv_formats() >> kv_format & 1)) return -1;
    const auto write = [&](auto* cache) {
        write_kv(k, ldk, v, ldv, T, KV, D, cache, num_blocks, block_size, slots, nthreads);
    };
    switch (kv_format) {
        case KV_F32: write(static_cast<float*>(kv)); break;
        case KV_F16: write(static_cast<uint16_t*>(kv)); break;
        case KV_I8: write(static_cast<int8_t*>(kv)); break;
        case KV_E4M3: write(static_cast<e4m3_t*>(kv)); break;
        case KV_E5M2: write(static_cast<e5m2_t*>(kv)); break;
        default: return -1;
    }
    return 0;
}

#ifdef PAGELLM_SIMD_ATTENTION
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

// Scores to softmax numerators in place (their maximum subtracted); returns 1 / their sum.
inline float softmax_in_place(float* s, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; i < n; ++i) mx = std::max(mx, s[i]);
    return 1.f / softmax_numerators(s, n, mx);
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

#include "paged_walk.h"
#include "attention_int8_vnni.h"

namespace {

#ifdef PAGELLM_SIMD_ATTENTION
// Scores of 4 keys at once: 8-lane products per key, then one transposing reduction for all four
// (the per-key horizontal sum was as costly as the products). Every key gets the same arithmetic in
// whichever slot it lands, so a score never depends on its neighbours (speculative rows stay exact).
template <typename T>
inline __m128 dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int D) {
    __m256 qv = _mm256_loadu_ps(q);
    __m256 a0 = _mm256_mul_ps(qv, load8(k0)), a1 = _mm256_mul_ps(qv, load8(k1));
    __m256 a2 = _mm256_mul_ps(qv, load8(k2)), a3 = _mm256_mul_ps(qv, load8(k3));
    for (int d = 8; d < D; d += 8) {
        qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k3 + d), a3);
    }
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}


// o[0, 8 * NC) = sum_i p_i v_i over the row's keys, accumulated in registers in key order.
// p_i, times the int8 row's scale (v points d0 elements into the row, so its scale sits at D - d0)
// or e4m3's read scale.
template <typename T>
inline float scaled_weight(float p, const T* v, int D, int d0) {
    if constexpr (std::is_same_v<T, int8_t>) return p * row_scale(v - d0, D);
    if constexpr (std::is_same_v<T, e4m3_t>) return p * E4M3_READ_SCALE;  // load8 reads e4m3 / 256
    return p;
}

template <int NC, typename T>
inline void weighted_values(const AttentionArgs<T>& a, const int64_t* table, int64_t first, int64_t pos,
                            const float* p, const T* v, float inv_sum, float* o, int d0, Ahead<T> ahead) {
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for_each_key(a, table, first, pos, [&](int64_t i, int64_t off) {
        const __m256 w = _mm256_set1_ps(scaled_weight(p[i], v + off, a.D, d0));
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + off + 8 * c), acc[c]);
    }, ahead);
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv_sum)));
}

#ifdef PAGELLM_WIDE_ATTENTION
// weighted_values 16 lanes at a time: o[0, 16 * NC), float32, float16 and int8 caches (v: the rows' starts).
template <int NC, typename T>
inline void weighted_values16(const AttentionArgs<T>& a, const int64_t* table, int64_t first, int64_t pos,
                              const float* p, const T* v, float inv_sum, float* o, Ahead<T> ahead) {
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    for_each_key(a, table, first, pos, [&](int64_t i, int64_t off) {
        const __m512 w = _mm512_set1_ps(scaled_weight(p[i], v + off, a.D, 0));
        for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(w, load16(v + off + 16 * c), acc[c]);
    }, ahead);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv_sum)));
}

// True when it wrote o (the format and D allow 16 lanes).
template <typename T>
inline bool weighted_values_wide(const AttentionArgs<T>& a, const int64_t* table, int64_t first, int64_t pos,
                                 const float* p, const T* v, float inv_sum, float* o, Ahead<T> ahead) {
    if constexpr (!loads16<T>()) {
        return false;
    } else {
        switch (a.D) {  // the common head sizes; others take the 8-lane loop
            case 64: weighted_values16<4>(a, table, first, pos, p, v, inv_sum, o, ahead); return true;
            case 128: weighted_values16<8>(a, table, first, pos, p, v, inv_sum, o, ahead); return true;
            default: return false;
        }
    }
}
#endif

// Query row t, query head `head` (of KV head head / G): scores, softmax, weighted values. D % 8 == 0. What its
// walks ask for: walk_plan (next: the next row's tokens, may be null).
template <typename T>
void attend_head(const AttentionArgs<T>& a, int t, int head, float* scores, TokenStream<T>* next) {
    const int D = a.D;
    const HeadView h = head_view(a, t, head);
    const int64_t* table = h.table;
    const int64_t pos = h.pos, first = h.first, n = h.n;
    const float* q = h.q;
    const T* keys = a.kv + h.kv_off;
    const __m128 scale = _mm_set1_ps(a.scale);
    const T* k[4];
#ifdef PAGELLM_WIDE_ATTENTION
    const bool wide = loads16<T>() && D % 16 == 0;
    (void)wide;
#endif
    int64_t batch_start = 0;
    int filled = 0;
    auto flush = [&]() {
        for (int i = filled; i < 4; ++i) k[i] = k[filled - 1];  // padding: recomputed, not stored
        float s[4];
        __m128 dots;
#ifdef PAGELLM_WIDE_ATTENTION
        if constexpr (loads16<T>()) dots = wide ? dot4_16(q, k[0], k[1], k[2], k[3], D) : dot4(q, k[0], k[1], k[2], k[3], D);
        else
#endif
            dots = dot4(q, k[0], k[1], k[2], k[3], D);
        if constexpr (std::is_same_v<T, int8_t>)  // score = (k_scale * (q . k_int)) * softmax scale
            dots = _mm_mul_ps(dots, _mm_setr_ps(row_scale(k[0], D), row_scale(k[1], D), row_scale(k[2], D),
                                                row_scale(k[3], D)));
        if constexpr (std::is_same_v<T, e4m3_t>) dots = _mm_mul_ps(dots, _mm_set1_ps(E4M3_READ_SCALE));
        _mm_storeu_ps(s, _mm_mul_ps(dots, scale));
        std::memcpy(scores + batch_start, s, sizeof(float) * filled);
        batch_start += filled;
        filled = 0;
    };
    const WalkPlan<T> plan = walk_plan(a, h, head == 0, next);
    const Ahead<T> ahead = plan.keys, va = plan.values;
    if (!int8_vnni_scores<1>(a, h, &scores, ahead)) {  // the grouped path's scores for one head (the same bits)
        for_each_key(a, table, first, pos, [&](int64_t, int64_t off) {
            k[filled++] = keys + off;
            if (filled == 4) flush();
        }, ahead);
        if (filled) flush();
    }
    const float inv_sum = softmax_in_place(scores, n);
    const T* values = a.kv + a.plane + h.kv_off;
    float* o = h.out;
#ifdef PAGELLM_WIDE_ATTENTION
    if (weighted_values_wide(a, table, first, pos, scores, values, inv_sum, o, va)) return;
#endif
    for (int d0 = 0; d0 < D; d0 += 64) {  // up to 8 accumulators (64 dims) at a time
        switch (std::min(8, (D - d0) / 8)) {
            case 8: weighted_values<8>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 7: weighted_values<7>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 6: weighted_values<6>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 5: weighted_values<5>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 4: weighted_values<4>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 3: weighted_values<3>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            case 2: weighted_values<2>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
            default: weighted_values<1>(a, table, first, pos, scores, values + d0, inv_sum, o + d0, d0, va); break;
        }
    }
}
#else
// Portable version: the same three passes, scalar (every format but float16), the int8 scale applied
// per key as in the SIMD path.
template <typename T>
inline float dot_row(const float* q, const T* k, int D) {
    if constexpr (std::is_same_v<T, float>) {
        return dot(q, k, D);
    } else {
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += q[d] * to_float(k[d]);
        return s * row_scale(k, D);
    }
}

template <typename T>
void attend_head(const AttentionArgs<T>& a, int t, int head, float* scores, TokenStream<T>*) {
    const int D = a.D;
    const HeadView h = head_view(a, t, head);
    float mx = -INFINITY;
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t i, int64_t off) {
        scores[i] = dot_row(h.q, a.kv + h.kv_off + off, D) * a.scale;
        mx = std::max(mx, scores[i]);
    });
    const float inv_sum = 1.f / softmax_numerators(scores, h.n, mx);
    std::memset(h.out, 0, sizeof(float) * D);
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t i, int64_t off) {
        const T* v = a.kv + a.plane + h.kv_off + off;
        const float w = scores[i] * row_scale(v, D);
        for (int d = 0; d < D; ++d) h.out[d] += w * to_float(v[d]);
    });
    for (int d = 0; d < D; ++d) h.out[d] *= inv_sum;
}
#endif

}  // namespace

#include "attention_grouped.h"
#include "attention_grouped8.h"
#include "attention_spans.h"

namespace {

template <typename T>
void paged_attention(AttentionArgs<T> a, int T_, int nthreads) {
    int64_t max_keys = 0;
    for (int t = 0; t < T_; ++t) max_keys = std::max(max_keys, a.row_pos[t] + 1);
    // Enough rows: one row (all heads) per work item; a KV head's keys are walked once per query head
    // of its group, from cache after the first. Few rows (batch-1 decode): one query head per item, or
    // the other threads would idle.
    const bool by_row = T_ >= 2 * nthreads;
    a.prefetch = by_row;
    a.whole_tokens = by_row && max_keys * a.stride * (int64_t)sizeof(T) * 2 <= WHOLE_ROW_BYTES;
#ifdef PAGELLM_WIDE_ATTENTION
    const bool grouped = by_row && groups_heads(a);  // a row's heads of one KV head share each key's loads
#elif defined(PAGELLM_SIMD_ATTENTION)
    const bool grouped = by_row && groups_heads8(a);  // the same, 8 lanes and up to 3 heads at a time
#else
    const bool grouped = false;
#endif
    std::atomic<int> next_row{0};
    // a verification step's rows of one request walk their keys together (int8 keys on VNNI: attention_spans.h)
    std::vector<Span> spans;
    int span_rows = 0;  // the longest span's
#ifdef PAGELLM_INT8_VNNI_ATTENTION
    if (std::is_same_v<T, int8_t> && grouped && (a.D == 64 || a.D == 128) && has_span(a, T_)) {
        spans = row_spans(a, T_, nthreads);
        if ((int)spans.size() == T_) spans.clear();  // split back into single rows
        for (const Span& s : spans) span_rows = std::max(span_rows, s.rows);
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t stride = max_keys + 8;
        std::vector<float> scores(spans.empty() ? (size_t)stride * (grouped ? 4 : 1) : 0);
        if (!spans.empty()) {
#ifdef PAGELLM_INT8_VNNI_ATTENTION
            if constexpr (std::is_same_v<T, int8_t>) {
                // (not zeroed: up to 33 rows of a long context; every entry read is written first)
                const std::unique_ptr<float[]> buf(new float[(size_t)stride * (4 * span_rows + 1)]);
                for_each_row(a, (int)spans.size(), next_row, [&](int n, TokenStream<T>* next) {
                    attend_span(a, spans[n], buf.get(), stride, next);
                }, [&](int n) { return spans[n].t0 + spans[n].rows - 1; });
            }
#endif
        } else if (grouped) {
#ifdef PAGELLM_WIDE_ATTENTION
            if constexpr (loads16<T>()) {
                for_each_row(a, T_, next_row, [&](int t, TokenStream<T>* next) {
                    attend_row_grouped(a, t, scores.data(), stride, next);
                });
            }
#elif defined(PAGELLM_SIMD_ATTENTION)
            for_each_row(a, T_, next_row, [&](int t, TokenStream<T>* next) {
                attend_row_grouped8(a, t, scores.data(), stride, next);
            });
#endif
        } else if (by_row) {
            for_each_row(a, T_, next_row, [&](int t, TokenStream<T>* next) {
                for (int h = 0; h < a.H; ++h) attend_head(a, t, h, scores.data(), next);
            });
        } else {
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int t = 0; t < T_; ++t)
                for (int h = 0; h < a.H; ++h) attend_head<T>(a, t, h, scores.data(), nullptr);
        }
    }
}

}  // namespace

namespace {

template <typename T>
void run_attention(const float* q, int64_t ldq, int T_, int H, int D, const void* kv, int64_t num_blocks,
                   int block_size, int KV, const int64_t* block_tables, int64_t table_stride, const int64_t* row_seq,
                   const int64_t* row_pos, int window, float softmax_scale, float* out, int nthreads) {
    const int64_t row = D + row_extra<T>(), stride = (int64_t)KV * row, plane = num_blocks * block_size * stride;
    paged_attention(AttentionArgs<T>{q, ldq, H, D, H / KV, KV, block_size, window, static_cast<const T*>(kv),
                                     plane, stride, row, block_tables, table_stride, row_seq, row_pos,
                                     softmax_scale, out}, T_, nthreads);
}

}  // namespace

// q: [T, H, D] with row stride ldq; out: [T, H, D] contiguous; kv_format: the cache's KvFormat.
// Returns 0, or -1 for unsupported shapes (D % 8, H % KV) or a format this build lacks.
extern "C" int pagellm_paged_attention(const float* q, int64_t ldq, int T, int H, int D, const void* kv,
                                       int64_t num_blocks, int block_size, int KV, const int64_t* block_tables,
                                       int64_t table_stride, const int64_t* row_seq, const int64_t* row_pos,
                                       int window, float softmax_scale, float* out, int nthreads, int kv_format) {
    if (H % KV || D % 8 || !(pagellm_kv_formats() >> kv_format & 1)) return -1;
    auto run = [&](auto tag) {
        run_attention<decltype(tag)>(q, ldq, T, H, D, kv, num_blocks, block_size, KV, block_tables, table_stride,
                                     row_seq, row_pos, window, softmax_scale, out, nthreads);
    };
    switch (kv_format) {
        case KV_F32: run(float{}); break;
        case KV_I8: run(int8_t{}); break;
        case KV_E4M3: run(e4m3_t{}); break;
        case KV_E5M2: run(e5m2_t{}); break;
#ifdef PAGELLM_SIMD_ATTENTION
        case KV_F16: run(uint16_t{}); break;
#endif
        default: return -1;
    }
    return 0;
}
