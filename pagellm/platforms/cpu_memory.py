"""CPU memory: a KV cache resident only as its blocks fill, prefaulting it, and glibc's heap around loading.

The CPU platform (cpu.py) allocates and releases through these; they touch memory only, not the ISA."""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import mmap

import torch

# Freed memory glibc keeps at the top of a heap before it gives it back by itself (see loading()).
TRIM_THRESHOLD = 256 << 20
# Blocks at least this large are mapped for each allocation and unmapped when freed, so every use faults its pages
# in again. glibc's dynamic threshold stops at 32 MiB; float32 logits of 164+ rows (SmolLM2's 49,152 columns) are
# larger: the head at 256 rows on the Xeon VM took 22.2 ms (12,289 faults a call) against 11.4 from the heap
# (benchmarks/big_batch_faults.py 32|128 head).
MMAP_THRESHOLD = 128 << 20


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor backed by anonymous memory that the OS hands out page by page on first write, so a
    KV cache costs resident memory only for the blocks requests have used (torch.zeros writes every byte
    up front: the whole --kv-cache-memory would be resident from the start)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    # private anonymous mapping: reads as zeros, untouched pages cost nothing (a shared one is shmem, whose
    # faults cost more)
    buf = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call
PREFAULT_MAX_SHARE = 0.9  # of MemAvailable a prefaulted KV cache may take (the steps' activations need the rest)


def available_memory() -> int | None:
    """Bytes the OS could hand out now without swapping (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def populate(tensors: list[torch.Tensor], threads: int) -> None:
    """Make every page of these CPU tensors resident now, contents unchanged, on `threads` threads. The OS
    zeroes each page on its first write; inside a step that costs the step, and on a VM whose host has not
    backed the memory yet each first touch is several microseconds (benchmarks/page_touch.py; the offline
    workload's first run on a 2-core Xeon VM +3-8% with its KV cache populated in one hour, nothing the
    next: benchmarks/NOTES.md, eighteenth session). vLLM and llama.cpp write their whole KV cache at start."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes releases the GIL: the threads overlap
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        madvise = None

    def one(t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or (madvise is not None and madvise(t.data_ptr(), nbytes, MADV_POPULATE_WRITE) == 0):
            return
        # an older kernel (EINVAL) or a start inside a page: write one byte of every page back unchanged
        sample = t.view(-1).view(torch.uint8)[::mmap.PAGESIZE]
        sample.copy_(sample.clone())

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(one, tensors))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def mallopt(param: int, nbytes: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(param, nbytes)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
