"""How a Linear layer computes with its weights, one LinearMethod per weight format.

A layer keeps its float weight transposed (`weight_t`, [in, out], contiguous: a batch-1 step streams it
about 1.9x faster than F.linear's [out, in] layout here, benchmarks/NOTES.md) and, for GGUF block formats,
a `packed` copy. A GGUF file declares its format per tensor, so a layer starts unquantized and switches
to `GGUFBlocksLinearMethod` when all of its shards have arrived in one block format (loader order: each
tensor's float form, then its blocks). Which kernels a method calls was decided once by the platform
(`OpChoices`); nothing here probes hardware.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pagellm.kernels import amx, blas, int8_tiles, ops
from pagellm.platforms.base import OpChoices
from pagellm.quant.formats import PACKED_MAX_ROWS, PackedWeight


class _Step:
    drafts = 0  # speculative draft rows in the forward (and its sampled logits) now running
    rows: int | None = None  # the forward's rows, where its products count them instead of their own (step_rows)
    prompt = False  # the forward runs prompt chunks (prompt_step)


@contextlib.contextmanager
def drafts_in_step(drafts: int) -> Iterator[None]:
    """Set by the model runner around a forward and its logits: how many of their rows are drafts."""
    old, _Step.drafts = _Step.drafts, drafts
    try:
        yield
    finally:
        _Step.drafts = old


@contextlib.contextmanager
def step_rows(rows: int | None) -> Iterator[None]:
    """Set by the model runner around a forward whose last layer runs only the sampled rows: every product
    picks its path by the step's rows, so a kept row gets the arithmetic it would get unpruned (and the
    one-call decoder's, which computes every row)."""
    old, _Step.rows = _Step.rows, rows
    try:
        yield
    finally:
        _Step.rows = old


@contextlib.contextmanager
def prompt_step(prompt: bool) -> Iterator[None]:
    """Set by the model runner around a forward of prompt chunks (or of a step that has any): where the platform
    chose one-plane int8 for them (OpChoices.int8_many_rows) their products take it at any row count, and the
    decode rows of other forwards never do, so a row's arithmetic depends on its kind, not on how its prompt was
    chunked or which rows shared its step (speculative decoding stays lossless)."""
    old, _Step.prompt = _Step.prompt, prompt
    try:
        yield
    finally:
        _Step.prompt = old


def in_prompt_step() -> bool:
    return _Step.prompt


def path_rows(rows: int, choices: OpChoices) -> int:
    """The rows a product counts when it picks its path. Where the paths are float32 and bf16 (`--dtype auto`
    with bf16 GEMMs), speculative drafts do not count: a verification step of 4 requests x 5 rows computes
    as the 4-row plain step does (few-row float32 kernels), not on the bf16 copies, so drafts never change
    a token's arithmetic and speculation stays lossless. (Between the float32 kernels and the float32
    GEMM only the rounding order differs, so there rows count as they are.)"""
    if _Step.rows is not None:
        rows = _Step.rows
    return rows - _Step.drafts if choices.bf16_gemm else rows


def torch_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x @ w if bias is None else torch.addmm(bias, x, w)


class LinearMethod:
    name = "base"

    def __init__(self, choices: OpChoices | None = None):
        self.choices = choices or OpChoices()
        # float32 many-row products: numpy's OpenBLAS where the platform chose it, else torch's GEMM
        self.gemm = blas.matmul if self.choices.blas_gemm else torch_matmul
        # the most rows a product takes the few-row kernels (packed blocks) or float32 for
        self.max_rows = self.choices.packed_max_rows or PACKED_MAX_ROWS

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        layer.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_shard(self, layer: nn.Module, start: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint matrix [rows, in] into output rows start:start+rows (q/k/v or gate/up fused)."""
        dst = layer.weight_t.narrow(1, start, tensor.shape[0])
        if dst.shape != tensor.t().shape:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit {tuple(dst.t().shape)}")
        dst.copy_(tensor.t())

    def process_after_loading(self, layer: nn.Module) -> None:
        if self.choices.bf16_gemm:
            layer.weight_bf16 = self.float_weight(layer).to(torch.bfloat16).contiguous()
            self.prepack_bf16(layer)

    def prepack_bf16(self, layer: nn.Module) -> None:
        """Reorders the bf16 copy into oneDNN's blocked layout now, at load (and after a tensor-parallel cut),
        where the platform chose prepacked products. Done lazily at the first product, the model's ~150
        reorders made the first step of more rows than the block kernels take ~150-300 ms slower (the serve
        workload's first 2,048-token step on the AMX Xeon: 534-555 ms against 345-390 for the next ones):
        the first burst's time to first token paid it."""
        if self.choices.bf16_prepacked and layer.weight_bf16 is not None and not layer.weight_bf16.is_mkldnn:
            layer.weight_bf16 = torch.ops.mkldnn._reorder_linear_weight(layer.weight_bf16, 64)

    def float_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as float32 [out, in] (for the bfloat16 copy)."""
        return layer.weight_t.t()

    def bf16_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T on bfloat16 copies with float32 accumulation (oneDNN), widened to float32 (+ bias); bfloat16
        for a layer that feeds another bf16 product (`bf16_out`: the MLP's gate/up), saving two cast passes
        over its widest activations. x may come in bfloat16 already (the down projection). oneDNN rounds the
        sums to bfloat16 on the way out (torch has no float32 output for a bf16 mm on the CPU), as in a bf16
        model: logits on this path (more rows than the block kernels take) are bf16 values, so near-equal
        logits can tie exactly (a probe with PAGELLM_CPU_AMX=0 on the AMX Xeon: 11-15 tied top-5 neighbours in
        52-64); the AMX and vdpbf16ps products write float32."""
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if self.choices.bf16_prepacked:
            # The same products bit for bit, without oneDNN reordering the weight at every call: 1.5-1.8x
            # at 8 rows, 1.25-1.3x at 64, 1.05-1.15x at 512 (benchmarks/microbench_bf16_gemm.py on the
            # Zen 5 VM). Reordered at load and after a tensor-parallel cut (prepack_bf16).
            y = torch.ops.mkldnn._linear_pointwise(xb, layer.weight_bf16, None, "none", [], "")
        else:
            y = torch.mm(xb, layer.weight_bf16.t())
        if self.bf16_output(layer):
            return y
        y = y.float()
        return y if layer.bias is None else y.add_(layer.bias)

    @staticmethod
    def bf16_output(layer: nn.Module) -> bool:
        """Whether a bf16 product of this layer returns bfloat16 (its output feeds a bf16 op, no bias to add)."""
        return layer.bf16_out and layer.bias is None

    def bf16_rows(self, layer: nn.Module, rows: int) -> bool:
        """Whether a product of this many rows runs on the bfloat16 copy."""
        return layer.weight_bf16 is not None and path_rows(rows, self.choices) > self.max_rows

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def int8_activations(self) -> int:
        return 0

    def int8_many(self, layer: nn.Module) -> bool:
        """Whether this layer's prompt rows run on one-plane int8 (block formats only: GGUFBlocksLinearMethod)."""
        return False

    def silu_mul_apply(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This layer's product of silu(gate) * up straight from the gate/up output, where a kernel fuses the
        two (else None: the caller runs the activation, then the product)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def apply(self, layer, x):
        # few rows stay float32 (decode of float checkpoints is memory-bound either way)
        if self.bf16_rows(layer, x.shape[0]):
            return self.bf16_matmul(layer, x)
        return self.gemm(x, layer.weight_t, layer.bias)


class GGUFBlocksLinearMethod(LinearMethod):
    """Block-format weights (every kind ops.kernel_reads): few-row products (decode, verification: at most
    `max_rows` rows) read the blocks in place through the native kernels, optionally on int8
    activations; many-row ones use the float weight, or, once it is dropped (packed_weights_only),
    dequantize 128-column slices into a cache-sized buffer for OpenBLAS (the loader's exact values, so the
    same products)."""

    name = "gguf_blocks"

    @property
    def int8_activations(self) -> int:
        return self.choices.int8_activations

    def process_after_loading(self, layer) -> None:
        self.pack_tile_orders(layer)
        self.prepack_bf16(layer)
        # A kind no kernel reads keeps its float copy: that is what it computes with.
        if self.choices.packed_weights_only and self.reads_blocks(layer.packed):
            drop_float_weight(layer)

    def prepack_bf16(self, layer) -> None:
        """The bfloat16 copy, from the blocks, where the platform chose bf16 GEMMs, unless one-plane int8 takes the
        rows it would (int8_many, int8_head); also after a tensor-parallel cut that the int8 tile order no longer
        takes."""
        int8 = self.int8_many(layer) or self.int8_head(layer)
        if self.choices.bf16_gemm and layer.weight_bf16 is None and not int8:
            layer.weight_bf16 = self.float_weight(layer).to(torch.bfloat16).contiguous()
        super().prepack_bf16(layer)

    def pack_tile_orders(self, layer) -> None:
        """The blocks in AMX tile order where the platform chose AMX products and the kernel takes the kind, and
        in the int8 tile order where few-row products run on int8 activations and the build has that path (every
        row then the same bits whatever the rows in the step: int8_tiles)."""
        packed = layer.packed
        blocks = packed is not None and int8_tiles.packs(packed) and self.reads_blocks(packed)
        few_rows = self.int8_activations and int8_tiles.available()
        # an AVX2 build's prompt rows (int8_many_rows without bf16): q4_1 only, int8 activations off elsewhere
        avx2_prompts = self.choices.int8_many_rows and not self.choices.bf16_gemm and int8_tiles.avx2_rows()
        use = blocks and (few_rows or (avx2_prompts and packed.kind == "q4_1"))
        layer.int8_tiles = int8_tiles.pack(packed) if use else None
        use = self.choices.amx_max_rows and layer.packed is not None and amx.packs(layer.packed)
        layer.amx_blocks = amx.pack(layer.packed) if use and not self.int8_head(layer) else None

    def amx_rows(self, layer, rows: int) -> bool:
        """Whether a many-row product of this many rows runs on AMX tiles (or vdpbf16ps) over the blocks: up to
        amx_max_rows, or at any count for the decode rows of a layer whose prompt rows take int8 (int8_many:
        it keeps no bf16 copy)."""
        if layer.amx_blocks is None:
            return False
        if self.int8_many(layer):
            return not _Step.prompt
        return path_rows(rows, self.choices) <= self.choices.amx_max_rows

    def int8_many(self, layer) -> bool:
        """Whether this layer's prompt rows run on one-plane int8 over its int8 tile-order blocks (and its decode
        rows past the few-row kernels on vdpbf16ps, amx_blocks: N % 32 == 0; without bf16 GEMMs, on AVX2, on the
        float32 paths)."""
        return self.choices.int8_many_rows and layer.int8_tiles is not None and (
            layer.amx_blocks is not None or not self.choices.bf16_gemm)

    def int8_head(self, layer) -> bool:
        """Whether this layer is the logits head and multiplies its rows past the few-row kernels (the model runner
        counts a batch's size there, prompts' logits too) on one-plane int8 (OpChoices.int8_head), not vdpbf16ps:
        1.5-1.6x at 16-128 rows on the Zen 4 VM; the logprobs' median distance from float32 0.019 -> 0.023 nats.
        Few rows stay two-plane: on one plane at every count, small differences upstream (the layers' own switch at
        the few-row limit) moved more greedy tokens (benchmarks/NOTES.md, thirty-ninth session)."""
        return self.choices.int8_head and layer.logits_head and layer.int8_tiles is not None

    def int8_rows(self, layer, rows: int) -> bool:
        """Whether a product runs there: in a forward of prompt chunks (prompt_step), at any row count; the logits
        head (int8_head) past the few-row kernels."""
        return (_Step.prompt and self.int8_many(layer)) or (
            self.int8_head(layer) and path_rows(rows, self.choices) > self.max_rows)

    def reads_blocks(self, packed: PackedWeight) -> bool:
        return self.choices.packed_kernels and ops.kernel_reads(packed)

    def float_weight(self, layer) -> torch.Tensor:
        return layer.packed.dequantize()

    def few_rows(self, layer, rows: int) -> bool:
        """Whether a product of this many rows reads the blocks in place (a kernel reads their kind; at any row
        count where the platform chose int8 tile-order products for every row and the layer has them)."""
        if self.choices.int8_all_rows and layer.int8_tiles is not None:
            return True
        if self.int8_rows(layer, rows):
            return False
        return path_rows(rows, self.choices) <= self.max_rows and self.reads_blocks(layer.packed)

    def bf16_rows(self, layer, rows: int) -> bool:
        if self.few_rows(layer, rows) or self.int8_rows(layer, rows):
            return False
        return layer.weight_bf16 is not None or self.amx_rows(layer, rows)

    def apply(self, layer, x):
        packed: PackedWeight = layer.packed
        if packed.act_fp8:  # from float32 (a bf16 x: the MLP's activation under --dtype auto, widened exactly)
            x = fp8_activations(x.float() if x.dtype == torch.bfloat16 else x, packed.act_scale)
        few = self.few_rows(layer, x.shape[0])
        if not few and self.amx_rows(layer, x.shape[0]):  # as bf16_matmul: bf16 out where it feeds a bf16 op
            y = amx.linear(x, layer.amx_blocks, torch.bfloat16 if self.bf16_output(layer) else torch.float32,
                           tiles=self.choices.amx_on_tiles)
            return y if layer.bias is None else y.add_(layer.bias)
        if not few and self.int8_rows(layer, x.shape[0]):  # float32 out: the next op takes it as it is
            y = int8_tiles.linear(x.float() if x.dtype == torch.bfloat16 else x, layer.int8_tiles, ops.INT8)
            return y if layer.bias is None else y.add_(layer.bias)
        if layer.weight_bf16 is not None and not few:
            return self.bf16_matmul(layer, x)
        if few:
            if layer.int8_tiles is not None and self.choices.int8_activations:
                y = int8_tiles.linear(x, layer.int8_tiles, self.choices.int8_activations)
                return y if layer.bias is None else y.add_(layer.bias)
            xp = x if packed.perm is None else x.index_select(1, packed.perm)
            y = ops.packed_linear(xp, packed, self.choices.int8_activations)
        elif layer.weight_t.numel() == 0:  # float copy dropped
            xp = x if packed.perm is None else x.index_select(1, packed.perm)
            y = blas.packed_matmul(xp, packed) if self.choices.blas_gemm else None
            if y is None:
                y = xp @ packed.dequantize(natural_order=False).t()
        else:
            return self.gemm(x, layer.weight_t, layer.bias)
        return y if layer.bias is None else y.add_(layer.bias)

    def silu_mul_apply(self, layer, gate_up):
        # one-plane int8 rows: the activation computed while x is rounded (the bits of ops.silu_mul, then apply)
        if gate_up.dtype != torch.float32 or not self.choices.native_ops or not self.int8_rows(layer, gate_up.shape[0]):
            return None
        y = int8_tiles.linear(gate_up, layer.int8_tiles, ops.INT8, silu_mul=True)
        return y if layer.bias is None else y.add_(layer.bias)

    @staticmethod
    def embedding_rows(layer, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the matrix as float32 (a tied embedding whose float copy was dropped looks up here)."""
        return layer.packed.rows(ids).dequantize()


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_activations(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x rounded to e4m3 as a W8A8 FP8 checkpoint expects (then multiplied back: the product stays float32,
    CPUs have no fp8 arithmetic): per token with scale absmax / 448 (dynamic), or by a static scale."""
    if scale is None:
        s = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    else:
        s = torch.tensor(scale, dtype=x.dtype)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s


def drop_float_weight(layer: nn.Module) -> int:
    """Frees a layer's float weight when a packed copy stands in for it; returns the bytes freed."""
    if getattr(layer, "packed", None) is None or layer.weight_t.numel() == 0:
        return 0
    freed = layer.weight_t.numel() * layer.weight_t.element_size()
    layer.weight_t.data = torch.empty(0, 0)
    return freed
