"""The bytes the engine holds for a checkpoint's weights, from the files' headers alone (no tensor is read):
`pagellm plan`'s weight figure for a GGUF file or a Hugging Face directory, quantized or not.

On a CPU with pagellm's native kernels every quantized matrix stays in a block kind (pagellm/quant/formats.py:
codes, then float32 scales and minimums per 32 or 16 weights), GGUF's too (pagellm/quant/gguf_blocks.py maps
each type onto one), and the float copy is freed; the fused q/k/v and gate/up layers hold their shards in one
common kind. Everything else is a float parameter of the run's dtype: norms, biases, an untied embedding (its
lookups read float rows), and a float LM head. A tied LM head that is not in blocks keeps its own transposed
copy beside the embedding (the products read [in, out]); one in blocks serves the lookups too.

The block kernels run at float32 on a CPU only. Elsewhere (a CUDA engine, `--dtype bfloat16` on a CPU) a
quantized checkpoint is dequantized to the dtype at load; `--quantization int8|int4` and W8A8 FP8 layers compute
with the float copy while keeping their blocks beside it.

tests/test_plan.py checks these bytes against the engine's own count (LLMEngine.weights_bytes) and the kinds'
sizes against PackedWeight.nbytes.
"""

from __future__ import annotations

import json
import math
import os

from pagellm.model_config import ModelConfig

FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The minimum is stored beside the scale in these kinds (w = d * q + m).
_WITH_MINIMUM = ("q4_1", "q8_1", "q4_1_16", "q8_1_16")
# GGUF block type -> the kind the engine holds it in (pagellm/quant/gguf_blocks.py's module docstring).
GGUF_KINDS = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q5_0": "q8_0", "Q5_1": "q8_1", "Q8_0": "q8_0", "Q2_K": "q4_1_16",
              "Q3_K": "q4_1_16", "Q4_K": "q4_1", "Q5_K": "q8_1", "Q6_K": "q8_0_16"}
# Kinds a fused layer's shards may widen to, tried in this order (PackedWeight.unify).
_WIDENINGS = {"q4_1": ("q8_1", "q4_1_16", "q8_1_16"), "q8_0": ("q8_1", "q8_0_16", "q8_1_16"), "q8_1": ("q8_1_16",),
              "q4_1_16": ("q8_1_16",), "q8_0_16": ("q8_1_16",)}
# The layers the engine fuses, by the checkpoint's module names (GGUF, Hugging Face).
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
          "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

def kind_bytes_per_weight(kind: str) -> float:
    """Codes (4 or 8 bits) plus float32 scales, and minimums where the kind has them, per 32 or 16 weights."""
    group = 16 if kind.endswith("_16") else 32
    codes = 0.5 if kind.startswith("q4_") else 1.0
    return codes + 4 / group * (2 if kind in _WITH_MINIMUM else 1)


def common_kind(kinds: list[str]) -> str | None:
    """The kind fused shards are held in: theirs when they agree, else the first wider kind that holds them all
    (None: no kind does, and the layer keeps float weights)."""
    if len(set(kinds)) == 1:
        return kinds[0]
    for common in ("q8_1", "q4_1_16", "q8_1_16"):
        if all(k == common or common in _WIDENINGS.get(k, ()) for k in kinds):
            return common
    return None


def _layers_bytes(groups: dict[tuple, list[tuple[str | None, int]]], float_bytes: int) -> float:
    """groups: per engine layer, its shards' (kind or None for float, weights): blocks in the common kind, or
    float weights where a shard has no kind."""
    total = 0.0
    for shards in groups.values():
        kind = None if any(k is None for k, _ in shards) else common_kind([k for k, _ in shards])
        n = sum(w for _, w in shards)
        total += n * (kind_bytes_per_weight(kind) if kind else float_bytes)
    return total


def _held_bytes(cfg: ModelConfig, gguf_names: bool, kind_of, dtype: str, blocks: bool,
                kept_beside: bool = False) -> int:
    """The engine's bytes for the model's tensors (names and shapes: model_checks.expected_shapes). kind_of(module):
    a matrix's block kind as it arrives, None for float; blocks: the kernels read them, so the float copy goes;
    kept_beside: without such kernels the blocks stay beside the float copy that computes."""
    from pagellm.model.loader.model_checks import expected_shapes

    fb = FLOAT_BYTES[dtype]
    embed, head = ("token_embd", "output") if gguf_names else ("model.embed_tokens", "lm_head")
    groups: dict[tuple, list[tuple[str | None, int]]] = {}
    floats = 0
    for name, shape in expected_shapes(cfg, gguf_names)[0].items():
        module, _, part = name.rpartition(".")
        if module in (embed, head):
            continue
        if len(shape) == 1:  # norms, and biases where the model has them
            floats += shape[0] if part == "weight" or cfg.attention_bias else 0
            continue
        parts = module.split(".")
        key = (next(p for p in parts if p.isdigit()), _FUSED.get(parts[-1], parts[-1]))
        groups.setdefault(key, []).append((kind_of(module), math.prod(shape)))
    if blocks:
        total = _layers_bytes(groups, fb)
    else:
        total = sum(n for shards in groups.values() for _, n in shards) * fb
        total += _layers_bytes(groups, 0) if kept_beside else 0
    total += floats * fb
    vocab, head_kind = cfg.vocab_size * cfg.hidden_size, kind_of(head)
    if blocks and head_kind:  # a tied head's blocks serve the lookups; an untied embedding stays float
        total += vocab * kind_bytes_per_weight(head_kind) + (0 if cfg.tie_word_embeddings else vocab * fb)
    elif kept_beside and head_kind:  # the float embedding, the head's float copy and its blocks beside it
        total += vocab * (2 * fb + kind_bytes_per_weight(head_kind))
    else:  # a float embedding and a float head (a tied one keeps its transposed copy)
        total += 2 * vocab * fb
    return int(total)


def gguf_weight_bytes(path: str, cfg: ModelConfig, dtype: str, blocks: bool) -> int:
    """What the engine holds for a GGUF file's tensors; blocks: the platform's kernels read the blocks."""
    from pagellm.model.loader.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        types = {name: t.qtype.name for name, t in f.tensors.items()}

    def kind_of(module: str) -> str | None:  # a tied model's head is its embedding
        qtype = types.get(module + ".weight", types.get("token_embd.weight") if module == "output" else None)
        return GGUF_KINDS.get(qtype)

    return _held_bytes(cfg, True, kind_of, dtype, blocks)


def _hf_headers(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (dtype, shape), from the shards the loader reads (safetensors_files)."""
    from pagellm.model.loader.hf_loader import safetensors_files
    from pagellm.model.loader.safetensors_header import read_safetensors_header

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in safetensors_files(path):
        out.update(read_safetensors_header(shard))
    return out


def _scheme_kind(args) -> str:
    """A quantized module's block kind (pagellm/quant/formats.py: how GPTQ, AWQ, FP8 and compressed-tensors
    map onto the kinds)."""
    if args.type == "float":
        return "fp8_e4m3"
    if args.bits == 4:
        return "q4_1"
    return "q8_0" if args.symmetric else "q8_1"


def hf_weight_bytes(path: str, cfg: ModelConfig, dtype: str, blocks: bool, quantization: str | None) -> int:
    """What the engine holds for a Hugging Face directory: its quantization_config's modules in block kinds
    (blocks: the platform's kernels read them), or every Linear quantized at load (quantization int8 / int4)."""
    from pagellm.quant.hf_formats.quant_config import read_quant_config

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = read_quant_config(path, json.load(f))
    headers = _hf_headers(path)
    rtn = {"int4": "q4_1", "int8": "q8_0"}.get(quantization or "")

    def kind_of(module: str) -> str | None:
        """The module's block kind, None where it stays float (not stored quantized: an ignored module, a
        tied or float LM head)."""
        if rtn:
            return rtn
        scheme = None if qc is None else qc.scheme_for(module)
        weight = headers.get(module + ".weight")
        stored = weight[0] not in ("F32", "F16", "BF16") if weight else \
            module + ".qweight" in headers or module + ".weight_packed" in headers
        return _scheme_kind(scheme) if scheme is not None and stored else None

    # act-order: each quantized layer's column order (int64), where blocks are what computes
    h, d = cfg.hidden_size, cfg.head_dim
    perms = 8 * cfg.num_hidden_layers * (2 * h + cfg.num_attention_heads * d + cfg.intermediate_size) \
        if blocks and qc is not None and qc.desc_act and not rtn else 0
    # without block kernels, blocks still arrive beside the float copy for quantized-at-load layers and W8A8
    # FP8 ones (those round their inputs to e4m3 from the blocks' form)
    kept_beside = bool(rtn) or (qc is not None and qc.method == "fp8")
    return _held_bytes(cfg, False, kind_of, dtype, blocks, kept_beside) + perms
