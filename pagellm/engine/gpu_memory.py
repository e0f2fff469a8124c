"""How big a GPU engine's KV cache is: measured after loading, as vLLM does.

The weights are loaded first; then one profiling step (pagellm/model/memory_profile.py: max_num_batched_tokens
prompt tokens, the logits and sampling of max_num_seqs rows) gives the activation peak; the KV cache gets
`--gpu-memory-utilization` x the GPU's memory less the weights, that peak, any other memory in use (the
CUDA context, other engines or processes on the GPU) and an estimate of the CUDA graphs' pool (the
arithmetic: engine/kv_sizing.py). An explicit `--kv-cache-memory` skips all of this. The start-up line puts
these numbers next to what `pagellm plan` predicts for the GPU (the plan estimates the activations instead
of measuring them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagellm.config import EngineArgs
from pagellm.engine.kv_sizing import check_gpu_kv_budget, gpu_kv_cache_bytes, graph_pool_reserve
from pagellm.model.memory_profile import profile_kv_caches, profile_seq_lens, profile_step
from pagellm.model_config import ModelConfig
from pagellm.plan import plan_memory
from pagellm.quant.kv_cache import kv_dtype_label

logger = logging.getLogger("pagellm")


@dataclass(frozen=True)
class GpuMemory:
    total: int
    utilization: float
    weights: int
    activation_peak: int
    other_in_use: int
    graph_reserve: int
    kv_bytes: int
    num_blocks: int
    bytes_per_block: int
    profiled_tokens: int


def profiled_tokens(args: EngineArgs, model_len: int) -> int:
    """The rows of the biggest step: the token budget, or a whole prompt where prefill is not chunked."""
    if args.enable_chunked_prefill:
        return args.max_num_batched_tokens
    return max(args.max_num_batched_tokens, min(args.max_model_len or model_len, model_len))


def size_kv_cache(platform, model, backend, kv_dtype: torch.dtype, args: EngineArgs, cfg: ModelConfig,
                  bytes_per_block: int, weights: int, largest_graph_batch: int) -> GpuMemory:
    model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokens = profiled_tokens(args, cfg.max_position_embeddings)
    seq_lens = profile_seq_lens(tokens, model_len)
    scratch_bytes = 0

    def step() -> None:  # everything it allocates is freed when it returns (and handed back to the driver)
        nonlocal scratch_bytes
        kv = profile_kv_caches(model, args.block_size, kv_dtype, seq_lens, platform.allocate_kv)
        scratch_bytes = sum(t.nbytes for t in kv)
        profile_step(model, backend, kv, args.block_size, seq_lens, args.max_num_seqs, platform.device)

    peak = platform.peak_memory_of(step)
    peak = max(0, peak - scratch_bytes) if peak else 0  # the throwaway cache is not activation memory
    # everything else in use: the CUDA context, cuBLAS workspaces, other engines and processes on the GPU
    other = max(0, platform.memory_in_use() - weights)
    total, util = platform.total_memory(), args.gpu_memory_utilization
    reserve = graph_pool_reserve(peak, tokens, largest_graph_batch)
    kv_bytes = gpu_kv_cache_bytes(total, util, weights, peak, other, reserve)
    blocks = check_gpu_kv_budget(kv_bytes, bytes_per_block, total, util, weights, peak, other, reserve)
    return GpuMemory(total, util, weights, peak, other, reserve, kv_bytes, blocks, bytes_per_block, tokens)


def log_kv_sizing(mem: GpuMemory, cfg: ModelConfig, model_name: str, dtype: torch.dtype, kv_dtype: torch.dtype,
                  args: EngineArgs, block_size: int, max_model_len: int) -> None:
    """One INFO line: the measured terms, the KV blocks and concurrency they give, and the plan's prediction."""
    gib = 2**30
    tokens = mem.num_blocks * block_size
    try:  # the same question to `pagellm plan`, with the real weight bytes (it estimates the activations)
        plan = plan_memory(cfg, model_name, mem.total, dtype=kv_dtype_label(dtype),
                           kv_cache_dtype=kv_dtype_label(kv_dtype), max_model_len=max_model_len,
                           max_num_seqs=args.max_num_seqs, block_size=block_size,
                           max_num_batched_tokens=mem.profiled_tokens, utilization=mem.utilization,
                           weights_bytes=mem.weights)
        predicted = (f"; pagellm plan predicts {plan.kv_blocks} blocks (activation estimate "
                     f"{plan.workspace_bytes_per_rank / gib:.2f} GiB), {plan.max_batch_at_max_model_len} sequences")
    except ValueError:
        predicted = ""
    logger.info(
        "GPU memory: %.2f x %.1f GiB = %.2f GiB: weights %.2f GiB, activation peak %.2f GiB (a %d-token step, "
        "profiled), other memory in use %.2f GiB, CUDA graphs %.2f GiB (estimate) -> KV cache %.2f GiB = %d blocks "
        "(%d tokens); max concurrency at max_model_len %d: %.1f sequences%s",
        mem.utilization, mem.total / gib, mem.total * mem.utilization / gib, mem.weights / gib,
        mem.activation_peak / gib, mem.profiled_tokens, mem.other_in_use / gib, mem.graph_reserve / gib,
        mem.num_blocks * mem.bytes_per_block / gib, mem.num_blocks, tokens, max_model_len,
        tokens / max_model_len, predicted)
