"""The paged KV write: each new token's k and v rows ([T, KV, D]) into its slot of a layer's cache
[2, num_blocks, block_size, KV, D], cast to the cache's dtype (float32, float16 or bfloat16); and the same
write fused with the rotary embedding (neox / rotate-half style) of q and k in the qkv projection's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WRITABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """x in dtype. To bfloat16 the rounding (to nearest even) is done on the bits: CUDA's cast rounds the
    same way but Triton's interpreter truncates, and this gives torch's bits on both (NaN payloads aside)."""
    if dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return tl.where(x != x, 0x7FC0, (bits >> 16)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def slot_address(cache, slot, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    return cache + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot


@triton.jit
def write_kv_kernel(
    k, v, cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_half, stride_block, stride_slot, stride_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:  # a padding token (e.g. of a batch padded to a captured CUDA graph's size) writes nothing
        return
    heads = tl.arange(0, KV_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    dst = slot_address(cache, slot, stride_block, stride_slot, BLOCK_SIZE) + heads[:, None] * stride_head + dims
    dtype = cache.dtype.element_ty
    key = tl.load(k + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(dst, cast_to(key, dtype), mask=mask)
    value = tl.load(v + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(dst + stride_half, cast_to(value, dtype), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KV, D] (any float dtype, last dim contiguous); kv_cache: [2, num_blocks, block_size, KV, D];
    slot_mapping: [T] int32/int64, block_id * block_size + offset, or -1 for a token that writes nothing."""
    num_tokens, num_kv, head_dim = k.shape
    check_cache(kv_cache, num_kv, head_dim, slot_mapping, num_tokens)
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape, last dim contiguous")
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], KV_PAD=triton.next_power_of_2(num_kv), D_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def rope_write_kv_kernel(
    qkv, positions, cos, sin, cache, slot_mapping,
    stride_qkv, stride_cos, stride_sin, stride_half, stride_block, stride_slot, stride_head,
    num_heads, num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, ROT_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    row = qkv + token.to(tl.int64) * stride_qkv
    position = tl.load(positions + token).to(tl.int64)
    half = head_dim // 2
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < half
    # cos/sin rows hold the same angles in both halves (HF's cat(freqs, freqs)): the first half serves both
    c = tl.load(cos + position * stride_cos + cols, mask=col_ok).to(tl.float32)
    s = tl.load(sin + position * stride_sin + cols, mask=col_ok).to(tl.float32)
    heads = tl.arange(0, ROT_PAD)  # q heads, then k heads: side by side at the start of the row
    mask = (heads[:, None] < num_heads + num_kv_heads) & col_ok[None, :]
    first = row + heads[:, None] * head_dim + cols[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + half, mask=mask).to(tl.float32)
    # Rounded to qkv's dtype before the cache sees them: the cache holds what the unfused path would write.
    y1 = cast_to(x1 * c[None, :] - x2 * s[None, :], qkv.dtype.element_ty)
    y2 = cast_to(x2 * c[None, :] + x1 * s[None, :], qkv.dtype.element_ty)
    tl.store(first, y1, mask=mask)
    tl.store(first + half, y2, mask=mask)

    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    dtype = cache.dtype.element_ty
    dst = slot_address(cache, slot, stride_block, stride_slot, BLOCK_SIZE)
    key_mask = mask & (heads[:, None] >= num_heads)
    key_dst = dst + (heads[:, None] - num_heads) * stride_head + cols[None, :]
    tl.store(key_dst, cast_to(y1, dtype), mask=key_mask)
    tl.store(key_dst + half, cast_to(y2, dtype), mask=key_mask)
    kv_heads = tl.arange(0, KV_PAD)
    dims = tl.arange(0, D_PAD)
    v_mask = (kv_heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    value = tl.load(row + (num_heads + num_kv_heads + kv_heads[:, None]) * head_dim + dims[None, :], mask=v_mask)
    tl.store(dst + stride_half + kv_heads[:, None] * stride_head + dims[None, :], cast_to(value, dtype), mask=v_mask)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """qkv: [T, (H + 2 * KV) * D], rows of q heads, k heads, v heads (the fused projection's output, last dim
    contiguous); positions: [T]; cos, sin: [max_positions, D] (both halves equal, as RotaryEmbedding keeps
    them). Rotates q and k in place in qkv (as RotaryEmbedding.forward_native does) and writes the rotated
    k and v into the cache at slot_mapping (-1: nothing), all in one pass over qkv."""
    head_dim = kv_cache.shape[-1]
    num_tokens = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * head_dim}] with a contiguous last dim "
                         f"for {num_heads} q and {num_kv_heads} KV heads of {head_dim}, got {tuple(qkv.shape)}")
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape[-1] != head_dim:
        raise ValueError(f"cos and sin must be [max_positions, {head_dim}] (an even head_dim), got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    check_cache(kv_cache, num_kv_heads, head_dim, slot_mapping, num_tokens)
    if num_tokens == 0:
        return
    rope_write_kv_kernel[(num_tokens,)](
        qkv, positions, cos, sin, kv_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_heads, num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], ROT_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads), HALF_PAD=triton.next_power_of_2(head_dim // 2),
        D_PAD=triton.next_power_of_2(head_dim),
    )


def check_cache(kv_cache: torch.Tensor, num_kv: int, head_dim: int, slot_mapping: torch.Tensor, num_tokens: int):
    if kv_cache.dtype not in WRITABLE_DTYPES:
        raise ValueError(f"the Triton KV write stores float32, float16 or bfloat16 caches, not {kv_cache.dtype} "
                         "(fp8 and int8 rows are written by pagellm.quant.kv_cache.write_rows)")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv, head_dim):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv}, {head_dim}], got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or slot_mapping.shape != (num_tokens,) or slot_mapping.stride(0) != 1:
        raise ValueError(f"kv_cache needs a contiguous last dim and slot_mapping {num_tokens} contiguous entries")
