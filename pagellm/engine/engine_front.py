"""The event-loop half of the async engine, whoever runs the engine: per-request streams, admission, aborts,
deadlines, drain, and the dispatch of each step's result to the streams and the metrics observer.

Two subclasses run the engine: `AsyncLLMEngine` (engine/async_engine.py) steps it in a worker thread of
this process; `EngineProcessClient` (engine/core_client.py) talks to an engine core process. Both take the
adds and aborts queued here between steps (`_take_queued`) and hand every `StepResult` to `_dispatch`, on
the event loop. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from pagellm.engine.engine_core import Add, EngineInfo, StepResult
from pagellm.engine.request_log import log_request
from pagellm.engine.request_stats import finished_request
from pagellm.engine.request_stream import (
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestObserver,
    RequestStream,
    RequestTimeoutError,
)
from pagellm.executor.errors import WorkerFailedError
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")


class EngineFront:
    """Subclasses set `info` and `tokenizer`, and implement start, stop, run_job, num_waiting."""

    info: EngineInfo
    tokenizer = None

    def __init__(self, max_queue_len: int | None = None):
        self.max_queue_len = max_queue_len
        self.observer: RequestObserver | None = None
        self.snapshot = EngineSnapshot()
        self._lock = threading.Lock()  # guards _adds / _aborts (written by the loop, read by the stepping side)
        self._adds: list[Add] = []
        self._aborts: set[str] = set()
        self._streams: dict[str, RequestStream] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = False
        self._stopping = False
        self.error: BaseException | None = None  # why the engine died (EngineDeadError); None while healthy
        self.log_requests = False  # --log-requests: prompts and outputs reach the log only when set

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def is_accepting(self) -> bool:
        """Running and taking new requests (False while a shutdown drains the in-flight ones)."""
        return self._accepting and self.is_running

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def run_job(self, job):
        raise NotImplementedError

    def _check_accepting(self) -> None:
        if not self.is_accepting:
            raise EngineStoppedError("the server is shutting down and accepts no new requests")

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                          timeout: float | None = None, cache_salt: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it (ValueError if it is invalid)."""
        try:
            (stream,) = await self.add_requests([prompt], params, [request_id], timeout, cache_salt)
        except BaseException:
            del prompt  # the traceback holds this frame too (see add_requests)
            raise
        return stream

    async def add_requests(self, prompts: list, params: SamplingParams, request_ids: list[str | None],
                           timeout: float | None = None, cache_salt: str | None = None) -> list[RequestStream]:
        """Queue several requests at once and wait until the engine took them all: the engine admits them
        between two steps together (add_request after add_request waits one step each: a list of 64 prompts
        took ~11 s to admit under load, unaware of its client leaving). Every one or none: where one is
        refused, or the wait is cancelled, the others are closed (aborted) and the error raised."""
        self._check_room(len(prompts))
        streams = self._queue_all(prompts, params, request_ids, timeout, cache_salt)
        try:
            results = await asyncio.gather(*(s.accepted for s in streams), return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
            del results
            if error is not None:
                raise error
        except BaseException:
            for s in streams:
                s.close()
            # The exception's traceback holds this frame (and add_request's): no prompt may stay among their
            # locals, or refused prompts wait for the next full GC (tests/test_bench_soak.py).
            del streams, prompts
            raise
        return streams

    def _queue_all(self, prompts: list, params: SamplingParams, request_ids: list[str | None],
                   timeout: float | None, cache_salt: str | None) -> list[RequestStream]:
        """Every prompt queued, or (a request id in use) none: those queued already are closed. Its own frame,
        gone when it returns, so that no later traceback holds a prompt in a loop variable."""
        streams: list[RequestStream] = []
        try:
            for prompt, rid in zip(prompts, request_ids, strict=True):
                streams.append(self._queue(prompt, params, rid, timeout, cache_salt))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def _check_room(self, n: int) -> None:
        self._check_accepting()
        if self.max_queue_len is not None and n > self.max_queue_len:  # a 503 would be retried forever
            raise ValueError(f"a request of {n} prompts is more than the server's queue holds "
                             f"(--max-queue-len {self.max_queue_len})")
        if self.max_queue_len is not None and self.num_waiting() + n > self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests"
                                 f"{f', {n} more asked' if n > 1 else ''}); retry later")

    def _queue(self, prompt, params: SamplingParams, request_id: str | None, timeout: float | None,
               cache_salt: str | None) -> RequestStream:
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        now = time.time()
        stream = RequestStream(self._release, rid, params.n, now, now + timeout if timeout else None)
        stream.max_tokens = params.max_tokens
        self._streams[rid] = stream
        with self._lock:  # an abort of this id still queued is the previous request's (the id is reused)
            self._adds.append(Add(rid, prompt, params, now, cache_salt, after_abort=rid in self._aborts))
        self._wakeup.set()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id, timeout)
        async for out in stream:
            yield out

    def is_request_id_in_use(self, request_id: str) -> bool:
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._release(stream)

    def _release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            if self.log_requests:
                log_request(stream, self.tokenizer)
        if not stream.finished:
            stream.finished = True
            with self._lock:
                self._aborts.add(stream.request_id)
                for a in self._adds:  # its own add, still queued (after an abort of a reused id): dropped too
                    if a.request_id == stream.request_id:
                        a.after_abort = False
            if self._wakeup is not None:
                self._wakeup.set()

    def _take_queued(self) -> tuple[list[Add], set[str]]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, set()
        return adds, aborts

    # ---- shutdown ----------------------------------------------------------------------------
    async def drain(self, timeout: float, give_up=lambda: False) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` seconds, then abort the rest,
        each with a final output (finish_reason "abort") so that its client gets a last message."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not give_up() and self.is_running:
            await asyncio.sleep(0.05)
        aborted = 0
        for stream in list(self._streams.values()):
            aborted += not stream.finished
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineStoppedError("the server is shutting down"))
            elif not stream.finished:
                stream.queue.put_nowait(stream.final_abort_output())
            self._release(stream)
        if aborted:
            logger.info("aborted %d in-flight request(s) at shutdown", aborted)

    def _die(self, error: BaseException, traceback_text: str | None = None, what: str = "engine step failed") -> None:
        """The engine itself failed (forward pass, scheduler, a bug, its process): its state can no longer be
        trusted. Fail everything and stop accepting (/health: 503); the server then exits non-zero (as vLLM
        does). traceback_text: the failure's traceback when it happened in another process ("": none)."""
        msg = what + ": the engine is dead; failing %d in-flight request(s)"
        if traceback_text is None:
            logger.error(msg, len(self._streams), exc_info=error)
        elif traceback_text:
            logger.error(msg + "\n%s", len(self._streams), traceback_text.rstrip())
        else:
            logger.error(msg, len(self._streams))
        self.error = error
        self._accepting = False
        # A worker's or the core's end (killed by a signal, exited) is said as it is; other errors only by their
        # type (a bug's message may quote what a request held)
        detail = f": {error}" if isinstance(error, (WorkerFailedError, EngineDeadError)) else ""
        err = EngineDeadError(f"the engine failed while running this request: {type(error).__name__}{detail}")
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(err)
            stream.queue.put_nowait(err)
            self._release(stream)

    # ---- step results ------------------------------------------------------------------------
    def _output(self, item, stream: RequestStream) -> RequestOutput:
        """A step's output for a live stream, as the stream hands it on (the core process sends less)."""
        return item

    def _expire_deadlines(self) -> None:
        now = time.time()
        for stream in list(self._streams.values()):
            if stream.deadline is not None and now > stream.deadline and not stream.finished:
                error = RequestTimeoutError(f"request timed out after {now - stream.arrival_time:.1f} s")
                if not stream.accepted.done():  # not even admitted yet (a long step): add_request raises it
                    stream.accepted.set_exception(error)
                stream.queue.put_nowait(error)
                self._release(stream)

    def _dispatch(self, res: StepResult) -> None:
        """On the event loop: resolve adds, record timings, hand outputs to their queues."""
        self.snapshot = res.snapshot
        for rid, outcome in res.added.items():
            stream = self._streams.get(rid)
            if stream is None or stream.accepted.done():
                continue
            if isinstance(outcome, BaseException):
                stream.finished = True  # never reached the engine: nothing to abort
                stream.accepted.set_exception(outcome)
            else:
                stream.prompt, stream.prompt_token_ids = outcome
                stream.accepted.set_result(None)
        for rid, t in res.scheduled.items():
            if rid in self._streams:
                self._streams[rid].scheduled_time = t
        obs, now = self.observer, res.end_time
        if obs is not None and res.num_tokens:
            obs.observe_iteration(res.num_tokens)
        for item in res.outputs:
            stream = self._streams.get(item.request_id)
            if stream is None or stream.finished or not stream.accepted.done():
                continue  # not accepted yet: a previous request's output under the same (reused) id
            out = self._output(item, stream)
            if stream.last_token_time is None:
                stream.first_token_time = now
                if obs is not None:
                    obs.observe_first_token(now - stream.arrival_time)
            elif obs is not None:
                obs.observe_inter_token(now - stream.last_token_time)
            stream.last_token_time = now
            stream.last_output = out
            if out.error is not None:  # this stream's error only: the step went on for the others
                stream.finished = True
                stream.queue.put_nowait(RequestFailedError(out.error))
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                stream.finished = True
                if obs is not None:
                    obs.observe_finished(finished_request(stream, out, now))
