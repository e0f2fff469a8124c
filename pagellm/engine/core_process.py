"""The engine core process of `pagellm serve`: the scheduler, the model and `LLMEngine.step()`, away from the
HTTP front end's GIL (vLLM v1's EngineCore).

Started by engine/core_client.py as `python -m pagellm.engine.core_process FD PARENT_PID` (a fresh
interpreter: scripts need no `__main__` guard), with one end of a socket pair as FD. Over it, pickled:

  front -> core   ("start", EngineArgs, log level)   once; the core answers ("ready", EngineInfo)
                                                      or ("failed", exception, traceback text)
                  ("work", adds, aborts, jobs, cancelled job ids)
                  ("stop",)
  core -> front   ("step", StepResult, {job id: (result, error)})   after each round of work; its outputs
                                                      are what is new in each (engine/output_wire.py)
                  ("dead", exception, traceback text)   the engine failed; the process then exits 1

The loop blocks on the channel while idle (and trims freed memory once, as the in-process loop did); with
work it drains whatever arrived, then steps. Grammars are compiled in a helper thread before their request
is added, so the loop never compiles. The process exits when told to stop, when the front's end of the
channel closes, and (Linux) when the parent dies: PR_SET_PDEATHSIG, as the executor's workers; its own
tensor/pipeline-parallel workers are its children. SIGINT/SIGTERM are the front's to handle (it drains,
then stops the core), so they are ignored here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait

from pagellm.engine.embedding import run_job, within_slice
from pagellm.engine.engine_core import TRIM_INTERVAL_S, Add, EngineCore, EngineInfo, portable_error
from pagellm.engine.output_wire import OutputEncoder

logger = logging.getLogger("pagellm")

IDLE_CHECK_S = 5.0  # idle: look at the parent this often, in case its death went unnoticed


class CoreLoop:
    def __init__(self, engine, conn: Connection, parent_pid: int):
        self.engine = engine
        self.core = EngineCore(engine)
        self.conn = conn
        self.parent_pid = parent_pid
        self.adds: list[Add] = []
        self.aborts: set[str] = set()
        self.jobs: dict[int, object] = {}
        self.compiling: list[tuple[Add, Future]] = []
        self.refused: dict[str, BaseException] = {}  # adds whose grammar failed to compile
        self.encoder = OutputEncoder()
        self.grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="pagellm-grammar")
        self._wake_r, self._wake_w = os.pipe()  # written by other threads to end an idle wait
        engine.executor.on_failure = self._wake  # a worker died: step, fail, report
        self.stepped_since_trim = False
        self.last_trim = 0.0

    def _wake(self, *_) -> None:
        os.write(self._wake_w, b"x")

    def has_work(self) -> bool:
        return bool(self.adds or self.aborts or self.jobs or self.refused) or self.core.has_work()

    def run(self) -> int:
        """The process's exit status: 0 when told to stop or left by the front, 1 when the engine failed."""
        while True:
            if not self.receive(0.0 if self.has_work() else self.idle_timeout()):
                return 0
            self.collect_compiled()
            if self.has_work():
                job_results: dict[int, tuple] = {}
                try:
                    res = self.core.step(self.adds, self.aborts, functools.partial(self.run_jobs, results=job_results))
                except Exception as e:
                    self.send(("dead", portable_error(e), traceback.format_exc()))
                    return 1
                self.encoder.forget(self.aborts)
                res.outputs = self.encoder.encode(res.outputs)  # what is new in each (engine/output_wire.py)
                self.adds, self.aborts = [], set()
                res.added.update(self.refused)
                self.refused = {}
                self.send(("step", res, job_results))
                self.stepped_since_trim = True
            elif self.stepped_since_trim and time.monotonic() >= self.last_trim + TRIM_INTERVAL_S:
                # Idle after work: return freed memory to the OS, at most once a second (a trim walks the heap).
                self.stepped_since_trim, self.last_trim = False, time.monotonic()
                self.engine.platform.release_free_memory()

    def idle_timeout(self) -> float:
        if self.stepped_since_trim:
            return max(0.0, self.last_trim + TRIM_INTERVAL_S - time.monotonic())
        return IDLE_CHECK_S

    def receive(self, timeout: float) -> bool:
        """Wait up to `timeout` for a message (or a wake-up), then take every message that arrived; False
        when the loop should end."""
        ready = wait([self.conn, self._wake_r], timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        if not ready and os.getppid() != self.parent_pid:
            return False  # the parent is gone (and its end of the channel with it)
        try:
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == "stop":
                    return False
                self.take(*msg[1:])
        except (EOFError, OSError):
            return False
        return True

    def take(self, adds: list[Add], aborts: set[str], jobs: list[tuple[int, object]], cancelled: list[int]) -> None:
        for a in self.adds + [c[0] for c in self.compiling]:
            if a.request_id in aborts:  # aborted after an earlier message brought it: dropped by the step
                a.after_abort = False
        for a in adds:
            if a.request_id in self.aborts:  # an abort from an earlier message, not yet applied: a reused id
                a.after_abort = True
            if a.params.structured_outputs is None:
                self.adds.append(a)
            else:
                fut = self.grammar_pool.submit(self.engine.structured_output.validate, a.params)
                fut.add_done_callback(self._wake)
                self.compiling.append((a, fut))
        if aborts:
            self.aborts |= aborts
            self.compiling = [(a, f) for a, f in self.compiling if a.request_id not in aborts or a.after_abort]
        self.jobs.update(jobs)
        for job_id in cancelled:
            self.jobs.pop(job_id, None)

    def collect_compiled(self) -> None:
        """Adds whose grammar is compiled (add_request then finds it in the cache) join the next step."""
        still = []
        for a, fut in self.compiling:
            if not fut.done():
                still.append((a, fut))
            elif fut.exception() is not None:
                self.refused[a.request_id] = portable_error(fut.exception())
            else:
                self.adds.append(a)
        self.compiling = still

    def run_jobs(self, engine, results: dict[int, tuple]) -> None:
        """Jobs in arrival order for about JOB_SLICE_S; the rest after the next step (and the next messages,
        which may cancel them)."""
        for job_id, job in within_slice(list(self.jobs.items())):
            outcome = run_job(job, engine)
            if outcome is None:
                continue  # the KV cache is busy: again after this step
            del self.jobs[job_id]
            result, error = outcome
            if error is None:
                try:
                    pickle.dumps(result)
                except Exception as e:
                    result, error = None, TypeError(f"the job's result cannot be sent back: {e}")
            results[job_id] = (result, None if error is None else portable_error(error))

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            pass  # the front is gone: the next receive ends the loop

    def close(self) -> None:
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)


def main(fd: int, parent_pid: int) -> int:
    if os.environ.get("PAGELLM_DIE_WITH_PARENT") == "1":
        from pagellm.executor.worker import die_with_parent

        die_with_parent()
    if os.getppid() != parent_pid:
        return 0  # the parent died before the signal was asked for
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        _, args, level = conn.recv()
    except (EOFError, OSError):
        return 0
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return _in_one_thread(functools.partial(_serve, conn, args, parent_pid))


def _serve(conn: Connection, args, parent_pid: int) -> int:
    """Build the engine, report, then run the loop until told to stop."""
    from pagellm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(args)
    except Exception as e:  # the front reports it (one line for a bad flag, as in process)
        with contextlib.suppress(OSError):
            conn.send(("failed", portable_error(e), traceback.format_exc()))
        return 1
    loop = None
    try:
        conn.send(("ready", EngineInfo.of(engine)))
        loop = CoreLoop(engine, conn, parent_pid)
        return loop.run()
    except (EOFError, OSError):
        return 0
    finally:
        if loop is not None:
            loop.close()
        engine.shutdown()  # the tensor/pipeline-parallel workers, if any


def _in_one_thread(run) -> int:
    """run() in a second thread that both loads the model and steps it, so that the process has one OpenMP
    team. libgomp throttles its spin-waits to ~100 rounds once it manages more threads than there are cores
    (a team made by the main thread while loading plus another for stepping would be 4 on 2 cores): each
    barrier then sleeps on a futex, and the serve workload ran 445 against 617 output tok/s in one team
    (benchmarks/NOTES.md, fifteenth session). Not in the main thread itself: the main thread keeps its
    signal handling free, as the in-process server steps in a worker thread too."""
    result = [1]

    def target():
        result[0] = run()

    t = threading.Thread(target=target, name="pagellm-engine-core")
    t.start()
    t.join()
    return result[0]


if __name__ == "__main__":
    code = main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: threads (gloo's, the grammar pool) need no joining
