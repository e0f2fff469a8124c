"""How long a sequence may be, given the model's context and the KV cache: refused or clamped, never silently;
and how much KV cache a GPU holds (the arithmetic; engine/gpu_memory.py measures its terms).

vLLM refuses a `max_model_len` the KV cache cannot hold ("the model's max seq len is larger than the
maximum number of tokens that can be stored in KV cache"); so does pagellm when `--max-model-len` was asked
for. Without it, the length defaults to what fits (a small `--kv-cache-memory` is a normal CPU setup) and
one warning says so. A cache smaller than one block is refused (in LLMEngine) before any of this.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pagellm")


def check_device_memory(name: str, nbytes: int, device_bytes: int | None) -> None:
    """Refuse a KV cache or swap space larger than the memory of the device it lives on, in one line (a
    typo's 10**23 bytes would otherwise fail as a MemoryError deep in the block pool). device_bytes None:
    this host's physical memory."""
    if device_bytes is None:
        device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > device_bytes:
        raise ValueError(f"{name} {nbytes} bytes ({nbytes / 2**30:.4g} GiB) is more than the device's memory "
                         f"({device_bytes / 2**30:.1f} GiB)")


def fit_max_model_len(requested: int | None, model_len: int, kv_tokens: int, kv_cache_memory: int) -> int:
    """The model length limit the scheduler gets: min(requested or model context, model context, KV capacity)."""
    if requested is not None and requested > model_len:  # first: past the context, more KV would not help
        logger.warning("--max-model-len %d is longer than the model's context (%d tokens): using %d",
                       requested, model_len, model_len)
    wanted = min(requested or model_len, model_len)
    if requested is not None and wanted > kv_tokens:
        asked = f"{requested}" + (f" (the model's context: {wanted})" if wanted != requested else "")
        raise ValueError(f"--max-model-len {asked} is larger than the {kv_tokens} tokens the KV cache can "
                         f"store (--kv-cache-memory {kv_cache_memory} bytes): raise --kv-cache-memory or lower "
                         f"--max-model-len")
    if wanted > kv_tokens:
        logger.warning("max_model_len is %d tokens, not the model's %d: that is all the KV cache holds "
                       "(--kv-cache-memory %d bytes); raise --kv-cache-memory for longer sequences",
                       kv_tokens, model_len, kv_cache_memory)
    return min(wanted, kv_tokens)


def gpu_kv_cache_bytes(total: int, utilization: float, weights: int, activation_peak: int,
                       other_in_use: int = 0, graph_reserve: int = 0) -> int:
    """What a GPU's KV cache gets (vLLM's rule): utilization x total memory, less the weights, the activation
    peak of the biggest step (profiled), other memory in use (CUDA context, cuBLAS workspaces, other engines
    and processes) and a reserve for the CUDA graphs' memory pool. Negative when nothing is left."""
    return int(total * utilization) - weights - activation_peak - other_in_use - graph_reserve


def graph_pool_reserve(activation_peak: int, profiled_tokens: int, largest_graph_batch: int) -> int:
    """An estimate of the CUDA graphs' private memory pool: the activations of the largest captured decode
    batch, taken as the profiled peak scaled by rows (activations grow about linearly with a step's rows;
    the sampled logits are outside the graphs). Zero without graphs."""
    if not largest_graph_batch or not profiled_tokens:
        return 0
    return activation_peak * min(largest_graph_batch, profiled_tokens) // profiled_tokens


def check_gpu_kv_budget(kv_bytes: int, bytes_per_block: int, total: int, utilization: float, weights: int,
                        activation_peak: int, other_in_use: int, graph_reserve: int) -> int:
    """The number of KV blocks kv_bytes holds; a one-line error naming every term when not one fits."""
    if kv_bytes >= bytes_per_block:
        return kv_bytes // bytes_per_block
    gib = 2**30
    raise ValueError(
        f"no GPU memory left for the KV cache: {utilization} x {total / gib:.2f} GiB = "
        f"{int(total * utilization) / gib:.2f} GiB, less weights {weights / gib:.2f} GiB, activation peak "
        f"{activation_peak / gib:.2f} GiB, other memory in use {other_in_use / gib:.2f} GiB and CUDA graphs "
        f"{graph_reserve / gib:.2f} GiB leaves {kv_bytes / gib:.3f} GiB (one block is {bytes_per_block} bytes): "
        "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or give --kv-cache-memory")
