"""Full-vocabulary next-token distributions of given token sequences (teacher forcing), from the engine's
own forward: the same `ModelRunner.forward_hidden` (compiled decoder or module path, as a step of that many
rows would take) and `compute_logits` that generation uses, never a second implementation of the model.

Like `embed`, it bypasses the scheduler: KV blocks are taken from the engine's `KVCacheManager` for the
call and returned in a `finally`; nothing is sampled or published to the prefix cache. `chunk` rows run per
forward (default: the step budget). Quality checks that must see what decoding sees pass a small chunk:
steps of at most 16 rows run the few-row path (packed kernels, --int8-activations, native attention).
"""

from __future__ import annotations

import uuid

import torch

from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.request import Request
from pagellm.sample.logprobs import log_softmax
from pagellm.sampling_params import SamplingParams


def next_token_logprobs(engine, token_ids: list[int], start: int = 0, chunk: int | None = None) -> torch.Tensor:
    """float32 log-softmax rows [len(token_ids) - start, vocab] on the CPU: row i is the distribution of the
    token after token_ids[:start + i + 1]. `engine` is an LLMEngine; ValueError for bad input."""
    ids = list(token_ids)
    vocab = engine.model_config.vocab_size
    if not ids:
        raise ValueError("a scored sequence must contain at least one token")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range [0, {vocab})")
    if len(ids) > engine.max_model_len:
        raise ValueError(f"sequence has {len(ids)} tokens, but max_model_len is {engine.max_model_len}")
    if not 0 <= start < len(ids):
        raise ValueError(f"start must be in [0, {len(ids)}), got {start}")
    chunk = chunk or engine.scheduler.config.max_num_batched_tokens
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    req = Request(f"score-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1))
    if engine.kv_cache.allocate_slots(req, len(ids)) is None:
        raise ValueError(f"the KV cache has no room for {len(ids)} tokens now (raise --kv-cache-memory)")
    try:
        return _rows(engine, req, start, chunk)
    finally:
        engine.kv_cache.free(req)


@torch.inference_mode()
def _rows(engine, req: Request, start: int, chunk: int) -> torch.Tensor:
    table = engine.kv_cache.block_table(req.request_id)
    parts = []
    while req.num_computed_tokens < req.num_tokens:
        first = req.num_computed_tokens
        n = min(chunk, req.num_tokens - first)
        hidden, _ = engine.runner.forward_hidden(SchedulerOutput([ScheduledRequest(req, n, table)], n))
        keep = max(start - first, 0)  # rows of positions before `start` are not wanted
        if keep < n:
            parts.append(log_softmax(engine.model.compute_logits(hidden[keep:])).cpu())
        req.num_computed_tokens += n
    return torch.cat(parts)
