"""POST /v1/chat/completions: the chat template renders the messages; one engine request with n samples."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request

from pagellm.outputs import RequestOutput
from pagellm.server.common import (
    DONE,
    EngineStreamingResponse,
    ServerContext,
    chat_logprobs,
    choice_usage,
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
from pagellm.server.prompt_logprobs import check_prompt_logprobs, vllm_prompt_logprobs, with_prompt_logprobs
from pagellm.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from pagellm.server.request_checks import check_request, prepare_prompts
from pagellm.server.request_id import base_request_id
from pagellm.server.serving_chat_tools import ChoiceDeltas, ToolPlan, plan_tools, render_prompt


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, *, plan: ToolPlan | None = None,
                body: ChatCompletionRequest | TokenizeRequest | None = None) -> list[int]:
    """Messages -> prompt token ids. The template already writes any BOS, hence no special tokens by
    default. `plan` brings the tools, `body` vLLM's templating fields (documents, continue_final_message,
    chat_template_kwargs, chat_template)."""
    tok = ctx.engine.tokenizer
    extras = {} if body is None else {"documents": body.documents, "chat_template_kwargs": body.chat_template_kwargs,
                                      "continue_final_message": body.continue_final_message,
                                      "chat_template": body.chat_template}
    template_param = "chat_template" if extras.get("chat_template") else "messages"  # whose template failed
    try:
        text = render_prompt(tok, ctx.chat, [m.to_template_dict() for m in messages], add_generation_prompt,
                             plan, **extras)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except jinja2.TemplateError as e:  # templates reject e.g. non-alternating roles with raise_exception
        raise APIError(400, f"the chat template rejected the messages: {e}", param=template_param) from None
    except (TypeError, ArithmeticError) as e:  # a template's expression failed on what the client sent
        raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       param=template_param) from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext):
    model = ctx.check_model(body.model)
    check_request(body)
    body.return_tokens_as_token_ids = tokens_as_ids(body, ctx)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    plan = plan_tools(body, ctx.chat)
    # Off the event loop: templating and encoding a long conversation must not stall other clients.
    prompt_ids = await asyncio.to_thread(render_chat, ctx, body.messages, body.add_generation_prompt,
                                         body.add_special_tokens, plan=plan, body=body)
    if max_tokens is None and body.use_beam_search:  # beams need a length limit: the rest of the context
        max_tokens = max(ctx.engine.max_model_len - len(prompt_ids), 1)
    try:
        logprobs = body.engine_logprobs()
        params = body.to_sampling_params(max_tokens, logprobs, defaults=ctx.sampling_defaults)
    except ValueError as e:
        msg = str(e)
        if body.max_completion_tokens is not None and msg.startswith("max_tokens "):
            msg = "max_completion_tokens" + msg[len("max_tokens"):]
        raise bad_request(msg) from None
    check_prompt_logprobs(body)
    params = with_prompt_logprobs(params, body)
    params = plan.apply(params)  # tool_choice "required" / named: structured output
    rid = f"chatcmpl-{base_request_id(request)}"  # the client's X-Request-Id, as in vLLM
    prompts = await prepare_prompts(ctx.engine.tokenizer, [prompt_ids], params, ctx.engine.max_model_len,
                                    max_tokens_param="max_completion_tokens" if body.max_completion_tokens
                                    is not None else "max_tokens")
    try:
        streams = await ctx.add_all(prompts, params, rid, "messages", body.cache_salt)
    except APIError as e:  # the engine's name for the beam width: chat's is n
        if e.param == "beam_width":
            e.param = "n"
        raise
    created = now_s()
    if body.stream:
        return EngineStreamingResponse(_stream(body, streams, rid, created, model, plan), streams)
    (out,) = await unless_disconnected(request, final_outputs(streams))
    return _response(body, out, rid, created, model, plan)


def _response(body: ChatCompletionRequest, out: RequestOutput, rid: str, created: int, model: str,
              plan: ToolPlan) -> dict:
    choices = []
    for c in out.outputs:
        lps = None
        if body.logprobs:
            lps = chat_logprobs(sampled_logprobs(c, 0, len(c.token_ids)), body.top_logprobs or 0,
                                body.return_tokens_as_token_ids)
        message, finish_reason = plan.message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": lps, "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([out]),
            "prompt_logprobs": vllm_prompt_logprobs(out, body.prompt_logprobs)}


async def _stream(body: ChatCompletionRequest, streams, rid: str, created: int,
                  model: str, plan: ToolPlan) -> AsyncIterator[str]:
    deltas: dict[int, ChoiceDeltas] = {}  # per choice: text -> content or tool-call deltas
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
            tokens = next((len(c.token_ids) for c in final.outputs if c.index == index), 0) if final else 0
            payload["usage"] = (choice_usage(len(streams[0].prompt_token_ids), tokens)
                                if body.continuous_usage else None)
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
                choice = deltas.setdefault(c.index, plan.deltas())
                delta, finish_reason = (choice.finish(c.text, c.finish_reason) if c.finished
                                        else (choice.step(c.text), None))
                if delta:
                    lps = None
                    if body.logprobs:
                        end = len(c.token_ids)
                        lps = chat_logprobs(sampled_logprobs(c, sent_tokens.get(c.index, 0), end),
                                            body.top_logprobs or 0, body.return_tokens_as_token_ids)
                        sent_tokens[c.index] = end
                    yield chunk(c.index, delta, lps)
                if c.finished:
                    done.add(c.index)
                    lps = None
                    if body.logprobs and sent_tokens.get(c.index, 0) < len(c.token_ids):
                        # tokens that produced no visible text (EOS, a swallowed stop string)
                        lps = chat_logprobs(sampled_logprobs(c, sent_tokens.get(c.index, 0), len(c.token_ids)),
                                            body.top_logprobs or 0, body.return_tokens_as_token_ids)
                    yield chunk(c.index, {}, lps, finish_reason, c.stop_reason)
    except Exception as e:
        yield error_event(e)
        yield DONE
        return
    if body.include_usage and final is not None:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage([final])})
    yield DONE
