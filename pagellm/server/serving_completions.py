"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from pagellm.outputs import RequestOutput
from pagellm.server.common import (
    DONE,
    EngineStreamingResponse,
    ServerContext,
    choice_usage,
    completion_logprobs,
    error_event,
    final_outputs,
    merged,
    now_s,
    sampled_logprobs,
    sse,
    tokens_as_ids,
    unless_disconnected,
    usage,
)
from pagellm.server.errors import APIError, bad_request
from pagellm.server.prompt_logprobs import (
    check_prompt_logprobs,
    echo_logprobs,
    echo_without_generation,
    joined,
    prompt_only,
    vllm_prompt_logprobs,
    with_prompt_logprobs,
)
from pagellm.server.protocol import CompletionRequest
from pagellm.server.request_checks import check_request, prepare_prompts
from pagellm.server.request_id import base_request_id


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext):
    model = ctx.check_model(body.model)
    check_request(body)
    body.return_tokens_as_token_ids = tokens_as_ids(body, ctx)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.use_beam_search:  # vLLM: best_of is the beam width, n how many beams come back
        if body.best_of is not None and body.best_of < body.n:
            raise APIError(400, f"best_of must be >= n ({body.n}) with use_beam_search, got {body.best_of}",
                           param="best_of")
    elif body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported without use_beam_search (it must equal n)", param="best_of")
    check_prompt_logprobs(body)
    no_generation = echo_without_generation(body)  # max_tokens 0 + echo: run the prompt, drop the token
    try:
        prompts = body.prompts()
        params = body.to_sampling_params(1 if no_generation else body.max_tokens, body.logprobs,
                                         beam_width=body.best_of, defaults=ctx.sampling_defaults)
    except ValueError as e:
        raise bad_request(e, "prompt") from None
    params = with_prompt_logprobs(params, body, body.logprobs if body.echo else None)
    rid = f"cmpl-{base_request_id(request)}"  # the client's X-Request-Id, as in vLLM
    # tokenized off the event loop; max_tokens checked against the context (vLLM's 400)
    prompts = await prepare_prompts(ctx.engine.tokenizer, prompts, params, ctx.engine.max_model_len,
                                    body.add_special_tokens)
    try:
        streams = await ctx.add_all(prompts, params, rid, "prompt", body.cache_salt)
    except APIError as e:  # the engine's name for the beam width; over HTTP it is best_of (else n)
        if e.param == "beam_width":
            e.param = "best_of" if body.best_of is not None else "n"
        raise
    created = now_s()
    if body.stream:
        return EngineStreamingResponse(_stream(body, streams, rid, created, model, ctx), streams)
    outputs = await unless_disconnected(request, final_outputs(streams))
    if no_generation:
        outputs = [prompt_only(o) for o in outputs]
    return _response(body, outputs, rid, created, model, ctx)


def _decoder(ctx: ServerContext):
    return lambda tid: ctx.engine.tokenizer.decode([tid], skip_special_tokens=False)


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
                lps = completion_logprobs(sampled_logprobs(c, 0, len(c.token_ids)), len(prefix),
                                          body.return_tokens_as_token_ids)
                if body.echo:
                    lps = joined(echo_logprobs(out, body.logprobs, _decoder(ctx), body.return_tokens_as_token_ids), lps)
            choices.append({"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": lps,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "prompt_logprobs": vllm_prompt_logprobs(out, body.prompt_logprobs)})
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

    def chunk(index: int, text: str, lps, finish, stop_reason, prompt_tokens: int, tokens: int) -> str:
        payload = {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish,
                                "stop_reason": stop_reason}]}
        if body.include_usage:
            payload["usage"] = choice_usage(prompt_tokens, tokens) if body.continuous_usage else None
        return sse(payload)

    try:
        async for i, out in merged(streams):
            if body.max_tokens == 0:  # echo without generation (checked at admission)
                out = prompt_only(out)
            finals[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                text = c.text[sent_text.get(idx, 0):]
                prefix = ""
                first = idx not in sent_text
                if first and body.echo:
                    prefix = _prompt_text(out, ctx)
                    offsets[idx] = len(prefix)
                if not text and not prefix and not c.finished:
                    continue  # nothing visible yet (held-back stop prefix or half a character)
                lps = None
                if body.logprobs is not None:
                    end = len(c.token_ids)
                    entries = sampled_logprobs(c, sent_tokens.get(idx, 0), end)
                    lps = completion_logprobs(entries, offsets.get(idx, 0), body.return_tokens_as_token_ids)
                    sent_tokens[idx] = end
                    offsets[idx] = offsets.get(idx, 0) + sum(len(e[t].decoded_token or "") for t, e in entries)
                    if first and body.echo:  # the prompt's entries open the choice, as its text does
                        lps = joined(echo_logprobs(out, body.logprobs, _decoder(ctx),
                                                   body.return_tokens_as_token_ids), lps)
                sent_text[idx] = len(c.text)
                if c.finished:
                    done.add(idx)
                yield chunk(idx, prefix + text, lps, c.finish_reason, c.stop_reason, len(out.prompt_token_ids),
                            len(c.token_ids))
    except Exception as e:
        yield error_event(e)
        yield DONE
        return
    if body.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
    yield DONE
