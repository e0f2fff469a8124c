"""Prompt logprobs: for prompt positions p, how likely the model found prompt token p + 1, its rank in the
vocabulary and the top-N alternatives. Computed from the same float32 log-softmax as sampled logprobs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagellm.sample.logprobs import log_softmax


class PromptLogprobRow(NamedTuple):
    """The entry for one prompt token (the one after the position whose logits scored it)."""

    logprob: float
    rank: int  # 1 + the number of tokens the model found strictly more likely (vLLM's rank)
    top_ids: list[int]
    top_logprobs: list[float]


def prompt_logprob_rows(logits: torch.Tensor, next_ids: torch.Tensor, top_n: int) -> list[PromptLogprobRow]:
    """logits [R, vocab] at R prompt positions; next_ids [R] the prompt tokens that followed them."""
    lp = log_softmax(logits)
    chosen = lp.gather(1, next_ids.view(-1, 1)).view(-1)
    ranks = ((lp > chosen.view(-1, 1)).sum(dim=1) + 1).tolist()
    if top_n:
        top = lp.topk(top_n, dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    else:
        ids = vals = [[] for _ in ranks]
    return [PromptLogprobRow(c, r, i, v) for c, r, i, v in zip(chosen.tolist(), ranks, ids, vals, strict=True)]
