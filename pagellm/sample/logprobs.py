"""The one place logprobs are computed: float32 log-softmax of raw logits (vLLM's default: before any
processing), so sampled, verified and beam tokens report the same numbers for the same logits."""

import torch


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)
