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


def text_prompts(tokenizer, num: int, length: tuple[int, int], seed: int) -> list[list[int]]:
    """`num` slices of the bundled English text (pagellm/quant/calibration.txt), each of a length in [lo, hi):
    prompts whose continuations n-gram drafts can guess, as random ids' cannot."""
    from pagellm.quant.quantize_cli import DEFAULT_CALIBRATION

    with open(DEFAULT_CALIBRATION) as f:
        ids = tokenizer.encode(f.read())
    rnd = random.Random(seed)
    lengths = [rnd.randrange(*length) for _ in range(num)]
    return [ids[s:s + n] for n in lengths for s in [rnd.randrange(0, len(ids) - n)]]


def check_fits(lengths: list[tuple[int, int]], max_model_len: int) -> None:
    """(prompt, output) token counts against the engine's max_model_len, before a run: a request that cannot
    fit would stop early (fewer output tokens than the figures claim) or be refused mid-run."""
    longest = max(p + o for p, o in lengths)
    if longest > max_model_len:
        raise ValueError(f"input + output length up to {longest} tokens exceeds max_model_len {max_model_len} "
                         "(shorter --input-len / --output-len, or a larger --max-model-len)")
