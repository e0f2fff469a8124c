"""POST /v1/chat/completions: the chat template renders the messages; one engine request with n samples."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request

from pagellm.outputs import RequestOutput
from pagellm.server.common import (
    DONE,
    EngineStreamingResponse,
    ServerContext,
    chat_logprobs,
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
from pagellm.server.protocol import ChatCompletionRequest, ChatMessage


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """Messages -> prompt token ids. The template already writes any BOS, hence no special tokens."""
    tok = ctx.engine.tokenizer
    try:
        text = tok.apply_chat_template([m.to_template_dict() for m in messages],
                                       add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except jinja2.TemplateError as e:  # templates reject e.g. non-alternating roles with raise_exception
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext):
    model = ctx.check_model(body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt_ids = render_chat(ctx, body.messages, body.add_generation_prompt)
    if max_tokens is None and body.use_beam_search:  # beams need a length limit: the rest of the context
        max_tokens = max(ctx.engine.max_model_len - len(prompt_ids), 1)
    try:
        logprobs = body.engine_logprobs()
        params = body.to_sampling_params(max_tokens, logprobs)
    except ValueError as e:
        msg = str(e)
        if body.max_completion_tokens is not None and msg.startswith("max_tokens "):
            msg = "max_completion_tokens" + msg[len("max_tokens"):]
        raise bad_request(msg) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await ctx.add_all([prompt_ids], params, rid, "messages", body.cache_salt)
    created = now_s()
    if body.stream:
        return EngineStreamingResponse(_stream(body, streams, rid, created, model), streams)
    (out,) = await unless_disconnected(request, final_outputs(streams))
    return _response(body, out, rid, created, model)


def _response(body: ChatCompletionRequest, out: RequestOutput, rid: str, created: int, model: str) -> dict:
    choices = []
    for c in out.outputs:
        lps = None
        if body.logprobs:
            lps = chat_logprobs(sampled_logprobs(c, 0, len(c.token_ids)), body.top_logprobs or 0)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([out])}


async def _stream(body: ChatCompletionRequest, streams, rid: str, created: int,
                  model: str) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    final: RequestOutput | None = None

    def chunk(index: int, delta: dict, lps=None, finish=None, stop_reason=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice]}
        if body.include_usage:
            payload["usage"] = None
        return sse(payload)

    # OpenAI opens every choice with the role.
    for i in range(body.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for _, out in merged(streams):
            final = out
            for c in out.outputs:
                if c.index in done:
                    continue
                text = c.text[sent_text.get(c.index, 0):]
                if text:
                    lps = None
                    if body.logprobs:
                        end = len(c.token_ids)
                        lps = chat_logprobs(sampled_logprobs(c, sent_tokens.get(c.index, 0), end),
                                            body.top_logprobs or 0)
                        sent_tokens[c.index] = end
                    sent_text[c.index] = len(c.text)
                    yield chunk(c.index, {"content": text}, lps)
                if c.finished:
                    done.add(c.index)
                    lps = None
                    if body.logprobs and sent_tokens.get(c.index, 0) < len(c.token_ids):
                        # tokens that produced no visible text (EOS, a swallowed stop string)
                        lps = chat_logprobs(sampled_logprobs(c, sent_tokens.get(c.index, 0), len(c.token_ids)),
                                            body.top_logprobs or 0)
                    yield chunk(c.index, {}, lps, c.finish_reason, c.stop_reason)
    except Exception as e:
        yield error_event(e)
        yield DONE
        return
    if body.include_usage and final is not None:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage([final])})
    yield DONE
