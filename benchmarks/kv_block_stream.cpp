// How fast two threads read a paged KV cache's blocks when the blocks lie in random order, as decode attention
// reads them: each block of TOKENS tokens x 384 bytes (SmolLM2's K row: 3 KV heads x 64 float16) read front to
// back and summed, the block two ahead prefetched, GB/s of blocks read. It bounds what the decode attention
// kernel can stream on a machine. The figures in benchmarks/NOTES.md (seventeenth session) come from:
//
//     g++ -O2 -march=native -fopenmp benchmarks/kv_block_stream.cpp -o /tmp/kv_block_stream
//     for t in 16 32 64 128; do /tmp/kv_block_stream $t; done
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

int main(int argc, char** argv) {
    const int64_t tokens = argc > 1 ? std::atoi(argv[1]) : 16, bytes = tokens * 384;
    const int64_t blocks = (int64_t)1228800000 / bytes;  // ~1.2 GB: far past the caches
    std::vector<uint8_t> mem((size_t)(blocks * bytes + 64), 1);
    const uint8_t* base = reinterpret_cast<const uint8_t*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t(63));
    std::vector<int64_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(1));
    for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        int64_t total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
        {
            __m256i acc = _mm256_setzero_si256();
#pragma omp for schedule(static)
            for (int64_t i = 0; i < blocks; ++i) {
                if (i + 2 < blocks)
                    for (int64_t c = 0; c < bytes; c += 64)
                        _mm_prefetch(reinterpret_cast<const char*>(base + order[i + 2] * bytes + c), _MM_HINT_T0);
                const uint8_t* b = base + order[i] * bytes;
                for (int64_t c = 0; c < bytes; c += 32)
                    acc = _mm256_add_epi32(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + c)));
            }
            alignas(32) int32_t lanes[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
            for (int32_t v : lanes) total += v;
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("%ld-token blocks: %.1f GB/s (%ld)\n", (long)tokens, (double)blocks * bytes / s / 1e9, (long)total);
    }
    return 0;
}
