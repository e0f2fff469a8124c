"""A Linear layer that keeps its weight transposed ([in, out], contiguous).

y = x @ W_t (+ b). On this project's CPU a batch-1 decode step streams weights from memory about 1.9x
faster in this layout than through F.linear's [out, in] one, and batched steps are within a few percent
either way (benchmarks/NOTES.md). Checkpoints hold [out, in]; load_weights transposes once.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)
