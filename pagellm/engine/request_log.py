"""`--log-requests`: each request's prompt and output in the server log, once, when it ends.

Off by default: prompts and outputs are the users' data and never reach the log unless asked for (vLLM's
--enable-log-requests / --enable-log-outputs). Long texts are cut, so one line stays readable.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagellm.requests")

MAX_CHARS = 2000


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else f"{text[:MAX_CHARS]}... ({len(text)} chars)"


def log_request(stream, tokenizer) -> None:
    """One INFO line for a RequestStream that ends (finished, aborted, failed or refused). A prompt given
    as token ids (chat: rendered by the server) is logged as its text."""
    prompt = stream.prompt
    if prompt is None:
        ids = stream.prompt_token_ids[:MAX_CHARS]
        prompt = tokenizer.decode(ids, skip_special_tokens=False) if ids else "<not admitted>"
    out = stream.last_output
    outputs = [(o.index, o.finish_reason, _cut(o.text)) for o in out.outputs] if out is not None else []
    logger.info("request %s: prompt %r; outputs (index, finish_reason, text) %r", stream.request_id,
                _cut(prompt), outputs)
