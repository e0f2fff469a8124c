"""Pieces both generation endpoints share: admission, SSE framing, client-disconnect handling, logprobs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from starlette.responses import StreamingResponse

from pagellm.engine.engine_front import EngineFront
from pagellm.engine.request_stream import (
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    RequestTimeoutError,
)
from pagellm.metrics import EngineMetrics
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sample.sampler import NO_TOKEN_ALLOWED
from pagellm.sampling_params import SamplingParams
from pagellm.server.errors import APIError, bad_request
from pagellm.server.protocol_structured import compile_structured_outputs
from pagellm.server.serving_chat_tools import ChatSettings

RETRY_AFTER_S = 1
MAX_PROMPTS_PER_REQUEST = 2048  # OpenAI's limit on embedding inputs, applied to every prompt list
_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerContext:
    engine: EngineFront
    metrics: EngineMetrics
    model_names: list[str]
    api_key: str | None = None
    request_timeout: float | None = None
    created: int = 0
    chat: ChatSettings = field(default_factory=ChatSettings)  # --chat-template, tool calling
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the default of the request field
    sampling_defaults: dict = field(default_factory=dict)  # --generation-config: fields requests leave out

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to echo back in responses; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.model_name
        if name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(self.model_names)}", param="model", code="model_not_found")
        return name

    async def add_all(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                      prompt_param: str, cache_salt: str | None = None) -> list[RequestStream]:
        """Admit every prompt of a request, or none of them: together, between two engine steps."""
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:  # 10**5 would flood the queue and one step's admission
            raise APIError(400, f"{prompt_param} must hold at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                                f"got {len(prompts)}", param=prompt_param)
        await compile_structured_outputs(self.engine, params)  # off the event loop; invalid: a 400
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        if any(self.engine.is_request_id_in_use(i) for i in ids):
            # A client's X-Request-Id that another of its requests still runs under: both run (vLLM makes its
            # engine ids unique too); the response keeps the client's id. (No await between this and queueing.)
            suffix = uuid.uuid4().hex[:8]
            ids = [f"{i}-{suffix}" for i in ids]
        try:
            return await self.engine.add_requests(prompts, params, ids, self.request_timeout, cache_salt)
        except BaseException as e:
            raise admission_error(e, prompt_param) from None


def admission_error(e: BaseException, prompt_param: str) -> BaseException:
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):  # died while admitting it: the server exits next
        return APIError(500, str(e), code="engine_error")
    if isinstance(e, RequestTimeoutError):  # --request-timeout passed before the engine admitted it
        return iteration_error(e)
    if isinstance(e, ValueError):
        return bad_request(e, prompt_param)
    return e


def iteration_error(e: BaseException) -> APIError:
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), code="timeout")
    if isinstance(e, RequestFailedError) and str(e).startswith(NO_TOKEN_ALLOWED):  # its own fields contradict
        return APIError(400, str(e))
    if isinstance(e, RequestFailedError):  # failed alone: its message says what failed
        return APIError(500, str(e), code="request_failed")
    return APIError(500, str(e), code="engine_error")


def now_s() -> int:
    return int(time.time())


# json.dumps escapes every control character below U+0020 but writes U+0085, U+2028 and U+2029 as they are;
# clients that read SSE with str.splitlines (httpx's iter_lines, for one) take those for line ends and cut the
# chunk's JSON in two (a sampled token decoded to one of them lost a request in a serving benchmark).
# Replaced only where present: str.translate took ~60 us a KB on any text with a non-ASCII character.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def sse_json(payload: dict) -> str:
    """payload as one line of JSON, safe inside an SSE data field for any line splitter."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse(payload: dict) -> str:
    return f"data: {sse_json(payload)}\n\n"


DONE = "data: [DONE]\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    results: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merged(streams):
            results[i] = out
    except (RequestTimeoutError, RuntimeError) as e:
        raise iteration_error(e) from None
    return results  # type: ignore[return-value]


async def unless_disconnected(request: Request, work: Awaitable):
    """Run `work` but cancel it (aborting its requests) if the client hangs up first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():  # cancel() above only takes effect at the task's next step
        raise APIError(499, "client closed the request", code="client_closed")
    return task.result()


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes (aborts) its engine requests however the response ends, even if the
    client leaves before the body iterator ever started."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


def error_event(e: BaseException) -> str:
    err = e if isinstance(e, APIError) else iteration_error(e)
    return sse(err.body())


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return choice_usage(prompt, completion)


def choice_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """stream_options.continuous_usage_stats, as vLLM counts it: a chunk carries its prompt's tokens and its own
    choice's tokens so far (the last chunk, with no choices, has the whole request's)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def sampled_logprobs(c: CompletionOutput, start: int, end: int) -> list[tuple[int, dict[int, Logprob]]]:
    """(sampled token id, its logprob entry) for tokens [start, end) of a sequence."""
    if c.logprobs is None:
        return []
    # The engine appends to the logprobs list as it runs: bound it by this output's own token count.
    return list(zip(c.token_ids[start:end], c.logprobs[start:end], strict=False))


def tokens_as_ids(body, ctx: ServerContext) -> bool:
    """return_tokens_as_token_ids: the request's field, else the server's flag."""
    asked = getattr(body, "return_tokens_as_token_ids", None)
    return ctx.return_tokens_as_token_ids if asked is None else asked


def token_text(tid: int, lp: Logprob, as_ids: bool) -> str:
    # vLLM's "token_id:N" lets a client read ids back from tokens that are not valid UTF-8 on their own.
    return f"token_id:{tid}" if as_ids else lp.decoded_token or ""


def completion_logprobs(entries: list[tuple[int, dict[int, Logprob]]], text_offset: int,
                        as_ids: bool = False) -> dict:
    """The legacy completions shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset.
    text_offset counts the decoded text even when tokens are shown as ids."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in entries:
        lp = entry[tid]
        out["tokens"].append(token_text(tid, lp, as_ids))
        out["token_logprobs"].append(_lp(lp.logprob))
        out["top_logprobs"].append({token_text(t, e, as_ids): _lp(e.logprob) for t, e in entry.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(lp.decoded_token or "")
    return out


def chat_logprobs(entries: list[tuple[int, dict[int, Logprob]]], top_n: int, as_ids: bool = False) -> dict:
    def item(tid: int, lp: Logprob) -> dict:
        token = token_text(tid, lp, as_ids)
        # a piece of a multi-byte character: its own bytes (OpenAI's), so that a client can join them
        raw = lp.token_bytes if lp.token_bytes is not None and not as_ids else token.encode()
        return {"token": token, "logprob": _lp(lp.logprob), "bytes": list(raw)}

    content = []
    for tid, entry in entries:
        ranked = sorted(((t, e) for t, e in entry.items() if e.rank is not None), key=lambda te: te[1].rank)
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, e) for t, e in ranked[:top_n]]})
    return {"content": content}
