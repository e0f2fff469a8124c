"""POST /v1/responses (OpenAI's Responses API) on the chat machinery: input items -> chat messages -> the
chat template -> one engine request; the output as message and function_call items, whole or as the
Responses SSE events (`event:` + `data:` lines, no [DONE]).

Finished responses with `store` (the default) stay in memory for the server's lifetime, in an LRU of
RESPONSE_STORE_SIZE, so `previous_response_id` can continue a conversation: the new prompt is the earlier
conversation (its input and output, not its instructions, as OpenAI does) followed by the new input.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2
from fastapi import Request
from pydantic import ValidationError

from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.server.common import (
    EngineStreamingResponse,
    ServerContext,
    chat_logprobs,
    final_outputs,
    iteration_error,
    merged,
    sampled_logprobs,
    sse_json,
    unless_disconnected,
)
from pagellm.server.errors import APIError, bad_request
from pagellm.server.protocol import ChatCompletionRequest
from pagellm.server.protocol_responses import NamedToolChoice, ResponsesRequest, items_to_messages
from pagellm.server.request_checks import check_context
from pagellm.server.request_limits import MAX_MESSAGES, check_list_length
from pagellm.server.serving_chat_tools import ToolPlan, plan_tools, render_prompt

RESPONSE_STORE_SIZE = 1024


@dataclass
class StoredResponse:
    response: dict
    messages: list[dict]  # the whole conversation so far (without instructions), output included


class ResponseStore:
    """Bounded LRU of finished responses; reading one makes it recent."""

    def __init__(self, capacity: int = RESPONSE_STORE_SIZE):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


def retrieve_response(request: Request, response_id: str) -> dict:
    item = store_of(request).get(response_id)
    if item is None:
        raise not_found(response_id)
    return item.response


def delete_response(request: Request, response_id: str) -> dict:
    if not store_of(request).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found (pagellm keeps stored responses in "
                         f"memory for its lifetime, the latest {RESPONSE_STORE_SIZE})", param="response_id",
                    code="response_not_found")


async def create_response(body: ResponsesRequest, request: Request, ctx: ServerContext):
    model = ctx.check_model(body.model)
    check_list_length("input", body.input, MAX_MESSAGES)  # every item is rendered through the template
    try:
        body.refuse_unsupported()
        params = body.to_sampling_params(ctx.sampling_defaults)
    except ValueError as e:
        raise bad_request(e) from None
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = store_of(request).get(body.previous_response_id)
        if previous is None:  # OpenAI answers 400 here (404 is for GET /v1/responses/{id})
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found (pagellm "
                                f"keeps stored responses in memory for its lifetime, the latest "
                                f"{RESPONSE_STORE_SIZE})", param="previous_response_id",
                           code="previous_response_not_found")
        history = previous.messages
    conversation = [*history, *items_to_messages(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = _as_chat_request(body, [*system, *conversation])
    plan = plan_tools(chat, ctx.chat)
    params = plan.apply(params)
    prompt_ids = await asyncio.to_thread(_render, ctx, chat, plan)
    check_context(len(prompt_ids), params.max_tokens, ctx.engine.max_model_len, "max_output_tokens")
    # Always a fresh id, never the client's X-Request-Id (as chat's ids are): a response is stored under it and
    # read back by it, so a reused or guessed header must not replace or reveal another client's response.
    rid = f"resp_{uuid.uuid4().hex}"
    streams = await ctx.add_all([prompt_ids], params, rid, "input", body.cache_salt)
    state = _ResponseState(body, rid, model, conversation, plan)
    if body.stream:
        return EngineStreamingResponse(_stream(state, streams, store_of(request)), streams)
    (out,) = await unless_disconnected(request, final_outputs(streams))
    return state.finish(out, store_of(request))


def _as_chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The same conversation as a chat completion request, so tools are planned, rendered and parsed exactly
    as /v1/chat/completions does it."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate({
            "messages": messages, "tools": [t.to_chat_tool() for t in body.tools] or None,
            "tool_choice": choice if body.tools else None, "parallel_tool_calls": body.parallel_tool_calls})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"input: an item does not make a valid conversation turn ({where}: "
                            f"{first.get('msg')})", param="input") from None


def _render(ctx: ServerContext, chat: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    tok = ctx.engine.tokenizer
    try:
        text = render_prompt(tok, ctx.chat, [m.to_template_dict() for m in chat.messages], True, plan)
    except ValueError as e:  # the chat form's name for a function_call item's arguments is not the client's
        msg = str(e).replace("tool_calls[].function.arguments", "input: a function_call item's arguments")
        raise APIError(400, msg, param="input") from None
    except jinja2.TemplateError as e:
        raise APIError(400, f"the chat template rejected the conversation: {e}", param="input") from None
    except (TypeError, ArithmeticError) as e:  # a template's expression failed on this conversation
        raise APIError(400, f"the chat template failed on this conversation: {type(e).__name__}: {e}",
                       param="input") from None
    return tok.encode(text, add_special_tokens=False)


class _ResponseState:
    """One response's identity and options; builds its output items and JSON."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, conversation: list[dict], plan: ToolPlan):
        self.body = body
        self.id = rid
        self.model = model
        self.conversation = conversation
        self.plan = plan
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def skeleton(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None) -> dict:
        b = self.body
        choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedToolChoice) else b.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
            "reasoning": None, "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
            "top_logprobs": b.top_logprobs, "text": b.text.model_dump(by_alias=True) if b.text else
            {"format": {"type": "text"}}, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools], "truncation": b.truncation or "disabled",
            "usage": usage, "user": b.user, "metadata": b.metadata or {}}

    def logprobs(self, c: CompletionOutput, start: int = 0) -> list[dict]:
        if not self.body.wants_logprobs:
            return []
        return chat_logprobs(sampled_logprobs(c, start, len(c.token_ids)), self.body.top_logprobs or 0)["content"]

    def message_item(self, text: str, status: str, logprobs: list[dict] | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [part]}

    def output_items(self, c: CompletionOutput) -> list[dict]:
        status = "incomplete" if c.finish_reason == "length" else "completed"
        message, _ = self.plan.message(c.text, c.finish_reason)
        calls = message.get("tool_calls") or []
        if self.body.max_tool_calls is not None:
            calls = calls[:self.body.max_tool_calls]
        items = []
        content = message.get("content")
        if content or not calls:
            lps = self.logprobs(c) if self.body.wants_logprobs else None
            items.append(self.message_item(content or "", status, lps))
        for call in calls:
            items.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": status})
        return items

    def finish(self, out: RequestOutput, store: ResponseStore) -> dict:
        c = out.outputs[0]
        items = self.output_items(c)
        incomplete = "max_output_tokens" if c.finish_reason == "length" else None
        prompt, generated = len(out.prompt_token_ids), len(c.token_ids)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + generated}
        response = self.skeleton("incomplete" if incomplete else "completed", items, usage, incomplete)
        if self.body.store:
            store.put(self.id, StoredResponse(response, [*self.conversation, *_as_messages(items)]))
        return response


def _as_messages(items: list[dict]) -> list[dict]:
    """Output items -> the messages a follow-up request's prompt replays them as."""
    messages: list[dict] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"]})
        elif not _is_json_object(item["arguments"]):
            # a call cut by max_output_tokens: replayed as the text it was, since it cannot be a call
            messages.append({"role": "assistant", "content": item["arguments"]})
        else:
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            elif messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return messages


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class _Events:
    """Numbers the SSE events of one stream (sequence_number counts from 0)."""

    def __init__(self):
        self.seq = 0

    def __call__(self, type_: str, **payload) -> str:
        data = {"type": type_, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {type_}\ndata: {sse_json(data)}\n\n"


async def _stream(state: _ResponseState, streams, store: ResponseStore) -> AsyncIterator[str]:
    event = _Events()
    yield event("response.created", response=state.skeleton("in_progress", []))
    yield event("response.in_progress", response=state.skeleton("in_progress", []))
    # With tools the text may turn out to be a call, so it is only sent once parsed at the end.
    live = state.plan.parser is None
    ids = {"item_id": state.message_id, "output_index": 0}
    if live:
        yield event("response.output_item.added", output_index=0, item=state.message_item("", "in_progress", None))
        yield event("response.content_part.added", **ids, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
    sent_text = sent_tokens = 0
    final: RequestOutput | None = None
    try:
        async for _, out in merged(streams):
            final = out
            c = out.outputs[0]
            if live and len(c.text) > sent_text:
                lps = state.logprobs(c, sent_tokens)
                sent_tokens = len(c.token_ids)
                yield event("response.output_text.delta", **ids, content_index=0, delta=c.text[sent_text:],
                            logprobs=lps)
                sent_text = len(c.text)
    except Exception as e:
        err = e if isinstance(e, APIError) else iteration_error(e)
        failed = state.skeleton("failed", [])
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        yield event("response.failed", response=failed)
        return
    if final is None:
        return
    response = state.finish(final, store)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            if not live:
                yield event("response.output_item.added", output_index=index,
                            item={**item, "status": "in_progress", "content": []})
                yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
                if part["text"]:
                    yield event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=part["text"], logprobs=part.get("logprobs", []))
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=part.get("logprobs", []))
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(done, response=response)
