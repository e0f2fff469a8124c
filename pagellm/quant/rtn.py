"""Round-to-nearest weight-only quantization of a float matrix into a PackedWeight (`--quantization int8|int4`).

int8: symmetric, one scale per output channel: w ~ d * q, q in [-127, 127], d = max|w_row| / 127 (kind q8_0,
the row's d repeated in each 32-block). int4: asymmetric, one (scale, minimum) per group of G input columns:
w ~ d * q + m, q in [0, 15], d = (max - min) / 15, m = min (kind q4_1, each group's d and m repeated in its
32-blocks). Both keep |w - w_q| <= d / 2 per element (up to float32 rounding of d * q + m), and both are
row-local, so quantizing a fused q/k/v or gate/up matrix equals quantizing its shards.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.config import QUANT_GROUP_SIZES as GROUP_SIZES
from pagellm.quant.formats import BLOCK, PackedWeight

RTN_QUANTIZATIONS = ("int8", "int4")


def pack_int8_per_channel(w: torch.Tensor) -> PackedWeight:
    """w: float [N, K] -> kind q8_0 with d = the row's scale in every 32-block."""
    n, k = w.shape
    _check_blocks(w, BLOCK)
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0 is exact
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("q8_0", q.contiguous(), scale.expand(n, k // BLOCK).contiguous(), None)


def pack_int4_groups(w: torch.Tensor, group_size: int = 128) -> PackedWeight:
    """w: float [N, K] -> kind q4_1 with d = the group's scale, m = its minimum, in each of its 32-blocks."""
    n, k = w.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {list(GROUP_SIZES)}, got {group_size}")
    _check_blocks(w, group_size)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, w = m exactly
    q = torch.round((g - lo) / scale).clamp_(0, 15).to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    # q4_1 nibbles: byte j of a block holds element j (low) and element j + 16 (high)
    qs = (q[:, :, : BLOCK // 2] | (q[:, :, BLOCK // 2:] << 4)).reshape(n, k // 2)
    per_block = group_size // BLOCK
    d = scale.reshape(n, -1).repeat_interleave(per_block, dim=1)
    m = lo.reshape(n, -1).repeat_interleave(per_block, dim=1)
    return PackedWeight("q4_1", qs.contiguous(), d.contiguous(), m.contiguous())


def pack_rtn(w: torch.Tensor, quantization: str, group_size: int = 128) -> PackedWeight:
    if quantization == "int8":
        return pack_int8_per_channel(w)
    if quantization == "int4":
        return pack_int4_groups(w, group_size)
    raise ValueError(f"round-to-nearest quantization is one of {list(RTN_QUANTIZATIONS)}, got {quantization!r}")


def quantize_linear(layer: nn.Module, name: str, quantization: str, group_size: int = 128) -> None:
    """Quantizes a float Linear (pagellm.model.layers.linear) in place: its float copy takes the quantized
    values (what the layer computes with wherever it keeps one), then the blocks arrive like a GGUF's and
    the layer's method frees the float copy where a kernel reads them (GGUFBlocksLinearMethod)."""
    w = layer.weight_t.t()
    try:
        packed = pack_rtn(w, quantization, group_size)
    except ValueError as e:
        hint = " (pass --quantization-group-size 32 or 64)" if quantization == "int4" else ""
        shape = f"[{w.shape[0]}, {w.shape[1]}]"
        raise ValueError(f"--quantization {quantization}: layer {name} {shape}: {e}{hint}") from None
    layer.weight_t.data.copy_(packed.dequantize().t())
    # Any split into `shards` row ranges works: the layer re-stacks them in order (PackedWeight.cat).
    bounds = torch.linspace(0, packed.out_features, layer.shards + 1).round().long().tolist()
    for i in range(layer.shards):
        layer.add_packed_shard(i, packed.rows(torch.arange(bounds[i], bounds[i + 1])))


def _check_blocks(w: torch.Tensor, group: int) -> None:
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"the input dimension K = {w.shape[-1]} must be a multiple of {group}")
