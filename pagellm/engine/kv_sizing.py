"""How long a sequence may be, given the model's context and the KV cache: refused or clamped, never silently.

vLLM refuses a `max_model_len` the KV cache cannot hold ("the model's max seq len is larger than the
maximum number of tokens that can be stored in KV cache"); so does pagellm when `--max-model-len` was asked
for. Without it, the length defaults to what fits (a small `--kv-cache-memory` is a normal CPU setup) and
one warning says so. A cache smaller than one block is refused (in LLMEngine) before any of this.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagellm")


def fit_max_model_len(requested: int | None, model_len: int, kv_tokens: int, kv_cache_memory: int) -> int:
    """The model length limit the scheduler gets: min(requested or model context, model context, KV capacity)."""
    if requested is not None and requested > kv_tokens:
        raise ValueError(f"--max-model-len {requested} is larger than the {kv_tokens} tokens the KV cache can "
                         f"store (--kv-cache-memory {kv_cache_memory} bytes): raise --kv-cache-memory or lower "
                         f"--max-model-len")
    if requested is not None and requested > model_len:
        logger.warning("--max-model-len %d is longer than the model's context (%d tokens): using %d",
                       requested, model_len, model_len)
    wanted = min(requested or model_len, model_len)
    if wanted > kv_tokens:
        logger.warning("max_model_len is %d tokens, not the model's %d: that is all the KV cache holds "
                       "(--kv-cache-memory %d bytes); raise --kv-cache-memory for longer sequences",
                       kv_tokens, model_len, kv_cache_memory)
    return min(wanted, kv_tokens)
