"""Step outputs as they cross from the engine core process to the server: what is new since the last one.

A `RequestOutput` is cumulative (all the text, token ids and logprobs so far, and the prompt), so sent whole
at every step a request would cost O(length) each step, O(length^2) over its life: with logprobs, 64
sequences of 150 tokens made 0.7 MiB a step, 57 ms to unpickle. The core's `OutputEncoder` sends each
output as a tuple of what to keep of the previous one and what to add; the server rebuilds the cumulative
output from the stream's last one (`decode`), with the prompt it already has. Logprob lists grow in place,
as the in-process engine's do (the engine appends to one list per sequence). Whatever is not a plain
extension (a text that changed, a new list) is sent whole, so the encoding is exact, never a guess.
"""

from __future__ import annotations

from typing import NamedTuple

from pagellm.outputs import CompletionOutput, RequestOutput


class WireOutput(NamedTuple):
    request_id: str
    finished: bool
    error: str | None
    metrics: dict | None
    prompt_logprobs: tuple[int, list] | None  # (kept, added), or None
    # per completion: (index, text_keep, text_add, ids_keep, ids_add, logprobs (kept, added) or None,
    # cumulative_logprob, finish_reason, stop_reason)
    outputs: list[tuple]


def _grown(new: list | None, prev: list | None, prev_len: int) -> tuple[int, list] | None:
    """The same list object, grown: (kept, added); else all of it."""
    if new is None:
        return None
    if new is prev and len(new) >= prev_len:
        return prev_len, new[prev_len:]
    return 0, list(new)


class OutputEncoder:
    """Core side: per request, what the server has of it (forget a request once it is finished or aborted)."""

    def __init__(self):
        # request id -> (prompt logprobs list and length, {index: (text, token ids, logprobs list, length)})
        self._sent: dict[str, tuple] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[WireOutput]:
        return [self._encode(out) for out in outputs]

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)

    def _encode(self, out: RequestOutput) -> WireOutput:
        prev_plp, prev_plp_len, prev = self._sent.get(out.request_id, (None, 0, {}))
        parts, state = [], {}
        for c in out.outputs:
            p_text, p_ids, p_lp, p_lp_len = prev.get(c.index, ("", [], None, 0))
            text_keep = len(p_text) if c.text.startswith(p_text) else 0
            ids_keep = len(p_ids) if c.token_ids[:len(p_ids)] == p_ids else 0
            parts.append((c.index, text_keep, c.text[text_keep:], ids_keep, c.token_ids[ids_keep:],
                          _grown(c.logprobs, p_lp, p_lp_len), c.cumulative_logprob, c.finish_reason, c.stop_reason))
            state[c.index] = (c.text, c.token_ids, c.logprobs, len(c.logprobs or ()))
        plp = _grown(out.prompt_logprobs, prev_plp, prev_plp_len)
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (out.prompt_logprobs, len(out.prompt_logprobs or ()), state)
        return WireOutput(out.request_id, out.finished, out.error, out.metrics, plp, parts)


def _extend(prev: list | None, part: tuple[int, list] | None) -> list | None:
    if part is None:
        return None
    keep, added = part
    if prev is not None and keep == len(prev):
        prev.extend(added)  # in place, as in process
        return prev
    return (prev or [])[:keep] + added


def decode(wire: WireOutput, prev: RequestOutput | None, prompt: str | None,
           prompt_token_ids: list[int]) -> RequestOutput:
    """Server side: the cumulative output, from the stream's previous one (None before the first)."""
    rid, finished, error, metrics, plp, parts = wire
    before = {c.index: c for c in prev.outputs} if prev is not None else {}
    outputs = []
    for index, text_keep, text_add, ids_keep, ids_add, lp, cum, reason, stop in parts:
        p = before.get(index)
        text = (p.text[:text_keep] if p is not None else "") + text_add
        ids = (p.token_ids[:ids_keep] if p is not None else []) + ids_add
        outputs.append(CompletionOutput(index, text, ids, cum, _extend(p.logprobs if p is not None else None, lp),
                                        reason, stop))
    prompt_lp = _extend(prev.prompt_logprobs if prev is not None else None, plp)
    return RequestOutput(rid, prompt, prompt_token_ids, outputs, finished, metrics, error, prompt_lp)
