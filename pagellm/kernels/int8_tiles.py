"""Few-row int8-activation products over q4_1 and q8_0 blocks in tile order (cpu/quant_linear_int8_tiles.cpp):
one layout that AVX-512 VNNI and AMX-INT8 both read, with exact integer sums per block and the same float work
after them, so a row's result is the same whatever the number of rows in the call and whichever unit ran it.
That is what lets a speculative verification step (a request's token and its drafts: several rows) run on the
tiles at nearly the cost of one row and still give exactly the tokens one-row decode steps give."""

from __future__ import annotations

import functools

import torch

from pagellm.kernels.amx import TiledBlocks, block_codes
from pagellm.kernels.build import cpu_kernels, library
from pagellm.quant.formats import PackedWeight

COLUMNS, BLOCK = 16, 32
KINDS = {"q4_1": 0, "q8_0": 1}  # the kernel's kind codes
METHODS = {"auto": 0, "vnni": 1, "tiles": 2}


class Int8Tiles(TiledBlocks):
    """codes uint8 [N/16, K/32, R, 64]: per strip of 16 columns and block of 32 inputs, the block as an AMX B tile
    in VNNI order (row j: inputs 4j..4j+3, column c at bytes 4c..4c+3); q8_0: R = 8, codes + 128; q4_1: R = 4,
    row j's code in the low nibble and row j + 4's in the high one. d (q4_1's m) float32 [N/16, K/32, 16]."""


@functools.cache
def available() -> bool:
    """Whether the loaded kernels have the tile-order products (AVX-512 VNNI builds: kernel path bit 6)."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 6 & 1)


@functools.cache
def avx2_rows() -> bool:
    """Whether the loaded kernels have, instead, the AVX2 build's one-plane products over q4_1 blocks in tile order
    (kernel path bit 10, cpu/quant_linear_int8_avx2.cpp): prompt rows under --dtype auto on an AVX2 CPU."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 10 & 1)


@functools.cache
def amx_ready() -> bool:
    """Whether many-row calls run on AMX-INT8 tiles (the build has them and Linux granted the tile state)."""
    return available() and bool(library().pagellm_int8_tiles_amx_ready())


def packs(w: PackedWeight) -> bool:
    """Whether pack takes this weight: q4_1 or q8_0 blocks in natural column order, N a multiple of 16."""
    return w.kind in KINDS and w.perm is None and not w.act_fp8 and w.out_features % COLUMNS == 0 \
        and w.in_features % BLOCK == 0


def pack(w: PackedWeight) -> Int8Tiles:
    if not packs(w):
        raise ValueError(f"int8_tiles.pack: a {w.kind} weight [{w.out_features}, {w.in_features}] has no tile order")
    n, k = w.out_features, w.in_features
    s, nb = n // COLUMNS, k // BLOCK
    codes = block_codes(w)
    if w.kind == "q8_0":  # unsigned for vpdpbusd / tdpbsud: the kernel takes 128 x sum(x) back off
        codes = (codes.to(torch.int16) + 128).to(torch.uint8)
    # [strip, column, block, row j, byte i] -> [strip, block, row j, column, byte i]
    tiles = codes.reshape(s, COLUMNS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(s, nb, 8, 64)
    if w.kind == "q4_1":
        tiles = tiles[:, :, :4] | (tiles[:, :, 4:] << 4)

    def per_strip(v: torch.Tensor | None) -> torch.Tensor | None:  # [strip, block, 16 columns]
        return None if v is None else v.reshape(s, COLUMNS, nb).transpose(1, 2).contiguous()

    return Int8Tiles(w.kind, tiles.contiguous(), per_strip(w.d), per_strip(w.m), n, k)


def linear(x: torch.Tensor, w: Int8Tiles, planes: int, method: str = "auto", silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) @ W^T -> float32 [M, N], x rounded to int8 per 32 values (planes 1;
    2: plus its rounding error as a second plane). method: auto (VNNI for few rows, else the tiles where ready),
    vnni, or tiles; every method gives the same bits. silu_mul: x is an MLP's gate/up output [M, 2K] and the
    product is that of ops.silu_mul(x), bit for bit, without the [M, K] pass between."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if silu_mul:
        k //= 2
    if k != w.in_features or (silu_mul and x.shape[1] != 2 * k):
        raise ValueError(f"int8_tiles.linear: x has {x.shape[1]} columns, the weight {w.in_features}"
                         + (" (x2: gate and up)" if silu_mul else ""))
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    if m == 0:
        return y
    fn = library().pagellm_int8_tiles_linear_silu_mul if silu_mul else library().pagellm_int8_tiles_linear
    rc = fn(
        KINDS[w.kind], planes, METHODS[method], x.data_ptr(), x.stride(0), m, k, w.codes.data_ptr(), w.d.data_ptr(),
        None if w.m is None else w.m.data_ptr(), w.out_features, y.data_ptr(), y.stride(0), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"int8_tiles.linear: this build or process cannot run method {method!r} "
                           f"(planes {planes}, {m} rows)")
    return y
