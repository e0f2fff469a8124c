"""Full-vocabulary next-token distributions of given token sequences (teacher forcing), from the engine's
own forward: the same `ModelRunner.execute` (compiled decoder or module path, as a step of that many
rows would take) and `compute_logits` that generation uses, never a second implementation of the model.

Like `embed`, it bypasses the scheduler: KV blocks are taken from the engine's `KVCacheManager` for the
call and returned in a `finally`; nothing is sampled or published to the prefix cache. `chunk` rows run per
forward (default: the step budget). Quality checks that must see what decoding sees pass a small chunk:
steps of at most 16 rows run the few-row path (packed kernels, --int8-activations, native attention).
"""

from __future__ import annotations

import torch

from pagellm.engine.embedding import borrowed_request, check_token_ids, hidden_chunks
from pagellm.sample.logprobs import log_softmax


def next_token_logprobs(engine, token_ids: list[int], start: int = 0, chunk: int | None = None) -> torch.Tensor:
    """float32 log-softmax rows [len(token_ids) - start, vocab] on the CPU: row i is the distribution of the
    token after token_ids[:start + i + 1]. `engine` is an LLMEngine; ValueError for bad input."""
    ids = list(token_ids)
    check_token_ids(ids, "a scored sequence", engine.model_config.vocab_size, engine.max_model_len)
    if not 0 <= start < len(ids):
        raise ValueError(f"start must be in [0, {len(ids)}), got {start}")
    chunk = chunk or engine.scheduler.config.max_num_batched_tokens
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    with borrowed_request(engine, ids, "score", ValueError) as req:
        return _rows(engine, req, start, chunk)


@torch.inference_mode()
def _rows(engine, req, start: int, chunk: int) -> torch.Tensor:
    parts = []
    for first, logits in hidden_chunks(engine, req, chunk, logits=True):
        keep = max(start - first, 0)  # rows of positions before `start` are not wanted
        if keep < len(logits):
            parts.append(log_softmax(logits[keep:]).cpu())
    return torch.cat(parts)
