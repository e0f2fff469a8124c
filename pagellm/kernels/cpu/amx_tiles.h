// What the AMX kernels share (quant_linear_amx.cpp, quant_linear_int8_tiles.cpp, prefill_attention_amx.h): the
// tile configuration that _tile_loadconfig reads (palette 1: up to 8 tiles of up to 16 rows x 64 bytes), the
// configuration of all 8 tiles at full size, and 64-byte alignment for the buffers tiles load from (a tile row
// split across two cache lines costs every load twice).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace {

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if defined(__AMX_TILE__)
inline void configure_full_tiles() {  // this thread's 8 tiles, each 16 rows x 64 bytes
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}
#endif

template <typename T>
inline T* aligned64(T* p) {  // the first 64-byte boundary at or after p
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

}  // namespace
