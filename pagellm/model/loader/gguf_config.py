"""GGUF metadata -> ModelConfig (numpy only, so reading a config never imports torch)."""

from __future__ import annotations

import math

import numpy as np

from pagellm.model.loader import model_checks as checks
from pagellm.model.loader.gguf_reader import GGUFFile
from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.model_config import ModelConfig

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_REQUIRED = object()


def gguf_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(gf.path, f"unsupported GGUF architecture {checks.short(arch)}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}", "general.architecture")
    md = gf.metadata

    def num(key: str, default=_REQUIRED, kind=checks.require_int, **bounds):
        full = f"{arch}.{key}"
        value = gf.arch_key(key, default)
        if value is _REQUIRED:
            raise ModelFileError(gf.path, "metadata key is missing", full)
        if value is None:
            return None
        return kind(gf.path, full, value, **bounds)

    hidden = num("embedding_length", low=1)
    heads = num("attention.head_count", low=1)
    kv_heads = gf.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts exist in some archs; dense models repeat one value
        kv_heads = kv_heads[0] if kv_heads else None
    kv_heads = checks.require_int(gf.path, f"{arch}.attention.head_count_kv", kv_heads, low=1)
    vocab = gf.arch_key("vocab_size")
    if vocab is None:
        embd = gf.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else len(md.get("tokenizer.ggml.tokens") or ())
    head_dim = num("attention.key_length", None, low=1) or hidden // heads
    theta = num("rope.freq_base", 10000.0, kind=checks.require_number)
    eos_ids = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if k in md]
    window = num("attention.sliding_window", None, low=0)
    if heads % kv_heads:
        raise ModelFileError(gf.path, f"head count {heads} is not a multiple of the KV head count {kv_heads}",
                             f"{arch}.attention.head_count_kv")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=checks.require_int(gf.path, f"{arch}.vocab_size", vocab, low=1),
        hidden_size=hidden,
        intermediate_size=num("feed_forward_length", low=1),
        num_hidden_layers=num("block_count", low=1),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=num("attention.layer_norm_rms_epsilon", 1e-6, kind=checks.require_number),
        rope_theta=theta,
        rope_scaling=None,
        max_position_embeddings=num("context_length", 2048, low=1, high=checks.MAX_CONTEXT_LENGTH),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        sliding_window=window or None,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
    )
    checks.check_config_values(gf.path, cfg)
    checks.check_weight_shapes(gf.path, cfg, {n: t.shape for n, t in gf.tensors.items()}, gguf_names=True)
    cfg.rope_scaling = _rope_scaling(gf, theta, head_dim)
    checks.check_rope_scaling(gf.path, cfg.rope_scaling, f"{gf.architecture}.rope.scaling")
    return cfg


def _rope_scaling(gf: GGUFFile, theta: float, head_dim: int) -> dict | None:
    key = f"{gf.architecture}.rope.scaling."
    kind = gf.arch_key("rope.scaling.type")
    factor = gf.arch_key("rope.scaling.factor")
    orig = gf.arch_key("rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        out = {"rope_type": kind, "factor": checks.require_number(gf.path, key + "factor", factor)}
        if orig:
            out["original_max_position_embeddings"] = checks.require_int(
                gf.path, key + "original_context_length", orig, low=1, high=checks.MAX_CONTEXT_LENGTH)
        if kind == "yarn":
            for name, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("attn_factor", "attention_factor")):
                if (v := gf.arch_key(f"rope.scaling.{name}")) is not None:
                    out[hf] = checks.require_number(gf.path, key + name, v)
        return out
    if kind in ("linear", "yarn"):
        raise ModelFileError(gf.path, f"rope scaling type {kind!r} needs a non-zero factor, got {checks.short(factor)}",
                             key + "factor")
    if kind not in (None, "none"):
        raise ModelFileError(gf.path, f"unsupported rope scaling type {checks.short(kind)}", key + "type")
    if "rope_freqs.weight" in gf.tensors:
        # Llama 3.x GGUFs store precomputed per-frequency factors instead of the scaling parameters.
        info = gf.tensors["rope_freqs.weight"]
        if info.qtype.name != "F32" or info.nbytes == 0:
            raise ModelFileError(gf.path, f"expected float32 factors, got {info.qtype.name} "
                                 f"{list(info.shape)}", "rope_freqs.weight")
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
