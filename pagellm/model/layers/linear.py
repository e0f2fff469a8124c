"""A Linear layer that keeps its weight transposed ([in, out], contiguous), and optionally a packed
(GGUF block-format) copy for few-row products.

y = x @ W_t (+ b). On this project's CPU a batch-1 decode step streams weights from memory about 1.9x
faster in this layout than through F.linear's [out, in] one, and batched steps are within a few percent
either way (benchmarks/NOTES.md). Checkpoints hold [out, in]; load_weights transposes once.
A packed copy holds the same weights in 4-6x fewer bytes; decode and verification steps (at most
PACKED_MAX_ROWS rows) read that one through the native kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import blas, ops
from pagellm.model.layers.quant import PACKED_MAX_ROWS, PackedWeight


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shards: int = 1):
        super().__init__()
        self.shards = shards  # checkpoint matrices fused into this one (q/k/v: 3, gate/up: 2)
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedWeight | None = None
        self.int8_activations = False  # packed products with int8 x (LLMEngine sets it from EngineArgs)
        self._packed_shards: dict[int, PackedWeight] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS and ops.available(x):
            y = ops.packed_linear(x, self.packed, self.int8_activations)
        elif self.packed is not None and self.weight_t.numel() == 0:  # float32 copy dropped
            y = blas.packed_matmul(x, self.packed)
            if y is None:  # no OpenBLAS here: dequantize the whole matrix for this call
                y = x @ self.packed.dequantize().t()
        else:
            return blas.matmul(x, self.weight_t, self.bias)
        return y if self.bias is None else y.add_(self.bias)

    def drop_float_weight(self) -> int:
        """Frees the float32 weight when a packed copy can stand in for it; returns the bytes freed."""
        if self.packed is None or self.weight_t.numel() == 0:
            return 0
        freed = self.weight_t.numel() * self.weight_t.element_size()
        self.weight_t.data = torch.empty(0, 0)
        return freed

    def add_packed_shard(self, shard: int, weight: PackedWeight) -> None:
        self._packed_shards[shard] = weight

    def packing_complete(self) -> bool:
        return sorted(self._packed_shards) == list(range(self.shards))

    def finish_packing(self) -> None:
        """Keeps a packed copy only when every shard of the fused weight came packed, in one format."""
        shards = self._packed_shards
        self._packed_shards = {}
        if sorted(shards) != list(range(self.shards)):
            return
        packed = PackedWeight.cat([shards[i] for i in range(self.shards)])
        if packed is not None and (packed.in_features, packed.out_features) == tuple(self.weight_t.shape):
            self.packed = packed
