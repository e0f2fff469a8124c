"""Checks both generation endpoints run before admission, and their prompt preparation.

- A field OpenAI or vLLM define that pagellm cannot honour is a 400 naming it (never a 200 that ignores
  it); a harmless value of such a field (`"modalities": ["text"]`, `"store": false`) is accepted. Other
  unknown fields are accepted and logged, as vLLM does.
- Text prompts are tokenized off the event loop (the tokenizer releases the GIL), so that /health and
  streaming stay responsive while long prompts are encoded; the engine then gets token ids plus the text
  (kept for echo).
- `max_tokens` that cannot fit next to the prompt in max_model_len is a 400 stating both numbers, with
  vLLM's message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pagellm.engine.admission import truncate_prompt
from pagellm.sample.token_masks import bad_words_token_ids
from pagellm.sampling_params import SamplingParams
from pagellm.server.errors import APIError, bad_request
from pagellm.server.request_limits import check_limits

logger = logging.getLogger("pagellm")


def _unset(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return not v


# field -> (is this value harmless?, what follows "FIELD is not supported" in the 400)
REFUSED: dict[str, tuple[Callable[[object], bool], str]] = {
    # OpenAI
    "audio": (_unset, ": pagellm generates text only"),
    "modalities": (lambda v: v is None or v == ["text"], ': pagellm generates text only (["text"])'),
    "prediction": (_unset, " (predicted outputs)"),
    "web_search_options": (_unset, " (web search)"),
    "store": (_falsy, " (stored completions)"),
    "reasoning_effort": (_unset, ": the model does not reason separately"),
    "verbosity": (_unset, ""),
    "service_tier": (lambda v: v in (None, "auto", "default"), ': only "auto" or "default" are accepted'),
    "functions": (_unset, ": it is deprecated; send tools"),
    "function_call": (_unset, ": it is deprecated; send tool_choice"),
    "tools": (_unset, " on this endpoint: use /v1/chat/completions"),
    "tool_choice": (_unset, " on this endpoint: use /v1/chat/completions"),
    "max_completion_tokens": (_unset, " on this endpoint: send max_tokens"),
    "best_of": (lambda v: v in (None, 1), " on this endpoint"),
    "echo": (_falsy, " on this endpoint"),
    # vLLM extras
    "logits_processors": (_unset, " (custom logits processors)"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, " as false"),
    "priority": (lambda v: v in (None, 0), ": scheduling is first come, first served"),
    "mm_processor_kwargs": (_unset, " (multimodal inputs)"),
    "multi_modal_data": (_unset, " (multimodal inputs)"),
    "prompt_embeds": (_unset, " (prompt embeddings)"),
    "kv_transfer_params": (_unset, " (KV-cache transfer)"),
    "vllm_xargs": (_unset, " (custom extension arguments)"),
    "return_token_ids": (_falsy, ""),
    "request_id": (_unset, " as a field: send an X-Request-Id header"),
    "guided_decoding_backend": (lambda v: v in (None, "auto", "xgrammar"), ": the only guided decoding backend is "
                                                                        "xgrammar"),
}


def check_request(body) -> None:
    """Refuse what cannot be honoured: fields of REFUSED (unless harmless), stream_options without stream,
    lists longer than their caps (server/request_limits.py)."""
    check_limits(body)
    extra = body.model_extra or {}
    for name, value in extra.items():
        rule = REFUSED.get(name)
        if rule is not None and not rule[0](value):
            raise APIError(400, f"{name} is not supported{rule[1]}", param=name)
    unknown = sorted(set(extra) - set(REFUSED))
    if unknown:
        logger.warning("request fields ignored (unknown to pagellm): %s", ", ".join(unknown))
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """A prompt alone at max_model_len or over is the engine's error (it names the KV capacity too)."""
    if max_tokens is None or prompt_len >= max_model_len or prompt_len + max_tokens <= max_model_len:
        return
    raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                        f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                        f"{max_tokens} in the completion). Please reduce the length of the messages or "
                        f"completion.", param=param)


async def token_ids_of(tokenizer, items: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
    """Each item as token ids: the texts encoded together in one worker thread (off the event loop, and never in
    the engine core), id lists as given."""
    texts = [x for x in items if isinstance(x, str)]
    encoded = iter(await asyncio.to_thread(
        lambda: [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]) if texts else [])
    return [next(encoded) if isinstance(x, str) else x for x in items]


async def prepare_prompts(tokenizer, prompts: list[str | list[int]], params: SamplingParams, max_model_len: int,
                          add_special_tokens: bool = True, max_tokens_param: str = "max_tokens",
                          max_tokens: int | None = None) -> list[dict]:
    """Prompts -> vLLM TokensPrompt dicts ({"prompt_token_ids", "prompt"}) for the engine: text encoded in a
    worker thread (bad_words too, into params; allowed_token_ids each once), truncate_prompt_tokens applied (the
    text dropped then: it no longer matches), and max_tokens (`max_tokens` if given, else params.max_tokens)
    checked against the context."""
    try:
        all_ids = await token_ids_of(tokenizer, prompts, add_special_tokens)
    except ValueError as e:  # text the tokenizer cannot take (Tokenizer.encode names it): text prompts are completions'
        raise bad_request(e, "prompt") from None
    if params.allowed_token_ids is not None:  # each id once: the engine's step reads them all each time
        params.allowed_token_ids = list(dict.fromkeys(params.allowed_token_ids))
    if params.bad_words and params.bad_words_token_ids is None:  # here, not in the engine core's loop
        params.bad_words_token_ids = await asyncio.to_thread(
            bad_words_token_ids, params.bad_words, lambda w: tokenizer.encode(w, add_special_tokens=False))
    out = []
    for p, ids in zip(prompts, all_ids, strict=True):
        text = p if isinstance(p, str) else None
        try:
            kept = truncate_prompt(ids, params, max_model_len)
        except ValueError as e:
            raise bad_request(e) from None
        if len(kept) != len(ids):
            text, ids = None, kept
        check_context(len(ids), params.max_tokens if max_tokens is None else max_tokens, max_model_len,
                      max_tokens_param)
        out.append({"prompt_token_ids": ids, "prompt": text})
    return out
