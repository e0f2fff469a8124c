"""Hard masks on logits rows: `allowed_token_ids` and `bad_words` (vLLM's semantics).

Both set banned ids to -inf before any other processing. `bad_words` reads the word's token sequences
the engine stored in `SamplingParams.bad_words_token_ids` (each word with and without a leading space):
a sequence's last token is banned when the row's output ends with the sequence's other tokens, so a
one-token word is never generated and a longer one can start but never be completed.
"""

from __future__ import annotations

import torch

from pagellm.platforms.base import to_device

_NEG_INF = float("-inf")


def has_masks(params) -> bool:
    return params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def apply_token_masks(x: torch.Tensor, rows) -> None:
    """In place on x [rows, vocab]; rows are SamplingRows (params, output_token_ids)."""
    _apply_allowed(x, rows)
    _apply_bad_words(x, rows)


def _apply_allowed(x: torch.Tensor, rows) -> None:
    masked = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not masked:
        return
    vocab, dev = x.shape[1], x.device
    # Admission checks the ids against the vocabulary; the bound here keeps a stray one from failing a batch.
    r_idx, t_idx = [], []
    for j, i in enumerate(masked):
        ids = [t for t in rows[i].params.allowed_token_ids if 0 <= t < vocab]
        r_idx.extend([j] * len(ids))
        t_idx.extend(ids)
    keep = torch.zeros(len(masked), vocab, dtype=torch.bool, device=dev)
    keep[to_device(r_idx, dev, torch.long), to_device(t_idx, dev, torch.long)] = True
    rows_t = to_device(masked, dev)
    x[rows_t] = x[rows_t].masked_fill(~keep, _NEG_INF)


def _apply_bad_words(x: torch.Tensor, rows) -> None:
    vocab = x.shape[1]
    r_idx, t_idx = [], []
    for i, r in enumerate(rows):
        for seq in r.params.bad_words_token_ids or ():
            prefix = seq[:-1]
            out = r.output_token_ids
            if len(prefix) > len(out) or (prefix and out[len(out) - len(prefix):] != prefix):
                continue
            if 0 <= seq[-1] < vocab:
                r_idx.append(i)
                t_idx.append(seq[-1])
    if r_idx:
        dev = x.device
        x.index_put_((to_device(r_idx, dev), to_device(t_idx, dev)), torch.full((), _NEG_INF, device=dev))


def bad_words_token_ids(words: list[str], encode) -> list[list[int]]:
    """vLLM's rule: each word as it is (text start) and with a leading space (mid-text), the second
    only if it tokenizes to as many tokens as the first but starts differently (else it is the same
    ban or not one word)."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out
