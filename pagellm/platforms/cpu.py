"""The CPU platform: probes the ISA and cores, and decides where the native kernels and OpenBLAS run.

The native kernels (pagellm/kernels/cpu, compiled for the host) compute in float32; so the fused ops,
the packed GGUF products, the paged attention kernel and the one-call decoder are chosen only for a
float32 model, and everything else runs the plain-torch implementations (the reference, bit for bit the
path tests compare against). `PAGELLM_CPU_KERNELS=0` turns the native kernels off; `PAGELLM_CPU_BLAS=torch`
keeps torch's GEMM for float32 products.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from pagellm.kernels.build import env_choice
from pagellm.platforms import cpu_isa
from pagellm.platforms.base import OpChoices, Platform
from pagellm.platforms.cpu_memory import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD,
    PREFAULT_MAX_SHARE,
    TRIM_THRESHOLD,
    available_memory,
    malloc_trim,
    mallopt,
    populate,
    zeros_on_touch,
)

# With bf16 GEMMs, steps of more rows than this leave the packed kernels (and the one-call decoder): oneDNN's
# bf16 GEMM costs about the same from 1 to 16 rows while the packed kernels' float32 FMAs grow with every
# row (gate/up 0.173 vs 0.116 ms at 4 rows, 0.666 vs 0.203 at 16; one thread on the Zen 5 VM,
# benchmarks/microbench_few_rows.py), but the module path pays Python and separate attention calls per
# layer. Whole decode steps on the Zen 5 VM: the packed decoder wins at 4 rows, ties at 6, bf16 is 10-15%
# faster at 8 and ~1.6x at 16 (benchmarks/NOTES.md).
BF16_PACKED_MAX_ROWS = 6
# The same limit where few-row products run on int8 activations (AVX-512 VNNI: four q4 blocks per vpdpbusd,
# weights read at 0.6 bytes where the bf16 GEMM reads 2): whole decode steps on the Xeon VM (AMX) under auto,
# packed vs bf16 (benchmarks/few_rows_steps.py): 1.25x at 8 rows, 1.15x at 12, even at 16 (NOTES, 13th session).
# On the Zen 4 VM the two-plane products tie vdpbf16ps at 16 rows and lose past it; one-plane int8 is 1.2-1.35x the
# bf16 paths from 12 rows up but parts from float32 past auto's bounds when decode rows take it, and gained
# nothing in the offline workload as prefill only (benchmarks/microbench_int8_tiles.py; NOTES, 36th session).
INT8_PACKED_MAX_ROWS = 12
# Under auto with AMX-BF16, many-row products of q4_1 and q8_0 blocks up to this many rows dequantize the blocks
# into AMX tiles (kernels/amx.py) instead of the oneDNN product on the bf16 copy. 120 layer products, cold weights
# (benchmarks/microbench_amx.py, seventeenth session, after the 2 x 2 passes and reading bf16 x in place): 2.3x
# at 32 rows, 1.5x at 128, 1.07-1.09x at 192-256, 1.15-1.3x at 384-1024; past 1,024 rows oneDNN changes its
# blocking and wins (1,536 rows 0.71x, 2,048 0.50x). TTFT (benchmarks/prefill_ttft.py LIMIT TOKENS, 128 vs 1024,
# alternating): 256 tokens 77.4 vs 73.6 ms, 512 tokens 147.5 / 145.8 vs 127.7 / 125.1, 1,024 tokens 279.9 /
# 292.4 vs 281.5 / 267.6 (benchmarks/NOTES.md).
AMX_MAX_ROWS = 1024
# With AMX products past them, the few-row kernels keep steps of at most this many rows (int8 activations or
# not): whole decode steps under auto on the Xeon VM (benchmarks/few_rows_steps.py BATCH LIMITS, wall s of three
# runs), packed vs AMX, both in the one-call decoder: batch 4 2.19-2.32 vs 2.28-2.48, 5 2.7 vs 2.7 (less CPU),
# 6 2.86-2.97 vs 2.70-2.86 (AMX steps in the module path, before the decoder took them: 8 3.07 vs 3.04, 10
# 3.8-4.5 vs 3.3-3.5, 12 4.1-4.4 vs 3.5).
AMX_PACKED_MAX_ROWS = 4
# The same limit where few-row products take int8 activations: since they read their blocks in tile order
# (kernels/int8_tiles.py: 4 rows 7.5 -> 4.2 ms per step's products), limit 4 vs limit = batch, wall s of the
# last two runs: batch 5 0.72-0.74 vs 0.64-0.66, 6 0.87 vs 0.82-0.83, 7 0.81-0.94 vs 0.88-0.93, 8 1.03-1.08 vs
# 1.08-1.16 (benchmarks/NOTES.md, sixteenth session).
AMX_INT8_PACKED_MAX_ROWS = 6
# With AVX-512 VNNI but no bf16 dot products (Intel Cascade Lake, Ice Lake) auto keeps float32, and there the
# two-plane int8 products over tile-order blocks (float32-level sums) beat the float32 GEMM on dequantized
# slices at every row count, so they take every row (OpChoices.int8_all_rows). A step's 121 products, cold weights,
# on the Xeon VM, ms, OpenBLAS float32 vs two-plane int8 on VNNI (benchmarks/microbench_int8_tiles.py): 16 rows
# 59.9 vs 13.6, 64 117.3 vs 52.4, 128 192.3 vs 103.9, 512 603.2 vs 432.4, 2,048 2,473 vs 2,026 (NOTES, 35th session).
# Without AMX but with AVX-512 BF16 (AMD Zen 4 / Zen 5), many-row products of q4_1 and q8_0 blocks up to this many
# rows run on vdpbf16ps over the same tile-order blocks (cpu/quant_linear_bf16dp.cpp) instead of oneDNN's bf16
# product. One decode step's 120 layer products, cold weights, on the Zen 4 VM (benchmarks/microbench_amx.py
# --vdpbf16ps, two runs): 1.26-1.54x at 16 rows, 1.18-1.51x at 32, 1.19-1.21x at 48, 1.11-1.16x at 64, 0.96-1.11x
# at 128 (benchmarks/NOTES.md, twentieth session).
BF16DP_MAX_ROWS = 64
# Prompt rows (prompts longer than a few-row step) run their q4_1/q8_0 products on one-plane int8 over the int8 tile
# order (cpu/quant_linear_int8_wide.cpp, 64 multiply-adds per vpdpbusd to vdpbf16ps's 32), not oneDNN's bf16: 1.2-1.36x
# at 2,048 rows on the Zen 4 VM; decode rows never (NOTES, 38th session). PAGELLM_CPU_INT8_PREFILL=0: oneDNN's bf16.

# `pagellm info`'s words for each bf16_prefill_attention choice
PREFILL_ATTENTION = {"sdpa": "torch SDPA in bf16 (AMX tiles) under --dtype auto, else torch SDPA",
                     "kernel": "bf16 kernel (AMX tiles where ready, else vdpbf16ps) under --dtype auto, else SDPA",
                     None: "torch SDPA"}

# --kv-cache-dtype names and their cache element types, for `pagellm info`.
_KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8,
                    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}




SWITCHES = {"PAGELLM_CPU_KERNELS": ("1", "0"), "PAGELLM_CPU_AMX": ("1", "0"), "PAGELLM_CPU_BLAS": ("openblas", "torch"),
            "PAGELLM_CPU_INT8_PREFILL": ("1", "0"), "PAGELLM_CPU_INT8_HEAD": ("1", "0")}


def _switch(name: str) -> str:
    """A switch's value (the first choice where unset). Every switch is checked at each read, so a mistyped one is
    refused whichever of them this CPU goes on to read."""
    return {n: env_choice(n, choices) for n, choices in SWITCHES.items()}[name]


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    def __init__(self):
        # isa_level: PAGELLM_CPU_ISA, under which the platform may use less than the CPU has
        self.cpu_model, self.isa_level, self.isa = cpu_isa.probe()
        self.num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    # The switches are read at each decision (not cached), so a test or a user can turn them off per engine.
    @property
    def native_kernels(self) -> bool:
        """Whether the native kernels run here: switched on and built (a compiler was found)."""
        if _switch("PAGELLM_CPU_KERNELS") == "0":
            return False
        from pagellm.kernels import cpu_kernels

        return cpu_kernels() is not None

    @property
    def openblas_gemm(self) -> bool:
        if not self.native_kernels or _switch("PAGELLM_CPU_BLAS") == "torch":
            return False
        from pagellm.kernels import blas

        return blas.sgemm_available()

    @property
    def kernel_build(self) -> dict | None:
        from pagellm.kernels import build

        return build.build_info() if self.native_kernels else None

    @property
    def bf16_dot_products(self) -> bool:
        """AVX-512 BF16 or AMX-BF16: torch's oneDNN bfloat16 GEMM runs 2-3x the float32 one on the model's
        many-row products there (benchmarks/microbench_bf16_gemm.py)."""
        return "avx512_bf16" in self.isa or "amx_bf16" in self.isa

    def op_choices(self, dtype: torch.dtype, int8_activations: bool | None = None,
                   packed_weights_only: bool = True, auto: bool = False) -> OpChoices:
        native = dtype == torch.float32 and self.native_kernels
        blas = native and self.openblas_gemm
        bf16 = auto and dtype == torch.float32 and self.bf16_dot_products
        from pagellm.kernels import int8_tiles, ops

        if int8_activations is None:  # the platform's choice: under auto, the two-plane mode where it is built
            mode = ops.INT8_FINE if auto and self.fine_int8_activations else ops.INT8_OFF
        else:
            mode = ops.INT8 if int8_activations else ops.INT8_OFF
        amx = bf16 and native and self.amx_tiles
        vdpbf16ps = bf16 and native and not amx and self.bf16dp_products
        one_plane = vdpbf16ps and mode == ops.INT8_FINE  # where prompt rows and the head may take one-plane int8
        # AVX2 (no bf16, no VNNI two-plane mode): prompt rows on one-plane int8 over q4_1 blocks (vpmaddubsw,
        # cpu/quant_linear_int8_avx2.cpp) instead of OpenBLAS's sgemm; decode rows stay float32
        avx2_prompts = auto and native and not bf16 and int8_activations is None and mode == ops.INT8_OFF and \
            int8_tiles.avx2_rows()
        if not bf16:
            few_rows = None
        elif amx:
            few_rows = AMX_INT8_PACKED_MAX_ROWS if mode else AMX_PACKED_MAX_ROWS
        else:
            few_rows = INT8_PACKED_MAX_ROWS if native and mode else BF16_PACKED_MAX_ROWS
        return OpChoices(native_ops=native, packed_kernels=native, blas_gemm=blas,
                         int8_activations=mode if native else ops.INT8_OFF,
                         packed_weights_only=blas and packed_weights_only, bf16_gemm=bf16,
                         packed_max_rows=few_rows, bf16_prepacked=bf16 and torch.backends.mkldnn.is_available(),
                         amx_max_rows=AMX_MAX_ROWS if amx else BF16DP_MAX_ROWS if vdpbf16ps else 0,
                         amx_on_tiles=not vdpbf16ps,
                         int8_all_rows=auto and native and not bf16 and mode == ops.INT8_FINE,
                         int8_many_rows=(one_plane or avx2_prompts) and _switch("PAGELLM_CPU_INT8_PREFILL") == "1",
                         int8_head=one_plane and _switch("PAGELLM_CPU_INT8_HEAD") == "1")

    @property
    def amx_tiles(self) -> bool:
        """Whether the CPU has AMX-BF16, the kernel build its tile path, and Linux granted this process the tile
        state (kernels/amx.py); PAGELLM_CPU_AMX=0 switches the AMX products off (oneDNN's bf16 path instead)."""
        if "amx_bf16" not in self.isa or not self.native_kernels or _switch("PAGELLM_CPU_AMX") == "0":
            return False
        from pagellm.kernels import amx

        return amx.amx_ready()

    @property
    def bf16dp_products(self) -> bool:
        """Whether many-row products over tile-order blocks can run on AVX-512 BF16 vdpbf16ps (the kernel build
        has the path: kernels/amx.py bf16dp_ready), for CPUs without AMX tiles; PAGELLM_CPU_AMX=0 switches them off
        too (oneDNN's bf16 path)."""
        if "avx512_bf16" not in self.isa or not self.native_kernels or _switch("PAGELLM_CPU_AMX") == "0":
            return False
        from pagellm.kernels import amx

        return amx.bf16dp_ready()

    @property
    def fine_int8_activations(self) -> bool:
        """Whether `--dtype auto` runs the few-row (decode) products on two-plane int8 activations (x as int8
        per 32 values plus its rounding error as a second int8 plane, kernels.ops.INT8_FINE): where the kernel
        build has AVX-512 VNNI (four q4 blocks per vpdpbusd). On the Xeon VM: logprobs as auto without int8
        (dtype_auto_quality.py), products within 4e-5 of the float32 ones' scale, single-stream decode 1.3x
        float32 x (benchmarks/NOTES.md, thirteenth session); llama.cpp's one-plane scheme (--int8-activations)
        is faster still but parts from float32 sooner."""
        from pagellm.kernels import ops

        return self.native_kernels and ops.has_fine_int8_activations()

    def auto_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Where the platform chose bf16 GEMMs: int8 rows (head_dim codes and a float16 scale per token and KV
        head) where the build reads them in both attention kernels (decode 16 lanes at a time, prefill in bf16:
        AVX-512 BF16), else float16 where the paged kernel reads that in place. Decode attention streams every
        row's whole KV each step and is memory-bound: float32 -> float16 took the offline workload -5 to -9%
        CPU time on the Zen 5 VM, float16 -> int8 +8-13% output tok/s on the Xeon VM, with 0.54x the bytes
        per token (benchmarks/NOTES.md, nineteenth session; the logprob cost is in tests/test_dtype_auto.py).
        Without bf16 dot products (AVX2, or AVX-512 without BF16) float16 where the paged kernel reads it (F16C),
        as llama.cpp's default f16 cache: the offline workload +6% output tok/s and 1.6 -> 1.2 GiB peak RSS on the
        Zen 4 VM capped to AVX2 (benchmarks/NOTES.md, fortieth session); --dtype float32 keeps a float32 cache."""
        if not self.bf16_dot_products:
            return torch.float16 if dtype == torch.float32 and self.kv_dtype_readable_natively(torch.float16) \
                else dtype
        from pagellm.kernels import ops

        if self.kv_dtype_readable_natively(torch.int8) and ops.has_bf16_prefill_attention():
            return torch.int8
        if self.kv_dtype_readable_natively(torch.float16):
            return torch.float16
        return dtype

    def kv_dtype_readable_natively(self, kv_dtype: torch.dtype) -> bool:
        if not self.native_kernels:
            return False
        from pagellm.kernels import ops

        return ops.kv_dtype_supported(kv_dtype)

    def bf16_prefill_attention(self, auto: bool, kv_dtype: torch.dtype) -> str | None:
        """How long prefill chunks attend under auto (auto=True) where the CPU has bf16 dot products: "kernel", the
        own bf16 flash-attention kernel, with its products on AMX tiles where the CPU, the build and the OS have them
        (1.4-2.0x faster than torch's bf16 SDPA over the gathered cache on the Xeon VM at 512-2,048 tokens) and on
        AVX-512 BF16 `vdpbf16ps` without AMX (3x torch's bf16 SDPA on the Zen 5 VM); "sdpa" with AMX-BF16 but no
        tile kernel and no vdpbf16ps products (torch's flash attention on bf16 inputs, whose products oneDNN runs on
        AMX tiles); None: float32 SDPA. Both read float32, float16 and int8 caches; outputs within bf16 rounding
        (tests/test_prefill_attention.py)."""
        if not (auto and self.bf16_dot_products and self.native_kernels
                and kv_dtype in (torch.float32, torch.float16, torch.int8)):
            return None
        from pagellm.kernels import ops

        # AMX: the own kernel where its products run on tiles, else oneDNN's; but where the tiles are not ready and
        # products take vdpbf16ps (bf16dp_products), as on a Zen 4, prompts take one-plane int8 and the runner marks
        # their chunks for the own kernel (OpChoices.int8_many_rows): torch's SDPA would drop those marks
        if "amx_bf16" in self.isa and not ops.has_amx_prefill_attention() and not self.bf16dp_products:
            return "sdpa"
        return "kernel" if ops.has_bf16_prefill_attention() else None

    def attention_backend(self, requested: str, kv_dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
        if requested != "auto":
            return requested
        native = compute_dtype == torch.float32 and self.kv_dtype_readable_natively(kv_dtype)
        return "cpu_paged" if native else "torch_sdpa_batched"

    def compile_decoder(self, model, backend_name: str, kv_dtype: torch.dtype):
        """The one-call native decoder for few-row steps (decode, verification): all packed matmuls, the
        paged attention kernel and the fused ops of every layer in one native call, no Python between
        layers. Only where the module path would run those same kernels (so results are identical)."""
        if backend_name != "cpu_paged" or not self.kv_dtype_readable_natively(kv_dtype):
            return None
        from pagellm.kernels.decoder import NativeDecoder

        return NativeDecoder(model) if NativeDecoder.supports(model) else None

    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return zeros_on_touch(shape, dtype)

    def prefault_kv(self, caches: list[torch.Tensor]) -> None:
        # Resident now means it has to fit now, beside the steps' activations: refuse at start, with the
        # numbers, rather than swap or meet the OOM killer (without --prefault-kv-cache the cache only
        # takes what requests fill).
        need, free = sum(c.numel() * c.element_size() for c in caches), available_memory()
        if free is not None and need > PREFAULT_MAX_SHARE * free:
            raise ValueError(f"the KV cache ({need / 2**20:.0f} MiB) does not fit in the {free / 2**20:.0f} MiB of "
                             "memory available: lower --kv-cache-memory, or leave out --prefault-kv-cache to let "
                             "it become resident only as blocks fill")
        populate(caches, torch.get_num_threads())

    def allocate_swap(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return zeros_on_touch(shape, dtype)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        # Loading churns through tens of MiB-sized temporaries on worker threads; below glibc's grown mmap
        # threshold they pile up in per-thread arenas (peak RSS 1.5 GiB for a 0.45 GiB model). Map them
        # directly while loading, then allow MMAP_THRESHOLD (above the dynamic threshold's 32 MiB ceiling: a step's
        # big outputs, such as many rows' logits, are reused from the heap instead of faulted in every step).
        mallopt(M_MMAP_THRESHOLD, 1 << 20)
        try:
            yield
        finally:
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            # A fixed mmap threshold also fixes the trim threshold at 128 KiB: every step's freed activations
            # at the heap's top went back to the OS and the next step faulted them in again (W2 offline on the
            # Xeon VM: 1.35M page faults and 527 tok/s, a second run in the same engine 2.67M and 449; with
            # this 265k / 112k and 568 / 583). Idle trims (release_free_memory) still return it all.
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        # Dequantizing on worker threads leaves ~600 MiB of freed buffers in glibc's per-thread arenas
        # (measured with SmolLM2); hand them back to the OS before the KV cache is allocated on top.
        malloc_trim()

    def release_free_memory(self) -> None:
        # Requests leave freed buffers below the mmap threshold (MMAP_THRESHOLD) (bodies, prompts, logits rows) in
        # glibc's arenas, which only return memory from their top: without a trim RSS ratchets up with
        # every new peak (bench soak: +150 MiB over 10 minutes of SmolLM2 traffic).
        malloc_trim()

    def describe(self) -> dict[str, str]:
        build = self.kernel_build
        choices = self.op_choices(torch.float32, auto=True)
        dtype = self.auto_dtype()
        return {
            "device": "cpu",
            "cpu": f"{self.cpu_model}, {self.num_cores} cores",
            "isa": (" ".join(self.isa) or "baseline x86-64") + (
                f" (capped by PAGELLM_CPU_ISA={self.isa_level})" if self.isa_level != "native" else ""),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "kernels": ("off" if build is None else
                        f"built for -march={build['march']}, hand-written paths {', '.join(build['paths'])}"),
            "kernel_isa": "-" if build is None else " ".join(build["isa"]) or "baseline x86-64",
            "dtype": f"auto -> {str(dtype).removeprefix('torch.')}" + (
                f" activations, bf16 GEMMs above {choices.packed_max_rows} rows" if choices.bf16_gemm else "") + (
                "" if not choices.int8_activations else ", two-plane int8 activations in every product of q4_1/q8_0 "
                "blocks" if choices.int8_all_rows else ", two-plane int8 activations in few-row products") + (
                "" if not choices.int8_many_rows else ", one-plane int8 for prompt rows in q4_1/q8_0 products"
                if choices.bf16_gemm else ", one-plane int8 for prompt rows in q4_1 products (vpmaddubsw)") + (
                ", one-plane int8 for the logits head's rows past them" if choices.int8_head else ""),
            "op_dtypes": ", ".join(f"{k} {v}" for k, v in self.op_dtypes(dtype).items()),
            "ops": "native kernels (forward_cpu)" if choices.native_ops else "plain torch (forward_native)",
            "float32_gemm": "numpy OpenBLAS" if choices.blas_gemm else "torch",
            "auto_many_row_gemm": ("bfloat16 x bfloat16 -> float32 (torch oneDNN); --dtype float32 keeps float32"
                                   if choices.bf16_gemm else "two-plane int8 over q4_1/q8_0 blocks (VNNI), float32 "
                                   "for other weights" if choices.int8_all_rows else "float32") + (
                f"; q4_1/q8_0 blocks dequantized into {'AMX bf16 tiles' if choices.amx_on_tiles else 'vdpbf16ps'}"
                + (" products of decode rows, at any count; prompt rows on one-plane int8 over them (VNNI)"
                   if choices.int8_many_rows else f" products up to {choices.amx_max_rows} rows")
                if choices.amx_max_rows else ""),
            "attention_backend": f"auto -> {self.attention_backend('auto', dtype, dtype)}",
            "prefill_attention": PREFILL_ATTENTION[self.bf16_prefill_attention(True, self.auto_kv_dtype(dtype))] + (
                ", under --dtype auto the paged kernel a row at a time for prompts (int8 rows: chunking-invariant)"
                if choices.int8_many_rows and not choices.bf16_gemm else ""),
            "kv_cache_dtype": f"auto -> {str(self.auto_kv_dtype(dtype)).removeprefix('torch.')} under --dtype auto",
            "kv_float16_native": str(self.kv_dtype_readable_natively(torch.float16)).lower(),
            # --kv-cache-dtype values the paged kernel (and so the one-call decoder) reads in place
            "kv_cache_dtypes_native": " ".join(name for name, dt in _KV_CACHE_DTYPES.items()
                                               if self.kv_dtype_readable_natively(dt)) or "-",
            "threads": str(torch.get_num_threads()),
        }
