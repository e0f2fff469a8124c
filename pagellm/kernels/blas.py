"""Many-row float32 matmuls through numpy's OpenBLAS instead of torch's MKL, on the CPU.

On this project's AMD CPU, MKL's sgemm runs at 45-85 GFLOP/s on the model's shapes and OpenBLAS (the
library numpy wheels ship) at 70-150: up to 2x for the same float32 products (benchmarks/NOTES.md).
Both are float32 GEMMs; only the summation order differs. OpenBLAS runs single-threaded inside the
OpenMP pool torch uses (cpu/gemm.cpp splits the output), because two thread pools spinning against
each other on two cores made everything slower. `PAGELLM_CPU_BLAS=torch` keeps torch's GEMM (the CPU
platform reads it when it decides).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np  # noqa: F401  (loads numpy's OpenBLAS, which _sgemm finds among the loaded libraries)
import torch

from pagellm.kernels.build import cpu_kernels, library
from pagellm.kernels.ops import KIND_CODES

logger = logging.getLogger(__name__)

_SGEMM64 = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")  # ILP64 builds (numpy >= 1.22 wheels)
_THREADS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")


@functools.cache
def _sgemm() -> int | None:
    """Address of numpy's OpenBLAS cblas_sgemm (64-bit ints), with OpenBLAS set to one thread."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln and ".so" in ln.split()[-1]})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: this only returns a handle
        except OSError:
            continue
        sgemm = next((getattr(lib, n) for n in _SGEMM64 if hasattr(lib, n)), None)
        threads = next((getattr(lib, n) for n in _THREADS if hasattr(lib, n)), None)
        if sgemm is not None and threads is not None:
            threads(ctypes.c_int(1))
            return ctypes.cast(sgemm, ctypes.c_void_p).value
    logger.info("numpy's OpenBLAS not found (%s): float32 GEMMs stay on torch", paths or "no library")
    return None


@functools.cache
def _can_run() -> bool:
    """The library and numpy's sgemm exist (cached: matmul asks on every call)."""
    try:
        library()
    except RuntimeError:
        return False
    return _sgemm() is not None


def sgemm_available() -> bool:
    """Whether many-row float32 products can run here (the native kernels and numpy's OpenBLAS): also
    what lets the engine drop float32 weight copies (packed_matmul needs it). The platform asks once."""
    return cpu_kernels() is not None and _sgemm() is not None


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with unit column stride and a row stride BLAS accepts (>= K)."""
    if x.shape[1] != k:
        raise ValueError(f"matmul: x has {x.shape[1]} columns, the weight {k} rows")
    return x if x.stride(1) == 1 and x.stride(0) >= k else x.contiguous()


def _weight_layout(w: torch.Tensor) -> tuple[int, bool] | None:
    """(leading dimension, transposed) for a row-major [K, N] or a transposed view of [N, K]."""
    if w.stride(1) == 1:
        return w.stride(0), False
    if w.stride(0) == 1:
        return w.stride(1), True
    return None


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ bias); w may be a transposed view. torch's GEMM off the CPU/float32 path."""
    layout = _weight_layout(w) if w.dtype == torch.float32 else None
    if not (layout and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and _can_run()):
        return x @ w if bias is None else torch.addmm(bias, x, w)
    x = _rows(x, w.shape[0])
    (m, k), n = x.shape, w.shape[1]
    y = torch.empty(m, n, dtype=torch.float32)
    library().pagellm_sgemm(_sgemm(), x.data_ptr(), x.stride(0), m, k, w.data_ptr(), layout[0], layout[1], n,
                                y.data_ptr(), n, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def packed_matmul(x: torch.Tensor, w) -> torch.Tensor | None:
    """x [M, K] @ W^T for a PackedWeight W with no float32 copy kept: slices of W are dequantized (the
    loader's exact values) into a cache-sized buffer and multiplied there. None when it cannot run here."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and _can_run()):
        return None
    if w.kind not in KIND_CODES:
        raise ValueError(f"packed_matmul: unsupported block format {w.kind!r}")
    x = _rows(x, w.in_features)
    (m, k), n = x.shape, w.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    library().pagellm_packed_sgemm(_sgemm(), x.data_ptr(), x.stride(0), m, k, KIND_CODES[w.kind],
                                       w.qs.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), n,
                                       y.data_ptr(), n, torch.get_num_threads())
    return y
