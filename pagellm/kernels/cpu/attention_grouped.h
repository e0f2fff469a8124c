// Decode attention for up to 4 query heads of one KV head at once (GQA): each key and value row is loaded and
// converted once for the group instead of once per query head. Every (row, head, key) gets exactly the
// operations of attention.cpp's per-head path (dot4_16's products and reduction, weighted_values16's
// accumulation, the same softmax), so the two paths give the same bits and a step's results do not depend
// on which one ran. float32, float16 and int8 caches (the int8 row's scale per key, as there), D of 64 or
// 128; included by attention.cpp after its helpers.
#pragma once

#ifdef PAGELLM_WIDE_ATTENTION
namespace {

// Scores of NG heads (queries q[h], D floats each) against keys first..pos: scores[h][i], times scale.
// D a template argument, so that the NG x 4 accumulators stay in registers.
template <int NG, int D, typename T>
inline void group_scores(const AttentionArgs<T>& a, const HeadView& h, const T* keys, const float* const* q,
                         float* const* scores, Ahead<T> ahead) {
    const T* k[4];
    int filled = 0;
    int64_t start = 0;
    auto flush = [&]() {
        for (int i = filled; i < 4; ++i) k[i] = k[filled - 1];  // padding: recomputed, not stored
        __m512 acc[NG][4], kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = load16(k[j]);
        for (int g = 0; g < NG; ++g) {  // the first chunk a product, as dot4_16 (the same bits)
            const __m512 qv = _mm512_loadu_ps(q[g]);
            for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_mul_ps(qv, kv[j]);
        }
#pragma GCC unroll 8
        for (int d = 16; d < D; d += 16) {
            for (int j = 0; j < 4; ++j) kv[j] = load16(k[j] + d);
            for (int g = 0; g < NG; ++g) {
                const __m512 qv = _mm512_loadu_ps(q[g] + d);
                for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
            }
        }
        // int8: score = (k_scale * (q . k_int)) * softmax scale, as attend_head's
        constexpr bool scaled = std::is_same_v<T, int8_t>;
        __m128 row_scales = _mm_setzero_ps();
        if constexpr (scaled)
            row_scales = _mm_setr_ps(row_scale(k[0], D), row_scale(k[1], D), row_scale(k[2], D), row_scale(k[3], D));
        for (int g = 0; g < NG; ++g) {
            const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold16(acc[g][0]), fold16(acc[g][1])),
                                            _mm256_hadd_ps(fold16(acc[g][2]), fold16(acc[g][3])));
            const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            float out[4];
            _mm_storeu_ps(out, _mm_mul_ps(scaled ? _mm_mul_ps(dots, row_scales) : dots, _mm_set1_ps(a.scale)));
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

// out[g][d0, d0 + 64) = sum_i p[g][i] v_i / sum, for NG heads, each value chunk converted once; the walk asks
// for what `ahead` says (walk_plan).
template <int NG, typename T>
inline void group_values(const AttentionArgs<T>& a, const HeadView& h, const T* values, int d0,
                         float* const* p, const float* inv_sum, float* const* out, Ahead<T> ahead) {
    __m512 acc[NG][4];
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t i, int64_t off) {
        __m512 v[4];
        for (int c = 0; c < 4; ++c) v[c] = load16(values + off + d0 + 16 * c);
        const float row = scaled_weight(1.f, values + off, a.D, 0);  // the int8 row's scale, else 1
        for (int g = 0; g < NG; ++g) {
            const __m512 w = _mm512_set1_ps(p[g][i] * row);  // scaled_weight's p * scale
            for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }, ahead);
    for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 4; ++c)
            _mm512_storeu_ps(out[g] + d0 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
}

// Query row t, query heads head0 .. head0 + NG - 1 (one KV head's): scores[g] holds room for the row's keys;
// next (may be null): the next row's tokens, asked for while a later KV head computes.
template <int NG, typename T>
void attend_group(const AttentionArgs<T>& a, int t, int head0, float* const* scores, TokenStream<T>* next) {
    const HeadView h = head_view(a, t, head0);
    const float* q[NG];
    float* out[NG];
    float inv_sum[NG];
    for (int g = 0; g < NG; ++g) q[g] = h.q + (int64_t)g * a.D, out[g] = h.out + (int64_t)g * a.D;
    // the row's first heads fetch whole tokens, the later KV heads ask for the next row meanwhile (walk_plan)
    const WalkPlan<T> plan = walk_plan(a, h, head0 == 0, next);
    const Ahead<T> ahead = plan.keys;
    if (!int8_vnni_scores<NG>(a, h, scores, ahead)) {  // int8 keys on VNNI where the build has it, else here
        if (a.D == 64)
            group_scores<NG, 64>(a, h, a.kv + h.kv_off, q, scores, ahead);
        else
            group_scores<NG, 128>(a, h, a.kv + h.kv_off, q, scores, ahead);
    }
    for (int g = 0; g < NG; ++g) inv_sum[g] = softmax_in_place(scores[g], h.n);
    for (int d0 = 0; d0 < a.D; d0 += 64)
        group_values<NG>(a, h, a.kv + a.plane + h.kv_off, d0, scores, inv_sum, out, plan.values);
}

// Whether attend_group takes this format and shape.
template <typename T>
inline bool groups_heads(const AttentionArgs<T>& a) {
    return loads16<T>() && (a.D == 64 || a.D == 128) && a.G > 1;
}

// All query heads of row t, up to 4 of one KV head at a time; next (may be null): the tokens of the row this
// thread takes next, which the later KV heads' walks ask for.
template <typename T>
void attend_row_grouped(const AttentionArgs<T>& a, int t, float* scores, int64_t stride, TokenStream<T>* next) {
    float* s[4] = {scores, scores + stride, scores + 2 * stride, scores + 3 * stride};
    for (int kv = 0; kv < a.KV; ++kv) {
        for (int h0 = kv * a.G; h0 < (kv + 1) * a.G; h0 += 4) {
            switch (std::min(4, (kv + 1) * a.G - h0)) {
                case 4: attend_group<4>(a, t, h0, s, next); break;
                case 3: attend_group<3>(a, t, h0, s, next); break;
                case 2: attend_group<2>(a, t, h0, s, next); break;
                default: attend_group<1>(a, t, h0, s, next); break;
            }
        }
    }
}

}  // namespace
#endif
