// How fast the AMX bf16 tile unit runs the 2 x 2 loop of cpu/quant_linear_amx.cpp on its own (one thread,
// random bf16 data, no dequantizing): cycles per tdpbf16ps at the nominal clock given. Two loads of A and two
// of B per four products, C tiles stored after each pass of NB blocks, PASSES passes of 32 rows over each of
// STRIPS strips whose B tiles rotate through min(STRIPS, 8) buffers. The figures in benchmarks/NOTES.md
// (seventeenth session) come from:
//
//     g++ -O2 -march=native benchmarks/amx_tile_loop.cpp -o /tmp/amx_tile_loop
//     /tmp/amx_tile_loop 8 1 1 2.6      # 16 KiB of A and of B: every tile from L1
//     /tmp/amx_tile_loop 18 3 96 2.6    # K = 576 (18 blocks), 3 passes, 8 strips' B: from L2, as in a product
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s NB PASSES STRIPS GHZ\n", argv[0]);
        return 2;
    }
    const int nb = std::atoi(argv[1]), passes = std::atoi(argv[2]), strips = std::atoi(argv[3]);
    const double ghz = std::atof(argv[4]);
    if (syscall(SYS_arch_prctl, 0x1023, 18)) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        std::fprintf(stderr, "no AMX tile state granted\n");
        return 1;
    }
    // A: PASSES x 2 row tiles x NB blocks; B: 8 strips x NB blocks x 2 tiles; 512 bf16 per tile
    std::vector<uint16_t> a_raw((size_t)passes * nb * 1024 + 32), b_raw((size_t)8 * nb * 1024 + 32);
    for (auto* v : {&a_raw, &b_raw})
        for (auto& x : *v) x = (uint16_t)(0x3f40 + (std::rand() & 0x7f));  // bf16 values in [0.75, 1.5)
    const auto align = [](std::vector<uint16_t>& v) {
        return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
    };
    uint16_t *A = align(a_raw), *B = align(b_raw);
    alignas(64) float c[32 * 32];
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        long products = 0;
        for (int it = 0; it < 200; ++it)
            for (int s = 0; s < strips; ++s) {
                const uint16_t* tiles = B + (size_t)(s % (strips < 8 ? strips : 8)) * nb * 1024;
                for (int p = 0; p < passes; ++p) {
                    const uint16_t* a = A + (size_t)p * nb * 1024;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int b = 0; b < nb; ++b) {
                        _tile_loadd(4, a + b * 512, 64);
                        _tile_loadd(6, tiles + b * 1024, 64);
                        _tile_loadd(7, tiles + b * 1024 + 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, a + (size_t)(nb + b) * 512, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, 128);
                    _tile_stored(1, c + 16, 128);
                    _tile_stored(2, c + 512, 128);
                    _tile_stored(3, c + 528, 128);
                    products += 4 * nb;
                }
            }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("NB %d, %d passes, %d strips: %.1f cycles per tdpbf16ps (c[0] %g)\n", nb, passes, strips,
                    s * ghz * 1e9 / products, c[0]);
    }
    _tile_release();
    return 0;
}
