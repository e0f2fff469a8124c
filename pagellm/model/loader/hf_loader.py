"""Hugging Face model directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagellm.config import ModelConfig

if TYPE_CHECKING:  # torch is imported by safetensors only when weights are actually read
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def hf_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("model_type", "llama") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    # Generation config eos ids (e.g. Llama 3's <|eot_id|>) also end a turn.
    gen_path = os.path.join(model_dir, "generation_config.json")
    config = ModelConfig.from_hf_dict(cfg)
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
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
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                # Buffers some old checkpoints saved; recomputed by the model.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                yield name, f.get_tensor(name).to(dtype)
