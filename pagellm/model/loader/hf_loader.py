"""Hugging Face model directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagellm.config import ModelConfig
from pagellm.model.loader import model_checks as checks
from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.model.loader.safetensors_header import read_safetensors_header

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
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFileError(path, f"{type(e).__name__}: {e}") from None
    if os.path.isfile(gen_path):
        eos = _read_json_object(gen_path).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or []) if isinstance(eos, list) else []
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    checks.check_config_values(path, config)
    _check_weight_shapes(model_dir, config)
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


def _check_weight_shapes(model_dir: str, config: ModelConfig) -> None:
    """Shapes from the safetensors headers against the config, before the model is built from it.
    A directory without weights is left to iter_hf_weights (configs alone are read for rooflines)."""
    try:
        files = safetensors_files(model_dir)
    except FileNotFoundError:
        return
    shapes: dict[str, tuple] = {}
    for path in files:
        if not os.path.isfile(path):
            raise ModelFileError(path, "shard listed in model.safetensors.index.json does not exist")
        for name, (_, shape) in read_safetensors_header(path).items():
            # Some checkpoints drop the "model." prefix; load_weights accepts both.
            shapes[name if name.startswith(("model.", "lm_head.")) else "model." + name] = shape
    checks.check_weight_shapes(model_dir, config, shapes, gguf_names=False)


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


def iter_hf_weights(model_dir: str, config: ModelConfig,
                    dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
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
