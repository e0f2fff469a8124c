"""What the async engine hands the server per request (RequestStream), its errors, and what it reports to
the metrics layer (EngineSnapshot, RequestObserver)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagellm.engine.request_stats import FinishedRequest
from pagellm.outputs import CompletionOutput, RequestOutput


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_len; the client should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its loop died) and takes no new requests."""


class RequestTimeoutError(RuntimeError):
    """A request ran past its deadline and was aborted."""


class RequestFailedError(RuntimeError):
    """This request alone failed in the engine step (its own parameters); the others went on."""


class EngineDeadError(RuntimeError):
    """The engine step itself failed: the engine is dead and the server exits so a supervisor restarts it."""


class RequestObserver(Protocol):
    """What the metrics layer wants to hear about; all calls come from the event loop thread."""

    def observe_first_token(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float) -> None: ...
    def observe_finished(self, request: FinishedRequest) -> None: ...
    def observe_iteration(self, num_tokens: int) -> None: ...


@dataclass
class EngineSnapshot:
    """Engine gauges and counters, copied in the worker thread after each step so readers never race it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_swapped: int = 0  # requests whose KV blocks are in host memory now
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0


class RequestStream:
    """One accepted request: iterate it for cumulative outputs; `close()` aborts it if still running."""

    def __init__(self, release: Callable[[RequestStream], None], request_id: str, n: int, arrival: float,
                 deadline: float | None):
        self._release = release  # the async engine's: forget the stream, abort its request if unfinished
        self.request_id = request_id
        self.n = n
        self.arrival_time = arrival
        self.deadline = deadline
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.finished = False
        self.last_output: RequestOutput | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.max_tokens: int | None = None

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                # Outputs are cumulative: a slow reader only needs the newest one.
                while not isinstance(item, BaseException) and not self.queue.empty():
                    item = self.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        self._release(self)

    def final_abort_output(self) -> RequestOutput:
        """What a request that never finishes reports: its text so far, finish_reason "abort"."""
        last = self.last_output
        outs = list(last.outputs) if last else [CompletionOutput(i, "", []) for i in range(self.n)]
        outs = [o if o.finished else dataclasses.replace(o, finish_reason="abort") for o in outs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished=True)
