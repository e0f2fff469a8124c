"""Prompt lookup: if the request's latest n tokens occurred before, propose what followed them."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Longest suffix n-gram (n_max down to n_min) with an earlier occurrence; the most recent one wins.
    Returns up to k tokens that followed it (fewer near the end of the sequence), or []."""
    length = len(token_ids)
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = token_ids[length - n:]
        first = suffix[0]
        # Scan right to left so the most recent match wins; a match must leave a token to propose.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == first and token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
