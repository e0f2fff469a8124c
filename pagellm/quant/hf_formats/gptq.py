"""GPTQ (AutoGPTQ / GPTQModel / optimum layout): qweight int32 [K / pack, N] (pack = 32 / bits codes per
word along K), qzeros int32 [G, N / pack] (along N), scales [G, N], optional g_idx int32 [K] (the group of
each input column; act-order when not sorted). w = scale * (q - zero); the v1 checkpoint_format ("gptq")
stores zero - 1, gptq_v2 the zero itself."""

from __future__ import annotations

import torch

from pagellm.quant.formats import PackedWeight
from pagellm.quant.hf_formats.blocks import (
    ErrorFn,
    PartInfo,
    check_groups,
    column_groups,
    int_blocks,
    shape_of,
    unpack_int32,
)
from pagellm.quant.hf_formats.quant_config import HFQuantConfig, WeightArgs

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def is_quantized(parts: PartInfo) -> bool:
    return "qweight" in parts


def check_shapes(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, parts: PartInfo, n: int, k: int) -> int:
    """Returns the number of groups."""
    pack = 32 // args.bits
    groups = check_groups(err, "scales", k, args.group_size)
    gs = f"group_size {args.group_size}" if args.group_size > 0 else "per-channel"
    shape_of(err, parts, "qweight", (k // pack, n), f"{args.bits}-bit codes, {pack} per int32, for in_features {k} "
             f"x out_features {n}", ("I32",))
    shape_of(err, parts, "scales", (groups, n), f"{gs}: {groups} groups x out_features {n}", ("F16", "BF16", "F32"))
    shape_of(err, parts, "qzeros", (groups, n // pack), f"{gs}: {groups} groups x out_features {n} / {pack}", ("I32",))
    if "g_idx" in parts:
        shape_of(err, parts, "g_idx", (k,), f"one group index per input column, in_features {k}", ("I32", "I64"))
    elif qc.desc_act:
        raise err("g_idx", f"tensor is missing (desc_act needs one group index per input column, [{k}])")
    if k % pack or n % pack:
        raise err("qweight", f"in_features {k} and out_features {n} must be multiples of {pack}")
    return groups


def to_packed(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, tensors: dict[str, torch.Tensor], n: int,
              k: int, parts: PartInfo) -> PackedWeight:
    groups = check_shapes(err, qc, args, parts, n, k)
    codes = unpack_int32(tensors["qweight"], args.bits, dim=0).t()  # [N, K]
    zeros = unpack_int32(tensors["qzeros"], args.bits, dim=1).t().to(torch.int16)  # [N, G]
    if qc.gptq_v1_zeros:
        zeros = zeros + 1
    perm, block_group = column_groups(err, k, args.group_size, tensors.get("g_idx"), groups)
    return int_blocks(codes, tensors["scales"].t(), zeros, args.bits, perm, block_group)
