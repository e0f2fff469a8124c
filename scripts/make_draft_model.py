"""Build a draft model for speculative decoding: the target's first N layers plus its norm and head.

    python scripts/make_draft_model.py --layers 4 --out /tmp/smollm2-draft4     # from the default SmolLM2
    pagellm generate --speculative-method draft --draft-model /tmp/smollm2-draft4 --prompt ...

It shares the target's vocabulary by construction; the output is a Hugging Face directory
(config.json + model.safetensors), written wherever --out says (never commit weights).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from pagellm.model.loader import iter_weights, load_config, resolve_model_path


def make_draft(model: str | None, layers: int, out: str) -> str:
    path = resolve_model_path(model)
    cfg = load_config(path)
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise SystemExit(f"--layers must be in [1, {cfg.num_hidden_layers}]")
    tensors = {}
    for name, t in iter_weights(path, cfg, torch.float32):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
            continue
        tensors[name] = t.contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    hf = {
        "architectures": ["LlamaForCausalLM"] if cfg.architecture != "qwen2" else ["Qwen2ForCausalLM"],
        "model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target model (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to keep (default 4)")
    ap.add_argument("--out", required=True, help="output directory")
    ns = ap.parse_args()
    print(make_draft(ns.model, ns.layers, ns.out))


if __name__ == "__main__":
    main()
