"""What a deployment needs per rank, and whether it fits: the arithmetic behind `pagellm plan`.

KV cache per token per rank = 2 (K and V) x layers/PP x KV heads/TP x head_dim x bytes per element.
Tensor parallelism splits heads and MLP columns (KV heads are replicated when TP exceeds their count
and is a multiple of it); pipeline parallelism gives each stage a contiguous range of layers. Whatever
device memory the utilization leaves after weights and the activation workspace holds KV blocks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pagellm.model_config import ModelConfig

# Bytes per element. int4 weights carry an fp16 scale and zero per group of 128 (1/32 byte per weight).
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0,
               "int8": 1.0, "int4": 0.5 + 4 / 128}


def dtype_bytes(name: str) -> float:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_heads_per_rank(cfg: ModelConfig, tp: int) -> int:
    """KV heads one tensor-parallel rank holds; a clear error when the model cannot be split tp ways."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1 or heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the {heads} attention heads")
    if kv % tp == 0:
        return kv // tp
    if tp % kv == 0:
        return 1  # each KV head replicated on tp / kv ranks
    raise ValueError(f"tensor parallel size {tp} neither divides the {kv} KV heads nor is a multiple of them")


def layers_per_stage(cfg: ModelConfig, pp: int) -> int:
    """The largest stage's layer count (stages get contiguous ranges, the first ones one more)."""
    if pp < 1 or pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline parallel size {pp} must be between 1 and the {cfg.num_hidden_layers} layers")
    return math.ceil(cfg.num_hidden_layers / pp)


# An int8 KV row carries its float16 scale after the head_dim codes (pagellm/quant/kv_cache.py).
KV_ROW_EXTRA_BYTES = {"int8": 2}


def kv_row_bytes(head_dim: int, kv_dtype: str | float) -> float:
    """Bytes of one token's key (or value) for one KV head: a dtype name, or bytes per element."""
    if isinstance(kv_dtype, str):
        return head_dim * dtype_bytes(kv_dtype) + KV_ROW_EXTRA_BYTES.get(kv_dtype, 0)
    return head_dim * kv_dtype


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str | float, tp: int = 1, pp: int = 1) -> int:
    """2 x L/PP x H_KV/TP x d_head x bytes: one token's keys and values on the busiest rank. The engine sizes
    its own cache with this (LLMEngine's kv_bytes_per_block)."""
    return int(2 * layers_per_stage(cfg, pp) * kv_heads_per_rank(cfg, tp) * kv_row_bytes(cfg.head_dim, kv_dtype))


def weight_bytes_per_rank(cfg: ModelConfig, weight_dtype_bytes: float, embed_dtype_bytes: float,
                          tp: int = 1, pp: int = 1) -> int:
    """Parameters on the busiest rank: its share of a stage's layers plus, on the first and last stage,
    the vocabulary-parallel embedding and LM head (one copy when tied and PP = 1)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = cfg.num_attention_heads * d
    kv = kv_heads_per_rank(cfg, tp) * d
    matrices = (h * q + q * h + 3 * h * i) / tp + 2 * h * kv  # q, o, MLP split; k, v per rank's heads
    per_layer = matrices * weight_dtype_bytes + 2 * h * embed_dtype_bytes  # two norms, replicated
    if cfg.attention_bias:
        per_layer += (q / tp + 2 * kv) * embed_dtype_bytes
    vocab = cfg.vocab_size * h / tp * embed_dtype_bytes
    first = vocab  # embedding
    last = (0 if cfg.tie_word_embeddings and pp == 1 else vocab) + h * embed_dtype_bytes  # head, final norm
    ends = first + last if pp == 1 else max(first, last)
    return int(layers_per_stage(cfg, pp) * per_layer + ends)


def workspace_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, act_bytes: float,
                    tp: int = 1) -> int:
    """The largest live intermediates of one step (an estimate, not a profile): hidden state and residual,
    the fused q/k/v and gate/up outputs of max_num_batched_tokens rows, and float32 logits of one row per
    sequence."""
    t, h = max_num_batched_tokens, cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim / tp
    rows = t * (2 * h + qkv + 3 * cfg.intermediate_size / tp) * act_bytes
    return int(rows + max_num_seqs * cfg.vocab_size * 4)


@dataclass
class MemoryPlan:
    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    device_bytes: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    block_size: int
    weights_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    workspace_bytes_per_rank: int
    kv_cache_bytes_per_rank: int  # what is left for KV blocks (negative: weights alone do not fit)
    kv_blocks: int
    kv_tokens: int
    kv_bytes_per_sequence: int  # one sequence of max_model_len tokens, on one rank
    max_batch_at_max_model_len: int
    fits: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def plan_memory(cfg: ModelConfig, model: str, device_bytes: int, tp: int = 1, pp: int = 1,
                dtype: str = "bfloat16", kv_cache_dtype: str = "auto", weight_format: str | None = None,
                max_model_len: int | None = None, max_num_seqs: int = 1, block_size: int = 16,
                max_num_batched_tokens: int = 2048, utilization: float = 0.9,
                weights_bytes: int | None = None) -> MemoryPlan:
    """weight_format: int8/int4/fp8 for quantized matrices (default: dtype), for a preset's what-if.
    weights_bytes: what the engine holds for a real checkpoint (plan/weights.py), split over ranks as the
    parameter count is."""
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    kv_name = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    act = dtype_bytes(dtype)
    weights = weight_bytes_per_rank(cfg, dtype_bytes(weight_format or dtype), act, tp, pp)
    if weights_bytes is not None:  # the real total times this rank's share of the parameters
        share = weight_bytes_per_rank(cfg, 1.0, 1.0, tp, pp) / weight_bytes_per_rank(cfg, 1.0, 1.0)
        weights = int(weights_bytes * share)
    per_token = kv_bytes_per_token(cfg, kv_name, tp, pp)
    workspace = workspace_bytes(cfg, max_num_batched_tokens, max_num_seqs, act, tp)
    max_len = max_model_len or cfg.max_position_embeddings
    budget = int(device_bytes * utilization) - weights - workspace
    blocks = max(0, budget) // (per_token * block_size)
    per_seq_blocks = math.ceil(max_len / block_size)
    batch = blocks // per_seq_blocks
    if budget <= 0:
        fits, reason = False, (f"weights ({weights / 1e9:.2f} GB) and workspace ({workspace / 1e9:.2f} GB) exceed "
                               f"{utilization:.0%} of {device_bytes / 1e9:.1f} GB")
    elif batch < max_num_seqs:
        fits, reason = False, (f"{blocks} KV blocks hold {batch} sequences of {max_len} tokens, "
                               f"{max_num_seqs} were asked for")
    else:
        fits, reason = True, f"{batch} sequences of {max_len} tokens fit"
    return MemoryPlan(model, tp, pp, dtype, kv_name, device_bytes, utilization, max_len, max_num_seqs, block_size,
                      weights, per_token, workspace, budget, blocks, blocks * block_size,
                      per_token * max_len, batch, fits, reason)


def smallest_parallelism(plan_for, max_ranks: int = 64) -> tuple[int, int] | None:
    """The smallest TP x PP (TP first, up to 8 per node; then PP) for which plan_for(tp, pp).fits."""
    candidates = sorted(((tp, pp) for tp in (1, 2, 4, 8) for pp in range(1, max_ranks + 1)
                         if tp * pp <= max_ranks), key=lambda c: (c[0] * c[1], c[1]))
    for tp, pp in candidates:
        try:
            if plan_for(tp, pp).fits:
                return tp, pp
        except ValueError:  # the model cannot be split this way
            continue
    return None
