"""compressed-tensors (llm-compressor) checkpoints, as the `compressed-tensors` package writes them:
- pack-quantized: weight_packed int32 [N, K * bits / 32] (codes q + 2^(bits-1), element i at bits
  [i*bits, (i+1)*bits) of the row's bit stream), weight_scale [N, G] / [N, 1], weight_shape [2], and when
  asymmetric weight_zero_point int32 [ceil(N * bits / 32), G] (packed the same way, along N);
- int-quantized / naive-quantized: weight int8 [N, K] (signed codes), weight_scale, weight_zero_point int8;
- float-quantized: FP8 weights (pagellm.quant.hf_formats.fp8).
w = scale * (q - zero_point); weight_g_idx (actorder) orders the columns as GPTQ's g_idx does. Quantized
input activations (W8A8) are not emulated: activations stay float32."""

from __future__ import annotations

import torch

from pagellm.quant.formats import PackedWeight
from pagellm.quant.hf_formats import fp8
from pagellm.quant.hf_formats.blocks import (
    FLOATS,
    ErrorFn,
    PartInfo,
    check_groups,
    column_groups,
    int_blocks,
    shape_of,
    unpack_int32,
)
from pagellm.quant.hf_formats.quant_config import HFQuantConfig, WeightArgs

PARTS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
         "input_scale", "input_zero_point")


def is_quantized(parts: PartInfo) -> bool:
    return "weight_packed" in parts or ("weight" in parts and "weight_scale" in parts)


def _packed_zero_point(args: WeightArgs) -> bool:
    return args.format == "pack-quantized" and not args.symmetric and args.strategy in ("group", "channel")


def check_shapes(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, parts: PartInfo, n: int, k: int) -> int:
    if args.type == "float":
        fp8.check_shapes(err, qc, args, parts, n, k)
        return 1
    groups = check_groups(err, "weight_scale", k, args.group_size)
    scale_shapes = {"group": [(n, groups)], "channel": [(n, 1)], "tensor": [(), (1,), (1, 1)]}[args.strategy]
    why = f"strategy {args.strategy}" + (f", group_size {args.group_size}" if args.strategy == "group" else "")
    shape_of(err, parts, "weight_scale", scale_shapes, f"{why}, out_features {n}", FLOATS)
    if args.format == "pack-quantized":
        shape_of(err, parts, "weight_packed", (n, k * args.bits // 32),
                 f"{args.bits}-bit codes of out_features {n} x in_features {k}", ("I32",))
        shape_of(err, parts, "weight_shape", (2,), "[out_features, in_features]", ("I64", "I32"))
    else:
        shape_of(err, parts, "weight", (n, k), f"out_features {n} x in_features {k}", ("I8",))
    if not args.symmetric:
        if _packed_zero_point(args):
            rows = -(-n * args.bits // 32)
            shape_of(err, parts, "weight_zero_point", (rows, scale_shapes[0][1]),
                     f"{args.bits}-bit zero points packed along out_features {n}", ("I32",))
        else:
            shape_of(err, parts, "weight_zero_point", [tuple(parts["weight_scale"][1])], "like weight_scale", ("I8",))
    if "weight_g_idx" in parts:
        shape_of(err, parts, "weight_g_idx", (k,), f"one group index per input column, in_features {k}",
                 ("I32", "I64"))
    return groups


def to_packed(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, tensors: dict[str, torch.Tensor], n: int,
              k: int, parts: PartInfo) -> PackedWeight:
    if args.type == "float":  # (fp8.to_packed checks its own shapes)
        return fp8.to_packed(err, qc, args, tensors, n, k, parts)
    groups = check_shapes(err, qc, args, parts, n, k)
    offset, top = 1 << (args.bits - 1), (1 << args.bits) - 1
    if args.format == "pack-quantized":
        shape = [int(v) for v in tensors["weight_shape"].tolist()]
        if shape != [n, k]:
            raise err("weight_shape", f"holds {shape}, expected [{n}, {k}]")
        codes = unpack_int32(tensors["weight_packed"], args.bits, dim=1)  # already offset: unsigned
    else:
        q = tensors["weight"].to(torch.int16)
        if int(q.min()) < -offset or int(q.max()) > offset - 1:
            raise err("weight", f"codes must lie in [{-offset}, {offset - 1}] for {args.bits}-bit weights")
        codes = (q + offset).to(torch.uint8)
    scale = tensors["weight_scale"].float().reshape(-1, groups if args.strategy == "group" else 1)
    if scale.shape[0] == 1:
        scale = scale.expand(n, 1)
    if args.symmetric:
        zero = torch.full(scale.shape, offset, dtype=torch.int16)
    elif _packed_zero_point(args):
        zero = unpack_int32(tensors["weight_zero_point"], args.bits, dim=0)[:n].to(torch.int16)
    else:
        zero = tensors["weight_zero_point"].to(torch.int16).reshape(-1, scale.shape[1]).expand(n, -1) + offset
    if int(zero.min()) < 0 or int(zero.max()) > top:
        raise err("weight_zero_point", f"zero points must lie in [{-offset}, {offset - 1}]")
    perm, block_group = column_groups(err, k, args.group_size, tensors.get("weight_g_idx"), groups, "weight_g_idx")
    return int_blocks(codes, scale, zero, args.bits, perm, block_group)
