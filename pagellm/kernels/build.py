"""Compile pagellm/kernels/cpu/*.cpp into one shared library, cache it, load it with ctypes.

Why ctypes and not a torch C++ extension: these kernels take raw pointers and need no torch headers,
so a build takes about two seconds instead of a minute, and a call costs a few microseconds.

The library is built for -march=$PAGELLM_CPU_ARCH (default "native": the CPU it runs on, or the level that
$PAGELLM_CPU_ISA caps it at; "x86-64" gives the portable build, no AVX). It is cached under $PAGELLM_CACHE_DIR
(default ~/.cache/pagellm), keyed by what the compiler targets for that -march (every macro it predefines,
which names each ISA extension it may emit), the compiler's version, the flags and the sources. $CXX, when
set, is the compiler, and only it: if it cannot be run there are no kernels (the plain torch path), never a
different compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share its OpenMP thread pool)

log = logging.getLogger(__name__)
SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
# -ffp-contract=off: the compiler may not fuse a*b + c into one FMA (one rounding instead of two) on its
# own. Where it may, scalar float code rounds differently with and without FMA in the ISA, and even
# within one build, since the auto-vectorized main loop and the scalar tail of the same expression can
# be contracted differently: a row's result would then depend on how many rows the kernel call has
# (which rows land in the tail). Off, scalar code is the same IEEE operations whatever the ISA; the
# explicit FMA intrinsics of the SIMD paths are unaffected. -march=... is added per build.
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# The ISA macros `build_info()["isa"]` reports, in this order (lowercased, without underscores around).
ISA_MACROS = ["AVX2", "FMA", "F16C", "AVX512F", "AVX512BW", "AVX512VL", "AVX512BF16", "AVX512VNNI", "AVXVNNI",
              "AMX_TILE", "AMX_BF16", "AMX_INT8"]
# Bit i of pagellm_build_features() (cpu/features.cpp): the hand-written kernel paths compiled into the
# library (AVX2+FMA, F16C, VNNI; the compiler may still auto-vectorize plain loops for any ISA in "isa").
PATHS = ["avx2-fma", "f16c-kv", "vnni-int8", "avx512-bf16-prefill-attention", "avx512-vnni-int8", "amx-bf16-q4",
         "int8-tiles", "amx-prefill-attention", "avx512-bf16-q4", "avx512-vnni-int8-kv-attention",
         "avx2-int8-prompt-rows"]

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "pagellm_build_features": ([], _i32),
    "pagellm_has_simd": ([], _i32),
    "pagellm_has_f16_kv": ([], _i32),
    "pagellm_kv_formats": ([], _i32),
    "pagellm_q4_1_linear": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_0_linear": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q4_1_linear_i8": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_0_linear_i8": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_1_linear": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_1_linear_i8": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_fp8_e4m3_linear": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q4_1_16_linear": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_0_16_linear": ([_p, _i64, _i32, _i32, _p, _p, _i32, _p, _i64, _i32], None),
    "pagellm_q8_1_16_linear": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    # kind code, int8 activations, then as pagellm_q4_1_linear (m may be NULL)
    "pagellm_packed_linear": ([_i32, _i32, _p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], None),
    # kind, x, ldx, x is bf16, M, K, tile-order codes, d, m, N, y, ldy, y is bf16, threads (quant_linear_amx.cpp)
    "pagellm_packed_linear_amx": ([_i32, _p, _i64, _i32, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32, _i32], _i32),
    "pagellm_amx_ready": ([], _i32),
    # the same arguments, on AVX-512 BF16 vdpbf16ps (quant_linear_bf16dp.cpp)
    "pagellm_packed_linear_bf16dp": ([_i32, _p, _i64, _i32, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32, _i32],
                                     _i32),
    # kind, planes, method, x, ldx, M, K, tile-order codes, d, m, N, y, ldy, threads (quant_linear_int8_tiles.cpp)
    "pagellm_int8_tiles_linear": ([_i32, _i32, _i32, _p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32], _i32),
    "pagellm_int8_tiles_linear_silu_mul": ([_i32, _i32, _i32, _p, _i64, _i32, _i32, _p, _p, _p, _i32, _p, _i64, _i32],
                                           _i32),
    "pagellm_int8_tiles_amx_ready": ([], _i32),
    "pagellm_write_kv": ([_p, _i64, _p, _i64, _i32, _i32, _i32, _p, _i64, _i32, _p, _i32, _i32], _i32),
    "pagellm_paged_attention": ([_p, _i64, _i32, _i32, _i32, _p, _i64, _i32, _i32, _p, _i64, _p, _p, _i32, _f32,
                                 _p, _i32, _i32], _i32),
    # q, ldq, nq, H, D, kv, num_blocks, block_size, KV, table, seq_len, scale, out, ldo, threads, kv format, tiles
    "pagellm_prefill_attention_bf16": ([_p, _i64, _i32, _i32, _i32, _p, _i64, _i32, _i32, _p, _i64, _f32, _p, _i64,
                                        _i32, _i32, _i32], _i32),
    # q, ldq, H, D, kv, num_blocks, block_size, KV, chunks [R, 4], R, tables, table stride, scale, out, ldo, threads,
    # kv format, tiles
    "pagellm_prefill_attention_bf16_batch": ([_p, _i64, _i32, _i32, _p, _i64, _i32, _i32, _p, _i32, _p, _i64, _f32,
                                              _p, _i64, _i32, _i32, _i32], _i32),
    "pagellm_add_rmsnorm": ([_p, _p, _p, _p, _i32, _i32, _f32, _i32], None),
    "pagellm_add_bf16_rmsnorm": ([_p, _p, _p, _p, _i32, _i32, _f32, _i32], None),
    # x, x is bf16, residual (or NULL), weight, bf16 out, T, C, eps, threads
    "pagellm_rmsnorm_to_bf16": ([_p, _i32, _p, _p, _p, _i32, _i32, _f32, _i32], None),
    "pagellm_rope": ([_p, _i64, _i32, _i32, _i32, _p, _p, _p, _i32], None),
    "pagellm_rope_bf16": ([_p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _p, _p, _p, _i32], None),
    "pagellm_silu_mul": ([_p, _i32, _i32, _p, _i32], None),
    "pagellm_silu_mul_bf16": ([_p, _i32, _i32, _p, _i32], None),
    "pagellm_argmax_rows": ([_p, _i64, _i32, _i32, _p, _i32], _i32),
    "pagellm_sample_rows": ([_p, _i64, _i32, _i32, _p, _p, _i32], _i32),
    "pagellm_softmax_draw": ([_p, _i64, _i32, _i32, _p, _p, _p, _i32], _i32),
    "pagellm_sgemm": ([_p, _p, _i64, _i64, _i64, _p, _i64, _i32, _i64, _p, _i64, _i32], None),
    "pagellm_packed_sgemm": ([_p, _p, _i64, _i64, _i64, _i32, _p, _p, _p, _i64, _p, _i64, _i32], None),
    # dims, layers, num_layers, kv caches, num_blocks, block_size, final norm, x, T, positions, slots,
    # block tables, table stride, row_seq, threads (see decoder.cpp)
    "pagellm_decoder_forward": ([_p, _p, _i32, _p, _i64, _i32, _p, _p, _i32, _p, _p, _p, _i64, _p, _i32], _i32),
}


def _compiler() -> list[str] | None:
    """The compiler command: $CXX when set (it may carry a launcher, e.g. "ccache g++"), else the first found."""
    if os.environ.get("CXX"):
        cmd = shlex.split(os.environ["CXX"])
        if cmd and shutil.which(cmd[0]):
            return cmd
        log.warning("CXX=%s is not an executable compiler: using the plain torch CPU path (slower)",
                    os.environ["CXX"])
        return None
    found = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if found is None:
        log.warning("no C++ compiler found: using the plain torch CPU path (slower)")
    return None if found is None else [found]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd[:4])} ...: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _build(cxx: list[str], march: str) -> tuple[Path, list[str]]:
    """The cached library for -march=march (built when missing) and the ISA it targets."""
    flags = [f"-march={march}", *FLAGS]
    # All the macros, not only ISA_MACROS: two CPUs alike in those may differ in others (BMI2, AVX512VBMI,
    # ...) that -march=native lets the compiler use, and must not share a library.
    macros = sorted(_run([*cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull]).splitlines())
    isa = [m.lower() for m in ISA_MACROS if f"#define __{m}__ 1" in macros]
    key = hashlib.sha256()
    for part in [_run([*cxx, "--version"]), " ".join(isa), *macros, " ".join(flags),
                 *(s.read_text() for s in SOURCES + HEADERS)]:
        key.update(part.encode() + b"\0")
    # an empty value is unset (Path("") is the working directory)
    cache = Path(os.environ.get("PAGELLM_CACHE_DIR") or Path.home() / ".cache" / "pagellm") / "kernels"
    lib = cache / f"pagellm_cpu_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib, isa
    cache.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        _run([*cxx, *flags, "-o", tmp, *map(str, SOURCES)])
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib, isa


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment variable's value, choices[0] where unset or empty; any other value is a ValueError (a
    mistyped switch would otherwise pick the default without a word)."""
    value = os.environ.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return value


class IsaLevel(NamedTuple):
    march: str
    kept: tuple[str, ...]  # the /proc/cpuinfo flags (of platforms/cpu_isa.ISA_FLAGS) the platform keeps
    also_needed: tuple[str, ...]  # flags the -march lets the compiler use beyond those (BMI2's sarx, ...)
    onednn: str  # ONEDNN_MAX_CPU_ISA
    mkl: str  # MKL_ENABLE_INSTRUCTIONS
    aten: str  # ATEN_CPU_CAPABILITY


# PAGELLM_CPU_ISA caps what pagellm uses at an older x86-64 level than the CPU has, so that one machine can
# stand in for another (an AVX2-only laptop, an AVX-512 server without BF16): the platform sees only the level's
# flags, the kernels build for its -march (unless PAGELLM_CPU_ARCH names one: the lower-level knob wins), and
# torch's oneDNN, MKL and ATen kernels are capped to match (platforms/cpu_isa.py). "native" (the default) caps
# nothing. A level whose -march needs a flag the CPU lacks is refused: its library would die on SIGILL.
_AVX2 = ("avx2", "fma", "f16c")
_HASWELL = ("bmi1", "bmi2", "movbe", "abm")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512_vnni")
ISA_LEVELS = {
    "avx2": IsaLevel("haswell", _AVX2, _HASWELL, "AVX2", "AVX2", "avx2"),
    "avx512": IsaLevel("cascadelake", _AVX512, _HASWELL + ("avx512cd", "avx512dq", "avx512vl"),
                       "AVX512_CORE_VNNI", "AVX512", "avx512"),
    "avx512_bf16": IsaLevel("cooperlake", _AVX512 + ("avx512_bf16",), _HASWELL + ("avx512cd", "avx512dq", "avx512vl"),
                            "AVX512_CORE_BF16", "AVX512", "avx512"),
}


def isa_level() -> str:
    """The PAGELLM_CPU_ISA level ("native": no cap)."""
    return env_choice("PAGELLM_CPU_ISA", ("native", *ISA_LEVELS))


def check_isa_level(level: str, flags: set[str]) -> None:
    """ValueError unless a CPU with these /proc/cpuinfo flags runs everything the level's -march may emit."""
    missing = [f for f in ISA_LEVELS[level].kept + ISA_LEVELS[level].also_needed if f not in flags]
    if missing:
        raise ValueError(f"PAGELLM_CPU_ISA={level} needs {' '.join(missing)}, which this CPU lacks: it can only "
                         "cap the ISA below what the CPU has")


def cpu_flags() -> set[str]:
    """The first CPU's /proc/cpuinfo flags (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def _load_enabled() -> tuple[ctypes.CDLL, dict] | None:
    # The switch is read on every call, outside the cache: turning the kernels off for one engine (a test,
    # a comparison run) must not leave them off, or missing, for the rest of the process.
    return None if env_choice("PAGELLM_CPU_KERNELS", ("1", "0")) == "0" else _load()


@functools.cache
def _load() -> tuple[ctypes.CDLL, dict] | None:
    cxx = _compiler()
    if cxx is None:
        return None
    march, level = os.environ.get("PAGELLM_CPU_ARCH"), isa_level()
    if not march and level != "native":
        check_isa_level(level, cpu_flags())
        march = ISA_LEVELS[level].march
    march = march or "native"
    try:
        path, isa = _build(cxx, march)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        # An unwritable or full cache directory lands here too: one line, and the engine runs without them.
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        log.warning("could not build the CPU kernels (%s; the cache is $PAGELLM_CACHE_DIR, default "
                    "~/.cache/pagellm): using the plain torch path (slower)", first)
        log.debug("CPU kernel build failure in full: %s", e)
        return None
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    bits = lib.pagellm_build_features()
    paths = [p for i, p in enumerate(PATHS) if bits >> i & 1] or ["portable"]
    log.info("CPU kernels: -march=%s, targeting ISA %s, kernel paths %s (%s)", march,
             " ".join(isa) or "baseline", ", ".join(paths), path)
    return lib, {"march": march, "isa": isa, "paths": paths, "library": str(path)}


def library() -> ctypes.CDLL:
    """The loaded library, for the op wrappers: the platform already decided that the kernels run, so this
    skips the switch (an environment lookup per op call showed in profiles) and fails loudly if absent."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError("the native CPU kernels are not available here")
    return loaded[0]


def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded library, or None when switched off (PAGELLM_CPU_KERNELS=0) or it cannot be built."""
    loaded = _load_enabled()
    return None if loaded is None else loaded[0]


def build_info() -> dict | None:
    """{"march", "isa" (what the build targets), "paths" (kernel paths compiled in), "library"}, or None
    where cpu_kernels() is None."""
    loaded = _load_enabled()
    return None if loaded is None else {k: list(v) if isinstance(v, list) else v for k, v in loaded[1].items()}
