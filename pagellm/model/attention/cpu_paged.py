"""Paged attention through the native CPU kernel: each query row reads its request's KV blocks in
place (no gather into a padded copy), all rows of the step in one call, parallel over rows and heads.

Requests with many new rows (long prefill chunks) go through the reference SDPA path instead: the
kernel scores one query row at a time, which flash attention's blocking beats once rows are many.
"""

from __future__ import annotations

import torch

from pagellm.kernels import ops
from pagellm.model.attention.base import AttentionBackend, AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    max_native_queries = ops.PAGED_ATTENTION_MAX_QUERIES  # new rows per request up to which the kernel serves it

    def __init__(self):
        self._reference = TorchSdpaReferenceAttention()

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        if q.shape[-1] % 8:  # the kernel works in 8-float vectors (the platform chose it for the dtypes)
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        ops.write_kv(k, v, kv_cache, meta.slot_mapping)
        starts = meta.query_start_loc
        long = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] > self.max_native_queries]
        if not long:
            return ops.paged_attention(q, kv_cache, meta.block_tables, meta.row_seq, meta.positions,
                                       meta.sliding_window, scale)
        out = self._reference.attend(q, kv_cache, meta, scale, long)
        short = [r for i in range(meta.num_reqs) if i not in long for r in range(starts[i], starts[i + 1])]
        if short:
            rows = torch.tensor(short)
            o = ops.paged_attention(q.index_select(0, rows), kv_cache, meta.block_tables,
                                    meta.row_seq.index_select(0, rows), meta.positions.index_select(0, rows),
                                    meta.sliding_window, scale)
            out.index_copy_(0, rows, o)
        return out
