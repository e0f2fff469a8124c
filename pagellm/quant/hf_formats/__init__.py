"""Quantized Hugging Face checkpoints (GPTQ, AWQ, FP8, compressed-tensors) -> PackedWeight + float weight.

`quant_config` reads the checkpoint's `quantization_config` (no torch); one module per format knows its
tensor names (`PARTS`), checks their shapes against the layer's [out_features, in_features] before any
weight is read (`check_shapes`, header data only) and turns them into blocks (`to_packed`). The loader
(model/loader/hf_loader.py) groups a module's tensors with `group_modules` and calls `load_module`.
"""

from __future__ import annotations

from pagellm.quant.hf_formats.quant_config import HFQuantConfig

__all__ = ["format_module", "group_modules", "partly_quantized"]


def format_module(method: str):
    """The module of one format (gptq, awq, fp8, compressed_tensors); imports torch."""
    from pagellm.quant.hf_formats import awq, compressed_tensors, fp8, gptq

    return {"gptq": gptq, "awq": awq, "fp8": fp8, "compressed-tensors": compressed_tensors}[method]


def group_modules(qc: HFQuantConfig, header: dict[str, tuple[str, tuple]]) -> dict[str, dict[str, str]]:
    """module prefix -> {part: tensor name} for every module stored quantized (name -> (dtype, shape) of all
    the checkpoint's tensors). Other tensors (biases, norms, float layers) are not in it."""
    fmt = format_module(qc.method)
    return {prefix: parts for prefix, parts in _parts(fmt, header).items()
            if fmt.is_quantized({p: header[n] for p, n in parts.items()})}


def partly_quantized(qc: HFQuantConfig, header: dict[str, tuple[str, tuple]]) -> dict[str, dict[str, str]]:
    """module prefix -> {part: tensor name} of every module that stores quantization parts (scales, zeros,
    input scales) without a quantized weight: its codes missing, or its weight in float. Such a module would
    otherwise load as a float one, its other parts then "having no place" in the model."""
    fmt = format_module(qc.method)
    return {prefix: parts for prefix, parts in _parts(fmt, header).items()
            if set(parts) - {"weight"} and not fmt.is_quantized({p: header[n] for p, n in parts.items()})}


def _parts(fmt, header: dict[str, tuple[str, tuple]]) -> dict[str, dict[str, str]]:
    by_module: dict[str, dict[str, str]] = {}
    for name in header:
        prefix, _, part = name.rpartition(".")
        if part in fmt.PARTS:
            by_module.setdefault(prefix, {})[part] = name
    return by_module
