// Decode attention for a speculative verification step's rows over int8 keys on VNNI: a request's next token
// and its drafts are rows at consecutive positions over the same keys, and each used to walk them on its own
// (a 5-row verification cost 5 one-row walks). A span of such rows walks them once per KV head: each 16 keys
// are loaded and transposed once for every row's query heads, each value chunk converted once for all of
// them. Every (row, head, key) gets exactly the operations of the one-row paths (int8_vnni::score16's sums
// and scaling, the same softmax, group_values' p * row-scale weights accumulated in key order), so rows keep
// their bits whether they run alone, among others, or in a span: what keeps speculation lossless.
// Included by attention.cpp after attention_grouped.h.
#pragma once

#include <algorithm>
#include <vector>

namespace {

// At most this many rows per span: a verification step of 4 drafts is 5 rows, and the scores of all the
// span's (row, query head) pairs stay in the thread's buffer at once.
constexpr int MAX_SPAN_ROWS = 8;

struct Span {
    int t0, rows;
};

// Whether two rows of one request sit at consecutive positions (decode-only steps have none: no spans built).
template <typename T>
inline bool has_span(const AttentionArgs<T>& a, int T_) {
    for (int t = 1; t < T_; ++t)
        if (a.row_seq[t] == a.row_seq[t - 1] && a.row_pos[t] == a.row_pos[t - 1] + 1) return true;
    return false;
}

// The step's rows grouped into spans (consecutive rows of one request at consecutive positions, with the
// same first key); then, while there are fewer spans than 2 per thread, the largest split in two, so that
// every thread has work (a one-request verification step would otherwise run on one thread).
template <typename T>
inline std::vector<Span> row_spans(const AttentionArgs<T>& a, int T_, int nthreads) {
    std::vector<Span> spans;
    auto first_key = [&](int t) { return a.window > 0 && a.row_pos[t] + 1 > a.window ? a.row_pos[t] + 1 - a.window : 0; };
    for (int t = 0; t < T_; ++t) {
        Span* last = spans.empty() ? nullptr : &spans.back();
        if (last && last->rows < MAX_SPAN_ROWS && a.row_seq[t] == a.row_seq[t - 1] &&
            a.row_pos[t] == a.row_pos[t - 1] + 1 && first_key(t) == first_key(last->t0))
            ++last->rows;
        else
            spans.push_back({t, 1});
    }
    while ((int)spans.size() < 2 * nthreads) {
        auto big = std::max_element(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.rows < y.rows; });
        if (big->rows < 2) break;
        const Span tail{big->t0 + big->rows / 2, big->rows - big->rows / 2};
        big->rows /= 2;
        spans.insert(big + 1, tail);
    }
    // the longest first: the threads take items in order, and a long span left for last (a short prefill
    // chunk's rows come after the decode rows) kept one thread busy while the other waited
    std::stable_sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.rows > y.rows; });
    return spans;
}

}  // namespace

#ifdef PAGELLM_INT8_VNNI_ATTENTION
namespace {

namespace int8_vnni {

// Scores of R rows x NG query heads (h[r]: row r's view of the first head) against the keys of the last row,
// row r's stored up to its own last key: scores[4 * r + g].
template <int NG, int D>
inline void span_scores(const AttentionArgs<int8_t>& a, const HeadView* h, int R, float* const* scores,
                        Ahead<int8_t> ahead) {
    QueryCodes qc[MAX_SPAN_ROWS][NG];
    float qscale[MAX_SPAN_ROWS][NG];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) {
            round_query(h[r].q + (int64_t)g * D, D, qc[r][g]);
            qscale[r][g] = qc[r][g].step * a.scale;
        }
    const HeadView& last = h[R - 1];
    const int8_t* keys = a.kv + last.kv_off;
    const int8_t* k[16];
    alignas(64) __m512i tk[D / 64][16];  // the 16 keys transposed, for every row's heads
    int filled = 0;
    int64_t start = 0;
    auto flush = [&]() {
        for (int i = filled; i < 16; ++i) k[i] = k[filled - 1];
        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
        for (int c = 0; c < D / 64; ++c) {
            for (int i = 0; i < 16; ++i) tk[c][i] = _mm512_xor_si512(_mm512_loadu_si512(k[i] + 64 * c), flip);
            transpose16(tk[c]);
        }
        const __m512 key_scale = key_scales16(k, D);
        for (int r = 0; r < R; ++r) {
            const int64_t upto = h[r].n - start;  // this row's keys among the 16
            if (upto <= 0) continue;
            __m512i acc0[NG], acc1[NG];
            for (int g = 0; g < NG; ++g) acc0[g] = acc1[g] = _mm512_setzero_si512();
            for (int c = 0; c < D / 64; ++c)
#pragma GCC unroll 16
                for (int j = 0; j < 16; ++j)
                    for (int g = 0; g < NG; ++g) {
                        acc0[g] = _mm512_dpbusd_epi32(acc0[g], tk[c][j], broadcast4(qc[r][g].q0 + 64 * c + 4 * j));
                        acc1[g] = _mm512_dpbusd_epi32(acc1[g], tk[c][j], broadcast4(qc[r][g].q1 + 64 * c + 4 * j));
                    }
            store_scores<NG>(acc0, acc1, qc[r], qscale[r], key_scale, (int)std::min<int64_t>(filled, upto),
                             scores + 4 * r, start);
        }
        start += filled;
        filled = 0;
    };
    for_each_key(a, last.table, last.first, last.pos, [&](int64_t, int64_t off) {
        k[filled++] = keys + off;
        if (filled == 16) flush();
    }, ahead);
    if (filled) flush();
}

}  // namespace int8_vnni

// Dims d0 .. d0 + 15 of rows r0 .. r0 + R - 1 (R <= RMAX, their accumulators in registers), NG heads each:
// out = sum over the row's keys of w_i v_i, times 1 / sum. w: the softmax numerators times each key's row scale.
template <int NG, int RMAX>
inline void span_values16(const AttentionArgs<int8_t>& a, const HeadView* h, int r0, int R, const int8_t* values,
                          int d0, float* const* w, const float (*inv_sum)[4], Ahead<int8_t> ahead) {
    __m512 acc[RMAX][NG];
    int64_t n[RMAX];
#pragma GCC unroll 16
    for (int r = 0; r < RMAX; ++r) {
        n[r] = r < R ? h[r0 + r].n : 0;
        for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
    }
    const HeadView& last = h[r0 + R - 1];
    for_each_key(a, last.table, last.first, last.pos, [&](int64_t i, int64_t off) {
        const __m512 v = load16(values + off + d0);
#pragma GCC unroll 16
        for (int r = 0; r < RMAX; ++r) {
            if (r == R) break;
            if (i >= n[r]) continue;  // past this row's position
            for (int g = 0; g < NG; ++g)
                acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(w[4 * (r0 + r) + g][i]), v, acc[r][g]);
        }
    }, ahead);
#pragma GCC unroll 16
    for (int r = 0; r < RMAX; ++r) {
        if (r == R) break;
        for (int g = 0; g < NG; ++g)
            _mm512_storeu_ps(h[r0 + r].out + (int64_t)g * a.D + d0,
                             _mm512_mul_ps(acc[r][g], _mm512_set1_ps(inv_sum[r0 + r][g])));
    }
}

// Rows t0 .. t0 + R - 1 (a span), query heads head0 .. head0 + NG - 1 (one KV head's). s[4 * r + g]: room for
// row r's keys per head; rs: room for the keys' row scales; next as attend_group's.
template <int NG>
void attend_span_group(const AttentionArgs<int8_t>& a, int t0, int R, int head0, float* const* s, float* rs,
                       TokenStream<int8_t>* next) {
    HeadView h[MAX_SPAN_ROWS];
    for (int r = 0; r < R; ++r) h[r] = head_view(a, t0 + r, head0);
    const HeadView& last = h[R - 1];
    const WalkPlan<int8_t> plan = walk_plan(a, last, head0 == 0, next);
    if (a.D == 64)
        int8_vnni::span_scores<NG, 64>(a, h, R, s, plan.keys);
    else
        int8_vnni::span_scores<NG, 128>(a, h, R, s, plan.keys);
    float inv_sum[MAX_SPAN_ROWS][4];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) inv_sum[r][g] = softmax_in_place(s[4 * r + g], h[r].n);
    // the weights group_values forms per key (p * the row's scale, one float product), formed once here
    const int8_t* values = a.kv + a.plane + last.kv_off;
    for_each_key(a, last.table, last.first, last.pos, [&](int64_t i, int64_t off) { rs[i] = row_scale(values + off, a.D); });
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) {
            float* p = s[4 * r + g];
            int64_t i = 0;
            for (; i + 16 <= h[r].n; i += 16)
                _mm512_storeu_ps(p + i, _mm512_mul_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(rs + i)));
            for (; i < h[r].n; ++i) p[i] *= rs[i];
        }
    constexpr int RMAX = std::min(MAX_SPAN_ROWS, 16 / NG);
    Ahead<int8_t> ahead = plan.values;  // the first pass asks for what the plan says, the others find it in cache
    for (int d0 = 0; d0 < a.D; d0 += 16)
        for (int r0 = 0; r0 < R; r0 += RMAX) {
            span_values16<NG, RMAX>(a, h, r0, std::min(RMAX, R - r0), values, d0, s, inv_sum, ahead);
            ahead = {};
        }
}

// Every query head of a span's rows, up to 4 of one KV head at a time. buf: 4 score rows of `stride` floats
// per row of the span, then one more for the row scales.
inline void attend_span(const AttentionArgs<int8_t>& a, const Span& span, float* buf, int64_t stride,
                        TokenStream<int8_t>* next) {
    float* s[MAX_SPAN_ROWS * 4];
    for (int i = 0; i < span.rows * 4; ++i) s[i] = buf + i * stride;
    float* rs = buf + span.rows * 4 * stride;
    for (int kv = 0; kv < a.KV; ++kv)
        for (int h0 = kv * a.G; h0 < (kv + 1) * a.G; h0 += 4) {
            switch (std::min(4, (kv + 1) * a.G - h0)) {
                case 4: attend_span_group<4>(a, span.t0, span.rows, h0, s, rs, next); break;
                case 3: attend_span_group<3>(a, span.t0, span.rows, h0, s, rs, next); break;
                case 2: attend_span_group<2>(a, span.t0, span.rows, h0, s, rs, next); break;
                default: attend_span_group<1>(a, span.t0, span.rows, h0, s, rs, next); break;
            }
        }
}

}  // namespace
#endif
