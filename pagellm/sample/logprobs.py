"""The one place logprobs are computed: float32 log-softmax of raw logits (vLLM's default: before any
processing), so sampled, verified and beam tokens report the same numbers for the same logits."""

import torch


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones; a NaN counts as largest), as
    `x.argmax(dim=-1)`: torch's CPU `max(dim)` returns the same indices 2.5-3x faster (64 x 49,152 float32
    logits: 0.80 vs 2.0 ms on the Xeon VM; identical on ties, NaN and all -inf rows, checked in
    tests/test_sampler.py)."""
    return x.max(dim=-1).indices
