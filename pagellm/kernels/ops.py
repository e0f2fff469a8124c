"""torch-tensor wrappers around the native CPU kernels (float32 CPU tensors). The platform decides once
whether they run (pagellm/platforms/cpu.py); every op has a plain-torch twin in pagellm/model (the
`forward_native` of its layer: the portable path, and the reference in tests)."""

from __future__ import annotations

import functools

import torch

from pagellm.kernels.build import cpu_kernels, library
from pagellm.quant.formats import PackedWeight

# Requests with more new rows than this (long prefill chunks) attend through SDPA instead: the kernel scores one
# query row at a time, which flash attention's blocking beats once rows are many (benchmarks/NOTES.md).
PAGED_ATTENTION_MAX_QUERIES = 16


def ptr(t: torch.Tensor | None) -> int | None:
    """The tensor's address for a kernel argument, None (NULL) for an absent optional tensor."""
    return None if t is None else t.data_ptr()


# PackedWeight kinds the native packed kernels (and blas.packed_matmul) read in place.
KERNEL_KINDS = frozenset({"q4_1", "q8_0"})


def kernel_reads(w: PackedWeight) -> bool:
    """Whether packed_linear can multiply by this weight's blocks (else the layer keeps a float copy)."""
    return w.kind in KERNEL_KINDS


def packed_linear(x: torch.Tensor, w: PackedWeight, int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ W^T -> [M, N]. int8_activations: llama.cpp's scheme (x rounded
    to int8 per 32-value block, integer dot products), faster for one row, no longer float32-exact."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    lib, (m, k), n = library(), x.shape, w.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    if w.kind == "q4_1":
        fn = lib.pagellm_q4_1_linear_i8 if int8_activations else lib.pagellm_q4_1_linear
        fn(x.data_ptr(), x.stride(0), m, k, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), n, y.data_ptr(), n,
           threads)
    elif w.kind == "q8_0":
        fn = lib.pagellm_q8_0_linear_i8 if int8_activations else lib.pagellm_q8_0_linear
        fn(x.data_ptr(), x.stride(0), m, k, w.qs.data_ptr(), w.d.data_ptr(), n, y.data_ptr(), n, threads)
    else:
        raise ValueError(f"packed_linear: no kernel reads {w.kind!r} blocks")
    return y


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual (in place, when given); returns rmsnorm(x) * weight. x: contiguous [T, C]."""
    out = torch.empty_like(x)
    library().pagellm_add_rmsnorm(x.data_ptr(), ptr(residual), weight.data_ptr(), out.data_ptr(),
                                      x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotates the first num_heads heads of each row of x ([T, >= num_heads * head_dim], row-strided) in place."""
    library().pagellm_rope(x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, cos.data_ptr(),
                               sin.data_ptr(), positions.data_ptr(), torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    library().pagellm_silu_mul(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


@functools.cache
def _build_reads_f16_kv() -> bool:
    return bool(library().pagellm_has_f16_kv())


def kv_dtype_supported(dtype: torch.dtype) -> bool:
    """The attention kernels read float32 caches, and float16 ones where the build converts them (F16C)."""
    if cpu_kernels() is None:
        return False
    return dtype == torch.float32 or (dtype == torch.float16 and _build_reads_f16_kv())


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, KV, D] float32 views whose rows may be strided (slices of the fused qkv output); a float16
    cache stores them rounded to nearest, like torch's .to(torch.float16)."""
    _, num_blocks, block_size, num_kv, head_dim = kv_cache.shape
    rc = library().pagellm_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], num_kv,
                                        head_dim, kv_cache.data_ptr(), num_blocks, block_size, slots.data_ptr(),
                                        int(kv_cache.dtype == torch.float16))
    if rc:
        raise ValueError(f"write_kv kernel: unsupported KV cache dtype {kv_cache.dtype}")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    row_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q: [T, H, D] (rows may be strided); row t attends to keys 0..row_pos[t] of request row_seq[t]."""
    t, h, d = q.shape
    _, num_blocks, block_size, num_kv, _ = kv_cache.shape
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = library().pagellm_paged_attention(
        q.data_ptr(), q.stride(0), t, h, d, kv_cache.data_ptr(), num_blocks, block_size, num_kv,
        block_tables.data_ptr(), block_tables.stride(0), row_seq.data_ptr(), row_pos.data_ptr(), window or 0,
        scale, out.data_ptr(), torch.get_num_threads(), int(kv_cache.dtype == torch.float16))
    if rc:
        raise ValueError(f"paged_attention kernel: unsupported shape or KV dtype (heads {h}, kv heads {num_kv}, "
                         f"head_dim {d}, {kv_cache.dtype})")
    return out
