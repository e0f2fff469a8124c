"""T x P worker processes joined by torch.distributed (gloo): the engine broadcasts each step's message and
receives the result from the last stage.

Start-up: the engine hosts the TCPStore and puts the `WorkerSpec` in it; it spawns this node's workers
(all of them on one node; with --nnodes, `run_headless` spawns the others' on theirs) and waits until each
has loaded its share (or one reports an error, or dies). Failure: a watchdog thread polls the local
workers; when one dies, it kills the rest, so whatever the engine waits on fails at once, and the engine's
next or current step raises `WorkerFailedError`. Shutdown (or the engine's exit) stops every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref

from torch.distributed import TCPStore

from pagellm.core.step_message import StepMessage
from pagellm.distributed import GlooGroup, free_port
from pagellm.distributed.shm_allreduce import has_room
from pagellm.executor.base import Executor
from pagellm.executor.errors import WorkerFailedError
from pagellm.executor.transport import FROM_RESULT_BYTES, TO_WORKERS_BYTES, GlooTransport, ShmTransport
from pagellm.executor.worker import SPEC_KEY, STATS, STOP, WorkerSpec
from pagellm.model.runner import StepResult

logger = logging.getLogger("pagellm")

READY_TIMEOUT_S = 900.0  # loading a big model from a slow disk, on every rank at once
NODE_WAIT_NOTICE_S = 10.0  # then a line names the nodes still missing


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> list[int]:
    """The worker ranks a node hosts: workers spread evenly over the nodes, in rank order."""
    workers = world_size - 1
    if nnodes < 1 or workers % nnodes:
        raise ValueError(f"{workers} workers (tensor x pipeline parallel size) cannot be spread evenly over "
                         f"{nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank must be in [0, {nnodes}), got {node_rank}")
    k = workers // nnodes
    return list(range(1 + node_rank * k, 1 + (node_rank + 1) * k))


class WorkerProcess:
    """A worker started as `python -m pagellm.executor` (a fresh interpreter, as multiprocessing's
    spawn, without re-importing the caller's __main__: scripts need no `if __name__ == "__main__"` guard)."""

    def __init__(self, rank: int, master_addr: str, master_port: int, local_ranks: int):
        self.name = f"pagellm worker rank {rank}"
        # The kernel's parent-death signal follows the *thread* that started the child: asked for only from
        # the main thread (a thread pool's thread may exit while the engine lives on). Either way a worker
        # exits when the engine's end of its connection closes.
        env = dict(os.environ, PAGELLM_DIE_WITH_PARENT=str(int(threading.current_thread() is threading.main_thread())))
        self.popen = subprocess.Popen([sys.executable, "-m", "pagellm.executor", str(rank), master_addr,
                                       str(master_port), str(local_ranks)], stdin=subprocess.DEVNULL, env=env)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


def spawn_workers(ranks: list[int], master_addr: str, master_port: int) -> list[WorkerProcess]:
    return [WorkerProcess(rank, master_addr, master_port, len(ranks)) for rank in ranks]


def stop_processes(procs: list, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


class MultiprocExecutor(Executor):
    name = "mp"
    local_channels = True  # shared-memory message channels when every worker is on this host

    def __init__(self, spec: WorkerSpec, nnodes: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None):
        super().__init__(spec.args.block_size)
        self.spec, self.nnodes = spec, nnodes
        self._closed = False
        self._busy = threading.Lock()  # held while a step talks to the workers
        check_master_addr(master_addr)
        port = master_port or free_port(master_addr if master_addr != "0.0.0.0" else "127.0.0.1")
        try:
            self.store = TCPStore(master_addr, port, None, True, datetime.timedelta(seconds=READY_TIMEOUT_S),
                                  wait_for_workers=False)
        except RuntimeError as e:  # c10d's DistNetworkError: the port is taken, or the address is not this host's
            raise ValueError(f"--master-port {port}: cannot listen on {master_addr}: "
                             f"{str(e).strip().splitlines()[-1]}") from None
        self.master = (master_addr, port)
        # every worker on this host: step messages and results through shared memory, not gloo
        channels = nnodes == 1 and self.local_channels and has_room(TO_WORKERS_BYTES + FROM_RESULT_BYTES)
        if channels:
            spec.channels = ShmTransport.create(spec.world_size - 1)
            self.transport = ShmTransport(spec.channels, spec.world_size - 1, None, alive=self._workers_alive)
        self.store.set(SPEC_KEY, pickle.dumps(spec))
        self.procs: list = []
        # an engine dropped without shutdown() (at exit too) still stops its workers, and tells the watcher first:
        # those deaths are no failure to report
        self._dropped = threading.Event()
        weakref.finalize(self, _drop, self.procs, self._dropped)
        try:
            self.procs.extend(self._launch(node_ranks(spec.world_size, nnodes, 0), master_addr, port))
            self.weights_bytes = [int(b) for b in self._wait_for("ready", "loaded")]
            self.world = GlooGroup(self.store, "world", 0, spec.world_size)
            # their tensor/pipeline groups and shared all-reduce segments come after the world group: a
            # step (or a look at /dev/shm) right after the engine is up must find them in place
            self._wait_for("joined", "joined their groups")
        except BaseException:
            self._kill_all()
            raise
        finally:
            if channels:  # every worker has mapped them (or is gone): the names can go
                for path in spec.channels:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        if not channels:
            self.transport = GlooTransport(self.world)
        self.transport.world = self.world
        # (the thread holds the executor only for one look at a time: a bound method as its target had kept a
        # dropped engine alive, and its workers running, until the interpreter exited)
        self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self),), name="pagellm-worker-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _workers_alive(self) -> bool:
        return self.error is None and all(p.is_alive() for p in self.procs)

    def _launch(self, ranks: list[int], master_addr: str, master_port: int) -> list:
        """Start the workers; each handle has name, exitcode, is_alive(), kill(), join(timeout)."""
        return spawn_workers(ranks, master_addr, master_port)

    def _wait_for(self, key: str, what: str) -> list[bytes]:
        """Every worker's `key/<rank>` value once all have set it; a worker's error, death or the timeout
        raises, naming the other nodes with ranks that never connected (a node not started: the local ranks
        wait for it until their rendezvous times out)."""
        ranks = range(1, self.spec.world_size)
        start = time.monotonic()
        deadline, said = start + READY_TIMEOUT_S, False
        while True:
            error = self._worker_error(0.0)
            if error:
                raise WorkerFailedError(error + self._unconnected_nodes("never connected"))
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                raise WorkerFailedError(f"{dead[0].name} exited with code {dead[0].exitcode} while starting")
            if all(self.store.check([f"{key}/{r}"]) for r in ranks):
                return [self.store.get(f"{key}/{r}") for r in ranks]
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"workers not {what} after {READY_TIMEOUT_S:.0f} s"
                                        + self._unconnected_nodes("never connected"))
            if not said and time.monotonic() - start > NODE_WAIT_NOTICE_S:
                said = True  # a multi-node start is otherwise silent until a timeout minutes later
                missing = self._unconnected_nodes("not connected yet")
                if missing:
                    logger.info("waiting for the other nodes%s", missing.replace(";", ":", 1))
            time.sleep(0.05)

    def _unconnected_nodes(self, state: str) -> str:
        """'; node 1 (rank 2) <state>: start each ...' for the other nodes with a rank that never reached the
        store (a node still loading has: it is not named), else ''."""
        missing = []
        for node in range(1, self.nnodes):
            ranks = node_ranks(self.spec.world_size, self.nnodes, node)
            if not all(self.store.check([f"connected/{r}"]) for r in ranks):
                missing.append(f"node {node} (rank {ranks[0]})" if len(ranks) == 1 else
                               f"node {node} (ranks {ranks[0]}-{ranks[-1]})")
        if not missing:
            return ""
        return (f"; {', '.join(missing)} {state}: start each with the same model options and --nnodes "
                f"{self.nnodes} --node-rank N --master-addr {self.master[0]} --master-port {self.master[1]}")

    def _watch_once(self) -> bool:
        """One look at the local workers; True once there is nothing more to watch (stopped on purpose, or a
        death handled: every rank stopped, the group dropped, on_failure called)."""
        stopped = lambda: self._closed or self._dropped.is_set()  # noqa: E731  -- workers stopped on purpose
        if stopped():
            return True
        dead = next((p for p in self.procs if p.exitcode is not None), None)
        if dead is None or stopped():
            return False
        self.error = self.error or self._worker_error(0.0) or f"{dead.name} exited with code {dead.exitcode}"
        logger.error("%s: stopping every rank", self.error)
        self._kill_all()  # whatever the engine waits on now fails at once
        if not self._busy.locked():  # else the step waiting on the group fails and drops it
            self._abort_group()
        if self.on_failure is not None:
            self.on_failure()
        return True

    def _kill_all(self) -> None:
        _kill(self.procs)

    def run(self, msg: StepMessage) -> StepResult:
        return self._call(msg, lambda: self.transport.recv_result(self.spec.result_rank))

    def _call(self, msg, receive):
        """Send msg to every worker, return receive()'s answer; any failure fails the executor."""
        if self.error is not None or self._closed:
            raise WorkerFailedError(self.error or "the workers were shut down")
        try:
            with self._busy:
                self.transport.broadcast(msg)
                return receive()
        except Exception as e:  # a rank died under us: gloo reports the closed connection
            self.error = self.error or self._worker_error(2.0) or (
                f"lost a worker: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            self._fail()
            raise WorkerFailedError(self.error) from None
        except BaseException:  # Ctrl-C mid-step: the workers' state and a pending result no longer match
            self.error = self.error or "a step was interrupted; start a new engine"
            self._fail()
            raise

    def _worker_error(self, wait_s: float) -> str | None:
        """Why the workers failed, waiting briefly for a reason to appear: a local rank killed by a signal
        (it leaves no reason, and its peers' reasons, a closed connection, are echoes of it), else the
        first reason a rank left in the store (its step raised)."""
        deadline = time.monotonic() + wait_s
        while True:
            killed = next((p for p in self.procs if (p.exitcode or 0) < 0), None)
            if killed is not None:
                return f"{killed.name} was killed by signal {-killed.exitcode}"
            if self.store.check(["error/1"]):
                return self.store.get("error/1").decode()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _fail(self) -> None:
        self._closed = True
        self._kill_all()
        self._abort_group()

    def _abort_group(self) -> None:
        """Drop the engine's side of the broken group now: destroyed at exit, gloo's threads abort."""
        world, self.world = getattr(self, "world", None), None
        if world is not None:
            with contextlib.suppress(Exception):
                world.pg.abort()

    def stats(self) -> list[dict]:
        """Each worker's busy seconds and time spent waiting on the previous pipeline stage."""
        return self._call(STATS, lambda: [self.world.recv_object(r) for r in range(1, self.spec.world_size)])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.transport.broadcast(STOP)
        except Exception:
            pass
        stop_processes(self.procs)


def _watch(executor: weakref.ref) -> None:
    while True:
        ex = executor()
        if ex is None or ex._watch_once():
            return
        del ex
        time.sleep(0.1)


def _drop(procs: list, dropped: threading.Event) -> None:
    dropped.set()
    _kill(procs)


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(2.0)


def check_master_addr(addr: str) -> None:
    """--master-addr must resolve: c10d retried an unknown name until its timeout, warning all along."""
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--master-addr {addr!r}: {getattr(e, 'strerror', None) or e}") from None


def run_headless(spec_source: tuple[str, int], nnodes: int, node_rank: int) -> int:
    """A node other than 0: spawn its workers (the engine on node 0 hosts the store and the spec), wait for
    them, return the exit status (0 when the engine stopped them)."""
    addr, port = spec_source
    check_master_addr(addr)
    logger.info("node %d of %d: connecting to node 0 at %s:%d (waiting up to %.0f s for it)", node_rank, nnodes,
                addr, port, READY_TIMEOUT_S)
    store = TCPStore(addr, port, None, False, datetime.timedelta(seconds=READY_TIMEOUT_S))
    spec: WorkerSpec = pickle.loads(store.get(SPEC_KEY))
    procs = spawn_workers(node_ranks(spec.world_size, nnodes, node_rank), addr, port)
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        stop_processes(procs, grace_s=2.0)
    return max((p.exitcode or 0) if p.exitcode is not None and p.exitcode >= 0 else 1 for p in procs)


def start_workers(args, model_path: str, dtype, kv_dtype, num_blocks: int, num_host_blocks: int) -> MultiprocExecutor:
    """The engine's executor for args.executor_backend "mp" (or "ray": the same workers, placed by Ray)."""
    spec = WorkerSpec(args, model_path, dtype, kv_dtype, num_blocks, num_host_blocks, args.tensor_parallel_size,
                      args.pipeline_parallel_size, args.num_threads, args.nnodes)
    if args.executor_backend == "ray":
        from pagellm.executor.ray_workers import RayExecutor

        spec.one_host = False  # Ray places workers: no shared-memory all-reduce
        return RayExecutor(spec, 1, args.master_addr, args.master_port)
    return MultiprocExecutor(spec, args.nnodes, args.master_addr, args.master_port)
