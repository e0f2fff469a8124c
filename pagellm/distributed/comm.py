"""Process groups and the collectives pagellm uses: all-reduce and all-gather for tensor parallelism,
send/recv of hidden states between pipeline stages, and pickled objects from the engine to the workers
(broadcast) and back."""

from __future__ import annotations

import datetime
import pickle
import socket

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

# Idle workers wait in a broadcast for the next step for as long as the server is idle; a rank that dies
# is noticed at once (its sockets close), so this bounds only a rank that hangs alive.
IDLE_TIMEOUT = datetime.timedelta(days=7)
# building a group waits for every member: bounded, then the group's waits get IDLE_TIMEOUT
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)
_OBJECT_TAG = 7


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GlooGroup:
    """One gloo process group: `size` ranks that share `prefix` in the store."""

    def __init__(self, store: Store, prefix: str, rank: int, size: int, timeout=RENDEZVOUS_TIMEOUT):
        self.rank, self.size = rank, size
        self.pg = ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timeout)
        self.pg.set_timeout(IDLE_TIMEOUT)
        self.shm = None  # a ShmAllReduce, for ranks on one host (use_shared_memory)

    def use_shared_memory(self, store: Store, name: str, max_elems: int) -> None:
        from pagellm.distributed.shm_allreduce import ShmAllReduce

        self.shm = ShmAllReduce(store, name, self.rank, self.size, max_elems, self.gloo_all_reduce)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place: through shared memory where set up, else gloo."""
        return self.gloo_all_reduce(t) if self.shm is None else self.shm.all_reduce(t)

    def gloo_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            buf = t if t.is_contiguous() else t.contiguous()
            self.pg.allreduce([buf]).wait()
            if buf is not t:
                t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (all the same shape), in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return out

    # ---- objects (the engine's step messages and the workers' results) ---------------------------
    def broadcast_object(self, obj, root: int = 0):
        """Root sends `obj`, every other rank receives and returns it (two broadcasts: length, bytes)."""
        if self.rank == root:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            self.pg.broadcast(torch.tensor([data.numel()], dtype=torch.int64), root).wait()
            self.pg.broadcast(data, root).wait()
            return obj
        n = torch.empty(1, dtype=torch.int64)
        self.pg.broadcast(n, root).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        self.pg.broadcast(data, root).wait()
        return pickle.loads(data.numpy().tobytes())

    def send_object(self, obj, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, _OBJECT_TAG).wait()
        self.pg.send([data], dst, _OBJECT_TAG).wait()

    def recv_object(self, src: int):
        n = torch.empty(1, dtype=torch.int64)
        self.pg.recv([n], src, _OBJECT_TAG).wait()
        data = torch.empty(int(n), dtype=torch.uint8)
        self.pg.recv([data], src, _OBJECT_TAG).wait()
        return pickle.loads(data.numpy().tobytes())


class PipelineLink:
    """A pipeline stage's neighbours: hidden states (and the residual stream) go to the next stage and come
    from the previous one, in `micro_batches` pieces per step so that stages overlap."""

    def __init__(self, group: GlooGroup, micro_batches: int = 2):
        self.group = group
        self.stage, self.num_stages = group.rank, group.size
        self.micro_batches = micro_batches

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def send_hidden(self, t: torch.Tensor):
        """Asynchronous: the returned work must be waited on (and t kept) before t is reused."""
        return self.group.pg.send([t.contiguous()], self.stage + 1, 0)

    def recv_hidden(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(2, rows, hidden, dtype=dtype)
        self.group.pg.recv([buf], self.stage - 1, 0).wait()
        return buf
