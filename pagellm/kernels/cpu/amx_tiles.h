// What the AMX kernels share (quant_linear_amx.cpp, quant_linear_int8_tiles.cpp): the tile configuration that
// _tile_loadconfig reads (palette 1: up to 8 tiles of up to 16 rows x 64 bytes), and 64-byte alignment for the
// buffers tiles load from (a tile row split across two cache lines costs every load twice).
#pragma once

#include <cstdint>

namespace {

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

template <typename T>
inline T* aligned64(T* p) {  // the first 64-byte boundary at or after p
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

}  // namespace
