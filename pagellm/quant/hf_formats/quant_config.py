"""`quantization_config` (config.json) or `quantize_config.json` -> HFQuantConfig, and the check of an
explicit --quantization against it. Plain data: no torch, no tensors read."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from pagellm.model.loader.model_file_error import ModelFileError

METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
INT_BITS = (4, 8)  # the widths pagellm's blocks hold (q4_1; q8_0/q8_1)
_KEY = "quantization_config"
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True)
class WeightArgs:
    """How one module's weights are stored (compressed-tensors' QuantizationArgs, the subset used here)."""

    bits: int = 4
    type: str = "int"  # int | float
    symmetric: bool = True
    strategy: str = "group"  # group | channel | tensor | block
    group_size: int = -1  # -1: one group over all of K (per channel)
    block: tuple[int, int] | None = None  # 2-D weight blocks (FP8 block-wise)
    format: str = ""  # compressed-tensors: pack-quantized | int-quantized | naive-quantized | float-quantized


@dataclass
class HFQuantConfig:
    method: str  # one of METHODS
    path: str  # the file the config came from (errors name it)
    weights: WeightArgs = field(default_factory=WeightArgs)
    gptq_v1_zeros: bool = True  # GPTQ checkpoint_format "gptq" (v1): stored zeros are z - 1
    desc_act: bool = False
    static_input_scale: bool = False  # fp8 W8A8 with activation_scheme static (the inputs' scale is stored)
    ignore: tuple[str, ...] = ()
    # compressed-tensors config_groups: (targets, weights) in file order
    groups: list[tuple[tuple[str, ...], WeightArgs]] = field(default_factory=list)

    def scheme_for(self, module: str) -> WeightArgs | None:
        """The weight scheme of a Linear module (HF name without .weight); None: left in float."""
        if any(_matches(p, module, substring=self.method in ("gptq", "awq", "fp8")) for p in self.ignore):
            return None
        if self.method != "compressed-tensors":
            return self.weights
        for precise in (True, False):  # a module's own name or a regex wins over the class name
            for targets, args in self.groups:
                if any(_matches(t, module) if precise else t == "Linear" for t in targets):
                    return args
        return None


def _matches(pattern: str, module: str, substring: bool = False) -> bool:
    short = module.removeprefix("model.")
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None or re.match(pattern[3:], short) is not None
    if substring:  # transformers' modules_to_not_convert match any part of the name
        return pattern in module
    return pattern in (module, short)


def read_quant_config(model_dir: str, cfg: dict) -> HFQuantConfig | None:
    """The checkpoint's weight format, or None for a float checkpoint."""
    path = os.path.join(model_dir, "config.json")
    qc = cfg.get("quantization_config")
    if qc is None:
        legacy = os.path.join(model_dir, "quantize_config.json")  # AutoGPTQ before transformers knew it
        if not os.path.isfile(legacy):
            return None
        path = legacy
        try:
            with open(legacy, encoding="utf-8") as f:
                qc = json.load(f)
        except (UnicodeDecodeError, ValueError) as e:
            raise ModelFileError(legacy, f"not valid JSON ({e})") from None
        if isinstance(qc, dict):
            qc.setdefault("quant_method", "gptq")
    if not isinstance(qc, dict):
        raise ModelFileError(path, f"must be an object, got {type(qc).__name__}", "quantization_config")
    method = qc.get("quant_method")
    parse = _PARSERS.get(method)
    if parse is None:
        raise ModelFileError(path, f"quant_method {str(method)[:40]!r} is not supported "
                             f"(supported: {', '.join(METHODS)})", "quantization_config.quant_method")
    return parse(path, qc)


def resolve_quantization(found: HFQuantConfig | None, requested: str, model_dir: str) -> HFQuantConfig | None:
    """The format to load: the checkpoint's, after checking an explicit --quantization against it."""
    if requested in ("auto", "none") or (found is not None and found.method == requested):
        return found
    if found is None:
        raise ValueError(f"--quantization {requested}: {model_dir} is a float checkpoint (config.json has no "
                         "quantization_config); use --quantization auto")
    raise ValueError(f"--quantization {requested} does not match the checkpoint: {found.path} says quant_method "
                     f"{found.method!r}; use --quantization auto or {found.method}")


def _get(path: str, qc: dict, key: str, kind: type, default, *aliases: str):
    for k in (key, *aliases):
        if k in qc and qc[k] is not None:
            value = qc[k]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelFileError(path, f"must be an integer, got {str(value)[:40]!r}", f"{_KEY}.{k}")
            if kind is bool and not isinstance(value, bool):
                raise ModelFileError(path, f"must be true or false, got {str(value)[:40]!r}", f"{_KEY}.{k}")
            return value
    return default


def _bits(path: str, key: str, bits: int) -> int:
    if bits not in INT_BITS:
        raise ModelFileError(path, f"{bits}-bit weights are not supported (supported: 4, 8)", key)
    return bits


def _group_size(path: str, key: str, gs: int) -> int:
    if gs != -1 and (gs <= 0 or gs % 32):
        raise ModelFileError(path, f"group_size {gs} is not supported (supported: -1 for per-channel, or a "
                             "multiple of 32)", key)
    return gs


def _ignore(path: str, qc: dict, *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        value = qc.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelFileError(path, "must be a list of module names", f"quantization_config.{key}")
        out += value
    return tuple(out)


def _gptq(path: str, qc: dict) -> HFQuantConfig:
    bits = _bits(path, "quantization_config.bits", _get(path, qc, "bits", int, 4))
    gs = _group_size(path, "quantization_config.group_size", _get(path, qc, "group_size", int, 128))
    fmt = _get(path, qc, "checkpoint_format", str, "gptq", "format")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelFileError(path, f"checkpoint_format {str(fmt)[:40]!r} is not supported (supported: gptq, "
                             "gptq_v2)", "quantization_config.checkpoint_format")
    sym = _get(path, qc, "sym", bool, True)
    args = WeightArgs(bits, "int", sym, "group" if gs > 0 else "channel", gs)
    return HFQuantConfig("gptq", path, args, gptq_v1_zeros=fmt == "gptq", desc_act=_get(path, qc, "desc_act", bool,
                         False), ignore=_ignore(path, qc, "modules_to_not_convert"))


def _awq(path: str, qc: dict) -> HFQuantConfig:
    bits = _get(path, qc, "bits", int, 4, "w_bit")
    if bits != 4:
        raise ModelFileError(path, f"{bits}-bit AWQ weights are not supported (supported: 4)", f"{_KEY}.bits")
    gs = _group_size(path, "quantization_config.group_size", _get(path, qc, "group_size", int, 128, "q_group_size"))
    version = str(_get(path, qc, "version", str, "gemm")).lower()
    if version != "gemm":
        raise ModelFileError(path, f"AWQ version {version!r} is not supported (supported: gemm)",
                             "quantization_config.version")
    sym = not _get(path, qc, "zero_point", bool, True)
    return HFQuantConfig("awq", path, WeightArgs(4, "int", sym, "group" if gs > 0 else "channel", gs),
                         ignore=_ignore(path, qc, "modules_to_not_convert"))


def _fp8(path: str, qc: dict) -> HFQuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelFileError(path, f"fp8 fmt {str(fmt)[:40]!r} is not supported (supported: e4m3)",
                             "quantization_config.fmt")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ModelFileError(path, f"activation_scheme {str(scheme)[:40]!r} is not supported (static, dynamic)",
                             "quantization_config.activation_scheme")
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block(path, "quantization_config.weight_block_size", block)
    args = WeightArgs(8, "float", True, "block" if block else "channel", -1, block)
    return HFQuantConfig("fp8", path, args, static_input_scale=scheme == "static",
                         ignore=_ignore(path, qc, "ignored_layers", "modules_to_not_convert"))


def _block(path: str, key: str, block) -> tuple[int, int]:
    if (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                  and b > 0 for b in block) or block[1] % 32):
        raise ModelFileError(path, f"must be [rows, columns] of positive integers, columns a multiple of 32; got "
                             f"{str(block)[:40]}", key)
    return block[0], block[1]


def _compressed_tensors(path: str, qc: dict) -> HFQuantConfig:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelFileError(path, f"quantization_status {str(status)[:40]!r}: only compressed checkpoints load",
                             "quantization_config.quantization_status")
    if qc.get("sparsity_config"):
        raise ModelFileError(path, "sparse checkpoints are not supported", "quantization_config.sparsity_config")
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise ModelFileError(path, "must be a non-empty object of quantization groups",
                             "quantization_config.config_groups")
    groups = []
    for name, g in groups_cfg.items():
        key = f"quantization_config.config_groups.{name}"
        if not isinstance(g, dict) or not isinstance(g.get("targets"), list) or not isinstance(g.get("weights"), dict):
            raise ModelFileError(path, "each group needs 'targets' (a list) and 'weights' (an object)", key)
        fmt = g.get("format") or qc.get("format")
        if fmt not in CT_FORMATS:
            raise ModelFileError(path, f"format {str(fmt)[:40]!r} is not supported (supported: "
                                 f"{', '.join(CT_FORMATS)})", key + ".format")
        # (input_activations, W8A8, are not emulated: these checkpoints run weight-only)
        groups.append((tuple(str(t) for t in g["targets"]), _ct_weights(path, key + ".weights", g["weights"], fmt)))
    return HFQuantConfig("compressed-tensors", path, groups[0][1], ignore=_ignore(path, qc, "ignore"),
                         groups=groups)


def _ct_weights(path: str, key: str, w: dict, fmt: str) -> WeightArgs:
    kind, bits = w.get("type", "int"), _get(path, w, "num_bits", int, 8)
    strategy, gs = w.get("strategy", "tensor"), _get(path, w, "group_size", int, -1)
    sym = _get(path, w, "symmetric", bool, True)
    if kind == "float":
        if bits != 8 or fmt != "float-quantized":
            raise ModelFileError(path, f"float weights must be 8-bit float-quantized, got {bits}-bit {fmt}", key)
        if not sym:
            raise ModelFileError(path, "asymmetric FP8 weights are not supported", key + ".symmetric")
    elif kind == "int":
        _bits(path, key + ".num_bits", bits)
        if fmt == "float-quantized":
            raise ModelFileError(path, "int weights in a float-quantized checkpoint", key + ".type")
    else:
        raise ModelFileError(path, f"weight type {str(kind)[:40]!r} is not supported (int, float)", key + ".type")
    block = None
    if strategy == "group":
        gs = _group_size(path, key + ".group_size", gs)
        if gs <= 0:
            raise ModelFileError(path, "strategy 'group' needs a positive group_size", key + ".group_size")
    elif strategy == "block" and kind == "float":
        block = _block(path, key + ".block_structure", w.get("block_structure"))
    elif strategy not in ("channel", "tensor"):
        raise ModelFileError(path, f"weight strategy {str(strategy)[:40]!r} is not supported (group, channel, "
                             "tensor; block for FP8)", key + ".strategy")
    if w.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
        raise ModelFileError(path, f"actorder {str(w.get('actorder'))[:40]!r} is not supported", key + ".actorder")
    return WeightArgs(bits, kind, sym, strategy, gs if strategy == "group" else -1, block, fmt)


_PARSERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}
