"""The CUDA platform: one GPU (`cuda` or `cuda:N`), probed once; bf16 where the GPU has it.

What it decides (docs/architecture.md, "The platform layer"):
- dtype: `auto` is bfloat16 from compute capability 8.0 (Ampere) on, float16 before (no bf16 tensor cores).
- attention: `auto` is the Triton paged kernel ("triton_paged") when triton is installed, else torch SDPA
  ("torch_sdpa_batched": every decode row in one SDPA call; the reference backend loops over requests).
- ops: plain torch (`forward_native`) on the GPU; no packed GGUF kernels, so a GGUF's q4/q8 weights are
  dequantized to the compute dtype at load (the loader's float path).
- decode steps run as CUDA graphs, one per padded batch size, unless `--enforce-eager`; only with an
  attention backend that reads the step's lengths from tensors (a graph freezes Python lists).
- memory: the KV cache on the device, swap space in pinned host memory (asynchronous copies), and the
  numbers the engine sizes the KV cache from (total memory, a profiled step's peak, memory outside torch).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from pagellm.platforms.base import Platform

# Backends whose decode step can be captured once and replayed: they read seq_lens / query_start_loc from the
# metadata's tensors (`seq_lens_t`, `query_start_loc_t`), which the graph runner refills before each replay.
GRAPH_SAFE_BACKENDS = ("triton_paged",)


def padded_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes that get a CUDA graph: 1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs
    itself, so every decode step (at most max_num_seqs requests) pads to the next captured size: at most
    twice its rows, and none for the common full batch."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    def __init__(self, index: int | None = None):
        """index: N of `cuda:N`; None (plain `cuda`) is device 0."""
        self.index = 0 if index is None else index
        self.available = torch.cuda.is_available()
        self.device_count = torch.cuda.device_count() if self.available else 0
        if self.index < self.device_count:
            props = torch.cuda.get_device_properties(self.index)
            self.gpu_name, self.capability, self.memory = props.name, (props.major, props.minor), props.total_memory
        else:
            self.gpu_name, self.capability, self.memory = "none", (0, 0), 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def check_available(self) -> None:
        if not self.available:
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU here (use --device cpu)")
        if self.index >= self.device_count:
            raise ValueError(f"device 'cuda:{self.index}' was asked for, but torch sees {self.device_count} CUDA "
                             f"GPU(s) (cuda:0 to cuda:{self.device_count - 1})")

    def use_device(self) -> None:
        # Kernels launch on the current device (Triton's, cuBLAS handles, graph capture, streams): make it ours.
        torch.cuda.set_device(self.index)

    # ---- decisions --------------------------------------------------------------------------
    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.capability >= (8, 0) else torch.float16

    def attention_backend(self, requested: str, kv_dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
        if requested != "auto":
            return requested
        return "triton_paged" if self.kv_dtype_readable_natively(kv_dtype) else "torch_sdpa_batched"

    def kv_dtype_readable_natively(self, kv_dtype: torch.dtype) -> bool:
        """Whether the Triton kernel reads this cache in place: float caches and fp8 (e4m3 from compute
        capability 8.9 on); int8 rows with their in-band scale only the torch backends dequantize."""
        if not triton_available():
            return False
        if kv_dtype == torch.float8_e4m3fn:
            return self.capability >= (8, 9)
        return kv_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2)

    def decode_graph_sizes(self, backend_name: str, max_num_seqs: int, enforce_eager: bool) -> tuple[int, ...]:
        if enforce_eager or backend_name not in GRAPH_SAFE_BACKENDS:
            return ()
        return padded_batch_sizes(max_num_seqs)

    # ---- memory -----------------------------------------------------------------------------
    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def allocate_swap(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # pinned: device <-> host copies are DMA transfers that run while the GPU computes (non_blocking)
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def total_memory(self) -> int:
        return self.memory

    def memory_in_use(self) -> int:
        """Device memory in use now, by anyone: this process's tensors and allocator cache, the CUDA context,
        cuBLAS workspaces, other engines and processes on the GPU."""
        free, total = torch.cuda.mem_get_info(self.index)
        return total - free

    def peak_memory_of(self, fn: Callable[[], None]) -> int:
        """Bytes torch allocated at the peak of fn() above what was allocated before it (the activations of a
        profiling step); afterwards the freed blocks go back to the driver, for the KV cache to take."""
        torch.cuda.synchronize(self.index)
        torch.cuda.reset_peak_memory_stats(self.index)
        before = torch.cuda.memory_allocated(self.index)
        fn()
        torch.cuda.synchronize(self.index)
        peak = torch.cuda.max_memory_allocated(self.index) - before
        torch.cuda.empty_cache()
        return peak

    # ---- reporting --------------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        dtype = self.auto_dtype()
        backend = self.attention_backend("auto", dtype, dtype)
        return {
            "device": "cuda" if self.index == 0 else f"cuda:{self.index}",
            "gpu": (f"{self.gpu_name}, compute capability {self.capability[0]}.{self.capability[1]}, "
                    f"{self.memory / 2**30:.1f} GiB") if self.memory else "none visible to torch",
            "dtype": f"auto -> {str(dtype).removeprefix('torch.')}",
            "op_dtypes": ", ".join(f"{k} {v}" for k, v in self.op_dtypes(dtype).items()),
            "ops": "plain torch (forward_native)",
            "gguf_weights": "dequantized to the compute dtype at load",
            "attention_backend": f"auto -> {backend}",
            "cuda_graphs": ("decode steps, padded batch sizes 1, 2, 4, ... --max-num-seqs (--enforce-eager: off)"
                            if backend in GRAPH_SAFE_BACKENDS else f"off ({backend} reads Python lists)"),
            "kv_cache": "--gpu-memory-utilization x total - weights - profiled activations (or --kv-cache-memory)",
            "threads": str(torch.get_num_threads()),
        }
