// Causal flash attention for one request's prefill chunk in bfloat16 with float32 accumulation (AVX-512
// BF16: vdpbf16ps, 32 products per instruction), reading the paged KV cache (float32 or float16).
//
// Why a kernel of our own: torch's CPU flash attention runs ~115 GFLOP/s here in float32 and no faster in
// bf16 (no AMX), and bf16 matmuls through oneDNN leave the scores in bf16 and the [queries, keys] matrix in
// memory. Here the scores never leave registers: per work item (one query head, a block of ROWS query rows)
// the keys are walked 32 at a time, with an online softmax (running max and sum per row).
//
// Layouts (built once per call, per KV head, from the paged cache, zero-padded to whole 32-key steps):
//   K: [tile of 16 keys][D/2 pairs][16 keys][2]  one vector = one pair of dimensions of 16 keys, so a
//      broadcast pair of a query row times it accumulates 16 scores (no horizontal sums);
//   V: [key pair][D][2]                          one vector = 16 dimensions of two keys, so a broadcast pair
//      of probabilities times it accumulates 16 output dimensions.
// The probabilities are rounded to bf16 before P.V (as every bf16 flash attention does); the running max,
// the sums and the output stay float32. Tolerance against float32 SDPA: tests/test_prefill_attention.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kv_format.h"

// The same condition as bit 3 of pagellm_build_features (features.cpp).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(PAGELLM_SIMD_ATTENTION)
#define PAGELLM_BF16_ATTENTION 1
#endif

#ifdef PAGELLM_BF16_ATTENTION
namespace {

constexpr int ROWS = 8;   // query rows per work item: 2 x ROWS score accumulators
constexpr int STEP = 32;  // keys per step: two 16-lane tiles
constexpr int PACK_KEYS = 64;  // keys are packed in whole multiples of this (the AMX items' step)

inline uint16_t bf16_bits(float x) {  // round to nearest even (finite inputs)
    const uint32_t u = f32_bits(x);
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// exp(x) for x <= 0 (and up to the AMX items' LAZY_MAX above 0) at the precision bf16 probabilities need: one
// ln 2 step, then on r in [-ln2/2, ln2/2] a degree-3 polynomial fitted for relative error (< 1.4e-4 against bf16's
// 2^-9 rounding of the probabilities; 1 at 0) and vscalefps for the 2^n; 8 instructions where simd.h's exp16
// (float32-grade, for the exact paths) takes 15. Both item kinds' softmax (the AMX items too).
inline __m512 exp16_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // -inf (a row's first step) -> ~1e-38, as exp16
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.16346538f), r, _mm512_set1_ps(0.50449777f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.00040019f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));  // exp(0) = 1 exactly: an unmoved max rescales nothing
    return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }  // a vector cast: kept in registers
inline __m512i as_si(__m512bh x) { return (__m512i)x; }

// D values of a float32, float16 or int8 cache row as bf16 (round to nearest even, as bf16_bits), zeros for no row.
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const uint16_t* src) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
// int8 rows: each code times the row's scale (kv_format.h; the decode kernel scales q . k instead: both are
// within the bf16 rounding that follows).
inline __m512 load16(const int8_t* src, __m512 scale) {
    const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(codes), scale);
}
inline __m512 load16(const float* src, __m512) { return load16(src); }
inline __m512 load16(const uint16_t* src, __m512) { return load16(src); }
template <typename T>
inline void row_to_bf16(const T* src, uint16_t* dst, int D) {
    const __m512 scale = _mm512_set1_ps(src ? row_scale(src, D) : 0.f);
    for (int d = 0; d < D; d += 32)
        _mm512_store_si512(dst + d, src ? as_si(_mm512_cvtne2ps_pbh(load16(src + d + 16, scale),
                                                                    load16(src + d, scale)))
                                        : _mm512_setzero_si512());
}

struct Packed {
    std::vector<uint32_t> k, v;  // bf16 pairs as 32-bit words
    int64_t k_head, v_head;  // per KV head: words of K, of V
};

// K and V of keys 0..seq_len-1 of every KV head in the layouts above, 16 keys at a time: their rows in bf16,
// then K's words (dimension pairs) transposed to [pair][key] and V's rows interleaved by key pairs.
template <typename T>
Packed pack_kv(const T* kv, int64_t plane, int64_t stride, int block_size, const int64_t* table, int64_t seq_len,
               int KV, int D, int nthreads) {
    Packed p;
    const int64_t keys = (seq_len + PACK_KEYS - 1) / PACK_KEYS * PACK_KEYS, pairs = D / 2;  // zero-padded
    p.k_head = keys * pairs;
    p.v_head = keys / 2 * D;
    p.k.resize(KV * p.k_head);
    p.v.resize(KV * p.v_head);
    const int64_t tiles = keys / 16;
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static)
    for (int h = 0; h < KV; ++h)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            alignas(64) uint16_t kb[16][256], vb[16][256];
            for (int lane = 0; lane < 16; ++lane) {
                const int64_t j = tile * 16 + lane;
                const int64_t off = j < seq_len ? (table[j / block_size] * block_size + j % block_size) * stride +
                                                      h * (D + row_extra<T>())
                                                : -1;
                row_to_bf16(off < 0 ? nullptr : kv + off, kb[lane], D);
                row_to_bf16(off < 0 ? nullptr : kv + plane + off, vb[lane], D);
            }
            uint32_t* kt = p.k.data() + h * p.k_head + tile * 16 * pairs;
            for (int lane = 0; lane < 16; ++lane) {
                const uint32_t* words = reinterpret_cast<const uint32_t*>(kb[lane]);
                for (int dp = 0; dp < pairs; ++dp) kt[dp * 16 + lane] = words[dp];
            }
            uint32_t* vt = p.v.data() + h * p.v_head + tile * 8 * D;
            for (int i = 0; i < 8; ++i)  // keys 2i, 2i + 1: low and high halves of each word
                for (int d = 0; d < D; d += 32) {
                    const __m512i a = _mm512_load_si512(vb[2 * i] + d), b = _mm512_load_si512(vb[2 * i + 1] + d);
                    _mm512_storeu_si512(vt + i * D + d, _mm512_permutex2var_epi16(a, lo, b));
                    _mm512_storeu_si512(vt + i * D + d + 16, _mm512_permutex2var_epi16(a, hi, b));
                }
        }
    return p;
}

// A work item's running state cleared: output sums, maxima and sums of exponentials of its rows.
inline void reset_rows(float (*o)[256], float* m, __m512* l, int rows, int D) {
    for (int r = 0; r < rows; ++r) {
        std::memset(o[r], 0, sizeof(float) * D);
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
    }
}

// Rows r0..r0+n-1 of out for query head `head`: each row's output sums over its sum of exponentials.
inline void write_rows(const float (*o)[256], const __m512* l, int n, float* out, int64_t ldo, int r0, int head,
                       int D) {
    for (int r = 0; r < n; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
        float* dst = out + (int64_t)(r0 + r) * ldo + (int64_t)head * D;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(o[r] + d), inv));
    }
}

// One work item: query head `head`, rows r0..r0+n-1 (n <= ROWS) at positions first_pos + r.
void attend_rows(const float* q, int64_t ldq, float* out, int64_t ldo, int head, int kv_head, int D, int r0, int n,
                 int64_t first_pos, const Packed& p, float scale) {
    const int pairs = D / 2;
    alignas(64) uint32_t qb[ROWS][128];
    alignas(64) uint32_t pb[ROWS][16];
    alignas(64) float o[ROWS][256];
    float m[ROWS], alpha[ROWS];
    __m512 l[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        const float* qr = q + (int64_t)(r0 + (r < n ? r : 0)) * ldq + (int64_t)head * D;
        for (int dp = 0; dp < pairs; ++dp) qb[r][dp] = bf16_bits(qr[2 * dp]) | (uint32_t)bf16_bits(qr[2 * dp + 1]) << 16;
    }
    reset_rows(o, m, l, ROWS, D);
    const int64_t last = first_pos + r0 + n - 1;  // the block's last row sees keys 0..last
    const uint32_t* kh = p.k.data() + kv_head * p.k_head;
    const uint32_t* vh = p.v.data() + kv_head * p.v_head;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t key0 = 0; key0 <= last; key0 += STEP) {
        __m512 s[ROWS][2];
        for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
        const uint32_t* k0 = kh + key0 * pairs;
        const uint32_t* k1 = k0 + 16 * pairs;
        for (int dp = 0; dp < pairs; ++dp) {
            const __m512bh a = as_bh(_mm512_loadu_si512(k0 + dp * 16)), b = as_bh(_mm512_loadu_si512(k1 + dp * 16));
            for (int r = 0; r < ROWS; ++r) {
                const __m512bh x = as_bh(_mm512_set1_epi32((int)qb[r][dp]));
                s[r][0] = _mm512_dpbf16_ps(s[r][0], x, a);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], x, b);
            }
        }
        // Masked, scaled scores and each row's new running max; then every row's rescale factor in one vector exp
        // (as the AMX items: a row's first step has m = -inf, a factor of ~0 on its zero output and sum; a libm exp
        // per row spilled the live vectors around each call); then the probabilities. A step whose keys every row
        // sees (all but the diagonal's) skips the masks.
        const bool whole = key0 + STEP - 1 <= first_pos + r0;
        const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
        alignas(64) float m_new[16];
        for (int r = 0; r < ROWS; ++r) {
            if (whole) {
                s[r][0] = _mm512_mul_ps(s[r][0], sc);
                s[r][1] = _mm512_mul_ps(s[r][1], sc);
            } else {  // keys key0 + lane (+16) visible to row r: those <= its position (padding keys are beyond it)
                const __m512i limit = _mm512_set1_epi32((int)(first_pos + r0 + r - key0));
                s[r][0] = _mm512_mask_mul_ps(ninf, _mm512_cmple_epi32_mask(iota, limit), s[r][0], sc);
                s[r][1] = _mm512_mask_mul_ps(
                    ninf, _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16)), limit), s[r][1], sc);
            }
            // finite: row r sees key 0 from the first step
            m_new[r] = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
        }
        constexpr __mmask16 rows_mask = (1u << ROWS) - 1;  // the other lanes: exp(0 - 0), unused
        const __m512 mv = _mm512_maskz_loadu_ps(rows_mask, m_new);
        _mm512_mask_storeu_ps(alpha, rows_mask, exp16_bf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rows_mask, m), mv)));
        _mm512_mask_storeu_ps(m, rows_mask, mv);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 mx = _mm512_set1_ps(m[r]);
            __m512 pa = exp16_bf16(_mm512_sub_ps(s[r][0], mx)), pbv = exp16_bf16(_mm512_sub_ps(s[r][1], mx));
            if (!whole) {  // exactly 0 for the masked keys (exp16 clamps: -inf would give ~1e-38)
                pa = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[r][0], ninf, _CMP_NEQ_OQ), pa);
                pbv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s[r][1], ninf, _CMP_NEQ_OQ), pbv);
            }
            l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha[r]), _mm512_add_ps(pa, pbv));
            _mm512_store_si512(pb[r], as_si(_mm512_cvtne2ps_pbh(pbv, pa)));  // keys 0-15 low, 16-31 high
        }
        const uint32_t* vs = vh + key0 / 2 * D;
        for (int r = 0; r < ROWS; r += 4)
            for (int c = 0; c < D; c += 64) {
                __m512 acc[4][4];
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 4; ++j)
                        acc[i][j] = _mm512_mul_ps(_mm512_load_ps(o[r + i] + c + 16 * j), _mm512_set1_ps(alpha[r + i]));
                for (int jp = 0; jp < STEP / 2; ++jp) {
                    const uint32_t* vp = vs + jp * D + c;
                    __m512bh v[4];
                    for (int j = 0; j < 4; ++j) {
                        __m512i w = _mm512_loadu_si512(vp + 16 * j);
                        asm("" : "+v"(w));  // held in a register: GCC reloaded each vector per row (4x the loads)
                        v[j] = as_bh(w);
                    }
                    for (int i = 0; i < 4; ++i) {
                        const __m512bh x = as_bh(_mm512_set1_epi32((int)pb[r + i][jp]));
                        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, v[j]);
                    }
                }
                for (int i = 0; i < 4; ++i)
                    for (int j = 0; j < 4; ++j) _mm512_store_ps(o[r + i] + c + 16 * j, acc[i][j]);
            }
    }
    write_rows(o, l, n, out, ldo, r0, head, D);
}

}  // namespace

#include "prefill_attention_amx.h"

namespace {

// One request's chunk in a step's batch: query rows start..start+nq-1 of q and out (its newest positions,
// seq_len - nq .. seq_len - 1), its block table row `table` of the step's tables.
struct Chunk {
    int64_t start, nq, seq_len, table;
};
static_assert(sizeof(Chunk) == 4 * sizeof(int64_t), "read from rows of four int64 (ops.prefill_attention_bf16_batch)");

constexpr int64_t PACK_BUDGET = (int64_t)256 << 20;  // bytes of packed keys and values held at once

// The bytes pack_kv holds for a request of seq_len keys.
inline int64_t pack_bytes(int64_t seq_len, int KV, int D) {
    return (seq_len + PACK_KEYS - 1) / PACK_KEYS * PACK_KEYS * KV * D * 2 * 2;
}

// One round of prefill_attention: its chunks packed, then their items in one parallel loop.
template <typename T>
void attend_chunks(const float* q, int64_t ldq, int H, int D, const T* kv, int64_t num_blocks, int block_size,
                   int KV, const Chunk* chunks, int R, const int64_t* tables, int64_t table_stride, float scale,
                   float* out, int64_t ldo, int nthreads, bool tiles) {
    const int64_t stride = (int64_t)KV * (D + row_extra<T>()), plane = num_blocks * block_size * stride;
    std::vector<Packed> packs;
    packs.reserve(R);
    for (int r = 0; r < R; ++r)
        packs.push_back(pack_kv(kv, plane, stride, block_size, tables + chunks[r].table * table_stride,
                                chunks[r].seq_len, KV, D, nthreads));
#ifdef PAGELLM_AMX_ATTENTION
    tiles = tiles && pagellm_amx_ready();
    const int rows = tiles ? TILE_ROWS : ROWS;
#else
    tiles = false;
    const int rows = ROWS;
#endif
    struct Block {
        int r, b;
        int64_t keys;  // the keys its last row sees
    };
    std::vector<Block> blocks;
    for (int r = 0; r < R; ++r)
        for (int64_t b = 0; b * rows < chunks[r].nq; ++b)
            blocks.push_back({r, (int)b,
                              chunks[r].seq_len - chunks[r].nq + std::min<int64_t>((b + 1) * rows, chunks[r].nq)});
    std::stable_sort(blocks.begin(), blocks.end(), [](const Block& x, const Block& y) { return x.keys > y.keys; });
    const int G = H / KV;
    const int64_t items = (int64_t)blocks.size() * H;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef PAGELLM_AMX_ATTENTION
        if (tiles) configure_full_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const Block& blk = blocks[item / H];
            const Chunk& c = chunks[blk.r];
            const int head = (int)(item % H), r0 = blk.b * rows, n = (int)std::min<int64_t>(rows, c.nq - r0);
            const float* qc = q + c.start * ldq;
            float* oc = out + c.start * ldo;
#ifdef PAGELLM_AMX_ATTENTION
            if (tiles) {
                attend_rows_amx(qc, ldq, oc, ldo, head, head / G, D, r0, n, c.seq_len - c.nq, packs[blk.r], scale);
                continue;
            }
#endif
            attend_rows(qc, ldq, oc, ldo, head, head / G, D, r0, n, c.seq_len - c.nq, packs[blk.r], scale);
        }
#ifdef PAGELLM_AMX_ATTENTION
        if (tiles) _tile_release();
#endif
    }
}

// The chunks of a step in one call: each request's K and V packed, then one parallel loop over every (chunk, row
// block, head), the items that see the most keys first so the threads finish together. An item's arithmetic
// does not depend on the others: a request gets the same bits alone or among others.
// tiles: the work items on AMX tiles (16 rows each) where the build and the OS have them.
template <typename T>
void prefill_attention(const float* q, int64_t ldq, int H, int D, const T* kv, int64_t num_blocks, int block_size,
                       int KV, const Chunk* chunks, int R, const int64_t* tables, int64_t table_stride, float scale,
                       float* out, int64_t ldo, int nthreads, bool tiles) {
    // Chunks whose packed keys and values together pass PACK_BUDGET bytes go in several rounds (chunks after a
    // long cached prefix each pack the whole prefix)
    int done = 0;
    while (done < R) {
        int end = done + 1;
        int64_t bytes = pack_bytes(chunks[done].seq_len, KV, D);
        while (end < R && bytes + pack_bytes(chunks[end].seq_len, KV, D) <= PACK_BUDGET)
            bytes += pack_bytes(chunks[end++].seq_len, KV, D);
        attend_chunks(q, ldq, H, D, kv, num_blocks, block_size, KV, chunks + done, end - done, tables, table_stride,
                      scale, out, ldo, nthreads, tiles);
        done = end;
    }
}

template <typename T>
int run_kv_format(int kv_format, T&& run) {
    if (kv_format == KV_F32)
        run(static_cast<const float*>(nullptr));
    else if (kv_format == KV_F16)
        run(static_cast<const uint16_t*>(nullptr));
    else if (kv_format == KV_I8)
        run(static_cast<const int8_t*>(nullptr));
    else
        return -1;
    return 0;
}

}  // namespace
#endif

// The long chunks of a step in one call (CpuPagedAttention): chunks holds R rows of (start, nq, seq_len, table
// row): request r's query rows start..start+nq-1 of q ([T, H, D], row stride ldq), written to the same rows of
// out, over its block table tables + table_row * table_stride. The same conditions and return as below, and -2
// where the packed copies could not be allocated.
extern "C" int pagellm_prefill_attention_bf16_batch(const float* q, int64_t ldq, int H, int D, const void* kv,
                                                    int64_t num_blocks, int block_size, int KV, const int64_t* chunks,
                                                    int R, const int64_t* tables, int64_t table_stride, float scale,
                                                    float* out, int64_t ldo, int nthreads, int kv_format, int tiles) {
#ifdef PAGELLM_BF16_ATTENTION
    // scale > 0: the AMX items take a row's max of the raw scores times scale for the max of the scaled ones
    if (D % 64 || D > 256 || H % KV || R < 1 || !(scale > 0.f)) return -1;
    const Chunk* c = reinterpret_cast<const Chunk*>(chunks);
    for (int r = 0; r < R; ++r)
        if (c[r].nq < 1 || c[r].nq > c[r].seq_len) return -1;
    try {
        return run_kv_format(kv_format, [&](auto type) {
            using T = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
            prefill_attention(q, ldq, H, D, static_cast<const T*>(kv), num_blocks, block_size, KV, c, R, tables,
                              table_stride, scale, out, ldo, nthreads, tiles);
        });
    } catch (const std::bad_alloc&) {  // the packed copies: not an abort across the C boundary
        return -2;
    }
#else
    (void)q, (void)ldq, (void)H, (void)D, (void)kv, (void)num_blocks, (void)block_size, (void)KV, (void)chunks;
    (void)R, (void)tables, (void)table_stride, (void)scale, (void)out, (void)ldo, (void)nthreads, (void)kv_format;
    (void)tiles;
    return -1;
#endif
}

// q: [nq, H, D] float32 (row stride ldq), the request's newest nq positions seq_len - nq .. seq_len - 1;
// out: [nq, H, D] (row stride ldo). kv: the paged cache [2, num_blocks, block_size, KV, D] (kv_format
// float32, float16 or int8: rows of D + 2), table: the request's block ids. Returns 0, or -1 where this build
// has no bf16 kernel or the shape or format is not one it takes (D a multiple of 64 up to 256, H % KV,
// float32/float16/int8, scale > 0). tiles: run the work items on AMX tiles where this build and the OS have them
// (prefill_attention_amx.h).
extern "C" int pagellm_prefill_attention_bf16(const float* q, int64_t ldq, int nq, int H, int D, const void* kv,
                                              int64_t num_blocks, int block_size, int KV, const int64_t* table,
                                              int64_t seq_len, float scale, float* out, int64_t ldo, int nthreads,
                                              int kv_format, int tiles) {
    const int64_t chunk[4] = {0, nq, seq_len, 0};
    return pagellm_prefill_attention_bf16_batch(q, ldq, H, D, kv, num_blocks, block_size, KV, chunk, 1, table, 0,
                                                scale, out, ldo, nthreads, kv_format, tiles);
}
