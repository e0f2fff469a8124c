"""Many-row products over q4_1 and q8_0 blocks on AMX bf16 tiles (cpu/quant_linear_amx.cpp): the blocks
repacked once into the order a tile is filled in, then dequantized into the tiles at every product. The
arithmetic is the bf16 path's (the same bf16 weights and x, float32 sums, bf16 or float32 out), reading 0.8
(q4_1) or 1.1 (q8_0) bytes per weight instead of the bf16 copy's 2: what decode steps of more rows than the
few-row kernels take wait on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagellm.kernels.build import cpu_kernels, library
from pagellm.quant.formats import PackedWeight

TILE_COLUMNS, BLOCK = 16, 32
STRIP = 2 * TILE_COLUMNS  # columns per work item (two B tiles)
KINDS = {"q4_1": 0, "q8_0": 1}  # the kernel's kind codes


@dataclass
class TiledBlocks:
    """A q4_1 or q8_0 weight's blocks repacked once for a tile kernel (the layout: each subclass)."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)


class AmxBlocks(TiledBlocks):
    """A q4_1 or q8_0 weight in tile order, per strip of 32 columns, block of 32 inputs and group of 16 columns:
    codes [N/32, K/32, 2, 16, B] for tile rows r = 0..15, lane L being column L // 2 of the group and input
    2 r + L % 2 of the block (q4_1, B = 16 bytes: byte i holds lane i low, lane 16 + i high; q8_0, B = 32: lane
    L's code at L); d (and q4_1's m) float32 [N/32, K/32, 2, 16]."""


@functools.cache
def amx_ready() -> bool:
    """Whether the kernels were built with the AMX path (build feature bit 5, "amx-bf16-q4") and Linux granted
    this process the tile state (pagellm_amx_ready answers 0 in builds without it)."""
    return cpu_kernels() is not None and bool(library().pagellm_amx_ready())


@functools.cache
def bf16dp_ready() -> bool:
    """Whether the kernels were built with the vdpbf16ps twin of the tile products (build feature bit 8,
    "avx512-bf16-q4": AVX-512 BF16), for CPUs with bf16 dot products and no AMX."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 8 & 1)


def packs(w: PackedWeight) -> bool:
    """Whether pack takes this weight: q4_1 or q8_0 blocks in natural column order, N a multiple of 32."""
    return w.kind in KINDS and w.perm is None and w.out_features % STRIP == 0 and w.in_features % BLOCK == 0


def block_codes(w: PackedWeight) -> torch.Tensor:
    """A q4_1 or q8_0 weight's codes [N, K/32, 32] in input order (a q4_1 byte j holds inputs j and j + 16)."""
    n, nb = w.out_features, w.in_features // BLOCK
    if w.kind == "q4_1":
        q = w.qs.reshape(n, nb, BLOCK // 2)
        return torch.cat([q & 15, q >> 4], dim=2)
    return w.qs.reshape(n, nb, BLOCK)


def pack(w: PackedWeight) -> AmxBlocks:
    if not packs(w):
        raise ValueError(f"amx.pack: a {w.kind} weight [{w.out_features}, {w.in_features}] has no tile order")
    n, k = w.out_features, w.in_features
    g, nb = n // TILE_COLUMNS, k // BLOCK
    codes = block_codes(w)
    lanes = codes.reshape(g, TILE_COLUMNS, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(g, nb, 16, 32)
    if w.kind == "q4_1":
        lanes = lanes[..., :16] | (lanes[..., 16:] << 4)
    tile = lanes.reshape(g // 2, 2, nb, 16, -1).transpose(1, 2).contiguous()

    def per_group(v: torch.Tensor | None) -> torch.Tensor | None:  # [strip, block, group, 16 columns]
        return None if v is None else v.reshape(g // 2, 2, TILE_COLUMNS, nb).permute(0, 3, 1, 2).contiguous()

    return AmxBlocks(w.kind, tile, per_group(w.d), per_group(w.m), n, k)


def linear(x: torch.Tensor, w: AmxBlocks, out_dtype: torch.dtype = torch.float32, tiles: bool = True) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 (rows may be strided) @ W^T -> [M, N] in out_dtype (float32 or bfloat16),
    x rounded to bf16 and float32 sums as the oneDNN bf16 path; on AMX tiles, or (tiles=False) on AVX-512 BF16
    vdpbf16ps over the same blocks."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"amx.linear: x has {k} columns, the weight {w.in_features}")
    y = torch.empty(m, w.out_features, dtype=out_dtype)
    kernel = library().pagellm_packed_linear_amx if tiles else library().pagellm_packed_linear_bf16dp
    rc = kernel(
        KINDS[w.kind], x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), m, k, w.codes.data_ptr(),
        w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), w.out_features, y.data_ptr(), y.stride(0),
        int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise RuntimeError("amx.linear: this build or process has no " + ("AMX tiles" if tiles else "AVX-512 BF16"))
    return y
