"""Asyncio front of LLMEngine for the server: continuous batching across concurrent clients.

One background task drives `step()` in a worker thread, so the event loop keeps accepting and streaming
while the model runs. The engine is only ever touched from that worker thread (or from the loop task
while no step is in flight): adds and aborts are queued and applied between steps. Each request gets its
own asyncio queue of cumulative `RequestOutput`s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagellm.engine.embedding import EngineJobs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.request_stats import FinishedRequest, finished_request
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.request import RequestStatus
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_len; the client should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its loop died) and takes no new requests."""


class RequestTimeoutError(RuntimeError):
    """A request ran past its deadline and was aborted."""


class RequestFailedError(RuntimeError):
    """This request alone failed in the engine step (its own parameters); the others went on."""


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


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None


@dataclass
class _StepResult:
    added: dict[str, BaseException | tuple[str | None, list[int]]]
    outputs: list[RequestOutput]
    scheduled: dict[str, float]  # request id -> time of its first scheduling
    end_time: float
    snapshot: EngineSnapshot
    num_tokens: int = 0  # fed to the model in this step


class RequestStream:
    """One accepted request: iterate it for cumulative outputs; `close()` aborts it if still running."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, n: int, arrival: float,
                 deadline: float | None):
        self._engine = engine
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
        self._engine._release(self)

    def final_abort_output(self) -> RequestOutput:
        """What a request that never finishes reports: its text so far, finish_reason "abort"."""
        last = self.last_output
        outs = list(last.outputs) if last else [CompletionOutput(i, "", []) for i in range(self.n)]
        outs = [o if o.finished else dataclasses.replace(o, finish_reason="abort") for o in outs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished=True)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.observer: RequestObserver | None = None
        self.snapshot = EngineSnapshot()
        self._lock = threading.Lock()  # guards _adds / _aborts (written by the loop, read by the worker)
        self._adds: list[_Add] = []
        self._aborts: set[str] = set()
        self.jobs = EngineJobs()  # e.g. embeddings: run on the engine between steps (engine/embedding.py)
        self._streams: dict[str, RequestStream] = {}
        self._unscheduled: set[str] = set()  # worker thread only
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = False
        self._stopping = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        # len() of a deque is atomic, so reading it while a step runs is safe.
        return len(self.engine.scheduler.waiting) + len(self._adds)

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._accepting = True
        self._task = asyncio.create_task(self._loop(), name="pagellm-engine-loop")

    # ---- requests (event loop thread) ----------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          timeout: float | None = None, cache_salt: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it (ValueError if it is invalid)."""
        if not self._accepting or not self.is_running:
            raise EngineStoppedError("the server is shutting down and accepts no new requests")
        if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_len} requests); retry later")
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        now = time.time()
        stream = RequestStream(self, rid, params.n, now, now + timeout if timeout else None)
        stream.max_tokens = params.max_tokens
        self._streams[rid] = stream
        with self._lock:
            self._adds.append(_Add(rid, prompt, params, now, cache_salt))
        self._wakeup.set()
        try:
            await stream.accepted
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id, timeout)
        async for out in stream:
            yield out

    async def run_job(self, job: Callable[[LLMEngine], object]):
        """job(engine)'s result, run in the worker thread between two steps (see EngineJobs)."""
        if not self._accepting or not self.is_running:
            raise EngineStoppedError("the server is shutting down and accepts no new requests")
        fut = self.jobs.submit(job)
        self._wakeup.set()
        return await fut

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._release(stream)

    def _release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.finished:
            stream.finished = True
            with self._lock:
                self._aborts.add(stream.request_id)
            if self._wakeup is not None:
                self._wakeup.set()

    # ---- shutdown ----------------------------------------------------------------------------
    async def drain(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> None:
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

    async def stop(self) -> None:
        await self.drain(0.0)
        self.jobs.fail_all(EngineStoppedError("the server is shutting down"))
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await self._task  # lets a running step finish: the worker thread cannot be cancelled

    # ---- the loop ----------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._adds or self._aborts or self.jobs or self.engine.has_unfinished_requests())

    async def _loop(self) -> None:
        while True:
            if self._stopping and not (self._adds or self._aborts):
                return
            if not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                self._expire_deadlines()
                self._dispatch(await asyncio.to_thread(self._step_sync))
            except Exception as e:
                # Keep serving: fail what was in flight (a bad step must not take the server down).
                logger.exception("engine step failed; aborting %d in-flight request(s)", len(self._streams))
                self._fail_all(e)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for stream in list(self._streams.values()):
            if stream.deadline is not None and now > stream.deadline and not stream.finished:
                elapsed = now - stream.arrival_time
                stream.queue.put_nowait(RequestTimeoutError(f"request timed out after {elapsed:.1f} s"))
                self._release(stream)

    def _fail_all(self, error: Exception) -> None:
        err = RuntimeError(f"the engine failed while running this request: {type(error).__name__}")
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(err)
            stream.queue.put_nowait(err)
            self._release(stream)
        with self._lock:
            self._aborts.update(self.engine.requests)

    def _step_sync(self) -> _StepResult:
        """Runs in the worker thread: apply queued adds and aborts, then one engine step."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, set()
        eng = self.engine
        added: dict[str, BaseException | tuple[str | None, list[int]]] = {}
        for a in adds:
            if a.request_id in aborts:  # the client left before its request ever reached the engine
                continue
            try:
                eng.add_request(a.request_id, a.prompt, a.params, a.arrival_time, a.cache_salt)
            except Exception as e:
                added[a.request_id] = e
                continue
            state = eng.requests[a.request_id]
            added[a.request_id] = (state.prompt, list(state.prompt_token_ids))
            self._unscheduled.add(a.request_id)
        if aborts:
            eng.abort_request(list(aborts))
            self._unscheduled -= aborts
        self.jobs.run(eng)
        start = time.time()
        batched_before = eng.scheduler.stats.num_batched_tokens
        outputs = eng.step() if eng.has_unfinished_requests() else []
        end = time.time()
        scheduled = {}
        for rid in list(self._unscheduled):
            state = eng.requests.get(rid)
            if state is None or any(s.request.status is not RequestStatus.WAITING for s in state.seqs):
                scheduled[rid] = start
                self._unscheduled.discard(rid)
        return _StepResult(added, outputs, scheduled, end, self._take_snapshot(),
                           eng.scheduler.stats.num_batched_tokens - batched_before)

    def _take_snapshot(self) -> EngineSnapshot:
        eng = self.engine
        return EngineSnapshot(
            num_running=eng.scheduler.num_running, num_waiting=eng.scheduler.num_waiting,
            kv_cache_usage=eng.kv_cache.usage(), num_swapped=len(eng.kv_cache.req_host_blocks),
            prompt_tokens=eng.stats.prompt_tokens,
            generation_tokens=eng.stats.generation_tokens, finished=dict(eng.stats.finished),
            num_preemptions=eng.scheduler.stats.num_preemptions,
            num_swapped_out=eng.scheduler.stats.num_swapped_out, num_swapped_in=eng.scheduler.stats.num_swapped_in,
            spec_draft_tokens=eng.scheduler.stats.num_draft_tokens,
            spec_accepted_tokens=eng.scheduler.stats.num_accepted_tokens,
            spec_steps=eng.scheduler.stats.num_spec_steps,
            spec_accepted_per_pos=list(eng.scheduler.stats.num_accepted_per_pos),
            prefix_queries=eng.kv_cache.prefix_queries, prefix_hits=eng.kv_cache.prefix_hits)

    def _dispatch(self, res: _StepResult) -> None:
        """Back on the event loop: resolve adds, record timings, hand outputs to their queues."""
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
        for out in res.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue
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
