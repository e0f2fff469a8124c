"""Asyncio front of LLMEngine for the server: continuous batching across concurrent clients.

One background task drives `step()` in a worker thread, so the event loop keeps accepting and streaming
while the model runs. The engine is only ever touched from that worker thread (or from the loop task
while no step is in flight): adds and aborts are queued and applied between steps. Each request gets its
own asyncio queue of cumulative `RequestOutput`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagellm.engine.embedding import EngineJobs
from pagellm.engine.llm_engine import LLMEngine
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
from pagellm.outputs import RequestOutput
from pagellm.request import RequestStatus
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")

_TRIM_INTERVAL_S = 1.0


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
        self.error: BaseException | None = None  # why the loop died (EngineDeadError); None while healthy
        self.log_requests = False  # --log-requests: prompts and outputs reach the log only when set
        self._stepped_since_trim = False
        self._last_trim = 0.0

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
        loop, wakeup = asyncio.get_running_loop(), self._wakeup
        # a worker process that dies while the engine idles wakes the loop, which then fails and stops
        self.engine.executor.on_failure = lambda: loop.call_soon_threadsafe(wakeup.set)

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
        stream = RequestStream(self._release, rid, params.n, now, now + timeout if timeout else None)
        stream.max_tokens = params.max_tokens
        self._streams[rid] = stream
        with self._lock:
            self._adds.append(_Add(rid, prompt, params, now, cache_salt))
        self._wakeup.set()
        try:
            await stream.accepted
        except BaseException:
            stream.close()
            # The exception's traceback holds this frame; without `stream` (whose future holds the exception)
            # that is no cycle, so a refused prompt is freed at once rather than by the next full GC.
            del stream, prompt
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
            if self.log_requests:
                log_request(stream, self.tokenizer)
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
        return bool(self._adds or self._aborts or self.jobs or self.engine.has_unfinished_requests()
                    or self.engine.executor.error is not None)  # a dead worker: step, fail, stop

    async def _loop(self) -> None:
        while True:
            if self._stopping and not (self._adds or self._aborts):
                return
            if not self._has_work():
                self._wakeup.clear()
                if not self._stepped_since_trim:
                    await self._wakeup.wait()
                    continue
                # Idle after work: return freed memory to the OS (off the loop), at most once a second since a
                # trim walks the whole heap; work arriving first wins.
                wait = self._last_trim + _TRIM_INTERVAL_S - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), wait)
                    continue
                self._stepped_since_trim, self._last_trim = False, time.monotonic()
                await asyncio.to_thread(self.engine.platform.release_free_memory)
                continue
            try:
                self._expire_deadlines()
                self._dispatch(await asyncio.to_thread(self._step_sync))
                self._stepped_since_trim = True
            except Exception as e:
                # One request's own failures are isolated inside the step (engine/isolation.py), so this is
                # the engine itself (forward pass, scheduler, a bug): its state can no longer be trusted.
                # Fail everything, stop (/health: 503) and let the server exit non-zero (as vLLM does).
                logger.exception("engine step failed: the engine is dead; failing %d in-flight request(s)",
                                 len(self._streams))
                self.error = e
                self._accepting = False
                self._fail_all(e)
                self.jobs.fail_all(EngineDeadError("the engine failed"))
                return

    def _expire_deadlines(self) -> None:
        now = time.time()
        for stream in list(self._streams.values()):
            if stream.deadline is not None and now > stream.deadline and not stream.finished:
                elapsed = now - stream.arrival_time
                stream.queue.put_nowait(RequestTimeoutError(f"request timed out after {elapsed:.1f} s"))
                self._release(stream)

    def _fail_all(self, error: Exception) -> None:
        err = EngineDeadError(f"the engine failed while running this request: {type(error).__name__}")
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(err)
            stream.queue.put_nowait(err)
            self._release(stream)

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
                # Without its traceback: that holds this frame (and `added`, so itself) in a cycle that
                # kept a refused request's prompt alive until the next full GC (bench soak: +20 MB each).
                added[a.request_id] = e.with_traceback(None)
                continue
            state = eng.requests[a.request_id]
            added[a.request_id] = (state.prompt, list(state.prompt_token_ids))
            self._unscheduled.add(a.request_id)
        if aborts:
            eng.abort_request(list(aborts))
            self._unscheduled -= aborts
        self.jobs.run(eng)
        eng.executor.check_health()  # a worker died while idle: raise here, the loop then fails and stops
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
