import torch
import torch.nn.functional as F

from pagellm.kernels import ops
from pagellm.model.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(gate_up)
