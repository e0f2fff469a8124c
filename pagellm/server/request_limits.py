"""Caps on the lists a request may carry, so that no client makes the server allocate or scan without bound.

The body itself is capped first (`--max-request-body-bytes`, server/middleware.py); within it, a few
fields would still cost far more than their bytes: every stop string and stop token id is checked at each
generated token (in the engine step, slowing every request in the batch), every bad word is tokenized at
admission and matched at each step, each chat message is rendered through the template and tokenized
(10**6 one-letter messages, 29 MiB of JSON, took tens of seconds and gigabytes before this cap, in one
manual run), and the allowed token ids are read at admission and at each step (3 million of them stalled
every other request for ~15 s, as did 1,024 bad words of 28 KB each: thirty-second session). The limits
sit far above real use (OpenAI allows 4 stop strings); `n`, `best_of` and the beam width are bounded by
`--max-num-seqs` in the engine, `logprobs` by 20, prompt tokens by max_model_len and logit_bias keys by
the vocabulary.
"""

from __future__ import annotations

from pagellm.server.errors import APIError

MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 4096
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024  # each; a bad word is a word or a phrase
MAX_ALLOWED_TOKEN_IDS = 262_144  # as large as the largest vocabularies (each id once is the whole vocabulary)
MAX_MESSAGES = 16384
MAX_INPUTS = 2048  # /v1/embeddings inputs (OpenAI's own limit); /v1/responses input items use MAX_MESSAGES

_LIMITS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS, "bad_words": MAX_BAD_WORDS,
           "messages": MAX_MESSAGES, "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS}


def check_list_length(name: str, value, cap: int) -> None:
    if isinstance(value, list) and len(value) > cap:
        raise APIError(400, f"{name} must have at most {cap} items, got {len(value)}", param=name)


def check_limits(body) -> None:
    """A 400 naming the field when one of the capped lists of a request body is longer than its cap."""
    for name, cap in _LIMITS.items():
        check_list_length(name, getattr(body, name, None), cap)
    long = next((w for w in getattr(body, "bad_words", None) or () if len(w) > MAX_BAD_WORD_CHARS), None)
    if long is not None:
        raise APIError(400, f"bad_words must be at most {MAX_BAD_WORD_CHARS} characters each, got one of "
                            f"{len(long)}", param="bad_words")
