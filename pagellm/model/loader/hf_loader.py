"""Hugging Face model directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagellm.model.loader import model_checks as checks
from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.model.loader.safetensors_header import read_safetensors_header
from pagellm.model_config import ModelConfig
from pagellm.quant.hf_formats.quant_config import HFQuantConfig, read_quant_config, resolve_quantization

if TYPE_CHECKING:  # torch is imported by safetensors only when weights are actually read
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def hf_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    cfg = _read_json_object(path)
    if cfg.get("model_type", "llama") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    # Generation config eos ids (e.g. Llama 3's <|eot_id|>) also end a turn.
    gen_path = os.path.join(model_dir, "generation_config.json")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        checks.require_int(path, key, cfg.get(key), low=1)
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if cfg.get(key) is not None:
            checks.require_int(path, key, cfg[key], low=1)
    checks.check_hf_fields(path, cfg)
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFileError(path, f"{type(e).__name__}: {e}") from None
    checks.check_rope_scaling(path, config.rope_scaling)
    if os.path.isfile(gen_path):
        eos = _read_json_object(gen_path).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or []) if isinstance(eos, list) else []
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    checks.check_config_values(path, config)
    qc = read_quant_config(model_dir, cfg)
    config.weight_format = qc.method if qc is not None else None
    _check_weight_shapes(model_dir, config, qc)
    return config


def _read_json_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(path, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelFileError(path, f"holds a JSON {type(value).__name__}, expected an object")
    return value


def _check_weight_shapes(model_dir: str, config: ModelConfig, qc: HFQuantConfig | None = None) -> None:
    """Shapes from the safetensors headers against the config, before the model is built from it; a
    quantized module's tensors are checked against its format and stand for its [out, in] weight.
    A directory without weights is left to iter_hf_weights (configs alone are read for rooflines)."""
    try:
        files = safetensors_files(model_dir)
    except FileNotFoundError:
        return
    header, where = _headers(files)
    shapes = {_full_name(name): shape for name, (_, shape) in header.items()}
    if qc is not None:
        for prefix, (fmt, args, (n, k), err, info) in _quantized_modules(model_dir, config, qc, header, where).items():
            fmt.check_shapes(err, qc, args, info, n, k)
            for part in info:
                del shapes[_full_name(f"{prefix}.{part}")]
            shapes[_full_name(prefix + ".weight")] = (n, k)
    checks.check_weight_shapes(model_dir, config, shapes, gguf_names=False)


def _full_name(name: str) -> str:
    # Some checkpoints drop the "model." prefix; load_weights accepts both.
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def _headers(files: list[str]) -> tuple[dict[str, tuple[str, tuple]], dict[str, str]]:
    """(name -> (dtype, shape), name -> file) over all shards."""
    header, where = {}, {}
    for path in files:
        if not os.path.isfile(path):
            raise ModelFileError(path, "shard listed in model.safetensors.index.json does not exist")
        for name, entry in read_safetensors_header(path).items():
            header[name], where[name] = entry, path
    return header, where


def _quantized_modules(model_dir: str, config: ModelConfig, qc: HFQuantConfig, header: dict,
                       where: dict) -> dict[str, tuple]:
    """prefix -> (format module, WeightArgs, (out, in), error factory, part -> (dtype, shape)) of every
    module the checkpoint stores quantized."""
    from pagellm.quant.hf_formats import format_module, group_modules, partly_quantized

    fmt = format_module(qc.method)
    expected, _ = checks.expected_shapes(config, gguf_names=False)
    for prefix, parts in partly_quantized(qc, header).items():
        weight, others = header.get(prefix + ".weight"), ", ".join(sorted(set(parts) - {"weight"}))
        what = (f"weight stored as {weight[0]} beside its {others}: expected the {qc.method} codes" if weight
                else f"quantized weight missing: only its {others} are stored")
        raise ModelFileError(where.get(next(iter(parts.values())), model_dir), what, f"module {prefix!r}")
    out = {}
    for prefix, parts in group_modules(qc, header).items():
        def err(part: str, what: str, prefix=prefix) -> ModelFileError:
            name = f"{prefix}.{part}"
            return ModelFileError(where.get(name, model_dir), what, f"tensor {name!r}")

        first = next(iter(parts))
        shape = expected.get(_full_name(prefix + ".weight"))
        if shape is None or len(shape) != 2 or prefix.endswith("embed_tokens"):
            raise err(first, "quantized tensor has no place in the model (pagellm quantizes linear layers only)")
        args = qc.scheme_for(_full_name(prefix))
        if args is None:
            raise err(first, f"stored quantized, but {qc.path} leaves this module in float (ignore list / no "
                      "config group targets it)")
        out[prefix] = (fmt, args, shape, err, {p: header[n] for p, n in parts.items()})
    return out


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise ModelFileError(index, "weight_map must map tensor names to shard file names", "weight_map")
        return [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    # A directory may hold other safetensors (e.g. Mistral's consolidated.safetensors next to HF shards),
    # so the glob is only the last resort.
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (PyTorch .bin checkpoints are not "
                                "supported; re-save with safe_serialization=True)")
    return [os.path.join(model_dir, f) for f in files]


def iter_hf_weights(model_dir: str, config: ModelConfig, dtype: torch.dtype, packed: bool = False,
                    quantization: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order. A quantized checkpoint (or an explicit --quantization, checked against
    it) yields each quantized module's dequantized weight and, with packed=True, its blocks right after
    (name + PACKED_SUFFIX), as the GGUF loader does."""
    qc = resolve_quantization(read_quant_config(model_dir, _read_json_object(os.path.join(model_dir, "config.json"))),
                              quantization, model_dir)
    if qc is not None:
        # W8A8 FP8 blocks carry the input rounding: they come even where no kernel reads them, but not under
        # --quantization none (the dequantized weights only, by definition)
        yield from _iter_quantized(model_dir, config, dtype, packed, qc, act_blocks=quantization != "none")
        return
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        name = None
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    # Buffers some old checkpoints saved; recomputed by the model.
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    yield name, f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as e:
            raise ModelFileError(path, f"safetensors: {e}", f"tensor {name!r}" if name else None) from None


def _iter_quantized(model_dir: str, config: ModelConfig, dtype: torch.dtype, packed: bool,
                    qc: HFQuantConfig, act_blocks: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from contextlib import ExitStack

    from safetensors import SafetensorError, safe_open

    from pagellm.quant.formats import PACKED_SUFFIX
    from pagellm.quant.hf_formats.blocks import part_info

    files = safetensors_files(model_dir)
    header, where = _headers(files)
    modules = _quantized_modules(model_dir, config, qc, header, where)
    owner = {f"{prefix}.{part}": prefix for prefix, m in modules.items() for part in m[4]}
    done, name = set(), None
    try:
        with ExitStack() as stack:
            handles = {path: stack.enter_context(safe_open(path, framework="pt")) for path in files}
            for name in header:
                prefix = owner.get(name)
                if prefix is None:
                    if name.endswith(("rotary_emb.inv_freq", ".k_scale", ".v_scale")) or (
                            name == "lm_head.weight" and config.tie_word_embeddings):
                        continue  # recomputed, or KV-cache scales (the KV cache stays in its own dtype)
                    tensor = handles[where[name]].get_tensor(name)
                    if not _placeless_zero_bias(where[name], name, tensor, config):
                        yield name, tensor.to(dtype)
                    continue
                if prefix in done:
                    continue
                done.add(prefix)
                fmt, args, (n, k), err, info = modules[prefix]
                tensors = {p: handles[where[f"{prefix}.{p}"]].get_tensor(f"{prefix}.{p}") for p in info}
                pw = fmt.to_packed(err, qc, args, tensors, n, k, part_info(tensors))
                yield prefix + ".weight", pw.dequantize().to(dtype)
                if packed or (pw.act_fp8 and act_blocks):
                    yield prefix + ".weight" + PACKED_SUFFIX, pw
    except (SafetensorError, OSError) as e:
        raise ModelFileError(where.get(name, model_dir), f"safetensors: {e}",
                             f"tensor {name!r}" if name else None) from None


_BIASED = (".q_proj.bias", ".k_proj.bias", ".v_proj.bias")  # the only biases the architecture has (Qwen2's)


def _placeless_zero_bias(path: str, name: str, tensor: torch.Tensor, config: ModelConfig) -> bool:
    """AutoGPTQ saves a zero bias for every quantized Linear, bias or not: those add nothing and are skipped.
    A non-zero one where the model has no bias would change the outputs, so it is refused."""
    if not name.endswith(".bias") or (config.attention_bias and name.endswith(_BIASED)):
        return False
    if bool(tensor.any()):
        raise ModelFileError(path, "a non-zero bias where the architecture has none "
                             f"({config.architecture} has biases only on q/k/v when attention_bias is set)",
                             f"tensor {name!r}")
    return True
