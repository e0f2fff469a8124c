"""Built-in architectures and devices for `pagellm plan` (no checkpoint needed to plan a deployment).

Architectures are the published config.json values of each model family. Device sizes are the marketed
capacities in decimal gigabytes (an "80 GB" H100 is planned with 80e9 bytes; the driver reports a little
more, so plans err on the safe side).
"""

from __future__ import annotations

from pagellm.model_config import ModelConfig

ARCHITECTURES: dict[str, dict] = {
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192),
    "mistral-7b": dict(architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768),
    "qwen2-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=32768, attention_bias=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True),
}

GPUS: dict[str, int] = {
    "h100-80gb": 80 * 10**9,
    "a100-80gb": 80 * 10**9,
    "a100-40gb": 40 * 10**9,
    "h200-141gb": 141 * 10**9,
    "l40s-48gb": 48 * 10**9,
}


def preset_config(name: str) -> ModelConfig:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture preset {name!r}; presets: {', '.join(sorted(ARCHITECTURES))}")
    return ModelConfig(**ARCHITECTURES[name])
