"""GGUF block types -> PackedWeight kinds, exactly: `pack_gguf_tensor(...).dequantize()` holds the same
float32 values as `gguf.quants.dequantize` (and the loader) produce for the tensor, so a layer computes with
the file's blocks and frees its float copy. Plain data (numpy/torch), below kernels/ and model/.

Every scale below is formed in float32 as gguf-py forms it (f16 -> float32, times a small integer:
exact), and every weight is d * q (+ m) with d * q exact in float32 (at most 11 + 8 + 5 significant
bits), so the one rounding left is that of the minimum's addition, the same one gguf-py does:
  Q4_0 -> q4_1 (m = -8 d)          Q5_0 -> q8_0 (codes q - 16)      Q5_1 -> q8_1
  Q4_K -> q4_1 (per 32: d = d_super * sc, m = -(dmin * mn))         Q5_K -> q8_1 (the same scales)
  Q6_K -> q8_0_16 (per 16: d = d_super * sc, codes q - 32)
  Q3_K -> q4_1_16 (per 16: d = d_super * (sc - 32), codes q + 4, m = -4 d: d * (q + 4) - 4 d = d * q exactly)
  Q2_K -> q4_1_16 (per 16: d = d_super * (sc & 15), m = -(dmin * (sc >> 4)))
(A weight gguf-py computes as -0.0 comes out +0.0 here: equal as numbers, and in every product.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagellm.quant.formats import BLOCK, PackedWeight, pack_gguf_blocks

QK_K = 256  # weights per K-quant super-block
# Bytes per block in the file and weights per block, per GGUF type this module packs.
BLOCK_BYTES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
               "Q2_K": (84, QK_K), "Q3_K": (110, QK_K), "Q4_K": (144, QK_K), "Q5_K": (176, QK_K),
               "Q6_K": (210, QK_K)}


def _f32(b: np.ndarray) -> np.ndarray:
    """f16 values stored as 2 bytes each (last axis) -> float32 [..., count]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(codes: np.ndarray, n: int) -> torch.Tensor:
    """Codes 0..15 [n, K] (natural order) -> q4_1's bytes [n, K/2]: per 32, byte j = element j | element j+16 << 4."""
    c = codes.reshape(n, -1, 2, BLOCK // 2).astype(np.uint8)
    return torch.from_numpy((c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, -1))


def _five_bit(blocks: np.ndarray, qh: slice, qs: slice) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 [blocks, 32]: low nibbles from qs (element j: byte j low, j-16 high), bit 4 from
    the little-endian uint32 qh."""
    low = blocks[:, qs]
    low = np.concatenate([low & 15, low >> 4], axis=1)
    high = np.ascontiguousarray(blocks[:, qh]).view("<u4") >> np.arange(32, dtype=np.uint32)
    return low | ((high & 1).astype(np.uint8) << 4)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums -> two uint8 [blocks, 8] (gguf-py's layout)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _weight(kind: str, n: int, qs: torch.Tensor, d: np.ndarray, m: np.ndarray | None) -> PackedWeight:
    as_t = (lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(n, -1)))
    return PackedWeight(kind, qs, as_t(d), as_t(m))


def _int8(codes: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes.astype(np.int8)).reshape(n, -1))


def _q4_0(b: np.ndarray, n: int) -> PackedWeight:
    d = _f32(b[:, 0:2])
    return _weight("q4_1", n, torch.from_numpy(b[:, 2:].copy().reshape(n, -1)), d, d * np.float32(-8))


def _q5_0(b: np.ndarray, n: int) -> PackedWeight:
    codes = _five_bit(b, slice(2, 6), slice(6, 22)).astype(np.int16) - 16
    return _weight("q8_0", n, _int8(codes, n), _f32(b[:, 0:2]), None)


def _q5_1(b: np.ndarray, n: int) -> PackedWeight:
    return _weight("q8_1", n, _int8(_five_bit(b, slice(4, 8), slice(8, 24)), n), _f32(b[:, 0:2]), _f32(b[:, 2:4]))


def _k4_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-32 scale and minimum [blocks, 8]: d = d_super * sc, m = -(dmin * mn), in float32."""
    sc, mn = _k_scales(b[:, 4:16])
    return _f32(b[:, 0:2]) * sc.astype(np.float32), -(_f32(b[:, 2:4]) * mn.astype(np.float32))


def _q4_k(b: np.ndarray, n: int) -> PackedWeight:
    qs = b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    d, m = _k4_scales(b)
    return _weight("q4_1", n, _nibbles(qs & 15, n), d, m)


def _q5_k(b: np.ndarray, n: int) -> PackedWeight:
    ql = b[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = (ql & 15).reshape(-1, 8, 32) | ((qh & 1) << 4)
    d, m = _k4_scales(b)
    return _weight("q8_1", n, _int8(codes, n), d, m)


def _q6_k(b: np.ndarray, n: int) -> PackedWeight:
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ((ql & 15).reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    d = _f32(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return _weight("q8_0_16", n, _int8(codes, n), d, None)


def _q3_k(b: np.ndarray, n: int) -> PackedWeight:
    scales = b[:, 96:108]
    low = (scales[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    high = (scales[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((low & 15) | ((high & 3) << 4)).astype(np.int8) - np.int8(32)
    d = _f32(b[:, 108:110]) * sc.astype(np.float32)
    ql = (b[:, 32:96].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (b[:, 0:32].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    # q = ql - 4 (1 - qh) in -4..3, stored as q + 4 = ql + 4 qh in 0..7
    codes = ql.reshape(-1, 8, 32) + (qh.reshape(-1, 8, 32) << 2)
    return _weight("q4_1_16", n, _nibbles(codes, n), d, d * np.float32(-4))


def _q2_k(b: np.ndarray, n: int) -> PackedWeight:
    sc = b[:, 0:16]
    d = _f32(b[:, 80:82]) * (sc & 15).astype(np.float32)
    m = -(_f32(b[:, 82:84]) * (sc >> 4).astype(np.float32))
    codes = (b[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return _weight("q4_1_16", n, _nibbles(codes, n), d, m)


def _plain(kind: str) -> Callable[[np.ndarray, int], PackedWeight]:
    return lambda b, n: pack_gguf_blocks(kind, b, (n, b.size // n // BLOCK_BYTES[kind.upper()][0] * BLOCK))


PACKERS: dict[str, Callable[[np.ndarray, int], PackedWeight]] = {
    "Q4_0": _q4_0, "Q4_1": _plain("q4_1"), "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _plain("q8_0"),
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def pack_gguf_tensor(qtype: str, raw: np.ndarray, shape: tuple[int, int], name: str = "tensor") -> PackedWeight:
    """raw: a 2-D tensor's bytes as stored in the GGUF file, type `qtype` (a GGMLQuantizationType name);
    shape: [N, K] (out, in). The PackedWeight whose dequantize() equals gguf.quants.dequantize(raw)."""
    if qtype not in PACKERS:
        raise ValueError(f"{name}: GGUF type {qtype} has no packed form (packed: {', '.join(PACKERS)})")
    n, k = shape
    nbytes, per_block = BLOCK_BYTES[qtype]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % per_block:
        raise ValueError(f"{name}: {qtype} holds rows of whole {per_block}-weight blocks, not K = {k}")
    if raw.size != n * (k // per_block) * nbytes:
        raise ValueError(f"{name}: {qtype} [{n}, {k}] is {n * (k // per_block) * nbytes} bytes, the file holds "
                         f"{raw.size}")
    return PACKERS[qtype](raw.reshape(-1, nbytes), n)
