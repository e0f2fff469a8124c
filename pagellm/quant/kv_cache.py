"""Quantized KV cache formats (`--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2`): how a key or value
row is stored and read back. Plain torch, below kernels/ and model/ (the native kernel in
kernels/cpu/attention.cpp implements the same formats bit for bit on write).

The cache keeps its layout [2, num_blocks, block_size, num_kv_heads, W] per layer; only the element type
and the row width W change, so every block copy (swap, copy-on-write, prefix sharing) moves whole rows:

- int8 (torch.int8): W = head_dim + 2. Each [head_dim] row of one token and KV head is stored as
  q = round(x / s) in [-127, 127] followed by its scale s = absmax / 127 as float16 bits in the last two
  bytes (in-band, so a copied block carries its scales). s is clamped to float16's normal range
  [2^-14, 65504] before rounding, so |x - q * s| <= s / 2 for |x| <= 127 * 65504 (a float16 cache
  overflows at 65504 already).
- fp8_e4m3 (torch.float8_e4m3fn) and fp8_e5m2 (torch.float8_e5m2): W = head_dim, x cast to the format
  (round to nearest even, saturated to the largest finite value, as `x.clamp(-max, max).to(fp8)`), with
  vLLM's default per-tensor scale 1.0. Keys and values of these models sit far inside e4m3's range
  (max 448; its 3 mantissa bits set the error, not the range), so no scale is needed.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype names of the quantized formats -> the cache tensor's element type (fp8 is vLLM's e4m3).
KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
INT8_SCALE_BYTES = 2  # the float16 scale at the end of each int8 row
INT8_SCALE_MIN, INT8_SCALE_MAX = 2.0 ** -14, 65504.0  # float16's normal range
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The format code the native kernels take (attention.cpp's KvFormat), per cache element type.
KV_FORMAT_CODES = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.float8_e4m3fn: 3,
                   torch.float8_e5m2: 4}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def kv_dtype_label(dtype: torch.dtype) -> str:
    """The name logs, metrics and `pagellm info` use: int8, fp8_e4m3, fp8_e5m2, float32, ..."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
        dtype, str(dtype).removeprefix("torch."))


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension: head_dim, plus the in-band scale bytes for int8."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """head_dim of a cache [2, num_blocks, block_size, num_kv_heads, W]."""
    width = kv_cache.shape[-1]
    return width - INT8_SCALE_BYTES if kv_cache.dtype == torch.int8 else width


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> the stored rows [..., W] of `dtype`."""
    x = x.float()
    if dtype == torch.int8:
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(INT8_SCALE_MIN, INT8_SCALE_MAX).to(torch.float16)
        q = torch.round(x / scale.float()).clamp(-127, 127).to(torch.int8)
        return torch.cat([q, scale.view(torch.int8)], dim=-1)
    limit = FP8_MAX[dtype]
    return x.clamp(-limit, limit).to(dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows [..., W] -> values [..., head_dim] in out_dtype (int8: q * s computed in float32)."""
    if rows.dtype == torch.int8:
        d = rows.shape[-1] - INT8_SCALE_BYTES
        scale = rows[..., d:].contiguous().view(torch.float16).float()
        return (rows[..., :d].float() * scale).to(out_dtype)
    return rows.to(out_dtype)


def write_rows(cache_half: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Stores x [T, KV, head_dim] into the slots of one half (keys or values) of a cache,
    [num_blocks, block_size, KV, W]. Float caches take x cast to their dtype, as before."""
    num_kv, width = cache_half.shape[-2], cache_half.shape[-1]
    flat = cache_half.view(-1, num_kv, width)
    if not is_quantized(cache_half.dtype):
        flat.index_copy_(0, slots, x.to(cache_half.dtype))
        return
    rows = quantize_rows(x, cache_half.dtype)
    # index_copy_ has no float8 kernel on the CPU: copy the bytes.
    flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
