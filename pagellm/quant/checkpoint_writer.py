"""Writes `pagellm quantize` output as a standard Hugging Face checkpoint directory.

GPTQ layout (method rtn or gptq), per quantized linear, AutoGPTQ's v1 `checkpoint_format: gptq`:
  qweight int32 [K / pack, N]  pack = 32 / bits codes per int32 along K, code of row k in bits (k % pack)
  qzeros  int32 [G, N / pack]  zero point - 1 (the v1 convention), packed along N the same way
  scales  fp16  [G, N]          w = (q - z) * s
  g_idx   int32 [K]             group of each input row (act-order permutes it)
AWQ layout (AutoAWQ `version: gemm`, 4 bits, zero point stored as is):
  qweight int32 [K, N / 8]     eight output columns per int32, nibble i holding column AWQ_ORDER[i]
  qzeros  int32 [G, N / 8]     the same packing
  scales  fp16  [G, N]
compressed-tensors `pack-quantized` (symmetric rtn/gptq, no act-order), per linear:
  weight_packed      int32 [N, K / pack]  code q (= signed value + 2^(bits-1)) of column k in field k % pack
  weight_scale       fp16  [N, G]
  (w = (q - 2^(bits-1)) * s; asymmetric zero points are not written: the transformers 5 / compressed-tensors
  0.20 loader expects them in another shape than the packed one its own compressor writes)
  weight_shape       int64 [2]
Unquantized tensors are float16 (`torch_dtype`), as GPTQ/AWQ kernels compute in float16.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from pagellm.model_config import ModelConfig
from pagellm.quant.algorithms.rtn import GroupQuant
from pagellm.quant.hf_formats.awq import AWQ_ORDER  # the loader's nibble order: one definition

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def pack_along_last(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int codes [..., M] -> int32 [..., M * bits / 32]: field i of each word holds code order[i]."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, pack)
    word = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        word |= (c[..., j] & (2**bits - 1)) << (bits * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, as int32


def gptq_tensors(gq: GroupQuant) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_last(gq.q, gq.bits).t().contiguous(),
            "qzeros": pack_along_last(gq.zeros.t() - 1, gq.bits),
            "scales": gq.scales.t().to(torch.float16).contiguous(),
            "g_idx": gq.g_idx.to(torch.int32).contiguous()}


def awq_tensors(gq: GroupQuant) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_last(gq.q.t(), gq.bits, AWQ_ORDER),
            "qzeros": pack_along_last(gq.zeros.t(), gq.bits, AWQ_ORDER),
            "scales": gq.scales.t().to(torch.float16).contiguous()}


def compressed_tensors_tensors(gq: GroupQuant) -> dict[str, torch.Tensor]:
    if not bool((gq.zeros == 2 ** (gq.bits - 1)).all()):
        raise ValueError("compressed-tensors output is written for symmetric codes only")
    return {"weight_packed": pack_along_last(gq.q, gq.bits), "weight_scale": gq.scales.to(torch.float16),
            "weight_shape": torch.tensor(list(gq.q.shape), dtype=torch.int64)}


def quantization_config(method: str, bits: int, group_size: int, sym: bool, desc_act: bool,
                        keep: list[str], fmt: str) -> dict:
    if fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size,
                   "dynamic": False, "actorder": None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": ["lm_head", *(f"re:.*{re.escape(k)}.*" for k in keep)], "kv_cache_scheme": None}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": keep or None}
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
           "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True,
           "meta": {"quantizer": [f"pagellm:{method}"]}}
    if keep:  # transformers/optimum read modules_to_not_convert, vLLM and GPTQModel negative `dynamic` rules
        cfg["modules_to_not_convert"] = keep
        cfg["dynamic"] = {f"-:.*{re.escape(k)}.*": {} for k in keep}
    return cfg


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json for a model read from a GGUF (the fields ModelConfig.from_hf_dict reads back)."""
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return {"architectures": [ARCHITECTURES[cfg.architecture]], "model_type": cfg.architecture,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": eos, "attention_bias": cfg.attention_bias, "hidden_act": "silu"}


def checkpoint_tensors(state: dict[str, torch.Tensor], codes: dict[str, GroupQuant], fmt: str) -> dict:
    layout = {"awq": awq_tensors, "gptq": gptq_tensors, "compressed-tensors": compressed_tensors_tensors}[fmt]
    out = {}
    for name, t in state.items():
        if name in codes:
            module = name.removesuffix(".weight")
            out.update({f"{module}.{k}": v for k, v in layout(codes[name]).items()})
        else:
            out[name] = t.to(torch.float16).contiguous()
    return out


def write_checkpoint(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, source: str,
                     tokenizer=None) -> None:
    """source: the input model (an HF directory: its tokenizer files are copied; a GGUF: `tokenizer`, a
    pagellm Tokenizer, is written as tokenizer.json + tokenizer_config.json)."""
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    elif tokenizer is not None:
        tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
                   "model_max_length": config.get("max_position_embeddings")}
        if tokenizer.chat_template:
            tok_cfg["chat_template"] = tokenizer.chat_template
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tok_cfg, f, indent=2)
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, f)
