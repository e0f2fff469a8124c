"""Swap preemption's block copies between the device KV cache and host memory.

`HostSwap` is the CPU's (and the reference): one host tensor [layers, 2, host_blocks, block_size, kv_heads,
W], gathered and scattered with index ops, synchronously.

`PinnedSwap` is a GPU's: host blocks in pinned memory laid out [host_blocks, layers, 2, block_size, kv_heads,
W], so one block of every layer is one contiguous run and each block moves with one DMA copy
(`non_blocking`), on a side stream, while the compute stream runs. Ordering:
- the side stream first waits for the compute stream (the blocks to swap out were written by earlier
  forwards; the blocks swapped into were last read by them);
- swap out gathers the blocks on the device (a staging tensor), then copies each to its host block. The
  blocks it read may be handed to another request in this very step, so the forward waits for the gather
  (an event), not for the copies to the host, which overlap with the forward;
- swap in copies each host block to a device staging tensor, then scatters it into every layer's cache; the
  forward waits for that (an event) before it reads the KV;
- a swap in of a block swapped out earlier runs after that swap out's copies: one stream, in order.
Every staging tensor is allocated and used on the side stream only, so the caching allocator never hands
its memory to the compute stream while a copy still reads it. With `stream=None` (the CPU, in tests) the
same code runs synchronously on the current stream.
"""

from __future__ import annotations

import contextlib

import torch


class HostSwap:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int, allocate):
        self.kv_caches = kv_caches
        shape = kv_caches[0].shape
        self.host_cache = allocate((len(kv_caches), 2, num_host_blocks, *shape[2:]), kv_caches[0].dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        dev, host = (torch.tensor(x) for x in zip(*pairs, strict=True))
        device = self.kv_caches[0].device
        for layer, cache in enumerate(self.kv_caches):
            self.host_cache[layer][:, host] = cache[:, dev.to(device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        host, dev = (torch.tensor(x) for x in zip(*pairs, strict=True))
        device = self.kv_caches[0].device
        dev = dev.to(device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, dev] = self.host_cache[layer][:, host].to(device, non_blocking=True)

    def wait(self) -> None:
        """The compute stream waits for what the forward depends on (nothing: the copies were synchronous)."""


class PinnedSwap:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int, allocate,
                 stream: torch.cuda.Stream | None = None):
        self.kv_caches = kv_caches
        shape = kv_caches[0].shape
        self.host_cache = allocate((num_host_blocks, len(kv_caches), 2, *shape[2:]), kv_caches[0].dtype)
        self.stream = stream
        self._events: list = []

    def _on_side_stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def _done(self) -> None:
        """Marks the side stream's work so far as what the next forward must wait for."""
        if self.stream is not None:
            self._events.append(self.stream.record_event())

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        device = self.kv_caches[0].device
        with self._on_side_stream():
            dev = torch.tensor([d for d, _ in pairs]).to(device, non_blocking=True)
            # [blocks, layers, 2, block_size, kv_heads, W]: one contiguous host block per row
            staged = torch.stack([cache[:, dev].transpose(0, 1) for cache in self.kv_caches], dim=1)
            self._done()  # the gather is all the forward waits for
            for i, (_, h) in enumerate(pairs):
                self.host_cache[h].copy_(staged[i], non_blocking=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        device = self.kv_caches[0].device
        with self._on_side_stream():
            staged = torch.empty((len(pairs), *self.host_cache.shape[1:]), dtype=self.host_cache.dtype,
                                 device=device)
            for i, (h, _) in enumerate(pairs):
                staged[i].copy_(self.host_cache[h], non_blocking=True)
            dev = torch.tensor([d for _, d in pairs]).to(device, non_blocking=True)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, dev] = staged[:, layer].transpose(0, 1)
            self._done()

    def wait(self) -> None:
        current = torch.cuda.current_stream(self.stream.device) if self.stream is not None else None
        for event in self._events:
            current.wait_event(event)
        self._events.clear()
