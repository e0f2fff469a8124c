"""All-reduce through shared memory for tensor-parallel ranks on one host (as vLLM's CPU backend does):
each rank copies its part into its slot, bumps its counter, waits until every rank's counter has reached the
same call, then sums the slots in rank order (so every rank gets the same bits). Two slot sets alternate:
a rank that is one call ahead writes the other set, and cannot be two ahead (it waited for everyone's
previous call). Tensors that are not float32, or bigger than the slots, go through gloo.

The segment is created by tensor rank 0 and unlinked as soon as every rank has mapped it, so nothing is
left in /dev/shm even if a rank is killed later.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np
import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class NoSharedMemory(RuntimeError):
    """Not enough room in SHM_DIR: the caller keeps gloo."""


def has_room(nbytes: int) -> bool:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize >= nbytes * 1.25

_COUNTER_STRIDE = 8  # int64s per rank counter: one 64-byte cache line each
_SPINS_BEFORE_YIELD = 200


class ShmAllReduce:
    def __init__(self, store, name: str, rank: int, size: int, max_elems: int, fallback):
        self.rank, self.size, self.max_elems, self.fallback = rank, size, max_elems, fallback
        counters = size * _COUNTER_STRIDE * 8
        nbytes = counters + 2 * size * max_elems * 4
        # a file in /dev/shm mapped by hand: multiprocessing's SharedMemory would hand it to a resource
        # tracker, which unlinks (or warns about) it at exit in every process that touched it
        if rank == 0:
            path = os.path.join(SHM_DIR, f"pagellm-allreduce-{uuid.uuid4().hex}")
            if not has_room(nbytes):  # a small /dev/shm (containers: 64 MiB) would SIGBUS on first touch
                store.set(f"{name}/segment", "")
                raise NoSharedMemory(f"{SHM_DIR} has no room for {nbytes} bytes")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, nbytes)
            store.set(f"{name}/segment", path)
        else:
            path = store.get(f"{name}/segment").decode()
            if not path:
                raise NoSharedMemory(f"{SHM_DIR} has no room for the all-reduce segment")
            fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(fd, nbytes)
        os.close(fd)
        store.add(f"{name}/mapped", 1)
        if rank == 0:
            self._unlink_when_mapped(store, name, path)
        buf = memoryview(self.map)
        self.counters = np.ndarray((size, _COUNTER_STRIDE), dtype=np.int64, buffer=buf)
        self.slots = torch.frombuffer(buf, dtype=torch.float32, offset=counters,
                                      count=2 * size * max_elems).view(2, size, max_elems)
        self.seq = 0
        self.counters[rank, 0] = 0

    def _unlink_when_mapped(self, store, name: str, path: str) -> None:
        deadline = time.monotonic() + 300
        try:
            while store.add(f"{name}/mapped", 0) < self.size:
                if time.monotonic() > deadline:
                    raise TimeoutError("tensor-parallel ranks did not map the shared all-reduce segment")
                time.sleep(0.01)
        finally:
            os.unlink(path)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        if t.dtype != torch.float32 or n > self.max_elems:
            return self.fallback(t)
        self.seq += 1
        slots = self.slots[self.seq & 1]
        slots[self.rank, :n].copy_(t.reshape(-1))
        self.counters[self.rank, 0] = self.seq
        col, spins = self.counters[:, 0], 0
        while col.min() < self.seq:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:  # more ranks than free cores: let the others run
                os.sched_yield()
        out = slots[0, :n].clone() if self.size > 1 else slots[0, :n]
        for r in range(1, self.size):
            out.add_(slots[r, :n])
        t.copy_(out.view_as(t))
        return t
