import torch
from torch import nn

from pagellm.kernels import ops


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, the order transformers uses.

    With a residual, adds it first and returns (normed, sum): the sum is the next residual stream
    (x is updated in place on the native path, so callers pass a tensor they own)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if ops.available(x) and x.is_contiguous():
            out = ops.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, x)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
