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
_GGUF_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}
_HF_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


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


def gguf_weight_bytes(path: str, cfg: ModelConfig, dtype: str, blocks: bool) -> int:
    """What the engine holds for a GGUF file's tensors; blocks: the platform's kernels read the blocks."""
    from pagellm.model.loader.gguf_reader import GGUFFile

    fb = FLOAT_BYTES[dtype]
    with GGUFFile(path) as f:
        tensors = {name: (t.qtype.name, math.prod(t.shape), len(t.shape)) for name, t in f.tensors.items()}
    groups: dict[tuple, list[tuple[str | None, int]]] = {}
    floats = 0
    embed = tensors.get("token_embd.weight")
    for name, (qtype, n, ndim) in tensors.items():
        if name in ("token_embd.weight", "rope_freqs.weight"):  # the embedding below; rope_freqs is no weight
            continue
        if ndim != 2:  # norms, biases
            floats += n
            continue
        parts = name.split(".")
        key = (parts[1], _GGUF_FUSED.get(parts[2], parts[2])) if parts[0] == "blk" else (name,)
        groups.setdefault(key, []).append((GGUF_KINDS.get(qtype) if blocks else None, n))
    total = _layers_bytes(groups, fb) + floats * fb
    if embed is not None:
        qtype, n, _ = embed
        head_kind = GGUF_KINDS.get(qtype) if blocks else None
        if cfg.tie_word_embeddings:  # blocks: the head's serve the lookups; float: the embedding and the head's copy
            total += n * kind_bytes_per_weight(head_kind) if head_kind else 2 * n * fb
        else:
            total += n * fb
    return int(total)


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

    fb = FLOAT_BYTES[dtype]
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = read_quant_config(path, json.load(f))
    headers = _hf_headers(path)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"q_proj": cfg.num_attention_heads * d * h, "k_proj": cfg.num_key_value_heads * d * h,
              "v_proj": cfg.num_key_value_heads * d * h, "o_proj": h * cfg.num_attention_heads * d,
              "gate_proj": inter * h, "up_proj": inter * h, "down_proj": h * inter}
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

    groups: dict[tuple, list[tuple[str | None, int]]] = {}
    perms = 0
    for i in range(cfg.num_hidden_layers):
        for m in _HF_MODULES:
            module = f"model.layers.{i}.{m}"
            short = m.split(".")[1]
            fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
            groups.setdefault((i, fused.get(short, short)), []).append((kind_of(module), shapes[short]))
        if qc is not None and qc.desc_act and not rtn:  # act-order: each quantized layer's column order, int64
            perms += 8 * (2 * h + cfg.num_attention_heads * d + inter)
    layers = _layers_bytes(groups, fb) if blocks else sum(w for g in groups.values() for _, w in g) * fb
    # without block kernels the float copy computes, and the blocks stay beside it where they still arrive:
    # quantized at load, and W8A8 FP8 (its layers round their inputs to e4m3 from the blocks' form)
    kept_beside = rtn or (qc is not None and qc.method == "fp8")
    if not blocks and kept_beside:
        layers += _layers_bytes(groups, 0)
    vocab = cfg.vocab_size * h
    head_kind = kind_of("lm_head")
    norms = (2 * cfg.num_hidden_layers + 1) * h
    biases = cfg.num_hidden_layers * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d \
        if cfg.attention_bias else 0
    total = layers + perms * bool(blocks) + (norms + biases) * fb
    if blocks and head_kind:
        total += vocab * kind_bytes_per_weight(head_kind) + (0 if cfg.tie_word_embeddings else vocab * fb)
    elif rtn:  # (no block kernels) the float embedding, the head's float copy and its blocks beside it
        total += vocab * (2 * fb + kind_bytes_per_weight(rtn))
    else:  # a float embedding and a float head (a tied one keeps its transposed copy)
        total += 2 * vocab * fb
    return int(total)
