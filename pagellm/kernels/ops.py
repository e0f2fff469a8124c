"""torch-tensor wrappers around the native CPU kernels (float32 CPU tensors). The platform decides once
whether they run (pagellm/platforms/cpu.py); every op has a plain-torch twin in pagellm/model (the
`forward_native` of its layer: the portable path, and the reference in tests)."""

from __future__ import annotations

import functools

import torch

from pagellm.kernels import amx
from pagellm.kernels.build import cpu_kernels, library
from pagellm.quant.formats import PackedWeight
from pagellm.quant.kv_cache import KV_FORMAT_CODES, cache_head_dim

# Requests with more new rows than this (long prefill chunks) attend through SDPA instead: the kernel scores one
# query row at a time, which flash attention's blocking beats once rows are many (benchmarks/NOTES.md).
PAGED_ATTENTION_MAX_QUERIES = 16


def ptr(t: torch.Tensor | None) -> int | None:
    """The tensor's address for a kernel argument, None (NULL) for an absent optional tensor."""
    return None if t is None else t.data_ptr()


# PackedWeight kinds the native packed kernels (and blas.packed_matmul, the native decoder) read in place,
# with the code the C++ side knows each by (cpu/quant_linear.cpp pagellm_packed_linear, cpu/gemm.cpp).
KIND_CODES = {"q4_1": 0, "q8_0": 1, "q8_1": 2, "fp8_e4m3": 3, "q4_1_16": 4, "q8_0_16": 5, "q8_1_16": 6}
# Kinds with an int8-activation kernel; the others run their float32 kernel when int8 activations are asked
# for. fp8: e4m3 values span 2^-9..448, which 8-bit integer dot products cannot hold exactly; the *_16
# kinds: one scale per 16 weights would need a second scale per integer dot product (not built).
INT8_ACTIVATION_KINDS = frozenset({"q4_1", "q8_0", "q8_1"})
# How packed products treat their activations (OpChoices.int8_activations, the kernels' int8_x):
INT8_OFF = 0  # float32 x
INT8 = 1  # llama.cpp's scheme: x rounded to int8 per 32-value block (--int8-activations)
# x as int8 plus its rounding error as a second int8 plane in steps of 1/128 of the block's scale (~15 bits):
# float32-level results (benchmarks/NOTES.md, thirteenth session); float32 kernels where the build lacks it
INT8_FINE = 2


def kernel_reads(w: PackedWeight) -> bool:
    """Whether packed_linear can multiply by this weight's blocks (else the layer keeps a float copy)."""
    return w.kind in KIND_CODES


def packed_linear(x: torch.Tensor, w: PackedWeight, int8_activations: int = INT8_OFF) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ W^T -> [M, N]. int8_activations INT8 (or True): llama.cpp's scheme (x
    rounded to int8 per 32-value block, integer dot products), faster for one row, no longer float32-exact;
    INT8_FINE: with a second plane for the rounding error; kinds without such a kernel (INT8_ACTIVATION_KINDS)
    stay float32."""
    if w.kind not in KIND_CODES:
        raise ValueError(f"packed_linear: no kernel reads {w.kind!r} blocks")
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, w.out_features
    if k != w.in_features:
        raise ValueError(f"packed_linear: x has {k} columns, the weight {w.in_features}")
    y = torch.empty(m, n, dtype=torch.float32)
    library().pagellm_packed_linear(KIND_CODES[w.kind], int(int8_activations) if w.kind in INT8_ACTIVATION_KINDS else 0,
                                    x.data_ptr(), x.stride(0), m, k, w.qs.data_ptr(), w.d.data_ptr(), ptr(w.m), n,
                                    y.data_ptr(), n, torch.get_num_threads())
    return y


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual (in place, when given); returns rmsnorm(x) * weight. x: contiguous [T, C]."""
    out = torch.empty_like(x)
    library().pagellm_add_rmsnorm(x.data_ptr(), ptr(residual), weight.data_ptr(), out.data_ptr(),
                                      x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_bf16_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place; x bfloat16, residual float32, both contiguous [T, C]); returns
    rmsnorm(residual) * weight: the bits of add_rmsnorm(x.float(), residual, ...)."""
    out = torch.empty_like(residual)
    library().pagellm_add_bf16_rmsnorm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                       x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def rmsnorm_to_bf16(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """add_bf16_rmsnorm (x bfloat16: residual += x) or add_rmsnorm (x float32: x += residual when given) with the
    output in bfloat16: the bits of their output's .to(torch.bfloat16). x, residual: contiguous [T, C]."""
    if x.dtype == torch.bfloat16 and residual is None:
        raise ValueError("rmsnorm_to_bf16: a bfloat16 x is summed into a float32 residual, and none was given")
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    library().pagellm_rmsnorm_to_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16), ptr(residual), weight.data_ptr(),
                                      out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotates the first num_heads heads of each row of x ([T, >= num_heads * head_dim], row-strided) in place."""
    library().pagellm_rope(x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, cos.data_ptr(),
                               sin.data_ptr(), positions.data_ptr(), torch.get_num_threads())


def rope_bf16(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """A float32 copy of bfloat16 x ([T, C], row-strided) with its first num_heads heads rotated: the bits
    of rope_(x.float(), ...)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    library().pagellm_rope_bf16(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                                num_heads, head_dim, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """float32 in and out, or bfloat16 in and out (the bf16 MLP of `--dtype auto`)."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    fn = library().pagellm_silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else library().pagellm_silu_mul
    fn(gate_up.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's index of its largest value, the first of equal ones, as `x.max(dim=-1).indices` (x: [rows, n]
    float32 on the CPU, unit stride along a row); None where a row holds a NaN (torch decides those)."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    rc = library().pagellm_argmax_rows(x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
    return None if rc else out


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Each row's categorical draw by inverse CDF (the first token whose running sum of probs passes u times the
    row's total; probs: [rows, n] float32 on the CPU, unit stride along a row, any scale; u: [rows] float64 in
    [0, 1)); None where a row's total is not a positive finite number (the caller decides those)."""
    rows, n = probs.shape
    out = torch.empty(rows, dtype=torch.int64)
    rc = library().pagellm_sample_rows(probs.data_ptr(), probs.stride(0), rows, n, u.data_ptr(), out.data_ptr(),
                                       torch.get_num_threads())
    return None if rc else out


def softmax_draw(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Each row's draw from softmax(x / T) by inverse CDF, without the probabilities as a tensor (x: [rows, n]
    float32 on the CPU, unit stride along a row; inv_temp: [rows] float32 1 / T; u: [rows] float64 in [0, 1));
    None where a row has no finite maximum or total (the caller decides those)."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    rc = library().pagellm_softmax_draw(x.data_ptr(), x.stride(0), rows, n, inv_temp.data_ptr(), u.data_ptr(),
                                        out.data_ptr(), torch.get_num_threads())
    return None if rc else out


@functools.cache
def _build_kv_formats() -> int:
    return int(library().pagellm_kv_formats())


def kv_dtype_supported(dtype: torch.dtype) -> bool:
    """The attention kernels read float32, int8 and fp8 caches everywhere, float16 ones where the build
    converts them (F16C)."""
    if cpu_kernels() is None or dtype not in KV_FORMAT_CODES:
        return False
    return bool(_build_kv_formats() >> KV_FORMAT_CODES[dtype] & 1)


def kv_format_code(dtype: torch.dtype) -> int:
    """The kernels' KvFormat code for a cache element type (kernels/cpu/kv_format.h)."""
    if dtype not in KV_FORMAT_CODES:
        raise ValueError(f"the native attention kernels do not read a {dtype} KV cache")
    return KV_FORMAT_CODES[dtype]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [T, KV, D] float32 views whose rows may be strided (slices of the fused qkv output); a float16
    cache stores them rounded to nearest, like torch's .to(torch.float16); int8 and fp8 caches quantize each
    row exactly as pagellm/quant/kv_cache.py does."""
    _, num_blocks, block_size, num_kv, _ = kv_cache.shape
    rc = library().pagellm_write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], num_kv,
                                        cache_head_dim(kv_cache), kv_cache.data_ptr(), num_blocks, block_size,
                                        slots.data_ptr(), kv_format_code(kv_cache.dtype), torch.get_num_threads())
    if rc:
        raise ValueError(f"write_kv kernel: unsupported KV cache dtype {kv_cache.dtype}")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    row_pos: torch.Tensor, window: int | None, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (rows may be strided); row t attends to keys 0..row_pos[t] of request row_seq[t]. out: where
    to write ([T, H, D] float32, contiguous; a new tensor when None)."""
    t, h, d = q.shape
    _, num_blocks, block_size, num_kv, _ = kv_cache.shape
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.float32)
    elif out.shape != (t, h, d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"paged_attention: out must be a contiguous float32 [{t}, {h}, {d}]")
    rc = library().pagellm_paged_attention(
        q.data_ptr(), q.stride(0), t, h, d, kv_cache.data_ptr(), num_blocks, block_size, num_kv,
        block_tables.data_ptr(), block_tables.stride(0), row_seq.data_ptr(), row_pos.data_ptr(), window or 0,
        scale, out.data_ptr(), torch.get_num_threads(), kv_format_code(kv_cache.dtype))
    if rc:
        raise ValueError(f"paged_attention kernel: unsupported shape or KV dtype (heads {h}, kv heads {num_kv}, "
                         f"head_dim {d}, {kv_cache.dtype})")
    return out


def has_fine_int8_activations() -> bool:
    """Whether the loaded kernels have the two-plane int8 activations (INT8_FINE; AVX-512 VNNI: path bit 4)."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 4 & 1)


def has_bf16_prefill_attention() -> bool:
    """Whether the loaded kernels include the bf16 prefill attention (AVX-512 BF16 builds: kernel path bit 3)."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 3 & 1)


def int8_keys_on_vnni() -> bool:
    """Whether paged_attention scores int8 keys with integer dot products (AVX-512 VNNI builds: kernel path
    bit 9, attention_int8_vnni.h), the query rounded to two int8 planes (~15 bits) per (row, head)."""
    return cpu_kernels() is not None and bool(library().pagellm_build_features() >> 9 & 1)


def has_amx_prefill_attention() -> bool:
    """Whether prefill_attention_bf16 runs on AMX tiles here: the build has that path (kernel path bit 7) and
    Linux granted the tile state."""
    return has_bf16_prefill_attention() and bool(library().pagellm_build_features() >> 7 & 1) and amx.amx_ready()


def prefill_attention_bf16(q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
                           scale: float, tiles: bool = True) -> torch.Tensor | None:
    """Causal attention of one request's newest q.shape[0] positions (q: [n, H, D], rows may be strided) over
    its keys 0..seq_len-1 in the paged cache, in bf16 with float32 sums (cpu/prefill_attention.cpp): on AMX
    tiles where the build and the OS have them and `tiles` (has_amx_prefill_attention), else vdpbf16ps; None
    where the kernel does not take this shape or KV dtype (D not a multiple of 64, fp8 caches)."""
    n, h, d = q.shape
    _, num_blocks, block_size, num_kv, _ = kv_cache.shape
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.int8) or q.stride(2) != 1 or q.stride(1) != d:
        return None
    out = torch.empty(n, h, d, dtype=torch.float32)
    rc = library().pagellm_prefill_attention_bf16(
        q.data_ptr(), q.stride(0), n, h, d, kv_cache.data_ptr(), num_blocks, block_size, num_kv, table.data_ptr(),
        seq_len, scale, out.data_ptr(), h * d, torch.get_num_threads(), kv_format_code(kv_cache.dtype), int(tiles))
    return None if rc else out


def prefill_attention_bf16_batch(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                 chunks: list[tuple[int, int, int, int]], scale: float, out: torch.Tensor,
                                 tiles: bool = True) -> bool:
    """prefill_attention_bf16 for several requests' chunks of one step in one call: chunks holds (start, nq,
    seq_len, table row) per request, its query rows start..start+nq-1 of q ([T, H, D], rows may be strided) over
    block_tables[table row] ([B, max_blocks] int64); their outputs go to the same rows of out ([T, H, D] float32,
    contiguous), the other rows left alone. Each request gets the bits it gets alone. False where the kernel does
    not take this shape or KV dtype (nothing written)."""
    _, h, d = q.shape
    _, num_blocks, block_size, num_kv, _ = kv_cache.shape
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.int8) or q.stride(2) != 1 or q.stride(1) != d \
            or q.dtype != torch.float32 or out.dtype != torch.float32 or not out.is_contiguous() \
            or block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
        return False
    spec = torch.tensor(chunks, dtype=torch.int64)
    rc = library().pagellm_prefill_attention_bf16_batch(
        q.data_ptr(), q.stride(0), h, d, kv_cache.data_ptr(), num_blocks, block_size, num_kv, spec.data_ptr(),
        len(chunks), block_tables.data_ptr(), block_tables.stride(0), scale, out.data_ptr(), h * d,
        torch.get_num_threads(), kv_format_code(kv_cache.dtype), int(tiles))
    if rc == -2:
        raise MemoryError("prefill attention: no memory for the packed keys and values")
    return rc == 0
