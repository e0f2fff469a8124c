// How attention.cpp walks a request's paged keys: the kernel's arguments, the walk over a row's blocks
// (prefetching the next block's keys on many-row steps), and what one (row, head) pair attends.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

template <typename T>
struct AttentionArgs {
    const float* q;
    int64_t ldq;
    int H, D, G, KV, block_size, window;
    const T* kv;
    int64_t plane, stride;  // offset of the values; distance between consecutive tokens of a block
    int64_t row;  // elements per KV head row: D, or D + 2 for int8 (its scale)
    const int64_t* block_tables;
    int64_t table_stride;
    const int64_t* row_seq;
    const int64_t* row_pos;
    float scale;
    float* out;
    bool prefetch = false;  // a many-row step: its walks ask for memory ahead (walk_plan, for_each_key)
    bool whole_tokens = false;  // ... by whole tokens, and each thread for its next row (WHOLE_ROW_BYTES)
};

// How far ahead (in keys) a many-row walk asks for keys, whatever the block size. On the Xeon VM with 16-token
// blocks (benchmarks/NOTES.md, sixteenth session): W2 offline 590-613 tok/s one block (16 keys) ahead, 623-636 at
// 32, 601-642 at 64, 605-612 at 128 (as with 32- or 64-token blocks: 620-639); microbench_attention.py's 30 caches
// in turn 1.00-1.04 / 0.96-0.97 / 0.96-1.00 ms at 16 / 32 / 64, in cache 0.55 / 0.54-0.58 / 0.64-0.65.
constexpr int64_t PREFETCH_KEYS = 32;

// Every line of a row of `bytes` bytes at p, which may start mid-line (int8 rows: D + 2 bytes); Locality as
// __builtin_prefetch's: 3 prefetcht0, 2 prefetcht1.
template <int Locality>
inline void prefetch_row(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, Locality);
    __builtin_prefetch(c + bytes - 1, 0, Locality);  // the last line of an unaligned row
}

// Another row's tokens, one per step(), every KV head's key and value rows asked into L2: on many-row steps
// a row's later KV heads compute from cache (the first head's walk fetched whole tokens), and meanwhile ask
// for the row their thread takes next, which then starts in cache. 64 rows x 300 keys over int8 caches out
// of L3, both builds alternating in one process: 1.18x with the blocks in order, 1.27x in random order
// (Zen 4 VM; benchmarks/microbench_attention_ab.py, benchmarks/NOTES.md, twenty-fourth session).
template <typename T>
struct TokenStream {
    const int64_t* table = nullptr;
    int64_t j = 0, pos = -1, in = 0, base = 0;  // the next token, the last; its block offset and block start

    TokenStream() = default;
    TokenStream(const AttentionArgs<T>& a, const int64_t* table_, int64_t first, int64_t pos_)
        : table(table_), j(first), pos(pos_), in(first % a.block_size),
          base(table_[first / a.block_size] * a.block_size * a.stride) {}

    inline void step(const AttentionArgs<T>& a) {
        if (j > pos) return;
        const T* at = a.kv + base + in * a.stride;
        prefetch_row<2>(at, a.stride * (int64_t)sizeof(T));
        prefetch_row<2>(at + a.plane, a.stride * (int64_t)sizeof(T));
        ++j;
        if (++in == a.block_size && j <= pos) in = 0, base = table[j / a.block_size] * a.block_size * a.stride;
    }
};

// What a walk asks for as it goes (on many-row steps, a.prefetch): from `keys`, the rows PREFETCH_KEYS keys
// on (into L1); from `values`, the current key's rows (into L2), `bytes` of each; `next` stepped once per key.
template <typename T>
struct Ahead {
    const T* keys = nullptr;
    const T* values = nullptr;
    int64_t bytes = 0;
    TokenStream<T>* next = nullptr;
};

// What one (query row, query head) pair attends: its request's block table, keys first..pos (n of
// them), its query vector, the KV head's offset within a token, and its output row.
struct HeadView {
    const int64_t* table;
    int64_t pos, first, n;
    const float* q;
    int64_t kv_off;
    float* out;
};

// The most K and V bytes of a step's longest row for its walks to go by whole tokens (a.whole_tokens): the
// row's first head fetches them, and each thread asks for its next row while the later heads compute from
// cache. Past it, each head asks for its own rows as it walks them and rows go out as schedule(dynamic, 1)
// hands them: on the Zen 4 VM (1 MB L2) float16 rows of 0.4-2.3 MB and int8 rows of 3 MB ran 8-25% slower by
// whole tokens than before (microbench_attention_ab.py; benchmarks/NOTES.md, twenty-fourth session).
constexpr int64_t WHOLE_ROW_BYTES = 512 << 10;

// What the keys' and the values' walks of one (row, head) ask for on many-row steps (a.prefetch; nothing
// otherwise). By whole tokens (a.whole_tokens): its first head (first) fetches whole tokens, every KV head's key ahead
// and value now (a token's KV heads share cache lines); the other heads of KV head 0 find theirs in cache;
// the later KV heads' walks, computing from cache, step `next` (may be null): the next row's tokens. A
// longer row: each head its own keys ahead and values now, and its values ahead on the values' walk.
template <typename T>
struct WalkPlan {
    Ahead<T> keys, values;
};

template <typename T>
inline WalkPlan<T> walk_plan(const AttentionArgs<T>& a, const HeadView& h, bool first, TokenStream<T>* next) {
    if (!a.prefetch) return {};
    if (!a.whole_tokens) {
        const T* k = a.kv + h.kv_off;
        const int64_t bytes = a.row * (int64_t)sizeof(T);
        return {{k, k + a.plane, bytes}, {k + a.plane, nullptr, bytes}};
    }
    if (first) return {{a.kv, a.kv + a.plane, a.stride * (int64_t)sizeof(T)}, {}};
    if (h.kv_off == 0) return {};
    return {{nullptr, nullptr, 0, next}, {nullptr, nullptr, 0, next}};
}

// Walks keys first..pos of a row's blocks, calling f(i, token_offset) with i counted from 0. With a.prefetch
// and ahead.keys (where the walked rows start, K or V, or whole tokens), it also asks for the key
// PREFETCH_KEYS further on, through the block table (the same offset in the block that many keys on, looked
// up once per block): blocks lie in any order, and the hardware prefetcher loses the stream at every
// block's end. Many-row steps find their keys in memory, not cache (64 rows x 300 keys over 30 layers'
// caches: 16-21% faster, benchmarks/NOTES.md, eleventh session); one row's keys stay cached from token to
// token, where the prefetches cost 3-6%, so few-row steps go without.
// With ahead.values too (the keys' walk passes where the same tokens' values start), each key's value row is
// asked into L2 as its key is reached, so the values' walk that follows the softmax finds its rows in cache,
// the first ones included: 64 rows x 300 keys over 30 caches, float16 1.02-1.13 -> 0.80-0.90 ms, int8
// 0.69-0.78 -> 0.66-0.70; 16 x 1,000 int8 0.55-0.63 -> 0.50-0.54 (Zen 4 VM, microbench_attention.py;
// benchmarks/NOTES.md, twenty-second session).
template <typename T, typename F>
inline void for_each_key(const AttentionArgs<T>& a, const int64_t* table, int64_t first, int64_t pos, F f,
                         Ahead<T> ahead = {}) {
    const int bs = a.block_size;
    const bool prefetch = a.prefetch && ahead.keys != nullptr;
    if (!prefetch && ahead.next == nullptr) {  // walks that ask for nothing (few-row steps): the plain loop
        for (int64_t j = first; j <= pos;) {
            const int64_t count = std::min<int64_t>(bs - j % bs, pos + 1 - j);
            int64_t off = (table[j / bs] * bs + j % bs) * a.stride;
            for (int64_t i = j - first; i < j - first + count; ++i, off += a.stride) f(i, off);
            j += count;
        }
        return;
    }
    // The key PREFETCH_KEYS on lies `skip` whole blocks on, `rem` keys further (0 for blocks of up to 32
    // tokens, every block size being a power of two): in that block or the next. Their starts are looked up
    // once per block, where the walk reaches them (no division per key).
    const int64_t skip = PREFETCH_KEYS / bs, rem = PREFETCH_KEYS % bs, last_block = pos / bs;
    for (int64_t j = first; j <= pos;) {
        const int64_t b = j / bs, in = j % bs;
        const int64_t count = std::min<int64_t>(bs - in, pos + 1 - j);
        int64_t off = (table[b] * bs + in) * a.stride;
        const int64_t ahead_count = prefetch ? std::min<int64_t>(count, pos + 1 - j - PREFETCH_KEYS) : 0;
        const T* block0 = ahead_count > 0 ? ahead.keys + table[b + skip] * bs * a.stride : nullptr;
        const T* block1 = ahead_count > 0 && rem && b + skip + 1 <= last_block
                              ? ahead.keys + table[b + skip + 1] * bs * a.stride : nullptr;
        for (int64_t i = 0; i < count; ++i, off += a.stride) {
            if (prefetch) {
                const int64_t at = in + i + rem;  // the ahead key's offset from block b + skip's start
                if (i < ahead_count)
                    prefetch_row<3>(at < bs ? block0 + at * a.stride : block1 + (at - bs) * a.stride, ahead.bytes);
                if (ahead.values != nullptr) prefetch_row<2>(ahead.values + off, ahead.bytes);  // L2: values outgrow L1
            }
            if (ahead.next != nullptr) ahead.next->step(a);
            f(j - first + i, off);
        }
        j += count;
    }
}

template <typename T>
inline HeadView head_view(const AttentionArgs<T>& a, int t, int head) {
    const int64_t pos = a.row_pos[t];
    const int64_t first = a.window > 0 && pos + 1 > a.window ? pos + 1 - a.window : 0;
    return {a.block_tables + a.row_seq[t] * a.table_stride, pos, first, pos + 1 - first,
            a.q + t * a.ldq + (int64_t)head * a.D, (int64_t)(head / a.G) * a.row,
            a.out + ((int64_t)t * a.H + head) * a.D};
}

// A many-row step's rows 0..T-1 across the threads of the enclosing parallel region: attend(t, next). By whole
// tokens, each thread claims its next row from `counter` as it starts one, and `next` streams that row's
// tokens (null: none; the tail may wait up to a row longer than schedule(dynamic, 1) would); else
// schedule(dynamic, 1) and next null.
// Work items other than rows (attention_spans.h) pass `row_of`: the row whose tokens stand for item n's.
struct SameRow {
    int operator()(int n) const { return n; }
};

template <typename T, typename F, typename RowOf = SameRow>
inline void for_each_row(const AttentionArgs<T>& a, int T_, std::atomic<int>& counter, F attend, RowOf row_of = {}) {
    if (!a.whole_tokens) {
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < T_; ++t) attend(t, static_cast<TokenStream<T>*>(nullptr));
        return;
    }
    int t = counter.fetch_add(1);
    while (t < T_) {
        const int n = counter.fetch_add(1);
        TokenStream<T> stream;
        if (n < T_) {
            const HeadView v = head_view(a, row_of(n), 0);
            stream = TokenStream<T>(a, v.table, v.first, v.pos);
        }
        attend(t, n < T_ ? &stream : nullptr);
        t = n;
    }
}

}  // namespace
