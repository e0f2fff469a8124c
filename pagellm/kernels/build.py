"""Compile pagellm/kernels/cpu/*.cpp into one shared library, cache it, load it with ctypes.

Why ctypes and not a torch C++ extension: these kernels take raw pointers and need no torch headers,
so a build takes about two seconds instead of a minute, and a call costs a few microseconds.
The library is built for the CPU it runs on (-march=native) and cached under
$PAGELLM_CACHE_DIR (default ~/.cache/pagellm) keyed by source, compiler and CPU flags.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share its OpenMP thread pool)

log = logging.getLogger(__name__)
SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "pagellm_has_simd": ([], _i32),
    "pagellm_has_f16_kv": ([], _i32),
    "pagellm_q4_1_linear": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_0_linear": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q4_1_linear_i8": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_0_linear_i8": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_write_kv": ([_p, _i64, _p, _i64, _i32, _i32, _i32, _p, _i64, _i32, _p, _i32], _i32),
    "pagellm_paged_attention": ([_p, _i64, _i32, _i32, _i32, _p, _i64, _i32, _i32, _p, _i64, _p, _p, _i32, _f32,
                                 _p, _i32, _i32], _i32),
    "pagellm_add_rmsnorm": ([_p, _p, _p, _p, _i32, _i32, _f32, _i32], None),
    "pagellm_rope": ([_p, _i64, _i32, _i32, _i32, _p, _p, _p, _i32], None),
    "pagellm_silu_mul": ([_p, _i32, _i32, _p, _i32], None),
    "pagellm_sgemm": ([_p, _p, _i64, _i64, _i64, _p, _i64, _i32, _i64, _p, _i64, _i32], None),
    "pagellm_packed_sgemm": ([_p, _p, _i64, _i64, _i64, _i32, _p, _p, _p, _i64, _p, _i64, _i32], None),
    # dims, layers, num_layers, kv caches, num_blocks, block_size, final norm, x, T, positions, slots,
    # block tables, table stride, row_seq, threads (see decoder.cpp)
    "pagellm_decoder_forward": ([_p, _p, _i32, _p, _i64, _i32, _p, _p, _i32, _p, _p, _p, _i64, _p, _i32], _i32),
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in [version, _cpu_flags(), " ".join(FLAGS), *(s.read_text() for s in SOURCES + HEADERS)]:
        key.update(part.encode())
    cache = Path(os.environ.get("PAGELLM_CACHE_DIR", Path.home() / ".cache" / "pagellm")) / "kernels"
    lib = cache / f"pagellm_cpu_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    if os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0":
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: using the plain torch CPU path (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError) as e:
        log.warning("could not build the CPU kernels, using the plain torch path: %s", e)
        return None
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib
