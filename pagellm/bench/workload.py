"""Synthetic workloads shared by every benchmark and every peer engine (same token ids for all)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(num_requests: int, vocab_size: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                    seed: int = 0, low_token_id: int = 100) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the given inclusive ranges; token ids avoid the low ids,
    where tokenizers keep their special tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        out.append(BenchRequest([rng.randrange(low_token_id, vocab_size) for _ in range(n_in)], n_out))
    return out
