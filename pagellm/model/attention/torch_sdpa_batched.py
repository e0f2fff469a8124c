"""Batched paged attention in plain PyTorch (torch SDPA): every decode row of the step in one SDPA call.

Decode (one query per request) dominates a continuous-batching step, so those rows are gathered
into a padded [B, max_len] view of their blocks and attended in a single call, with a key-padding
mask. Prefill chunks (several queries per request) go through the reference path one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.model.attention.base import AttentionBackend, AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention
from pagellm.quant.kv_cache import dequantize_rows


class TorchSdpaBatchedAttention(AttentionBackend):
    name = "torch_sdpa_batched"

    def __init__(self):
        self._reference = TorchSdpaReferenceAttention()

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        starts = meta.query_start_loc
        decode = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        if meta.sliding_window is not None or len(decode) < 2:
            return self._reference.attend(q, kv_cache, meta, scale, range(meta.num_reqs))
        out = self._decode(q, kv_cache, meta, scale, decode)
        if len(decode) < meta.num_reqs:
            prefill = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] != 1]
            ref = self._reference.attend(q, kv_cache, meta, scale, prefill)
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in prefill]).to(q.device)
            out.index_copy_(0, rows, ref.index_select(0, rows))
        return out

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float, decode: list[int]):
        bs = meta.block_size
        num_kv, width = kv_cache.shape[3], kv_cache.shape[4]
        idx = torch.tensor(decode, device=q.device)
        lens = torch.tensor([meta.seq_lens[i] for i in decode], device=q.device)
        max_blocks = -(-int(lens.max()) // bs)
        tables = meta.block_tables.index_select(0, idx)[:, :max_blocks]
        # [2, B, max_blocks, bs, KV, W] -> [2, B, KV, max_len, D] in q's dtype (int8 / fp8 dequantized)
        kv = dequantize_rows(kv_cache[:, tables].reshape(2, len(decode), max_blocks * bs, num_kv, width),
                             q.dtype).transpose(2, 3)
        mask = torch.arange(max_blocks * bs, device=q.device).unsqueeze(0) < lens.unsqueeze(1)
        rows = torch.tensor([meta.query_start_loc[i] for i in decode], device=q.device)
        qd = q.index_select(0, rows).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kv[0], kv[1],
                                           attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out = torch.empty_like(q)
        out.index_copy_(0, rows, o.squeeze(2))
        return out
