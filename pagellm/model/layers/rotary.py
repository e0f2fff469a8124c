"""Rotary position embedding (rotate-half convention of HF checkpoints) with Llama-3 / linear scaling."""

from __future__ import annotations

import math

import torch

from pagellm.kernels import ops
from pagellm.model.layers.custom_op import CustomOp


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(CustomOp):
    """Rotates q and k heads in place in the fused qkv output, where they sit side by side in each row."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward_native(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rotates the first `heads` heads (q then k) of each row of qkv [T, >= heads * D] in place and returns
        it; cast to `dtype` (the model's activations) first where a bf16 product under --dtype auto left it
        in bfloat16."""
        if dtype is not None and qkv.dtype != dtype:
            qkv = qkv.to(dtype)
        n = heads * self.head_dim
        x = qkv[:, :n].view(-1, heads, self.head_dim)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        qkv[:, :n] = (x * cos + _rotate_half(x) * sin).reshape(-1, n)
        return qkv

    def forward_cpu(self, positions: torch.Tensor, qkv: torch.Tensor, heads: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        if qkv.dtype == torch.bfloat16 and dtype == torch.float32:  # cast and rotate in one pass
            return ops.rope_bf16(qkv, heads, self.head_dim, self.cos, self.sin, positions)
        ops.rope_(qkv, heads, self.head_dim, self.cos, self.sin, positions)
        return qkv

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Out of place, for separate tensors: q: [T, H, D], k: [T, KV, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
