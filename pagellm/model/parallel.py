"""Splitting a loaded model across tensor-parallel ranks and pipeline stages (Megatron-style).

Tensor parallelism (T ranks): q/k/v and gate/up are column-parallel (each rank keeps its heads' and its
MLP columns' output rows), o_proj and down_proj row-parallel (the matching input columns, then one
all-reduce each), the embedding and LM head vocab-parallel (each rank a contiguous range of token ids;
lookups outside it give zeros and are summed, logits are gathered). KV heads are split, or replicated when T
is a multiple of their count. Pipeline parallelism (P stages): each stage keeps a contiguous range of layers
(the first ones one more when P does not divide them); the first keeps the embedding, the last the final
norm and the head.

Every weight format splits the same way, through `Linear.shard`: float copies are sliced, block formats
(`PackedWeight`) are cut along output rows, or along input columns at block boundaries. The model is
loaded whole, then cut (each rank's copy holds the full model only while it loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.model.loader.model_loader import int8_prompt_rows_in_every_layer_or_none
from pagellm.model_config import ModelConfig
from pagellm.plan import kv_heads_per_rank


@dataclass
class ParallelInfo:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    group: object = None  # the tensor-parallel GlooGroup (all_reduce, all_gather); None while tp_size is 1
    vocab_per_rank: int = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.tp_size == 1 else self.group.all_reduce(t)

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab_per_rank] on each rank -> [rows, vocab] everywhere (the last rank's range is padded)."""
        if self.tp_size == 1:
            return logits
        n = self.vocab_per_rank
        if logits.shape[1] < n:
            logits = torch.nn.functional.pad(logits, (0, n - logits.shape[1]))
        return torch.cat(self.group.all_gather(logits), dim=1)[:, :vocab]


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of a stage's layers: contiguous, the first `num_layers % pp_size` stages one more."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def check_splittable(cfg: ModelConfig, tp: int, pp: int) -> None:
    """A clear error, naming the sizes, for a model that cannot be split tp x pp ways."""
    kv_heads_per_rank(cfg, tp)  # heads divisible by tp; KV heads split or replicated
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the MLP's {cfg.intermediate_size} columns")
    if not 1 <= pp <= cfg.num_hidden_layers:
        raise ValueError(f"pipeline parallel size {pp} must be between 1 and the {cfg.num_hidden_layers} layers")


def shard_model(model: nn.Module, info: ParallelInfo) -> nn.Module:
    cfg: ModelConfig = model.config
    tp, r = info.tp_size, info.tp_rank
    check_splittable(cfg, tp, info.pp_size)
    start, end = stage_layers(cfg.num_hidden_layers, info.pp_rank, info.pp_size)
    model.layer_range = (start, end)
    for i, layer in enumerate(model.layers):
        if not start <= i < end:
            model.layers[i] = nn.Module()  # another stage's layer: its weights are freed
        elif tp > 1:
            _shard_attention(layer.self_attn, cfg, tp, r, info)
            _shard_mlp(layer.mlp, cfg, tp, r, info)
    info.vocab_per_rank = math.ceil(cfg.vocab_size / tp)
    lo, hi = r * info.vocab_per_rank, min(cfg.vocab_size, (r + 1) * info.vocab_per_rank)
    first, last = info.pp_rank == 0, info.pp_rank == info.pp_size - 1
    emb, head = model.embed_tokens, model.lm_head
    if first and tp > 1:
        if emb.weight.numel():
            emb.weight.data = emb.weight.data[lo:hi].contiguous()
        emb.vocab_range, emb.reduce = (lo, hi), info.all_reduce
    if not first:
        emb.weight.data, emb.tied_head = torch.empty(0, cfg.hidden_size), None
    if last or emb.tied_head is head:  # the head (or the rows a tied embedding reads) stays
        if tp > 1:
            head.shard(rows=torch.arange(lo, hi))
    else:
        head.drop_weights()
    model.parallel = info
    if tp > 1:
        int8_prompt_rows_in_every_layer_or_none(model)
    return model


def _shard_attention(attn: nn.Module, cfg: ModelConfig, tp: int, r: int, info: ParallelInfo) -> None:
    d = attn.head_dim
    heads = attn.num_heads // tp
    kv_heads = kv_heads_per_rank(cfg, tp)
    # the KV heads this rank's query heads read: its own share, or the one its query heads all map to
    kv0 = r * kv_heads if cfg.num_key_value_heads % tp == 0 else (r * heads) // (attn.num_heads // attn.num_kv_heads)
    q_rows = torch.arange(r * heads * d, (r + 1) * heads * d)
    kv = torch.arange(kv0 * d, (kv0 + kv_heads) * d)
    attn.qkv_proj.shard(rows=torch.cat([q_rows, attn.q_size + kv, attn.q_size + attn.kv_size + kv]))
    attn.o_proj.shard(columns=(r * heads * d, (r + 1) * heads * d), rank=r, reduce=info.all_reduce)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d


def _shard_mlp(mlp: nn.Module, cfg: ModelConfig, tp: int, r: int, info: ParallelInfo) -> None:
    n = cfg.intermediate_size // tp
    cols = torch.arange(r * n, (r + 1) * n)
    mlp.gate_up_proj.shard(rows=torch.cat([cols, cfg.intermediate_size + cols]))
    mlp.down_proj.shard(columns=(r * n, (r + 1) * n), rank=r, reduce=info.all_reduce)
    mlp.intermediate_size = n

