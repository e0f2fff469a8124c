// Decode attention over int8 KV rows with integer dot products (AVX-512 VNNI), for head sizes 64 and 128.
//
// Scores: 16 keys at a time. Their rows are transposed in 4-byte groups (lane i: key i), so one vpdpbusd
// adds 4 dimensions of 16 keys' dot products with no horizontal sums. The query is rounded per (row, head)
// to two int8 planes, q ~ step * (128 q0 + q1) (the second plane holds the first's rounding error, so q
// keeps ~15 bits); the keys are read as unsigned (k + 128) and the 128 * sum(q) that adds is taken back.
// The integer sums are exact, then score = float(sum) * (step * softmax scale) * the key's row scale.
//
// The weighted values stay attention.cpp's (float32 products of the int8 codes).
//
// Every (row, head) gets the same operations in the same order whether it runs alone (attention.cpp's
// per-head path, NG = 1) or with the other query heads of its KV head (attention_grouped.h), and a key's
// score does not depend on its neighbours: rows stay bit-identical alone and among others, as speculative
// verification needs. Rounding the query costs ~1e-4 relative against float32 queries (tests/test_kernels.py).
#pragma once

#if defined(PAGELLM_WIDE_ATTENTION) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGELLM_INT8_VNNI_ATTENTION 1

namespace {
namespace int8_vnni {

// One query head rounded: q ~ step * (128 q0 + q1).
struct QueryCodes {
    alignas(64) int8_t q0[128];
    alignas(64) int8_t q1[128];
    float step;    // max |q| / 127 / 128; NaN where q is not finite (its scores are then NaN, as the float path's)
    int32_t bias;  // 128 * sum(128 q0 + q1): what reading the keys as k + 128 adds to every sum
};

inline void round_query(const float* q, int D, QueryCodes& c) {
    float amax = 0.f;
    bool finite = true;
    for (int d = 0; d < D; ++d) {
        finite = finite && std::isfinite(q[d]);
        amax = std::max(amax, std::fabs(q[d]));
    }
    float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    if (!std::isfinite(inv)) inv = 0.f;  // a query of subnormal size: scored as zero (its scores would round to 0)
    int32_t total = 0;
    for (int d = 0; d < D; ++d) {
        const float x = q[d] * inv, a = std::nearbyint(x), r = std::nearbyint((x - a) * 128.f);  // |r| <= 64
        c.q0[d] = static_cast<int8_t>(a), c.q1[d] = static_cast<int8_t>(r);
        total += 128 * static_cast<int32_t>(a) + static_cast<int32_t>(r);
    }
    c.step = !finite ? NAN : inv > 0.f ? amax / 127.f / 128.f : 0.f;
    c.bias = 128 * total;
}

// r[i] (key i's 16 dwords) -> r[j] (dword j of keys 0..15, key i in lane i). Inlined by force: GCC had kept it
// out of line, its 16 vectors stored and reloaded around every call (decode attention 1.03-1.07x inlined,
// benchmarks/NOTES.md, twenty-sixth session).
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[i + m], 128-bit lane L: dword 4L + m of keys i .. i + 3
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // the 4 x 4 transpose of 128-bit lanes over r[m], r[4 + m], r[8 + m], r[12 + m]
        const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88), r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

// The 16 keys' row scales (float16 after each row's D codes).
inline __m512 key_scales16(const int8_t* const* k, int D) {
    alignas(32) uint16_t half[16];
    for (int i = 0; i < 16; ++i) std::memcpy(half + i, k[i] + D, 2);
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(half)));
}

// NG heads' exact integer sums against 16 keys to scores: float(128 s0 + s1 - bias) * qscale * key scale,
// scores[g][start + i] for i < filled.
template <int NG>
inline void store_scores(const __m512i* acc0, const __m512i* acc1, const QueryCodes* qc, const float* qscale,
                         __m512 key_scale, int filled, float* const* scores, int64_t start) {
    const __mmask16 keep = static_cast<__mmask16>((1u << filled) - 1);
    for (int g = 0; g < NG; ++g) {
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(acc0[g], 7), acc1[g]),
                                           _mm512_set1_epi32(qc[g].bias));
        const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(qscale[g])), key_scale);
        _mm512_mask_storeu_ps(scores[g] + start, keep, f);
    }
}

// Scores of NG heads against 16 keys (k[i]: key rows, D codes then the float16 scale): scores[g][start + i]
// for i < filled (the other slots repeat a key and are not stored).
template <int NG, int D>
inline void score16(const int8_t* const* k, int filled, const QueryCodes* qc, const float* qscale,
                    float* const* scores, int64_t start) {
    __m512i acc0[NG], acc1[NG];
    for (int g = 0; g < NG; ++g) acc0[g] = acc1[g] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < D; c += 64) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_xor_si512(_mm512_loadu_si512(k[i] + c), flip);
        transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
            for (int g = 0; g < NG; ++g) {
                acc0[g] = _mm512_dpbusd_epi32(acc0[g], r[j], broadcast4(qc[g].q0 + c + 4 * j));
                acc1[g] = _mm512_dpbusd_epi32(acc1[g], r[j], broadcast4(qc[g].q1 + c + 4 * j));
            }
    }
    store_scores<NG>(acc0, acc1, qc, qscale, key_scales16(k, D), filled, scores, start);
}

// The scores of NG query heads (h: the first one's view; the others follow it in q) against the row's keys.
// Inlined into its caller by force: called out of line, the few-row walks ran ~15% slower (benchmarks/NOTES.md,
// twenty-fourth session).
template <int NG, int D>
__attribute__((always_inline)) inline void scores(const AttentionArgs<int8_t>& a, const HeadView& h,
                                                  float* const* scores, Ahead<int8_t> ahead) {
    QueryCodes qc[NG];
    float qscale[NG];
    for (int g = 0; g < NG; ++g) {
        round_query(h.q + (int64_t)g * D, D, qc[g]);
        qscale[g] = qc[g].step * a.scale;
    }
    const int8_t* keys = a.kv + h.kv_off;
    const int8_t* k[16];
    int filled = 0;
    int64_t start = 0;
    auto flush = [&]() {
        for (int i = filled; i < 16; ++i) k[i] = k[filled - 1];
        score16<NG, D>(k, filled, qc, qscale, scores, start);
        start += filled;
        filled = 0;
    };
    for_each_key(a, h.table, h.first, h.pos, [&](int64_t, int64_t off) {
        k[filled++] = keys + off;
        if (filled == 16) flush();
    }, ahead);
    if (filled) flush();
}

}  // namespace int8_vnni
}  // namespace
#endif

namespace {
// Scores NG query heads against int8 keys on VNNI where the build has it and the head size is 64 or 128
// (true); else leaves them to the caller (false).
template <int NG, typename T>
inline bool int8_vnni_scores(const AttentionArgs<T>& a, const HeadView& h, float* const* scores, Ahead<T> ahead) {
#ifdef PAGELLM_INT8_VNNI_ATTENTION
    if constexpr (std::is_same_v<T, int8_t>) {
        if (a.D == 64) return int8_vnni::scores<NG, 64>(a, h, scores, ahead), true;
        if (a.D == 128) return int8_vnni::scores<NG, 128>(a, h, scores, ahead), true;
    }
#endif
    (void)a, (void)h, (void)scores, (void)ahead;
    return false;
}
}  // namespace
