"""What making 1 GiB of anonymous memory resident costs, each way the KV cache could: written page by page
(a shared mapping, i.e. shmem, and a private one), `madvise(MADV_POPULATE_WRITE)` in one call, and page by page
under transparent huge pages (`MADV_HUGEPAGE`). Two rounds: on a VM the first touch of memory the host has not
backed yet costs more than the same touch once it has (the eighteenth session's figures in benchmarks/NOTES.md):

    .venv/bin/python benchmarks/page_touch.py

Linux only (MADV_POPULATE_WRITE needs 5.14+). One thread; run it alone.
"""

import mmap
import time

import torch

from pagellm.platforms.cpu_memory import MADV_POPULATE_WRITE

GIB = 1 << 30


def touch(label: str, flags: int, how: str) -> None:
    buf = mmap.mmap(-1, GIB, flags=flags)
    if how == "huge":
        buf.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    if how == "populate":
        buf.madvise(MADV_POPULATE_WRITE)
    else:
        torch.frombuffer(buf, dtype=torch.uint8)[::mmap.PAGESIZE].fill_(1)
    print(f"{label:<22} {time.perf_counter() - t0:.3f} s per GiB", flush=True)
    buf.close()


def main() -> None:
    torch.set_num_threads(1)
    for _ in range(2):
        touch("shared, page by page", mmap.MAP_SHARED, "touch")
        touch("private, page by page", mmap.MAP_PRIVATE, "touch")
        touch("private, populate", mmap.MAP_PRIVATE, "populate")
        touch("shared, populate", mmap.MAP_SHARED, "populate")
        touch("private, huge pages", mmap.MAP_PRIVATE, "huge")


if __name__ == "__main__":
    main()
