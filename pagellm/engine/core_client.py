"""The server's side of the engine core process (engine/core_process.py): the async engine's front (streams,
admission, aborts, deadlines, drain; engine/engine_front.py) with the engine in another process.

This process keeps the tokenizer (loaded here while the core loads the model) and the engine's constants
(`EngineInfo`, sent by the core once it is ready). The loop task sends what the front queued, batched, and
dispatches each `StepResult` the core sends back. Two daemon threads do the blocking I/O, so the event loop
never waits on the socket: the writer sends pickled messages, the reader receives them and wakes the loop.
The core's death (its end of the socket closes) fails every in-flight request with EngineDeadError and ends
the loop task (/health: 503; the server exits 1). `shutdown` stops the core with bounded waits, then kills it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

from pagellm.config import EngineArgs
from pagellm.engine.engine_core import EngineInfo
from pagellm.engine.engine_front import EngineFront
from pagellm.engine.output_wire import decode
from pagellm.engine.request_stream import EngineDeadError, EngineStoppedError
from pagellm.executor.errors import EngineStartError, WorkerFailedError
from pagellm.executor.multiproc import READY_TIMEOUT_S
from pagellm.platforms.openmp import bounded_spin_env

logger = logging.getLogger("pagellm")

STOP_TIMEOUT_S = 15.0  # the core finishes its step and stops its workers (they get 5 s), else it is killed
# Step results waiting beyond this many are dispatched at once (the newest output per stream wins): the
# front has fallen behind the core. Fewer are dispatched one per event-loop turn, so that each stream's
# reader sees every step, as in process.
BACKLOG = 4


class EngineProcessClient(EngineFront):
    """Launch with `EngineProcessClient.launch(args)`; then start() / stop() on the event loop as any
    AsyncLLMEngine, and shutdown() (idempotent) once it is no longer needed."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, info: EngineInfo, tokenizer,
                 max_queue_len: int | None = None):
        super().__init__(max_queue_len)
        self.proc = proc
        self.info = info
        self.tokenizer = tokenizer
        self._conn = conn
        self._inbox: collections.deque = collections.deque()  # from the reader thread: messages, None at EOF
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # to the writer thread: pickled messages, None ends it
        self._sent_adds: set[str] = set()  # sent, not yet accepted or refused by the core
        self._jobs: dict[int, asyncio.Future] = {}
        self._new_jobs: list[tuple[int, object]] = []
        self._cancelled_jobs: list[int] = []
        self._job_ids = itertools.count()
        self._structured = None
        self._closed = False
        threading.Thread(target=self._write, name="pagellm-core-writer", daemon=True).start()
        weakref.finalize(self, _kill, proc)  # a client dropped without shutdown() still stops its core

    @classmethod
    def launch(cls, args: EngineArgs, max_queue_len: int | None = None) -> EngineProcessClient:
        """Start the core process, load the tokenizer here meanwhile, wait until the core loaded the model.
        The core's start-up error is raised here (a bad flag: the same ValueError as in process)."""
        from pagellm.model.loader import resolve_model_path
        from pagellm.tokenizer import Tokenizer

        ours, theirs = socket.socketpair()
        # As for the executor's workers: the parent-death signal follows the thread that starts the child.
        env = dict(os.environ, PAGELLM_DIE_WITH_PARENT=str(int(threading.current_thread() is threading.main_thread())))
        env = bounded_spin_env(env)  # it steps beside this process and the clients (platforms/openmp.py)
        with theirs:
            proc = subprocess.Popen([sys.executable, "-m", "pagellm.engine.core_process", str(theirs.fileno()),
                                     str(os.getpid())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                    env=env)
        conn = Connection(ours.detach())
        try:
            conn.send(("start", args, logging.getLogger().getEffectiveLevel()))
            tokenizer = Tokenizer.from_path(args.tokenizer or resolve_model_path(args.model))
            info = _wait_ready(conn, proc)
        except BaseException:
            _kill(proc)
            conn.close()
            raise
        logger.info("engine core: process %d (the HTTP front end runs in process %d)", proc.pid, os.getpid())
        return cls(proc, conn, info, tokenizer, max_queue_len)

    @property
    def core_pid(self) -> int:
        return self.proc.pid

    @property
    def structured_output(self):
        """Grammars compiled here to validate a request before admission (the core compiles its own)."""
        if self._structured is None:
            from pagellm.structured_output import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.info.model_config.vocab_size,
                                                       self.info.eos_token_ids)
        return self._structured

    def num_waiting(self) -> int:
        return self.snapshot.num_waiting + len(self._adds) + len(self._sent_adds)

    async def start(self) -> None:
        if self.proc.poll() is not None:
            raise EngineDeadError(f"the engine core process {_how_it_ended(self.proc.returncode)}")
        loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._accepting = True
        threading.Thread(target=self._read, args=(loop,), name="pagellm-core-reader", daemon=True).start()
        self._task = asyncio.create_task(self._loop(), name="pagellm-engine-client-loop")

    async def run_job(self, job):
        """job(engine)'s result, run in the core between two steps: job and result must pickle (a
        functools.partial of a module-level function does)."""
        self._check_accepting()
        try:
            pickle.dumps(job)
        except Exception as e:
            raise TypeError(f"this job cannot be sent to the engine core process: {e}") from None
        job_id = next(self._job_ids)
        fut = asyncio.get_running_loop().create_future()
        self._jobs[job_id] = fut
        self._new_jobs.append((job_id, job))
        fut.add_done_callback(lambda f: self._job_done(job_id, f))
        self._wakeup.set()
        return await fut

    def _job_done(self, job_id: int, fut: asyncio.Future) -> None:
        if self._jobs.pop(job_id, None) is not None and fut.cancelled():  # the client left: tell the core
            self._cancelled_jobs.append(job_id)
            if self._wakeup is not None:
                self._wakeup.set()

    def _fail_jobs(self, error: BaseException) -> None:
        jobs, self._jobs, self._new_jobs = self._jobs, {}, []
        for fut in jobs.values():
            if not fut.done():
                fut.set_exception(error)

    async def stop(self) -> None:
        await self.drain(0.0)
        self._fail_jobs(EngineStoppedError("the server is shutting down"))
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await self._task
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the core process: ask, wait up to STOP_TIMEOUT_S (it finishes its step, stops its workers),
        then kill it. Idempotent; returns once the process is gone."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self._outbox.put(pickle.dumps(("stop",)))
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
                _kill(self.proc)
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            self._conn.close()  # no deadlock: the core is gone, so the reader has seen EOF (or will)

    # ---- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            await self._run_loop()
        except Exception as e:  # a bug on this side (dispatch, metrics, a malformed message): as a dead engine,
            # so every stream gets its error and the server exits, instead of streams waiting forever
            self._die(e, None, "the engine front failed")
            self._fail_jobs(EngineDeadError("the engine failed"))

    async def _run_loop(self) -> None:
        while True:
            # Woken by the reader (each message, the core's exit) and by the front (adds, aborts, jobs); with
            # requests in flight, at least once a second for their deadlines even if the core is slow.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), 1.0 if self._streams else None)
            self._wakeup.clear()
            while self._inbox:
                msg = self._inbox.popleft()
                if msg is None or msg[0] == "dead":
                    if not self._stopping:
                        await self._core_failed(msg)
                    return
                _, res, job_results = msg
                if res is not None:
                    self._sent_adds.difference_update(res.added)
                    self._dispatch(res)
                for job_id, (result, error) in job_results.items():
                    fut = self._jobs.pop(job_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(result) if error is None else fut.set_exception(error)
                if 0 < len(self._inbox) <= BACKLOG:
                    await asyncio.sleep(0)
            self._expire_deadlines()
            if self._stopping:
                return
            self._send_work()

    async def _core_failed(self, msg) -> None:
        if msg is None:  # the process ended without a word: killed, or crashed in native code
            code = await asyncio.to_thread(_wait_exit, self.proc, 5.0)
            what = f"the engine core process {_how_it_ended(code)}"
            self._die(EngineDeadError(what), "", what)
        else:
            self._die(msg[1], msg[2] or "")
        self._fail_jobs(EngineDeadError("the engine failed"))

    def _send_work(self) -> None:
        adds, aborts = self._take_queued()
        jobs, self._new_jobs = self._new_jobs, []
        cancelled, self._cancelled_jobs = self._cancelled_jobs, []
        if not (adds or aborts or jobs or cancelled):
            return
        try:
            data = pickle.dumps(("work", adds, aborts, jobs, cancelled))
        except Exception:  # one request carries something that does not pickle: refuse it alone
            adds = [a for a in adds if self._picklable(a)]
            data = pickle.dumps(("work", adds, aborts, jobs, cancelled))
        self._sent_adds.update(a.request_id for a in adds)
        # An aborted add is no longer waiting, whether or not the core reports dropping it (it does not when
        # the abort reaches it before the add was applied): else the queue length only grows (--max-queue-len).
        self._sent_adds.difference_update(aborts - {a.request_id for a in adds if a.after_abort})
        self._outbox.put(data)

    def _picklable(self, add) -> bool:
        try:
            pickle.dumps(add)
            return True
        except Exception as e:
            stream = self._streams.get(add.request_id)
            if stream is not None and not stream.accepted.done():
                stream.finished = True
                stream.accepted.set_exception(ValueError(f"this request cannot be sent to the engine: {e}"))
            return False

    def _output(self, item, stream):
        return decode(item, stream.last_output, stream.prompt, stream.prompt_token_ids)

    # ---- the threads -------------------------------------------------------------------------
    def _write(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._conn.send_bytes(data)
            except OSError:
                return  # the core is gone: the reader sees the end of the stream

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = None
            except Exception as e:  # a message that does not unpickle here: nothing after it can be trusted
                msg = ("dead", RuntimeError(f"unreadable message from the engine core: {e}"), None)
            self._inbox.append(msg)
            try:
                loop.call_soon_threadsafe(self._wakeup.set)
            except RuntimeError:  # the event loop is closed
                return
            if msg is None or msg[0] == "dead":
                return


def _wait_ready(conn: Connection, proc: subprocess.Popen) -> EngineInfo:
    deadline = time.monotonic() + READY_TIMEOUT_S + 60  # the core itself waits up to READY_TIMEOUT_S on workers
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # it exited without a word (killed, or a crash in native code)
                code = _wait_exit(proc, 5.0)
                raise EngineStartError(f"the engine core process {_how_it_ended(code)} while starting") from None
            if msg[0] == "ready":
                return msg[1]
            error, tb = msg[1], msg[2]
            if not isinstance(error, (ValueError, OSError, TypeError, WorkerFailedError)):
                logger.error("the engine failed to start:\n%s", tb.rstrip())  # a bug: its traceback helps
            raise error
        if proc.poll() is not None:
            raise EngineStartError(f"the engine core process {_how_it_ended(proc.returncode)} while starting")
    raise EngineStartError(f"the engine core process was not ready after {READY_TIMEOUT_S + 60:.0f} s")


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout)
    return None


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "closed its channel"
    if code < 0:
        if -code == signal.SIGKILL:  # unasked for, most often the OOM killer (the kernel log says)
            return f"was killed by signal {-code} (SIGKILL; out of memory?)"
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
