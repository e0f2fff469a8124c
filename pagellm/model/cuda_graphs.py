"""Decode steps as CUDA graphs: one captured forward per padded batch size, replayed on persistent buffers.

A decode step (one new token per request) of a small model on a big GPU is launch-bound: a few hundred
kernels of microseconds each, and Python between them. A CUDA graph records those launches once and
replays them with one call. A graph replays fixed addresses and shapes, so:

- every input lives in a persistent buffer sized for the largest batch (input ids, positions, slot
  mapping, block tables as wide as max_model_len needs, seq_lens and query_start_loc as int32 tensors
  for the attention backend's `*_t` fields, row_seq); a step copies its values in and replays;
- batch sizes are padded up to the next captured size (the platform's `decode_graph_sizes`: 1, 2, 4, ...,
  max_num_seqs). Padding rows read token 0 at position 0, attend to one key and write their K and V to a
  dummy block: one physical block past the KV cache manager's `num_blocks` (the runner allocates it), which
  no block table ever holds, so they never touch a request's KV. Their outputs are dropped;
- the Python lists in the metadata (`seq_lens`, `query_start_loc`) are frozen at capture, so only backends
  that read the tensors get graphs (`GRAPH_SAFE_BACKENDS` in pagellm/platforms/cuda.py). The frozen
  `seq_lens` list is max_model_len for every row: a backend may use it as an upper bound, never as a length.

The same object runs without graphs ("eager replay": `capture=False`): each step fills the same buffers
and runs the model's forward on the padded batch eagerly, with the lists filled in. On the CPU that is how
the buffer and padding logic is tested against the plain forward (tests/test_cuda_graphs.py); it is not a
stand-in for CUDA, which only tests/test_cuda.py on a GPU exercises.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pagellm.model.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger("pagellm")

# Optional tensor twins of the metadata's lists, read by the Triton backend (and needed under a graph).
_TENSOR_FIELDS = {f.name for f in dataclasses.fields(AttentionMetadata)} & {"seq_lens_t", "query_start_loc_t"}


def length_tensors(query_start_loc, seq_lens) -> dict:
    """AttentionMetadata's int32 `query_start_loc_t` / `seq_lens_t` keyword arguments, as far as it has them."""
    return {k: v for k, v in (("query_start_loc_t", query_start_loc), ("seq_lens_t", seq_lens))
            if k in _TENSOR_FIELDS}


def capture_graph(fn, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Records fn()'s kernels as a graph; its output tensor is overwritten by every replay. Graphs share one
    memory pool (captured largest first, the smaller ones reuse its blocks: only one runs at a time)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphRunner:
    """The runner's compiled decoder on a GPU (`serves` / `forward`, as the CPU's NativeDecoder)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, max_model_len: int, sizes: tuple[int, ...], dummy_block: int,
                 device: torch.device, capture: bool = True):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.max_model_len = block_size, max_model_len
        self.sizes = tuple(sorted(set(sizes)))
        self.max_rows = n = self.sizes[-1]
        self.dummy_block, self.dummy_slot = dummy_block, dummy_block * block_size
        self.sliding_window = model.config.sliding_window
        max_blocks = -(-max_model_len // block_size)

        def buffer(value, shape, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=device)

        # Buffers start as padding: what the capture and the warm-up runs read (so they write only the dummy block).
        self.input_ids = buffer(0, (n,))
        self.positions = buffer(0, (n,))
        self.slot_mapping = buffer(self.dummy_slot, (n,))
        self.block_tables = buffer(dummy_block, (n, max_blocks))
        self.seq_lens_t = buffer(1, (n,), torch.int32)
        # One row per request in every decode step: request i's row is i, whatever the batch.
        self.query_start_loc_t = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.row_seq = torch.arange(n, dtype=torch.int64, device=device)
        self.metas = {b: self._meta(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _meta(self, b: int, seq_lens: list[int] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            query_start_loc=list(range(b + 1)), seq_lens=seq_lens or [self.max_model_len] * b,
            block_size=self.block_size, sliding_window=self.sliding_window, row_seq=self.row_seq[:b],
            positions=self.positions[:b], **length_tensors(self.query_start_loc_t[:b + 1], self.seq_lens_t[:b]))

    @property
    def label(self) -> str:
        """For the engine's start-up line."""
        how = "CUDA graphs" if self.graphs else "graph runner in eager replay"
        return f"{how} for decode steps (batch sizes {', '.join(map(str, self.sizes))})"

    def serves(self, num_rows: int, query_start_loc: list[int]) -> bool:
        """Decode steps only: one new row per request (each request has at least one, so rows == requests),
        at most the largest captured batch. Prefill chunks and draft verification run eagerly."""
        return num_rows <= self.max_rows and num_rows == len(query_start_loc) - 1

    def padded_size(self, num_rows: int) -> int:
        return next(b for b in self.sizes if b >= num_rows)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of the step's n rows. A copy: every replay overwrites the graph's
        output buffer, and a caller may keep hidden states past the next step (embeddings pool them)."""
        n = input_ids.shape[0]
        b = self.padded_size(n)
        self._load(n, b, input_ids, positions, meta)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n].clone()
        # eager replay: the same buffers and padded batch, lists filled in for backends that read them
        return self._run(b, self._meta(b, meta.seq_lens + [1] * (b - n)))[:n]

    def _load(self, n: int, b: int, input_ids, positions, meta: AttentionMetadata) -> None:
        """Device-to-device copies of the step's inputs into rows :n, padding into rows n:b. Rows past b keep
        whatever they held: this step's graph does not read them."""
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()  # as the runner pads its tables
        self.seq_lens_t[:n].copy_(positions).add_(1)  # a decode row at position p attends to p + 1 keys
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(self.dummy_slot)
            self.block_tables[n:b].fill_(self.dummy_block)
            self.seq_lens_t[n:b].fill_(1)

    def _run(self, b: int, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta or self.metas[b],
                          self.backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved()
        for b in reversed(self.sizes):
            # Warm-up outside the graph: cuBLAS handles, Triton compilation and autotuning, allocator blocks.
            for _ in range(2):
                self._run(b)
            torch.cuda.synchronize()
            self.graphs[b], self.outputs[b] = capture_graph(lambda b=b: self._run(b), pool)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode steps (batch sizes %s) in %.1f s, %.0f MiB",
                    len(self.graphs), ", ".join(map(str, self.sizes)), time.perf_counter() - t0,
                    (torch.cuda.memory_reserved() - before) / 2**20)
