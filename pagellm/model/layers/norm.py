import torch

from pagellm.kernels import ops
from pagellm.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """Normalises in float32 and scales in the input dtype, the order transformers uses.

    With a residual, adds it first and returns (normed, sum): the sum is the next residual stream
    (x is updated in place by forward_cpu, so callers pass a tensor they own)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not x.is_contiguous():  # the kernel walks rows of C floats
            return self.forward_native(x, residual)
        out = ops.add_rmsnorm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
