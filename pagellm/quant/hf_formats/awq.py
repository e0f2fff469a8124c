"""AWQ, GEMM version (AutoAWQ): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], eight 4-bit codes per
word along N in AutoAWQ's order (nibble i holds column 8j + AWQ_ORDER[i]), scales [G, N].
w = scale * (q - zero); no zero-point off-by-one. zero_point false without qzeros: zero = 8 (the
symmetric midpoint)."""

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

PARTS = ("qweight", "qzeros", "scales")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def is_quantized(parts: PartInfo) -> bool:
    return "qweight" in parts


def check_shapes(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, parts: PartInfo, n: int, k: int) -> int:
    groups = check_groups(err, "scales", k, args.group_size)
    gs = f"group_size {args.group_size}" if args.group_size > 0 else "per-channel"
    if n % 8:
        raise err("qweight", f"out_features {n} must be a multiple of 8")
    shape_of(err, parts, "qweight", (k, n // 8), f"in_features {k} x out_features {n} / 8 words", ("I32",))
    shape_of(err, parts, "scales", (groups, n), f"{gs}: {groups} groups x out_features {n}", ("F16", "BF16", "F32"))
    if "qzeros" in parts or not args.symmetric:
        shape_of(err, parts, "qzeros", (groups, n // 8), f"{gs}: {groups} groups x out_features {n} / 8", ("I32",))
    return groups


def to_packed(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, tensors: dict[str, torch.Tensor], n: int,
              k: int, parts: PartInfo) -> PackedWeight:
    groups = check_shapes(err, qc, args, parts, n, k)
    codes = unpack_int32(tensors["qweight"], 4, dim=1, order=AWQ_ORDER).t()  # [N, K]
    if "qzeros" in tensors:
        zeros = unpack_int32(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER).t()  # [N, G]
    else:
        zeros = torch.full((n, groups), 8, dtype=torch.uint8)
    perm, block_group = column_groups(err, k, args.group_size, None, groups)
    return int_blocks(codes, tensors["scales"].t(), zeros, 4, perm, block_group)
