"""A tensor/pipeline-parallel worker process: load the model, keep this rank's share, then run every step
message the engine broadcasts until it says stop (or goes away).

World ranks: 0 is the engine (it schedules and samples, holds no weights); workers are 1..T x P, worker
w = 1 + pp_rank * T + tp_rank. Rank 1 + (P - 1) * T (tensor rank 0 of the last stage) returns each step's
result. A worker whose step raises leaves why in the store and exits; its peers then see their collectives
fail and do the same, and the engine, whose receive fails, reads the first reason there.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from torch.distributed import TCPStore

from pagellm.config import EngineArgs
from pagellm.distributed import GlooGroup, PipelineLink
from pagellm.distributed.shm_allreduce import NoSharedMemory
from pagellm.executor.transport import GlooTransport, ShmTransport
from pagellm.model.attention import get_attention_backend
from pagellm.model.loader import load_config
from pagellm.model.loader.model_loader import get_model, model_weight_bytes
from pagellm.model.parallel import ParallelInfo, shard_model
from pagellm.model.runner import ModelRunner
from pagellm.platforms import get_platform

logger = logging.getLogger("pagellm")

SPEC_KEY = "pagellm/spec"
ERROR_COUNT = "pagellm/errors"
STOP = "stop"
STATS = "stats"
CONNECT_TIMEOUT = datetime.timedelta(seconds=600)
# float32 elements per rank slot (2 MiB: decode and small prefill steps); bigger all-reduces go through
# gloo, whose ~1 ms latency is small beside the compute of that many rows
SHM_MAX_ELEMS = 512 << 10


@dataclass
class WorkerSpec:
    """What every worker needs to build its share, set in the store by the engine (remote nodes read it there)."""

    args: EngineArgs
    model_path: str
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_blocks: int
    num_host_blocks: int
    tp: int
    pp: int
    threads_per_rank: int | None  # None: the node's cores divided among its ranks
    nnodes: int = 1
    micro_batches: int = 2
    channels: tuple[str, str] | None = None  # shared-memory message channels (all workers on one host)
    one_host: bool = True  # False: placement is not ours (Ray), no rank shares memory with another

    @property
    def tp_group_on_one_node(self) -> bool:
        """Tensor groups are consecutive ranks and nodes hold equal shares: aligned, they share a host."""
        return self.one_host and (self.tp * self.pp // self.nnodes) % self.tp == 0

    @property
    def world_size(self) -> int:
        return 1 + self.tp * self.pp

    @property
    def result_rank(self) -> int:
        return 1 + (self.pp - 1) * self.tp


def worker_main(rank: int, master_addr: str, master_port: int, local_ranks: int) -> None:
    """A worker process's life (started by pagellm.executor.multiproc.WorkerProcess)."""
    if os.environ.get("PAGELLM_DIE_WITH_PARENT") == "1":
        die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s pagellm rank {rank} %(levelname)s %(message)s")
    store = TCPStore(master_addr, master_port, None, False, CONNECT_TIMEOUT)
    store.set(f"connected/{rank}", "1")  # node 0 tells a node still loading from one never started
    spec: WorkerSpec = pickle.loads(store.get(SPEC_KEY))
    try:
        runner, info = _build(spec, rank, local_ranks)
        transport = None
        if spec.channels:  # mapped before "ready": the engine unlinks them once every rank is
            parent = os.getppid()
            transport = ShmTransport(spec.channels, spec.world_size - 1, rank - 1,
                                     alive=lambda: os.getppid() == parent)
    except Exception as e:  # a clear line for the engine, then out
        _report(store, rank, f"failed to start: {type(e).__name__}: {e}")
    store.set(f"ready/{rank}", str(model_weight_bytes(runner.model)))
    try:
        world, transport = _join(store, spec, runner, info, rank, transport)
    except Exception as e:
        _report(store, rank, f"failed to join the other ranks: {type(e).__name__}: {e}")
    store.set(f"joined/{rank}", "1")
    _serve(store, world, transport, runner, rank, spec)


def _join(store: TCPStore, spec: WorkerSpec, runner: ModelRunner, info: ParallelInfo, rank: int, transport):
    """The process groups (world; tensor and pipeline neighbours) and the message transport."""
    world = GlooGroup(store, "world", rank, spec.world_size)
    if transport is None:
        transport = GlooTransport(world)
    transport.world = world
    if spec.tp > 1:
        info.group = GlooGroup(store, f"tp{info.pp_rank}", info.tp_rank, spec.tp)
        if spec.args.shm_allreduce and spec.tp_group_on_one_node:
            hidden = runner.model.config.hidden_size
            try:
                info.group.use_shared_memory(store, f"shm{info.pp_rank}",
                                             min(spec.args.max_num_batched_tokens * hidden, SHM_MAX_ELEMS))
            except NoSharedMemory as e:
                logger.warning("tensor-parallel all-reduce through gloo: %s", e)
    if spec.pp > 1:
        runner.pipeline = PipelineLink(GlooGroup(store, f"pp{info.tp_rank}", info.pp_rank, spec.pp), spec.micro_batches)
    return world, transport


def _report(store: TCPStore, rank: int, detail: str) -> None:
    """Leave why in the store (numbered: the first is the cause, later ones its echoes), then exit."""
    with contextlib.suppress(Exception):
        store.set(f"error/{store.add(ERROR_COUNT, 1)}", f"worker rank {rank} {detail}")
    os._exit(1)


def _build(spec: WorkerSpec, rank: int, local_ranks: int) -> tuple[ModelRunner, ParallelInfo]:
    args = spec.args
    platform = get_platform(args.device)
    platform.check_available()
    cores = len(os.sched_getaffinity(0))
    platform.set_num_threads(spec.threads_per_rank or max(1, cores // local_ranks))
    torch.manual_seed(args.seed)
    info = ParallelInfo(tp_rank=(rank - 1) % spec.tp, tp_size=spec.tp, pp_rank=(rank - 1) // spec.tp, pp_size=spec.pp)
    device = torch.device(args.device)
    model = get_model(spec.model_path, load_config(spec.model_path), platform, spec.dtype, device,
                      args.int8_activations, args.packed_weights_only, auto_dtype=args.dtype == "auto",
                      quantization=args.quantization, quantization_group_size=args.quantization_group_size)
    shard_model(model, info)
    platform.release_free_memory()  # the whole model was loaded; this rank keeps its share
    backend = get_attention_backend(args.attention_backend, platform, spec.kv_dtype, spec.dtype,
                                    args.dtype == "auto")
    runner = ModelRunner(model, spec.num_blocks, args.block_size, spec.kv_dtype, device, backend, platform,
                         num_host_blocks=spec.num_host_blocks, prefault_kv=args.prefault_kv_cache)
    return runner, info


def _serve(store: TCPStore, world: GlooGroup, transport, runner: ModelRunner, rank: int, spec: WorkerSpec) -> None:
    busy = 0.0
    while True:
        try:
            msg = transport.next_message()
        except Exception:  # the engine is gone
            os._exit(0)
        if msg == STOP:
            os._exit(0)
        if msg == STATS:
            world.send_object({"rank": rank, "busy_seconds": busy,
                               "pipeline_wait_seconds": runner.pipeline_wait_seconds}, 0)
            continue
        try:
            t0 = time.perf_counter()
            result = runner.execute(msg)
            busy += time.perf_counter() - t0
        except Exception as e:  # the engine reads why from the store once this rank is gone
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"pagellm worker rank {rank}: step failed\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            _report(store, rank, f"step failed: {detail}")
        if rank == spec.result_rank:
            transport.send_result(result)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no worker (nor engine core process) outlives
    a killed parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
