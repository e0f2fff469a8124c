// Which hand-written kernel paths this build of the library contains, from the macros the compiler defines
// for the -march it was given (build.py compiles every .cpp with the same flags, so these are the other
// files' macros too). build.py's PATHS names the bits; none set: the portable (plain C++) build. What else
// the compiler may use when it vectorizes plain loops (AVX-512, ...) is build_info()["isa"], not a path.

// bit 0: the AVX2 + FMA SIMD kernels (simd.h, quant_linear.cpp, gemm.cpp, elementwise.cpp, attention.cpp)
// bit 1: float16 KV cache reads and writes (F16C; attention.cpp needs AVX2 + FMA with it)
// bit 2: int8 dot products in one instruction (vpdpbusd: AVX-VNNI or AVX-512 VNNI + VL) for the int8-activation
//        products of quant_linear.cpp
// bit 3: bf16 flash attention for prefill chunks (AVX-512 F/BW/BF16 with the AVX2 path; prefill_attention.cpp)
// bit 4: int8-activation products four q4 blocks per 512-bit vpdpbusd, and their two-plane (~15-bit) mode
//        (AVX-512 F/BW/VNNI; quant_linear_vnni.h)
// bit 5: many-row q4_1 and q8_0 products on AMX bf16 tiles, blocks dequantized into the tiles (AMX-TILE/BF16 with
//        AVX-512 BF16; quant_linear_amx.cpp), usable once the OS grants the tile state (pagellm_amx_ready)
// bit 6: int8-activation products over blocks in tile order (AVX-512 F/BW/VNNI; quant_linear_int8_tiles.cpp),
//        whose many-row half runs on AMX-INT8 tiles where the build has them (pagellm_int8_tiles_amx_ready)
// bit 7: bit 3's prefill attention with its products on AMX bf16 tiles (AMX-TILE/BF16; prefill_attention_amx.h),
//        usable once the OS grants the tile state
// bit 8: bit 5's products on AVX-512 BF16 vdpbf16ps instead of tiles (AVX-512 F/BW/BF16; quant_linear_bf16dp.cpp)
// bit 9: decode attention over int8 KV rows with integer dot products (AVX-512 F/BW/VNNI with bits 0-1;
//        attention_int8_vnni.h)
// bit 10: one-plane int8 products of prompt rows over q4_1 blocks in the int8 tile order on AVX2 vpmaddubsw, where
//        bit 6 is not built (quant_linear_int8_avx2.cpp)
extern "C" int pagellm_build_features() {
    int bits = 0;
#if defined(__AVX2__) && defined(__FMA__)
    bits |= 1 << 0;
#if defined(__F16C__)
    bits |= 1 << 1;
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    bits |= 1 << 2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
    bits |= 1 << 3;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    bits |= 1 << 4;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    bits |= 1 << 5;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    bits |= 1 << 6;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__)
    bits |= 1 << 7;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    bits |= 1 << 8;
#endif
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    bits |= 1 << 9;
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
    bits |= 1 << 10;
#endif
#endif
    return bits;
}
