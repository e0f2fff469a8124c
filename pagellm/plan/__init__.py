"""Memory planning before deploying (`pagellm plan`): weights, KV cache and workspace per rank for a model
on a device, under tensor and pipeline parallelism. Plain arithmetic: no torch, nothing is loaded."""

from pagellm.plan.memory import (
    MemoryPlan,
    dtype_bytes,
    kv_bytes_per_token,
    kv_heads_per_rank,
    plan_memory,
    smallest_parallelism,
)

__all__ = ["MemoryPlan", "dtype_bytes", "kv_bytes_per_token", "kv_heads_per_rank", "plan_memory",
           "smallest_parallelism"]
