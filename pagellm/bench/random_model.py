"""Random-weight Llama checkpoints of any shape, written as a Hugging Face directory pagellm loads as it is:
config.json, safetensors shards (one per layer, so a big model never sits whole in host memory), and a
word-level tokenizer.json with one token per id (`<t17>`), so token-id prompts detokenize without a real
vocabulary. Nothing is downloaded: the GPU check (benchmarks/gpu_check.py) benchmarks Llama-3 shapes this
way, and tests/test_cuda.py builds its tiny model with it.

The weights are drawn on `device` (a GPU draws 8B parameters in a second), cast to `dtype` and copied to
host memory one layer at a time.
"""

from __future__ import annotations

import json
import os

import torch

# Published config.json shapes (Llama 3.2 1B ties its embedding to the LM head; Llama 3 8B does not).
SHAPES = {
    "llama3-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
}


def write_random_llama(path: str, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                       num_key_value_heads: int, intermediate_size: int, vocab_size: int,
                       tie_word_embeddings: bool = False, max_position_embeddings: int = 8192,
                       dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0,
                       std: float = 0.02, norm_std: float = 0.0, rope_theta: float = 500000.0) -> str:
    """Writes the checkpoint into `path` (created) and returns it. std: the matrices' normal init (0.02 as
    Llama's; a tiny test model takes 0.1 for peaked logits); norm_std: norm weights are 1 + norm_std * N(0, 1)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    head_dim = hidden_size // num_attention_heads
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=std, mean=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale + mean
        return t.to(dtype).cpu()

    def norm():
        return rand(hidden_size, scale=norm_std, mean=1.0)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    ends = {"model.embed_tokens.weight": rand(vocab_size, hidden_size), "model.norm.weight": norm()}
    if not tie_word_embeddings:
        ends["lm_head.weight"] = rand(vocab_size, hidden_size)
    shard("model-ends.safetensors", ends)
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        shard(f"model-layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(q, hidden_size), p + "self_attn.k_proj.weight": rand(kv, hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, hidden_size), p + "self_attn.o_proj.weight": rand(hidden_size, q),
            p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()})
    _write_json(path, "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    _write_json(path, "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch.")})
    write_id_tokenizer(path, vocab_size)
    return path


def write_id_tokenizer(path: str, vocab_size: int) -> None:
    """tokenizer.json: a word-level vocabulary `<t0>` ... `<t{vocab_size - 1}>` (ids 1 and 2 are BOS and EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.save(os.path.join(path, "tokenizer.json"))
    _write_json(path, "tokenizer_config.json", {"bos_token": "<t1>", "eos_token": "<t2>", "unk_token": "<t0>"})
    _write_json(path, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})


def _write_json(path: str, name: str, obj: dict) -> None:
    with open(os.path.join(path, name), "w") as f:
        json.dump(obj, f, indent=1)
