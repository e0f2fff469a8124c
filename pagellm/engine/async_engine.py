"""Asyncio front of LLMEngine in this process: continuous batching across concurrent clients.

One background task drives `EngineCore.step()` in a worker thread, so the event loop keeps accepting and
streaming while the model runs. The engine is only ever touched from that worker thread (or from the loop
task while no step is in flight): adds and aborts are queued (engine/engine_front.py) and applied between
steps. Each request gets its own asyncio queue of cumulative `RequestOutput`s. `pagellm serve` runs the
engine in its own process instead by default (engine/core_client.py), with the same front.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

from pagellm.engine.embedding import EngineJobs
from pagellm.engine.engine_core import TRIM_INTERVAL_S, EngineCore, EngineInfo, StepResult
from pagellm.engine.engine_front import EngineFront
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.request_stream import EngineDeadError, EngineStoppedError


class AsyncLLMEngine(EngineFront):
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None):
        super().__init__(max_queue_len)
        self.engine = engine
        self.core = EngineCore(engine)
        self.jobs = EngineJobs()  # e.g. embeddings: run on the engine between steps (engine/embedding.py)
        self._stepped_since_trim = False
        self._last_trim = 0.0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @functools.cached_property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def structured_output(self):
        """What compiles and validates grammars (the server compiles each one before admission)."""
        return self.engine.structured_output

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

    async def run_job(self, job: Callable[[LLMEngine], object]):
        """job(engine)'s result, run in the worker thread between two steps (see EngineJobs)."""
        self._check_accepting()
        fut = self.jobs.submit(job)
        self._wakeup.set()
        return await fut

    async def stop(self) -> None:
        await self.drain(0.0)
        self.jobs.fail_all(EngineStoppedError("the server is shutting down"))
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await self._task  # lets a running step finish: the worker thread cannot be cancelled

    # ---- the loop ----------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._adds or self._aborts or self.jobs or self.core.has_work())

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
                wait = self._last_trim + TRIM_INTERVAL_S - time.monotonic()
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
                self._die(e)
                self.jobs.fail_all(EngineDeadError("the engine failed"))
                return

    def _step_sync(self) -> StepResult:
        """Runs in the worker thread: apply queued adds and aborts, run jobs, then one engine step."""
        adds, aborts = self._take_queued()
        return self.core.step(adds, aborts, self.jobs.run)
