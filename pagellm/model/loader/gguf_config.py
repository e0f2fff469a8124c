"""GGUF metadata -> ModelConfig (numpy only, so reading a config never imports torch)."""

from __future__ import annotations

import math

import numpy as np

from pagellm.config import ModelConfig
from pagellm.model.loader.gguf_reader import GGUFFile

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


def gguf_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    md = gf.metadata
    hidden = int(gf.arch_key("embedding_length"))
    heads = int(gf.arch_key("attention.head_count"))
    kv_heads = gf.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts exist in some archs; dense models repeat one value
        kv_heads = kv_heads[0]
    vocab = gf.arch_key("vocab_size")
    if vocab is None:
        embd = gf.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else len(md["tokenizer.ggml.tokens"])
    head_dim = gf.arch_key("attention.key_length") or hidden // heads
    theta = float(gf.arch_key("rope.freq_base", 10000.0))
    eos_ids = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if k in md]
    window = gf.arch_key("attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gf.arch_key("feed_forward_length")),
        num_hidden_layers=int(gf.arch_key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(gf, theta, int(head_dim)),
        max_position_embeddings=int(gf.arch_key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        sliding_window=int(window) if window else None,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
    )


def _rope_scaling(gf: GGUFFile, theta: float, head_dim: int) -> dict | None:
    kind = gf.arch_key("rope.scaling.type")
    factor = gf.arch_key("rope.scaling.factor")
    orig = gf.arch_key("rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        out = {"rope_type": kind, "factor": float(factor)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        if kind == "yarn":
            for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                            ("attn_factor", "attention_factor")):
                if (v := gf.arch_key(f"rope.scaling.{key}")) is not None:
                    out[hf] = float(v)
        return out
    if kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    if "rope_freqs.weight" in gf.tensors:
        # Llama 3.x GGUFs store precomputed per-frequency factors instead of the scaling parameters.
        freqs = np.frombuffer(gf.raw("rope_freqs.weight").tobytes(), dtype=np.float32)
        return _llama3_scaling_from_factors(freqs, theta, head_dim)
    return None


def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor (same formula as its converter)."""
    factor = float(factors.max())
    for low, high, orig in ((1.0, 4.0, 8192),):
        expected = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * theta ** (i / head_dim)
            if wavelen < orig / high:
                expected.append(1.0)
            elif wavelen > orig / low:
                expected.append(factor)
            else:
                smooth = (orig / wavelen - low) / (high - low)
                expected.append(1 / ((1 - smooth) / factor + smooth))
        if len(expected) == len(factors) and np.allclose(expected, factors, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise ValueError("GGUF rope_freqs tensor does not match a known llama3 rope scaling; cannot load it")
