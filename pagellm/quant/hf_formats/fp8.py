"""FP8 weights (quant_method "fp8", vLLM / llm-compressor style; also compressed-tensors float-quantized):
weight float8_e4m3fn [N, K] and a scale: per tensor (one value), per output channel ([N] or [N, 1]), or per
2-D block (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)], multiplied in despite its name). w = f8 * scale.
quant_method "fp8" is W8A8: activation_scheme dynamic rounds each token's inputs to e4m3 by its own absmax
(per token), static by the checkpoint's input_scale (pagellm.quant.linear_method.fp8_activations);
compressed-tensors' FP8 stays weight-only (its input_activations are not emulated)."""

from __future__ import annotations

import math

import torch

from pagellm.quant.formats import PackedWeight
from pagellm.quant.hf_formats.blocks import (
    FLOATS,
    ErrorFn,
    PartInfo,
    blockwise_scale,
    check_groups,
    fp8_blocks,
    per_channel_scale,
    shape_of,
)
from pagellm.quant.hf_formats.quant_config import HFQuantConfig, WeightArgs

PARTS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")


def is_quantized(parts: PartInfo) -> bool:
    return parts.get("weight", ("", ()))[0].startswith("F8")


def scale_part(parts: PartInfo) -> str:
    return "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"


def check_shapes(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, parts: PartInfo, n: int, k: int) -> None:
    check_groups(err, "weight", k, -1)
    shape_of(err, parts, "weight", (n, k), f"out_features {n} x in_features {k}", ("F8_E4M3",))
    part = scale_part(parts)
    if args.block is not None:
        bn, bk = args.block
        want = (math.ceil(n / bn), math.ceil(k / bk))
        shape_of(err, parts, part, want, f"one scale per {bn}x{bk} block of [{n}, {k}]", FLOATS)
    else:
        shape_of(err, parts, part, [(), (1,), (1, 1), (n,), (n, 1)],
                 f"per tensor or per output channel, out_features {n}", FLOATS)
    if "input_scale" in parts and math.prod(parts["input_scale"][1]) != 1:
        raise err("input_scale", f"shape {list(parts['input_scale'][1])}: expected one value (per-tensor static)")
    if qc.method == "fp8" and qc.static_input_scale and "input_scale" not in parts:
        # (else this layer ran dynamic scales, and fused shards that disagreed fell back to float weights)
        raise err("input_scale", "missing: activation_scheme static stores every layer's input scale")


def to_packed(err: ErrorFn, qc: HFQuantConfig, args: WeightArgs, tensors: dict[str, torch.Tensor], n: int,
              k: int, parts: PartInfo) -> PackedWeight:
    check_shapes(err, qc, args, parts, n, k)
    scale = tensors[scale_part(parts)]
    d = blockwise_scale(scale, n, k, args.block) if args.block else per_channel_scale(scale, n, k)
    pw = fp8_blocks(tensors["weight"], d)
    if qc.method == "fp8":  # W8A8: the inputs are fp8 too
        pw.act_fp8 = True
        if "input_scale" in tensors and qc.static_input_scale:
            pw.act_scale = float(tensors["input_scale"].float().reshape(-1)[0])
            if not math.isfinite(pw.act_scale) or pw.act_scale <= 0:  # 0: inputs divide by it; NaN: every logit
                raise err("input_scale", f"{pw.act_scale}: expected a finite positive scale")
    return pw
