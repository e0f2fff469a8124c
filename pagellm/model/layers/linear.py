"""A Linear layer whose weight format decides how it computes (`pagellm.quant`).

y = x @ W_t (+ b). The layer holds the weights (`weight_t` [in, out], optional `bias`, and `packed` when a
block format came from the checkpoint); its `quant_method` does the arithmetic. `shards` checkpoint
matrices may be fused into one layer (q/k/v: 3, gate/up: 2).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagellm.platforms.base import OpChoices
from pagellm.quant.formats import PackedWeight
from pagellm.quant.linear_method import GGUFBlocksLinearMethod, LinearMethod, UnquantizedLinearMethod

logger = logging.getLogger("pagellm")
_UNFUSED_SAID: set[tuple[int, int]] = set()  # fused layers' shapes whose shards' blocks could not be fused


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shards: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.shards = in_features, out_features, shards
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, bias)
        self.packed: PackedWeight | None = None
        self.weight_bf16: torch.Tensor | None = None  # [out, in], where the platform chose bf16 GEMMs
        self.amx_blocks = None  # q4_1/q8_0 blocks in AMX tile order (kernels/amx.py) where the platform chose AMX
        self.int8_tiles = None  # q4_1/q8_0 blocks for the few-row int8-activation products (kernels/int8_tiles.py)
        self.bf16_out = False  # bf16 products return bfloat16 (set by a module whose next product takes it)
        self._packed_shards: dict[int, PackedWeight] = {}
        self.reduce = None  # row-parallel (tensor parallelism): the all-reduce that sums the ranks' parts
        self.logits_head = False  # the model's output layer (set by the model: OpChoices.int8_head)

    def configure(self, choices: OpChoices) -> None:
        """Before loading: the kernels this layer's method may use (the platform's choice)."""
        self.quant_method = UnquantizedLinearMethod(choices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.quant_method.choices.bf16_gemm and not self.bf16_rows(x.shape[0]):
            x = x.float()  # --dtype auto: a bf16 activation meeting a float32 path (layers of other GGUF kinds)
        y = self.quant_method.apply(self, x)
        if self.reduce is None:
            return y
        if self.bf16_out and self.quant_method.choices.bf16_gemm:
            y = y.float()  # --dtype auto: the ranks sum float32 parts, not a bf16 product's output
        return self.reduce(y)

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This layer applied to silu(gate) * up of an MLP's gate/up output, where its method fuses the two
        (None otherwise: the caller runs the activation and then the layer)."""
        y = self.quant_method.silu_mul_apply(self, gate_up)
        if y is None or self.reduce is None:
            return y
        return self.reduce(y)

    def shard(self, rows: torch.Tensor | None = None, columns: tuple[int, int] | None = None, rank: int = 0,
              reduce=None) -> None:
        """Keep output `rows` (column-parallel), or input `columns` start:end (row-parallel: the ranks'
        products are partial sums, added by `reduce`; only rank 0 adds the bias). Every copy of the weight
        is cut: float [in, out], bfloat16 [out, in], packed blocks."""
        wt, bf, packed = self.weight_t, self.weight_bf16, self.packed
        if bf is not None and bf.is_mkldnn:  # reordered for oneDNN by a product already
            bf = bf.to_dense()
        if rows is not None:
            if wt.numel():
                wt.data = wt.data[:, rows].contiguous()
            if self.bias is not None:
                self.bias.data = self.bias.data[rows].contiguous()
            self.weight_bf16 = None if bf is None else bf[rows].contiguous()
            self.packed = None if packed is None else packed.rows(rows)
            self.out_features = len(rows)
        else:
            a, b = columns
            if wt.numel():
                wt.data = wt.data[a:b].contiguous()
            if self.bias is not None and rank != 0:
                self.bias = None
            self.weight_bf16 = None if bf is None else bf[:, a:b].contiguous()
            self.packed = None if packed is None else packed.columns(a, b)
            self.in_features, self.reduce = b - a, reduce
        if self.amx_blocks is not None or self.int8_tiles is not None:  # the tile orders of the cut blocks
            self.quant_method.pack_tile_orders(self)
        self.quant_method.prepack_bf16(self)  # the cut bf16 copy in oneDNN's layout again

    def drop_weights(self) -> None:
        """Another pipeline stage computes with this layer: free every copy."""
        self.weight_t.data = torch.empty(0, 0)
        self.weight_bf16 = self.packed = self.amx_blocks = self.int8_tiles = None

    def bf16_rows(self, rows: int) -> bool:
        return self.quant_method.bf16_rows(self, rows)

    def rounds_input_to_bf16(self, rows: int) -> bool:
        """Whether a product of this many rows rounds its input to bfloat16 before anything else, so that an input
        rounded already gives it the same bits (a norm may then hand it bf16 rows). Not W8A8 FP8 layers: they
        round their input to e4m3 by a scale taken from the float32 row."""
        return self.bf16_rows(rows) and not (self.packed is not None and self.packed.act_fp8)

    @property
    def int8_activations(self) -> int:
        return self.quant_method.int8_activations

    def load_shard(self, start: int, tensor: torch.Tensor) -> None:
        self.quant_method.load_shard(self, start, tensor)

    def add_packed_shard(self, shard: int, weight: PackedWeight) -> None:
        """Block-format shards; when all have come, in one kind or in kinds one kind holds exactly
        (PackedWeight.unify), the layer computes with them."""
        self._packed_shards[shard] = weight
        if sorted(self._packed_shards) != list(range(self.shards)):
            return
        packed = PackedWeight.cat(PackedWeight.unify([self._packed_shards[i] for i in range(self.shards)]))
        self._packed_shards = {}
        if packed is None and (self.out_features, self.in_features) not in _UNFUSED_SAID:
            # said (once per shape, not per layer), since it costs memory and speed; rare: GPTQ shares one
            # column order per input
            _UNFUSED_SAID.add((self.out_features, self.in_features))
            logger.warning("a fused layer [%d, %d]: its shards' blocks differ (kinds or act-order column orders "
                           "that no common form holds): it computes with float weights",
                           self.out_features, self.in_features)
        if packed is not None and (packed.in_features, packed.out_features) == (self.in_features,
                                                                                 self.out_features):
            self.packed = packed
            self.quant_method = GGUFBlocksLinearMethod(self.quant_method.choices)
            self.quant_method.process_after_loading(self)  # frees the float copy at once when asked to

    def process_after_loading(self) -> None:
        """After every tensor is in: a layer that stayed unquantized lets its method finish it (a layer
        that switched to blocks was finished when they arrived)."""
        self._packed_shards = {}  # an incomplete set (some shard came as float only) stays unused
        if self.packed is None:
            self.quant_method.process_after_loading(self)
