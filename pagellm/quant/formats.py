"""Weight block formats (GGUF q4_1, q8_0, and the kinds other checkpoints map onto): plain data, below both
kernels/ and model/.

A `PackedWeight` holds the same numbers as the float32 weight the loader dequantizes (the kernels
rebuild each weight as d * q (+ m) in float32, the dequantizer's arithmetic), in 2.7-5.3x fewer bytes
(0.75-1.5 per weight).
Decode reads every weight once per token, so bytes are time: few-row matmuls use the packed form,
many-row ones (prefill) the float32 GEMM, which is compute-bound and faster there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

BLOCK = 32
PACKED_SUFFIX = ":packed"  # loader stream name of a weight's block form, after its float32 form
# Few-row products use the packed kernels; beyond this many rows the float32 GEMM is faster
# (benchmarks/NOTES.md has the measurement behind the number).
PACKED_MAX_ROWS = 20
# Bytes per 32-weight block in the file (q4_1: f16 scale, f16 min, 16 bytes of nibbles; q8_0: f16 scale,
# 32 int8 quants).
FORMATS = {"q4_1": 20, "q8_0": 34}
# Every kind a PackedWeight may hold, per 32-weight block along K (d, m: float32 [N, K/32]):
#   q4_1:     w = d * q + m, q uint8 nibbles 0..15 (qs uint8 [N, K/2], byte j: element j low, j + 16 high)
#   q8_0:     w = d * q,     q int8 (qs int8 [N, K])
#   q8_1:     w = d * q + m, q int8 (qs int8 [N, K]): 5..8-bit codes with a zero point or minimum
#   fp8_e4m3: w = d * f8(q), q the e4m3 bit pattern (qs uint8 [N, K]); d carries per-tensor, per-channel
#             or block scales, repeated per 32-block
#   q4_1_16, q8_0_16, q8_1_16: q4_1, q8_0, q8_1 with d (and m) per 16 weights (d, m: float32 [N, K/16]; same
#             qs layout): GGUF's K-quants with 16-weight scale groups (Q6_K, Q3_K, Q2_K;
#             pagellm/quant/gguf_blocks.py), and q8_1_16 the common kind of shards that differ (`unify`)
# GPTQ/AWQ/compressed-tensors 4-bit groups are q4_1 (d = s, m = -s * z), per-channel or symmetric 8-bit
# q8_0, asymmetric 8-bit q8_1. Which kinds the native kernels read is `pagellm.kernels.ops.kernel_reads`.
KINDS = ("q4_1", "q8_0", "q8_1", "fp8_e4m3", "q4_1_16", "q8_0_16", "q8_1_16")
NIBBLE_KINDS = ("q4_1", "q4_1_16")  # two 4-bit codes per byte
# Kinds each kind converts to exactly (PackedWeight.as_kind).
_WIDENINGS = {"q4_1": ("q8_1", "q4_1_16", "q8_1_16"), "q8_0": ("q8_1", "q8_0_16", "q8_1_16"), "q8_1": ("q8_1_16",),
              "q4_1_16": ("q8_1_16",), "q8_0_16": ("q8_1_16",)}


def group_size(kind: str) -> int:
    """Weights per scale (d, m) along K."""
    return 16 if kind.endswith("_16") else BLOCK


@dataclass
class PackedWeight:
    kind: str  # one of KINDS
    qs: torch.Tensor  # q4_1(_16): uint8 [N, K/2] (two weights per byte); q8_*: int8 [N, K]; fp8: uint8 [N, K]
    d: torch.Tensor  # float32 [N, K/group_size(kind)] scales
    m: torch.Tensor | None  # float32, d's shape: minimums (q4_1, q8_1, q4_1_16, q8_1_16)
    # Input-column order of the blocks (GPTQ act-order: columns sorted by group): y = x[:, perm] @ W_p^T.
    # None: the natural order.
    perm: torch.Tensor | None = None
    # W8A8 FP8 checkpoints: inputs rounded to e4m3 before the product, per token (act_scale None: the
    # row's absmax / 448, "dynamic") or with the checkpoint's static input scale (`fp8_activations`).
    act_fp8: bool = False
    act_scale: float | None = None

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.kind in NIBBLE_KINDS else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.perm) if t is not None)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """Output rows in a new order (Q/K un-permutation acts on output rows, which blocks never span)."""
        return replace(self, qs=self.qs[index].contiguous(), d=self.d[index].contiguous(),
                       m=None if self.m is None else self.m[index].contiguous())

    def columns(self, start: int, end: int) -> PackedWeight:
        """Input columns start:end (a tensor-parallel row split), cut at 32-weight block boundaries: the
        blocks are copied, not requantized."""
        k = self.in_features
        if start % BLOCK or (end % BLOCK and end != k):
            raise ValueError(f"a {self.kind} matrix splits only at {BLOCK}-column block boundaries; columns "
                             f"{start}:{end} of {k} do not")
        if self.perm is not None:
            raise ValueError("a GPTQ act-order (desc_act) matrix keeps its columns in group order and cannot be "
                             "split across tensor-parallel ranks by input column")
        if self.act_fp8 and self.act_scale is None:
            # each rank would scale its part of a token's inputs by that part's own absmax: other roundings, other
            # outputs than one rank (a probe saw a different greedy token at TP=2 on a tiny model)
            raise ValueError("a W8A8 FP8 matrix with dynamic (per-token) input scales cannot be split across "
                             "tensor-parallel ranks by input column; use one rank, a checkpoint with a static "
                             "input_scale, or --quantization none (weight-only)")
        g, per_byte = group_size(self.kind), 2 if self.kind in NIBBLE_KINDS else 1
        return replace(self, qs=self.qs[:, start // per_byte:end // per_byte].contiguous(),
                       d=self.d[:, start // g:end // g].contiguous(),
                       m=None if self.m is None else self.m[:, start // g:end // g].contiguous())

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight | None:
        """Stack along output rows (fused q/k/v, gate/up); None when the parts' formats differ."""
        if len({p.kind for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            return None
        perms = [p.perm for p in parts]
        if any(q is None for q in perms) != all(q is None for q in perms) or (
                perms[0] is not None and not all(torch.equal(perms[0], q) for q in perms)):
            return None  # one input order per fused layer
        if len({p.act_fp8 for p in parts}) != 1 or len({p.act_scale is None for p in parts}) != 1:
            return None  # one input rounding per fused layer
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        # static input scales of fused shards: the largest, so no shard's inputs clip (vLLM does the same)
        scale = None if parts[0].act_scale is None else max(p.act_scale for p in parts)
        return PackedWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m,
                            perms[0], parts[0].act_fp8, scale)

    def as_kind(self, kind: str) -> PackedWeight:
        """The same weights, exactly, in a kind that can hold them: nibbles as int8 codes, 32-weight scales
        repeated per 16, a missing minimum as 0 (d * q + 0 = d * q). Fused layers whose GGUF shards differ
        (Q4_K_M's Q4_K q/k beside a Q6_K v) meet in one kind this way (`unify`)."""
        if kind == self.kind:
            return self
        if kind not in _WIDENINGS.get(self.kind, ()):
            raise ValueError(f"a {self.kind} weight cannot be held exactly as {kind}")
        qs, d, m = self.qs, self.d, self.m
        if self.kind in NIBBLE_KINDS and kind not in NIBBLE_KINDS:
            q = qs.reshape(-1, BLOCK // 2)
            qs = torch.cat([q & 15, q >> 4], dim=1).to(torch.int8).reshape(self.out_features, -1)
        if group_size(kind) != group_size(self.kind):
            d = d.repeat_interleave(2, dim=1)
            m = None if m is None else m.repeat_interleave(2, dim=1)
        if m is None and kind in ("q8_1", "q4_1_16", "q8_1_16"):
            m = torch.zeros_like(d)
        return replace(self, kind=kind, qs=qs, d=d, m=m)

    @staticmethod
    def unify(parts: list[PackedWeight]) -> list[PackedWeight]:
        """The parts in their common kind (the first of q8_1, q4_1_16, q8_1_16 that holds them all), or
        unchanged when they share a kind or none holds them (fp8 beside integers: cat then refuses)."""
        kinds = {p.kind for p in parts}
        if len(kinds) == 1:
            return parts
        for common in ("q8_1", "q4_1_16", "q8_1_16"):
            if all(k == common or common in _WIDENINGS.get(k, ()) for k in kinds):
                return [p.as_kind(common) for p in parts]
        return parts

    def dequantize(self, natural_order: bool = True) -> torch.Tensor:
        """[N, K] float32, the same values the GGUF loader produces (for tests). natural_order=False keeps
        the blocks' column order (perm), the one a kernel multiplies x[:, perm] with."""
        w = self._dequantize_blocks()
        if self.perm is not None and natural_order:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def _dequantize_blocks(self) -> torch.Tensor:
        n = self.out_features
        if self.kind in NIBBLE_KINDS:
            q = self.qs.reshape(-1, BLOCK // 2)
            q = torch.cat([q & 15, q >> 4], dim=1).float()
        elif self.kind == "fp8_e4m3":
            q = self.qs.view(torch.float8_e4m3fn).float()
        else:
            q = self.qs.float()
        w = q.reshape(-1, group_size(self.kind)) * self.d.reshape(-1, 1)
        if self.m is not None:
            w = w + self.m.reshape(-1, 1)
        return w.reshape(n, -1)


def pack_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """raw: the tensor's bytes as stored in the GGUF file; shape: [N, K] (out, in)."""
    n, k = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, FORMATS[kind])
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "q8_0":
        qs = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(n, k))
        return PackedWeight(kind, qs, d, None)
    m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(blocks[:, :, 4:].copy().reshape(n, k // 2))
    return PackedWeight(kind, qs, d, m)
