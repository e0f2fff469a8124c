"""Prompt logprobs on the wire: OpenAI's `echo` + `logprobs` (the legacy completions shape over prompt and
completion) and vLLM's `prompt_logprobs` field, plus `max_tokens: 0` with `echo` (score a text without
generating: what lm-evaluation-harness's loglikelihood requests and vLLM allow)."""

from __future__ import annotations

import dataclasses

from pagellm.outputs import Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest

Body = CompletionRequest | ChatCompletionRequest

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def check_prompt_logprobs(body: Body) -> None:
    """vLLM's rule: prompt logprobs come whole with the final response, so not with stream."""
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")


def echo_without_generation(body: CompletionRequest) -> bool:
    """max_tokens 0 is only meaningful with echo (the prompt, scored, and nothing generated)."""
    if body.max_tokens != 0:
        return False
    if not body.echo:
        raise APIError(400, "max_tokens must be an integer >= 1 (0 is only accepted with echo: true)",
                       param="max_tokens")
    return True


def with_prompt_logprobs(params: SamplingParams, body: Body, echo_logprobs: int | None = None):
    """The engine computes the larger of what vLLM's field and echo + logprobs ask for."""
    wanted = [k for k in (body.prompt_logprobs, echo_logprobs) if k is not None]
    if not wanted:
        return params
    try:
        return dataclasses.replace(params, prompt_logprobs=max(wanted))
    except ValueError as e:  # out of [0, 20]: the error names prompt_logprobs (or logprobs, for echo)
        field = "prompt_logprobs" if body.prompt_logprobs is not None and body.prompt_logprobs == max(wanted) \
            else "logprobs"
        raise APIError(400, str(e).replace("prompt_logprobs", field, 1), param=field) from None


def prompt_only(out: RequestOutput) -> RequestOutput:
    """max_tokens 0: the engine generated one token to run the prompt; the client asked for none."""
    outs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                cumulative_logprob=0.0 if c.cumulative_logprob is not None else None,
                                finish_reason="length" if c.finished else None, stop_reason=None)
            for c in out.outputs]
    return dataclasses.replace(out, outputs=outs)


def vllm_prompt_logprobs(out: RequestOutput, top_n: int | None) -> list | None:
    """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}."""
    if top_n is None or out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in _top(entry, top_n, out.prompt_token_ids[j]).items()}
            for j, entry in enumerate(out.prompt_logprobs)]


def _top(entry: dict[int, Logprob], top_n: int, token: int) -> dict[int, Logprob]:
    """The prompt token plus the top-N (the engine may have computed more for another field)."""
    return {tid: lp for tid, lp in entry.items() if tid == token or (lp.rank is not None and lp.rank <= top_n)}


def echo_logprobs(out: RequestOutput, top_n: int, decode, as_ids: bool = False) -> dict:
    """The legacy completions logprobs of the prompt (first token: null logprob and null top_logprobs),
    text offsets from 0; the completion's own entries follow at the offset of the echoed text's end.
    as_ids (return_tokens_as_token_ids): tokens spelled "token_id:N", offsets still count the text."""
    res: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    entries = out.prompt_logprobs or [None]

    def spelled(tid: int, text: str) -> str:
        return f"token_id:{tid}" if as_ids else text

    for j, tid in enumerate(out.prompt_token_ids):
        entry = entries[j] if j < len(entries) else None
        if entry is None:
            text, lp, top = decode(tid), None, None
        else:
            text = entry[tid].decoded_token or ""
            lp = _lp(entry[tid].logprob)
            top = {spelled(t, e.decoded_token or ""): _lp(e.logprob) for t, e in _top(entry, top_n, tid).items()}
        res["tokens"].append(spelled(tid, text))
        res["token_logprobs"].append(lp)
        res["top_logprobs"].append(top)
        res["text_offset"].append(offset)
        offset += len(text)
    return res


def joined(prompt_part: dict, completion_part: dict | None) -> dict:
    if completion_part is None:
        return prompt_part
    return {k: prompt_part[k] + completion_part[k] for k in prompt_part}
