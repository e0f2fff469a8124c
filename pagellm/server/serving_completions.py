"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from pagellm.outputs import RequestOutput
from pagellm.server.common import (
    DONE,
    EngineStreamingResponse,
    ServerContext,
    completion_logprobs,
    error_event,
    final_outputs,
    merged,
    now_s,
    sampled_logprobs,
    sse,
    unless_disconnected,
    usage,
)
from pagellm.server.errors import APIError, bad_request
from pagellm.server.protocol import CompletionRequest


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    model = ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.use_beam_search:  # vLLM: best_of is the beam width, n how many beams come back
        if body.best_of is not None and body.best_of < body.n:
            raise APIError(400, f"best_of must be >= n ({body.n}) with use_beam_search, got {body.best_of}",
                           param="best_of")
    elif body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported without use_beam_search (it must equal n)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    try:
        prompts = body.prompts()
        params = body.to_sampling_params(body.max_tokens, body.logprobs, beam_width=body.best_of)
    except ValueError as e:
        raise bad_request(e, "prompt") from None
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await ctx.add_all(prompts, params, rid, "prompt", body.cache_salt)
    created = now_s()
    if body.stream:
        return EngineStreamingResponse(_stream(body, streams, rid, created, model, ctx), streams)
    outputs = await unless_disconnected(request, final_outputs(streams))
    return _response(body, outputs, rid, created, model, ctx)


def _prompt_text(out: RequestOutput, ctx: ServerContext) -> str:
    if out.prompt is not None:
        return out.prompt
    return ctx.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def _response(body: CompletionRequest, outputs: list[RequestOutput], rid: str, created: int, model: str,
              ctx: ServerContext) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        prefix = _prompt_text(out, ctx) if body.echo else ""
        for c in out.outputs:
            lps = None
            if body.logprobs is not None:
                lps = completion_logprobs(sampled_logprobs(c, 0, len(c.token_ids)), len(prefix))
            choices.append({"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": lps,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outputs)}


async def _stream(body: CompletionRequest, streams, rid: str, created: int, model: str,
                  ctx: ServerContext) -> AsyncIterator[str]:
    n = body.n
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}  # text_offset of the next token, for logprobs
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    def chunk(index: int, text: str, lps, finish, stop_reason=None) -> str:
        payload = {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish,
                                "stop_reason": stop_reason}]}
        if body.include_usage:
            payload["usage"] = None
        return sse(payload)

    try:
        async for i, out in merged(streams):
            finals[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                text = c.text[sent_text.get(idx, 0):]
                prefix = ""
                if idx not in sent_text and body.echo:
                    prefix = _prompt_text(out, ctx)
                    offsets[idx] = len(prefix)
                if not text and not prefix and not c.finished:
                    continue  # nothing visible yet (held-back stop prefix or half a character)
                lps = None
                if body.logprobs is not None:
                    end = len(c.token_ids)
                    lps = completion_logprobs(sampled_logprobs(c, sent_tokens.get(idx, 0), end),
                                              offsets.get(idx, 0))
                    sent_tokens[idx] = end
                    offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps["tokens"])
                sent_text[idx] = len(c.text)
                if c.finished:
                    done.add(idx)
                yield chunk(idx, prefix + text, lps, c.finish_reason, c.stop_reason)
    except Exception as e:
        yield error_event(e)
        yield DONE
        return
    if body.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
    yield DONE
