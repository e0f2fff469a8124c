// attention_grouped.h for AVX2 builds, 8 lanes at a time: up to 3 query heads of one KV head at once (GQA), each
// key and value row loaded and converted once for the group instead of once per query head. Every (row, head,
// key) gets exactly the operations of attention.cpp's per-head path (dot4's products and reduction,
// weighted_values' accumulation in key order, the same softmax), so the two paths give the same bits and a
// row's results do not depend on which one ran. 3 heads x 4 keys (or 4 value chunks) are 12 accumulators of the 16
// ymm registers, so one converted key or value chunk is live at a time. D of 64 or 128; included by attention.cpp
// after its helpers.
#pragma once

#if defined(PAGELLM_SIMD_ATTENTION) && !defined(PAGELLM_WIDE_ATTENTION)
namespace {

// Scores of NG heads (queries q[h], D floats each) against keys first..pos: scores[h][i], times scale.
template <int NG, int D, typename T>
inline void group_scores8(const AttentionArgs<T>& a, const HeadView& h, const T* keys, const float* const* q,
                          float* const* scores, Ahead<T> ahead) {
    const T* k[4];
    int filled = 0;
    int64_t start = 0;
    auto flush = [&]() {
        for (int i = filled; i < 4; ++i) k[i] = k[filled - 1];  // padding: recomputed, not stored
        // one key chunk live at a time: 12 accumulators + 1 chunk, the queries' chunks from L1
        __m256 acc[NG][4];
        for (int j = 0; j < 4; ++j) {
            const __m256 kv = load8(k[j]);
            for (int g = 0; g < NG; ++g)  // the first chunk a product, as dot4 (the same bits)
                acc[g][j] = _mm256_mul_ps(_mm256_loadu_ps(q[g]), kv);
        }
#pragma GCC unroll 4
        for (int d = 8; d < D; d += 8) {
            for (int j = 0; j < 4; ++j) {
                const __m256 kv = load8(k[j] + d);
                for (int g = 0; g < NG; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, acc[g][j]);
            }
        }
        __m128 row_scales = _mm_set1_ps(1.f);  // int8: score = (k_scale * (q . k_int)) * softmax scale
        if constexpr (std::is_same_v<T, int8_t>)
            row_scales = _mm_setr_ps(row_scale(k[0], D), row_scale(k[1], D), row_scale(k[2], D), row_scale(k[3], D));
        for (int g = 0; g < NG; ++g) {
            const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
            __m128 dots = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            if constexpr (std::is_same_v<T, int8_t>) dots = _mm_mul_ps(dots, row_scales);
            if constexpr (std::is_same_v<T, e4m3_t>) dots = _mm_mul_ps(dots, _mm_set1_ps(E4M3_READ_SCALE));
            float out[4];
            _mm_storeu_ps(out, _mm_mul_ps(dots, _mm_set1_ps(a.scale)));
            std::memcpy(scores[g] + start, out, sizeof(float) * filled);
        }
        start += filled;
        filled = 0;
    };
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t, int64_t off) {
        k[filled++] = keys + off;
        if (filled == 4) flush();
    }, ahead);
    if (filled) flush();
}

// out[g][d0, d0 + 32) = sum_i p[g][i] v_i / sum for NG heads, each value chunk converted once.
template <int NG, typename T>
inline void group_values8(const AttentionArgs<T>& a, const HeadView& h, const T* values, int d0,
                          float* const* p, const float* inv_sum, float* const* out, Ahead<T> ahead) {
    __m256 acc[NG][4];
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t i, int64_t off) {
        const T* v = values + off + d0;
        __m256 w[NG];  // weighted_values' weight; then one value chunk live at a time (12 + 3 + 1 registers)
        for (int g = 0; g < NG; ++g) w[g] = _mm256_set1_ps(scaled_weight(p[g][i], v, a.D, d0));
        for (int c = 0; c < 4; ++c) {
            const __m256 vc = load8(v + 8 * c);
            for (int g = 0; g < NG; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], vc, acc[g][c]);
        }
    }, ahead);
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 4; ++c)
            _mm256_storeu_ps(out[g] + d0 + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv_sum[g])));
}

// Query row t, query heads head0 .. head0 + NG - 1 (one KV head's); as attention_grouped.h's attend_group.
template <int NG, typename T>
void attend_group8(const AttentionArgs<T>& a, int t, int head0, float* const* scores, TokenStream<T>* next) {
    const HeadView h = head_view(a, t, head0);
    const float* q[NG];
    float* out[NG];
    float inv_sum[NG];
    for (int g = 0; g < NG; ++g) q[g] = h.q + (int64_t)g * a.D, out[g] = h.out + (int64_t)g * a.D;
    const WalkPlan<T> plan = walk_plan(a, h, head0 == 0, next);
    if (a.D == 64)
        group_scores8<NG, 64>(a, h, a.kv + h.kv_off, q, scores, plan.keys);
    else
        group_scores8<NG, 128>(a, h, a.kv + h.kv_off, q, scores, plan.keys);
    for (int g = 0; g < NG; ++g) inv_sum[g] = softmax_in_place(scores[g], h.n);
    for (int d0 = 0; d0 < a.D; d0 += 32)
        group_values8<NG>(a, h, a.kv + a.plane + h.kv_off, d0, scores, inv_sum, out, plan.values);
}

template <typename T>
inline bool groups_heads8(const AttentionArgs<T>& a) {
    return (a.D == 64 || a.D == 128) && a.G > 1;
}

// All query heads of row t (G > 1), 3 of one KV head at a time, the last 2 or 4 as 2 + 2: no group of 1 is left.
template <typename T>
void attend_row_grouped8(const AttentionArgs<T>& a, int t, float* scores, int64_t stride, TokenStream<T>* next) {
    float* s[3] = {scores, scores + stride, scores + 2 * stride};
    for (int kv = 0; kv < a.KV; ++kv) {
        for (int h0 = kv * a.G, left = a.G; left > 0;) {
            const int n = left == 2 || left == 4 ? 2 : 3;
            if (n == 3)
                attend_group8<3>(a, t, h0, s, next);
            else
                attend_group8<2>(a, t, h0, s, next);
            h0 += n, left -= n;
        }
    }
}

}  // namespace
#endif
