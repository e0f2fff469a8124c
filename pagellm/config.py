"""Engine configuration: plain dataclasses, validated once at construction."""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass, fields
from numbers import Integral

from pagellm import cli_types

logger = logging.getLogger("pagellm")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per KV block the kernels and the manager take


def _is_bool(value) -> bool:
    """A Python or a numpy bool (numpy's is no int subclass, and config stays numpy-free)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def check_block_size(value: int, name: str) -> None:
    if value not in BLOCK_SIZES:
        raise ValueError(f"{name} must be a power of two in [1, 256], got {value}")


def check_ngram_bounds(n_min: int, n_max: int) -> None:
    """The n-gram proposer's lengths (EngineArgs checks them before the load, the proposer when built)."""
    if n_max < 1:
        raise ValueError(f"ngram_max must be >= 1, got {n_max}")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"ngram_min must be in [1, ngram_max={n_max}], got {n_min}")


def parse_bytes(value: int | float | str) -> int:
    """Accept 2147483648, "2GiB", "512MiB", "1.5GB", "8e10", "80 gb" and return a byte count."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int | float):
        if not 1 <= value < 2**63:  # nan and inf too
            raise ValueError(f"byte size must be at least 1 byte and below 2**63, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse byte size {value!r} (examples: 2GiB, 512MiB, 1.5GB, 8e10)")
    n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if not 1 <= n < 2**63:  # 400 digits overflow float to inf
        raise ValueError(f"byte size must be at least 1 byte and below 2**63, got {value!r}")
    return int(n)


# --kv-cache-memory when none is given on the CPU (a GPU sizes the cache from --gpu-memory-utilization).
DEFAULT_KV_CACHE_MEMORY = "1GiB"


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    enable_prefix_caching: bool = True

    def __post_init__(self):
        try:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory: {e}") from None
        check_block_size(self.block_size, "block_size")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None -> the model's context length
    enable_chunked_prefill: bool = True
    # Prompt tokens one step takes beside running decodes while few requests wait (core/scheduler.py); 0: the
    # whole budget always
    max_prefill_tokens_while_decoding: int = 256

    def __post_init__(self):
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 0, got "
                             f"{self.max_prefill_tokens_while_decoding}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


# EngineArgs fields that only one mode reads: field -> (the mode's field, the values that turn it on, the flag
# to give). Their CLI defaults are None, so one given without its mode is refused (see from_cli_args).
_SPECULATING = ("speculative_method", ("ngram", "draft"), "--speculative-method ngram or draft")
MODE_ONLY_OPTIONS = {"num_speculative_tokens": _SPECULATING, "ngram_min": _SPECULATING, "ngram_max": _SPECULATING,
                     "speculative_disable_by_batch_size": _SPECULATING,
                     "quantization_group_size": ("quantization", ("int4",), "--quantization int4")}
# "auto": the platform picks per device (the engine resolves it). The default (None) is float32 on the CPU and
# auto on a GPU (bf16 from compute capability 8.0, float16 before); float16 compute only on a GPU.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# Weight formats (--quantization): auto reads quantization_config in config.json, or the GGUF tensor
# types; none dequantizes every quantized weight to the compute dtype; int8/int4 quantize a float
# checkpoint's matrices at load (round to nearest: per-channel int8, int4 in groups).
QUANTIZATIONS = ("auto", "none", "gptq", "awq", "fp8", "compressed-tensors", "int8", "int4")
# Group sizes along K of int4 at load and of `pagellm quantize` (multiples of the kernels' 32-weight blocks).
QUANT_GROUP_SIZES = (32, 64, 128)
ATTENTION_BACKENDS = ("auto", "cpu_paged", "torch_sdpa_batched", "torch_sdpa_reference", "triton_paged")
# Earlier names, still accepted (with a deprecation warning) so existing scripts and configs keep working.
ATTENTION_BACKEND_ALIASES = {"native": "cpu_paged", "batched": "torch_sdpa_batched",
                             "reference": "torch_sdpa_reference"}


@dataclass
class EngineArgs:
    """Every engine option, named like its CLI flag (--kv-cache-memory -> kv_cache_memory)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None  # None: "float32" on the CPU, "auto" on cuda (resolved in __post_init__)
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    # Bytes for the KV cache. None: DEFAULT_KV_CACHE_MEMORY on the CPU; on a GPU what
    # gpu_memory_utilization leaves after the weights and a profiled step's activations (engine/gpu_memory.py).
    kv_cache_memory: int | str | None = None
    # cuda only: the fraction of the GPU's memory the engine may use (weights + activations + KV), vLLM's option.
    gpu_memory_utilization: float = 0.9
    # cuda only: no CUDA graphs; every decode step runs eagerly, op by op (for debugging and comparisons).
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_prefill_tokens_while_decoding: int = 256
    enable_prefix_caching: bool = True
    # Make the CPU KV cache's whole memory resident at start, as vLLM and llama.cpp do, instead of page by
    # page as blocks are first written: no page faults inside the first steps (the offline workload's first
    # run on a 2-core Xeon VM: +3-8% while the host had not backed the memory, +0% once it had), but the whole
    # --kv-cache-memory is resident from the start (peak RSS 1.7 -> 2.1-2.2 GiB there).
    prefault_kv_cache: bool = False
    preemption_mode: str = "recompute"
    swap_space: int | str = "256MiB"
    attention_backend: str = "auto"
    # KV cache element type: "auto" follows dtype (under --dtype auto, the platform's choice: int8 rows where
    # both CPU attention kernels read them, else float16, platforms/cpu.py auto_kv_dtype). float16 halves the
    # cache's bytes per token (twice the tokens in the same memory, half the bytes attention reads per decode
    # step) at the cost of rounding keys and values to 11 significant bits, as llama.cpp's default f16 cache
    # does (tests/test_kv_cache_dtype.py); int8 about a quarter (tests/test_kv_quant.py).
    kv_cache_dtype: str = "auto"
    # Packed matmuls (steps of <= 20 rows) round activations to int8 per 32 values (llama.cpp's scheme):
    # faster single-stream decode on the CPU, logprobs no longer float32-exact (tests/test_kernels.py).
    # Bigger steps stay float32, so with speculation a verification step of more than 20 rows can part
    # from what non-speculative int8 decoding would have said.
    # None: the platform decides (under --dtype auto with AVX-512 VNNI: two-plane int8, kernels.ops.INT8_FINE).
    int8_activations: bool | None = None
    quantization: str = "auto"
    # --quantization int4: input columns per (scale, minimum) group; K of every matrix must be a multiple.
    quantization_group_size: int = 128
    # Keep only the GGUF blocks of quantized weights (no float32 copies) where the CPU kernels read them:
    # many-row matmuls dequantize cache-sized slices on the fly (the same values). ~530 MiB less for
    # SmolLM2; prefill GEMMs 0-10% slower (benchmarks/NOTES.md).
    packed_weights_only: bool = True
    num_threads: int | None = None
    speculative_method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    draft_kv_cache_memory: int | str = "256MiB"
    # No drafts in a step where this many requests or more are running (vLLM's option of the same name):
    # verification rows cost compute, and with enough rows in the batch that outweighs the saved steps
    # (on the 2-core CPU, n-gram K=4 already loses at batch 4: benchmarks/results/README.md).
    speculative_disable_by_batch_size: int | None = None
    # n-gram drafts only where they pay: the engine measures what verification rows cost and what each
    # request's drafts bring, and drops the drafts that would lower tokens per second
    # (pagellm/spec_decode/adaptive.py). False drafts whatever the proposer finds, as before.
    speculative_adaptive: bool = True
    # /v1/embeddings and LLM.embed: the final hidden state of the last prompt token, or the mean over all.
    embedding_pooling: str = "last"
    # Tensor x pipeline parallel worker processes (pagellm/executor): None picks "uni" (the engine's own
    # process) for one rank, else "mp"; "ray" places the workers on a Ray cluster (pip install pagellm[ray]).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    shm_allreduce: bool = True  # tensor-parallel ranks on one host sum through shared memory, not gloo

    def __post_init__(self):
        self._check_types()
        self._check_mode_only_options()
        gpu = str(self.device).startswith("cuda")
        if self.dtype is None:
            self.dtype = "auto" if gpu else "float32"
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {list(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and not gpu:
            raise ValueError("dtype float16 computes on a GPU only (--device cuda); on the CPU use float32, "
                             "bfloat16 or auto")
        if self.attention_backend in ATTENTION_BACKEND_ALIASES:
            new = ATTENTION_BACKEND_ALIASES[self.attention_backend]
            logger.warning("attention_backend %r is deprecated, use %r instead", self.attention_backend, new)
            self.attention_backend = new
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)} (or the old names "
                             f"{list(ATTENTION_BACKEND_ALIASES)}), got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be 'ngram' or 'draft', got {self.speculative_method!r}")
        if self.draft_model is not None and self.speculative_method != "draft":
            raise ValueError("draft_model is read only with speculative_method 'draft' (--speculative-method draft)")
        if self.speculative_method == "draft" and not self.draft_model:  # here, not after the target loaded
            raise ValueError("speculative_method='draft' needs draft_model (a .gguf file or HF directory)")
        n = self.speculative_disable_by_batch_size
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"speculative_disable_by_batch_size must be an integer >= 1, got {n!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        self._check_parallel()
        self._check_sizes()
        if self.embedding_pooling not in ("last", "mean"):
            raise ValueError(f"embedding_pooling must be 'last' or 'mean', got {self.embedding_pooling!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        try:
            self.swap_space = parse_bytes(self.swap_space) if self.swap_space not in (0, "0") else 0
        except ValueError as e:
            raise ValueError(f"swap_space: {e}") from None
        if self.preemption_mode == "swap" and self.swap_space == 0:  # it had fallen back to recompute silently
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 (host memory for swapped-out blocks)")

    def _check_types(self) -> None:
        """Integer and flag options of the wrong type (a Python caller's "abc" or True) fail here naming the
        field, not later inside the engine; then the bounds nothing else checks before the weights load."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if value is None and kind.endswith("| None"):
                continue
            if kind.startswith("int |") and kind != "int | None":
                continue  # a size: int or "256MiB", parsed below
            if kind.startswith("int"):
                if _is_bool(value) or not isinstance(value, Integral):
                    raise ValueError(f"{f.name} must be an integer, got {value!r}")
                setattr(self, f.name, int(value))  # numpy's integers too, as plain ints
            if kind.startswith("bool"):
                if not _is_bool(value):
                    raise ValueError(f"{f.name} must be True or False, got {value!r}")
                setattr(self, f.name, bool(value))
        if not re.fullmatch(r"(cpu|cuda)(:\d+)?", str(self.device)):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not -2**63 <= self.seed < 2**64:  # what torch.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        check_block_size(self.block_size, "block_size")
        self.scheduler_config(self.max_model_len or 1)  # its own checks, now rather than after the load
        if self.speculative_method == "ngram":  # read only then
            check_ngram_bounds(self.ngram_min, self.ngram_max)
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.attention_backend == "triton_paged" and not str(self.device).startswith("cuda") \
                and os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs it on the CPU, for tests
            raise ValueError("attention_backend 'triton_paged' runs on CUDA (--device cuda); on the CPU use "
                             "--attention-backend auto")

    def _check_mode_only_options(self) -> None:
        """An option that only one mode reads, set away from its default without that mode, is refused (the CLI
        refuses it even at its default: from_cli_args); set silently, it would change nothing."""
        defaults = {f.name: f.default for f in fields(self)}
        for k, (mode, on, _) in MODE_ONLY_OPTIONS.items():
            if getattr(self, k) != defaults[k] and getattr(self, mode) not in on:
                raise ValueError(f"{k}={getattr(self, k)!r} is read only with {mode} "
                                 f"{' or '.join(repr(m) for m in on)}")

    def _check_sizes(self) -> None:
        """What a falsy value would otherwise turn into the default (`or`): 0, or an empty string."""
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cli_types.MAX_THREADS):
            raise ValueError(f"num_threads must be an integer in [1, {cli_types.MAX_THREADS}], got {n!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        for name in ("kv_cache_memory", "draft_kv_cache_memory"):
            if getattr(self, name) is not None:
                try:
                    parse_bytes(getattr(self, name))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'uni', 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.world_ranks > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank; tensor x pipeline parallel size "
                             f"is {self.world_ranks}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address)")

    @property
    def world_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend:
            return self.distributed_executor_backend
        return "mp" if self.world_ranks > 1 or self.nnodes > 1 else "uni"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with add_cli_args (other attributes are ignored). The options that
        only one mode reads (MODE_ONLY_OPTIONS) default to None on the command line: given without their mode
        they are refused (as vLLM refuses num_speculative_tokens without a method), not silently ignored."""
        given = {k: getattr(ns, k) for k in cls.field_names() if hasattr(ns, k)}
        for k, (mode, on, flag) in MODE_ONLY_OPTIONS.items():
            if given.get(k) is not None and given.get(mode) not in on:
                raise ValueError(f"--{k.replace('_', '-')}: read only with {flag}")
        return cls(**{k: v for k, v in given.items() if v is not None or k not in MODE_ONLY_OPTIONS})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add every engine option as a --flag (dest = the field name) in an "engine" argument group."""
        from pagellm.config_cli import add_engine_args  # the option table imports this module's constants

        add_engine_args(parser)

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache dtype's name; "auto" only while dtype is "auto" too (the engine resolves both)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def cache_config(self) -> CacheConfig:
        """kv_cache_memory None becomes DEFAULT_KV_CACHE_MEMORY (a GPU engine sizes its cache itself first)."""
        return CacheConfig(self.block_size, self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, self.enable_prefix_caching)

    def scheduler_config(self, model_len: int) -> SchedulerConfig:
        max_len = min(self.max_model_len or model_len, model_len)
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_len,
                               self.enable_chunked_prefill, self.max_prefill_tokens_while_decoding)
