"""Request fields that act on the prompt or need the tokenizer, applied when a request is admitted:
truncate_prompt_tokens, allowed_token_ids (checked against the vocabulary) and bad_words (tokenized).
The server applies the same truncation before it checks max_tokens against the context."""

from __future__ import annotations

import dataclasses

from pagellm.sample.token_masks import bad_words_token_ids
from pagellm.sampling_params import SamplingParams


def truncation_length(params: SamplingParams, max_model_len: int) -> int | None:
    """How many of the last prompt tokens to keep; None keeps them all. -1 keeps as many as the context
    leaves room for next to max_tokens (vLLM truncates to max_model_len, which leaves no room at all)."""
    n = params.truncate_prompt_tokens
    if n is None:
        return None
    if n == -1:
        return max(max_model_len - (params.max_tokens or 1), 1)
    if n > max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be at most max_model_len ({max_model_len}), got {n}")
    return n


def truncate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    keep = truncation_length(params, max_model_len)
    return prompt_ids if keep is None or len(prompt_ids) <= keep else prompt_ids[-keep:]


def prepare_request(prompt_text: str | None, prompt_ids: list[int], params: SamplingParams, tokenizer,
                    vocab: int, max_model_len: int,
                    eos_token_ids=()) -> tuple[str | None, list[int], SamplingParams]:
    """(prompt text, or None once truncated, since it no longer matches the ids; prompt ids; params with
    bad_words tokenized). ValueError where the request's own masks leave no first token."""
    kept = truncate_prompt(prompt_ids, params, max_model_len)
    if len(kept) != len(prompt_ids):
        prompt_text, prompt_ids = None, kept
    bad = next((t for t in params.allowed_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab}), got {bad}")
    if params.bad_words and params.bad_words_token_ids is None:
        ids = bad_words_token_ids(params.bad_words, lambda w: tokenizer.encode(w, add_special_tokens=False))
        params = dataclasses.replace(params, bad_words_token_ids=ids)
    _check_first_token_allowed(params, eos_token_ids)
    return prompt_text, prompt_ids, params


def _check_first_token_allowed(params: SamplingParams, eos_token_ids) -> None:
    """allowed_token_ids that bad_words (one-token words) and min_tokens (the end-of-sequence and stop ids) ban
    entirely: refused here, where it is the caller's mistake, rather than failing in a step."""
    if params.allowed_token_ids is None:
        return
    allowed = set(params.allowed_token_ids)
    words = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1} & allowed
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    ends = ends & allowed if params.min_tokens else set()
    if allowed <= words | ends:
        why = (["bad_words"] if words else []) + (
            ["min_tokens (which bans the end-of-sequence and stop_token_ids tokens)"] if ends else [])
        raise ValueError(f"allowed_token_ids must hold a token that {' or '.join(why)} does not ban")
