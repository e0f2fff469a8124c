"""Group-wise integer codes and round-to-nearest: w ~ (q - z) * s per group of input columns.

The scales are rounded up to float16 before the codes are chosen, since the checkpoint formats store them
in float16: the codes then fit the stored scale, and |w - w_q| <= s / 2 holds for the stored values.
Zero points are kept in [1, 2^bits - 1] (not 0): GPTQ's v1 format stores z - 1, and a stored -1 is not
representable; a group whose minimum is >= 0 gets z = 1 and a scale that still covers its maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupQuant:
    """Integer codes of one [N, K] matrix: w ~ (q[:, k] - zeros[:, g]) * scales[:, g] with g = g_idx[k]."""

    q: torch.Tensor  # int32 [N, K], 0 .. 2^bits - 1
    scales: torch.Tensor  # float32 [N, G], values representable in float16
    zeros: torch.Tensor  # int32 [N, G]
    g_idx: torch.Tensor  # int32 [K], the group of each input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q - self.zeros[:, g]).float() * self.scales[:, g]


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of w [N, group] -> (float32 [N, 1], int32 [N, 1])."""
    maxq = 2**bits - 1
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if sym:
        scale = torch.maximum(lo.abs(), hi) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
        scale = _fp16_up(torch.where(scale > 0, scale, torch.ones_like(scale)))
        zero = torch.round(-lo / scale)
        low = zero < 1  # min >= 0: z = 1, the top code then maps to (maxq - 1) * s
        scale = torch.where(low, _fp16_up(torch.clamp(hi, min=1e-8) / (maxq - 1)), scale)
        high = zero > maxq  # max < 0: z = maxq, code 0 maps to -maxq * s
        scale = torch.where(high, _fp16_up(-lo / maxq), scale)
        zero = torch.where(low, 1, torch.where(high, maxq, zero))
    scale = _fp16_up(torch.where(scale > 0, scale, torch.ones_like(scale)))
    return scale, zero.to(torch.int32)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """The nearest codes of w under (scale, zero), clamped to the code range (int32, same shape as w)."""
    return (torch.round(w / scale) + zero).clamp_(0, 2**bits - 1).to(torch.int32)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> GroupQuant:
    """Round-to-nearest in groups of `group_size` consecutive input columns."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    g = w.float().reshape(n * (k // group_size), group_size)
    scale, zero = group_params(g, bits, sym)
    q = quantize_codes(g, scale, zero, bits).reshape(n, k)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    return GroupQuant(q, scale.reshape(n, -1), zero.reshape(n, -1), g_idx, bits)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """rtn_quantize(...).dequantize() without the codes (AWQ's search calls it many times)."""
    n, k = w.shape
    g = w.float().reshape(n * (k // group_size), group_size)
    scale, zero = group_params(g, bits, sym)
    return ((quantize_codes(g, scale, zero, bits) - zero) * scale).reshape(n, k)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 value >= x, as float32 (so a rounded scale still covers its range)."""
    h = x.to(torch.float16)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.float()
