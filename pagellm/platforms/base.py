"""The Platform interface: what every device kind decides for the engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A Python list as a tensor on `device` without making the host wait for the GPU: torch's plain
    host-to-device copy synchronizes the stream, a non_blocking one from pinned memory does not (the pinned
    buffer is recycled only once the copy is done). On the CPU, the plain tensor."""
    if torch.device(device).type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class OpChoices:
    """Which implementation the model's ops and weight formats use, decided once per model load.

    native_ops: fused native kernels for RMSNorm + residual, RoPE and SiLU-and-mul (`forward_cpu`);
    packed_kernels: few-row products read GGUF blocks in place; blas_gemm: many-row float32 GEMMs go
    through numpy's OpenBLAS; int8_activations: how packed products treat x (kernels.ops: INT8_OFF float32,
    INT8 rounded to int8 per 32 values as llama.cpp does, INT8_FINE int8 plus a rounding-error plane);
    packed_weights_only: float copies of packed weights are freed after loading; bf16_gemm: many-row
    products (more rows than the few-row kernels take) multiply bfloat16 copies of the weights and of x with
    float32 accumulation (torch's oneDNN GEMM), where the CPU has bf16 dot products and `--dtype auto` asked
    for the platform's choice; everything else stays float32. packed_max_rows: the most rows a product
    takes the few-row kernels for (None: quant.formats.PACKED_MAX_ROWS, the float32 GEMM's crossover);
    bf16_prepacked: the bf16 copies are reordered once into oneDNN's blocked layout (torch.ops.mkldnn), so a
    product does not reorder the weight on every call; amx_max_rows: many-row products of q4_1 and q8_0 blocks
    with at most this many rows (decode steps past the few-row kernels) dequantize the blocks into AMX bf16
    tiles instead (kernels/amx.py: the bf16 path's arithmetic, 0.8 / 1.1 bytes per weight read instead of 2;
    0: never); amx_on_tiles: those products run on AMX tiles (True) or, on CPUs with AVX-512 BF16 but no AMX,
    on vdpbf16ps over the same blocks (False: the same arithmetic, cpu/quant_linear_bf16dp.cpp);
    int8_all_rows: layers whose blocks are in int8 tile order take their two-plane int8 products at every row
    count, not only up to packed_max_rows (kernels/int8_tiles.py; where many-row products would be float32);
    int8_many_rows: in a forward of prompt chunks (quant.linear_method.prompt_step, set by the model runner for
    prompts longer than packed_max_rows) layers with int8 tile-order blocks multiply on one-plane int8 activations
    (llama.cpp's per-32 rounding; cpu/quant_linear_int8_wide.cpp) at any row count, and their decode rows past the
    few-row kernels on vdpbf16ps at any count; such layers keep no bf16 copy (AVX-512 BF16 + VNNI without AMX); in
    AVX2 builds (no bf16_gemm) q4_1 layers' prompt rows (cpu/quant_linear_int8_avx2.cpp), decode rows on float32;
    int8_head: the logits head (Linear.logits_head) with int8 tile-order blocks multiplies its rows past the few-row
    kernels on one-plane int8 activations, keeping neither a bf16 copy nor AMX tile-order blocks (the same CPUs)."""

    native_ops: bool = False
    packed_kernels: bool = False
    blas_gemm: bool = False
    int8_activations: int = 0
    packed_weights_only: bool = False
    bf16_gemm: bool = False
    packed_max_rows: int | None = None
    bf16_prepacked: bool = False
    amx_max_rows: int = 0
    amx_on_tiles: bool = True
    int8_all_rows: bool = False
    int8_many_rows: bool = False
    int8_head: bool = False

    @property
    def op_impl(self) -> str:
        """The CustomOp implementation name: "cpu" (native kernels) or "native" (plain torch)."""
        return "cpu" if self.native_ops else "native"


class Platform:
    name = "base"
    device_type = "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def check_available(self) -> None:
        """Raises a one-line error when the device cannot be used here."""

    def use_device(self) -> None:
        """Makes this device the current one for what launches on "the current device" (cuda:N)."""

    # ---- decisions --------------------------------------------------------------------------
    def resolve_dtype(self, requested: str) -> torch.dtype:
        """The compute dtype for a `--dtype` value; "auto" is the platform's choice."""
        if requested == "auto":
            return self.auto_dtype()
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {requested!r}")
        return DTYPES[requested]

    def auto_dtype(self) -> torch.dtype:
        return torch.float32

    def auto_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache element type under `--dtype auto` with `--kv-cache-dtype auto`."""
        return dtype

    def op_dtypes(self, dtype: torch.dtype) -> dict[str, str]:
        """The dtype each op class computes in, for `pagellm info` and the bench header."""
        name = str(dtype).removeprefix("torch.")
        return {"linear": name, "attention": name, "norm": "float32 (then cast)", "logits": "float32"}

    def op_choices(self, dtype: torch.dtype, int8_activations: bool | None = None,
                   packed_weights_only: bool = True, auto: bool = False) -> OpChoices:
        """auto: the user asked for the platform's choice (`--dtype auto`), so faster, non-exact paths may
        be chosen; with an explicit dtype, only paths exact for it. int8_activations None: the platform's
        choice (here: off)."""
        return OpChoices(int8_activations=int(bool(int8_activations)))

    def attention_backend(self, requested: str, kv_dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
        """The backend name for `--attention-backend auto`; other values pass through (checked by the
        selector)."""
        return "torch_sdpa_batched" if requested == "auto" else requested

    def kv_dtype_readable_natively(self, kv_dtype: torch.dtype) -> bool:
        return False

    def bf16_prefill_attention(self, auto: bool, kv_dtype: torch.dtype) -> str | None:
        """How long prefill chunks attend in bf16 under `--dtype auto` (auto=True): "sdpa" (torch's SDPA on bf16
        inputs), "kernel" (a native kernel), or None (in the compute dtype)."""
        return None

    def compile_decoder(self, model, backend_name: str, kv_dtype: torch.dtype):
        """A compiled few-row forward for the runner (the CPU's one-call native decoder), or None."""
        return None

    def decode_graph_sizes(self, backend_name: str, max_num_seqs: int, enforce_eager: bool) -> tuple[int, ...]:
        """Padded batch sizes whose decode step the runner captures as a graph and replays; () for none. The
        runner builds the graphs (pagellm/model/cuda_graphs.py): platforms decide, they do not touch the
        model's code."""
        return ()

    # ---- memory and threads -----------------------------------------------------------------
    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def prefault_kv(self, caches: list[torch.Tensor]) -> None:
        """Make KV caches from allocate_kv resident now rather than page by page in the steps that first
        write them (torch.zeros already wrote every byte)."""

    def allocate_swap(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for swapped-out KV blocks."""
        return torch.zeros(shape, dtype=dtype)

    def total_memory(self) -> int | None:
        """Device memory in bytes where the engine sizes its KV cache from it (a GPU), else None."""
        return None

    def memory_in_use(self) -> int:
        """Device memory in use now (weights included), where total_memory() is known."""
        return 0

    def peak_memory_of(self, fn) -> int:
        """Bytes allocated at fn()'s peak above what was allocated before (a GPU profiles it; else 0)."""
        fn()
        return 0

    def set_num_threads(self, num_threads: int | None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Wraps weight loading (allocator tuning while tensors churn; memory returned afterwards)."""
        yield

    def release_free_memory(self) -> None:
        """Hand memory the allocator holds but nothing uses back to the OS (the server calls it when idle)."""

    # ---- reporting --------------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        raise NotImplementedError

    HARDWARE_KEYS = ("device", "cpu", "gpu", "isa", "kernels", "threads")

    def summary_line(self, keys: tuple[str, ...] | None = None) -> str:
        """One line of describe(); by default with the platform's own choices for `auto` too."""
        d = self.describe()
        keys = keys or ("device", "cpu", "gpu", "isa", "kernels", "dtype", "attention_backend", "prefill_attention",
                        "threads")
        return "platform: " + "; ".join(f"{k} {d[k]}" for k in keys if k in d)
