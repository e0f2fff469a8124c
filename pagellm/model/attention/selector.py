"""Attention backends by name, constructed lazily (only the chosen one's module is imported).

`auto` is the platform's choice (the native paged kernel on a CPU computing in float32 with a KV dtype the
build reads, torch SDPA otherwise). The old names `native`, `batched`, `reference` are accepted for one
release, with a deprecation message.
"""

from __future__ import annotations

import importlib
import logging

import torch

from pagellm.model.attention.base import AttentionBackend

logger = logging.getLogger("pagellm")

# name -> (module, class)
BACKENDS = {
    "cpu_paged": ("pagellm.model.attention.cpu_paged", "CpuPagedAttention"),
    "torch_sdpa_batched": ("pagellm.model.attention.torch_sdpa_batched", "TorchSdpaBatchedAttention"),
    "torch_sdpa_reference": ("pagellm.model.attention.torch_sdpa_reference", "TorchSdpaReferenceAttention"),
    "triton_paged": ("pagellm.model.attention.triton_paged", "TritonPagedAttention"),
}
ALIASES = {"native": "cpu_paged", "batched": "torch_sdpa_batched", "reference": "torch_sdpa_reference"}
BACKEND_NAMES = ("auto", *BACKENDS)


def canonical_backend_name(name: str) -> str:
    if name in ALIASES:
        logger.warning("attention backend %r is deprecated: use %r", name, ALIASES[name])
        return ALIASES[name]
    return name


def get_attention_backend(name: str, platform, kv_dtype: torch.dtype = torch.float32,
                          compute_dtype: torch.dtype = torch.float32, auto_dtype: bool = False) -> AttentionBackend:
    """auto_dtype: `--dtype auto` asked for the platform's choice (bf16 prefill attention where it has it)."""
    name = platform.attention_backend(canonical_backend_name(name), kv_dtype, compute_dtype)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(BACKEND_NAMES)} (or the old names "
                         f"{list(ALIASES)}), got {name!r}")
    if name == "cpu_paged" and not (compute_dtype == torch.float32 and platform.kv_dtype_readable_natively(kv_dtype)):
        raise ValueError(f"attention_backend 'cpu_paged' needs the native CPU kernels, float32 compute and a KV "
                         f"dtype they read; here: compute {compute_dtype}, KV {kv_dtype} "
                         f"(kernels {'on' if getattr(platform, 'native_kernels', False) else 'off'})")
    module, cls = BACKENDS[name]
    backend = getattr(importlib.import_module(module), cls)
    if name == "cpu_paged":
        return backend(bf16_prefill=platform.bf16_prefill_attention(auto_dtype, kv_dtype),
                       paged_prompts=auto_dtype and not getattr(platform, "bf16_dot_products", False))
    if name == "triton_paged":
        return backend(kv_dtype=kv_dtype)  # refuses what it cannot read (int8 rows) before any step
    return backend()
