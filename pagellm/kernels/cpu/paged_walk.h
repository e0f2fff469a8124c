// How attention.cpp walks a request's paged keys: the kernel's arguments, the walk over a row's blocks
// (prefetching the next block's keys on many-row steps), and what one (row, head) pair attends.
#pragma once

#include <algorithm>
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
    bool prefetch = false;  // ask for each key's next-block successor ahead (for_each_key)
};

// How far ahead (in keys) a many-row walk asks for keys, whatever the block size. On the Xeon VM with 16-token
// blocks (benchmarks/NOTES.md, sixteenth session): W2 offline 590-613 tok/s one block (16 keys) ahead, 623-636 at
// 32, 601-642 at 64, 605-612 at 128 (as with 32- or 64-token blocks: 620-639); microbench_attention.py's 30 caches
// in turn 1.00-1.04 / 0.96-0.97 / 0.96-1.00 ms at 16 / 32 / 64, in cache 0.55 / 0.54-0.58 / 0.64-0.65.
constexpr int64_t PREFETCH_KEYS = 32;

// Walks keys first..pos of a row's blocks, calling f(i, token_offset) with i counted from 0. Given pf (where
// the walked rows start, K or V) and a.prefetch, it also asks for the key PREFETCH_KEYS further on, through the
// block table: blocks lie in random order, and the hardware prefetcher loses the stream at every block's end.
// Many-row steps find their keys in memory, not cache (64 rows x 300 keys over 30 layers' caches: 16-21%
// faster, benchmarks/NOTES.md, eleventh session); one row's keys stay cached from token to token, where
// the prefetches cost 3-6%, so few-row steps go without.
// Given pv too (the keys' walk passes where the same tokens' values start), each key's value row is asked
// into L2 as its key is reached, so the values' walk that follows the softmax finds its rows in cache,
// the first ones included (the values' own look-ahead misses its first PREFETCH_KEYS): 64 rows x 300 keys
// over 30 caches, float16 1.02-1.13 -> 0.80-0.90 ms, int8 0.69-0.78 -> 0.66-0.70; 16 x 1,000 int8
// 0.55-0.63 -> 0.50-0.54 (Zen 4 VM, microbench_attention.py; benchmarks/NOTES.md, twenty-second session).
// Every line of a row of `bytes` bytes at p, which may start mid-line (int8 rows: D + 2 bytes); Locality as
// __builtin_prefetch's: 3 prefetcht0, 2 prefetcht1.
template <int Locality>
inline void prefetch_row(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, Locality);
    __builtin_prefetch(c + bytes - 1, 0, Locality);  // the last line of an unaligned row
}

template <typename T, typename F>
inline void for_each_key(const AttentionArgs<T>& a, const int64_t* table, int64_t first, int64_t pos, F f,
                         const T* pf = nullptr, const T* pv = nullptr) {
    const int bs = a.block_size;
    const int64_t row_bytes = a.row * (int64_t)sizeof(T);  // int8 rows (D + 2 bytes) may straddle a line more
    const bool prefetch = a.prefetch && pf != nullptr;
    for (int64_t j = first; j <= pos;) {
        const int64_t b = j / bs;
        const int64_t count = std::min<int64_t>(bs - j % bs, pos + 1 - j);
        int64_t off = (table[b] * bs + j % bs) * a.stride;
        for (int64_t i = j - first, k = j; i < j - first + count; ++i, ++k, off += a.stride) {
            if (prefetch && k + PREFETCH_KEYS <= pos) {
                const int64_t ahead = k + PREFETCH_KEYS;
                prefetch_row<3>(pf + (table[ahead / bs] * bs + ahead % bs) * a.stride, row_bytes);
            }
            if (prefetch && pv != nullptr) prefetch_row<2>(pv + off, row_bytes);  // L2: a row's values outgrow L1
            f(i, off);
        }
        j += count;
    }
}

// What one (query row, query head) pair attends: its request's block table, keys first..pos (n of
// them), its query vector, the KV head's offset within a token, and its output row.
struct HeadView {
    const int64_t* table;
    int64_t pos, first, n;
    const float* q;
    int64_t kv_off;
    float* out;
};

template <typename T>
inline HeadView head_view(const AttentionArgs<T>& a, int t, int head) {
    const int64_t pos = a.row_pos[t];
    const int64_t first = a.window > 0 && pos + 1 > a.window ? pos + 1 - a.window : 0;
    return {a.block_tables + a.row_seq[t] * a.table_stride, pos, first, pos + 1 - first,
            a.q + t * a.ldq + (int64_t)head * a.D, (int64_t)(head / a.G) * a.row,
            a.out + ((int64_t)t * a.H + head) * a.D};
}

}  // namespace
