"""Quantized Hugging Face tensors -> PackedWeight blocks (the kinds in pagellm.quant.formats).

Every integer format here is w = s * (q - z) per group of input columns; the blocks store it as
d * code + m per 32-column block (q4_1: code = q, d = s, m = -s * z; q8_0/q8_1: code = q - 128 as int8,
m = -s * (z - 128)). The loader's float tensor is the blocks' own dequantize(), what the kernels compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.model.loader.model_file_error import ModelFileError
from pagellm.quant.formats import BLOCK, PackedWeight

# err(part, what) -> the ModelFileError naming the module's tensor `part`
ErrorFn = Callable[[str, str], ModelFileError]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words holding 32 // bits codes each (code i at bits [i*bits, (i+1)*bits)) -> uint8 codes,
    the words' codes laid out along `dim` (AWQ stores them in `order`: code i is element order[i])."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).movedim(dim, -1)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        codes = codes[..., torch.tensor(order).argsort()]
    codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)
    return codes.movedim(-1, dim).to(torch.uint8)


def column_groups(err: ErrorFn, k: int, group_size: int, g_idx: torch.Tensor | None, groups: int,
                  part: str = "g_idx") -> tuple[torch.Tensor | None, torch.Tensor]:
    """(perm, group of each 32-column block in perm order). perm sorts the columns by group (GPTQ
    act-order), None when they already are; each 32-column block must then lie inside one group."""
    if g_idx is None:
        g = torch.arange(k) // group_size if group_size > 0 else torch.zeros(k, dtype=torch.long)
    else:
        g = g_idx.to(torch.long)
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise err(part, f"group indices must lie in [0, {groups}), found [{int(g.min())}, {int(g.max())}]")
    perm = None
    if bool((g[1:] < g[:-1]).any()):
        perm = torch.argsort(g, stable=True)
        g = g[perm]
    blocks = g.reshape(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        raise err(part, f"every group must hold a multiple of {BLOCK} columns (the 32-column blocks of "
                  "pagellm's formats have one scale each)")
    return perm, blocks[:, 0]


def int_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               perm: torch.Tensor | None, block_group: torch.Tensor) -> PackedWeight:
    """codes: unsigned [N, K] (0 .. 2^bits - 1); scale, zero: [N, G] (zero in the same unsigned range);
    w[n, c] = scale[n, g(c)] * (codes[n, c] - zero[n, g(c)])."""
    n, k = codes.shape
    if perm is not None:
        codes = codes[:, perm]
    s = scale.float()[:, block_group]  # [N, K/32]
    z = zero.float()[:, block_group]
    if bits == 4:
        c = codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
        qs = (c[..., :BLOCK // 2] | (c[..., BLOCK // 2:] << 4)).reshape(n, k // 2)
        return PackedWeight("q4_1", qs.contiguous(), s.contiguous(), (-s * z).contiguous(), perm)
    # 8-bit: int8 codes q - 128 and m = s * (128 - z); all zeros 128 is q8_0 (no m)
    qs = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    if bool((z == 128).all()):
        return PackedWeight("q8_0", qs, s.contiguous(), None, perm)
    return PackedWeight("q8_1", qs, s.contiguous(), (s * (128 - z)).contiguous(), perm)


def fp8_blocks(weight: torch.Tensor, d: torch.Tensor) -> PackedWeight:
    """weight: float8_e4m3fn [N, K]; d: float32 [N, K/32], the scale of each block."""
    return PackedWeight("fp8_e4m3", weight.contiguous().view(torch.uint8), d.float().contiguous(), None)


def blockwise_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] scales of 2-D weight blocks -> [N, K/32] (bk a multiple of 32)."""
    bn, bk = block
    rows = scale.float().repeat_interleave(bn, dim=0)[:n]
    return rows.repeat_interleave(bk // BLOCK, dim=1)[:, :k // BLOCK].contiguous()


def per_channel_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A per-tensor (one value) or per-output-channel ([N] / [N, 1]) scale -> [N, K/32]."""
    return scale.float().reshape(-1, 1).expand(n, k // BLOCK).contiguous()  # [1, 1] or [N, 1] broadcasts


# part -> (safetensors dtype name, shape), from a file's header or from the tensors themselves
PartInfo = dict[str, tuple[str, tuple[int, ...]]]
TORCH_DTYPE_NAMES = {torch.int32: "I32", torch.int64: "I64", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                     torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                     torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
FLOATS = ("F16", "BF16", "F32")


def part_info(tensors: dict[str, torch.Tensor]) -> PartInfo:
    return {p: (TORCH_DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for p, t in tensors.items()}


def shape_of(err: ErrorFn, parts: PartInfo, part: str, want: tuple | list[tuple], why: str,
             dtypes: tuple[str, ...] | None = None) -> None:
    """The tensor `part` is present with one of the wanted shapes (and one of `dtypes`)."""
    wants = want if isinstance(want, list) else [want]
    if part not in parts:
        raise err(part, f"tensor is missing (expected shape {list(wants[0])}: {why})")
    dtype, shape = parts[part]
    if tuple(shape) not in [tuple(w) for w in wants]:
        choices = " or ".join(str(list(w)) for w in wants)
        raise err(part, f"shape {list(shape)} does not match the expected {choices} ({why})")
    if dtypes is not None and dtype not in dtypes:
        raise err(part, f"dtype {dtype} is not the expected {' or '.join(dtypes)}")


def check_groups(err: ErrorFn, part: str, k: int, group_size: int) -> int:
    """Number of groups along K; a group size that does not divide K, or splits a 32-block, is refused."""
    if group_size <= 0:
        if k % BLOCK:
            raise err(part, f"in_features {k} is not a multiple of {BLOCK}")
        return 1
    if k % group_size or group_size % BLOCK:
        raise err(part, f"group_size {group_size} must divide in_features {k} and be a multiple of {BLOCK}")
    return k // group_size
