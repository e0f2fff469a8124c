import torch

from pagellm.kernels import ops
from pagellm.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """Normalises in float32 and scales in the input dtype, the order transformers uses.

    With a residual, adds it first and returns (normed, sum): the sum is the next residual stream
    (forward_cpu updates x in place, or the residual when x is bfloat16, so callers pass tensors they own).
    A bfloat16 x (a bf16 product's output under --dtype auto) is summed in float32, as x.float() would be.
    bf16_out (forward_cpu): the caller's next product rounds its input to bfloat16 anyway; the output may then
    come in bfloat16 (forward_native ignores it: the product rounds)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None, bf16_out: bool = False):
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None, bf16_out: bool = False):
        """bf16_out: the output feeds a product that rounds it to bfloat16 first (--dtype auto, many rows), so it
        may come in bfloat16, rounded here (the same bits, without a float32 tensor and a cast pass between)."""
        if bf16_out and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32) and (
                residual.dtype == torch.float32 and residual.is_contiguous() if residual is not None
                else x.dtype == torch.float32):
            out = ops.rmsnorm_to_bf16(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual if x.dtype == torch.bfloat16 else x)
        if x.dtype == torch.bfloat16:  # a bf16 product's output (--dtype auto): summed into the residual
            if residual is not None and residual.dtype == torch.float32 and x.is_contiguous() \
                    and residual.is_contiguous():
                return ops.add_bf16_rmsnorm(x, residual, self.weight, self.eps), residual
            x = x.float()
        if not x.is_contiguous():  # the kernel walks rows of C floats
            return self.forward_native(x, residual)
        out = ops.add_rmsnorm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
