"""The one interface every attention backend implements, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.quant.kv_cache import write_rows


@dataclass
class AttentionMetadata:
    """Describes a flat, mixed batch: request i owns query rows query_start_loc[i]:query_start_loc[i+1]
    (its new tokens) and attends to seq_lens[i] keys (cached prefix + new tokens)."""

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per new token
    block_tables: torch.Tensor  # [B, max_blocks] int32/int64, padded with 0
    query_start_loc: list[int]  # B + 1 offsets into the T query rows
    seq_lens: list[int]  # B total lengths after this step
    block_size: int
    sliding_window: int | None = None
    row_seq: torch.Tensor | None = None  # [T] int64: the request (row of block_tables) of each query row
    positions: torch.Tensor | None = None  # [T] int64: each query row's position in its sequence
    # [B]: how many of each request's rows are speculative drafts (after its known tokens); None: none are.
    # A backend that picks an attention path by a request's rows counts them out, as the products do
    # (quant.linear_method.path_rows), so verification gives each row the arithmetic plain decoding gives it.
    query_drafts: list[int] | None = None
    # [B]: whether request i's rows are a chunk of a prompt (ModelRunner._prompt_chunk): a backend whose prompt and
    # decode kernels differ gives such rows the prompt kernel at any row count, so a prompt row's arithmetic does
    # not depend on how its prompt was chunked (which differs between plain and speculative runs). None: unmarked.
    query_prompt: list[bool] | None = None
    # query_start_loc and seq_lens as int32 tensors on the device, for kernels that read them there
    # (triton_paged). A CUDA-graph runner fills persistent ones; left None, the backend builds them.
    query_start_loc_t: torch.Tensor | None = None  # [B + 1] int32
    seq_lens_t: torch.Tensor | None = None  # [B] int32

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend:
    """KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, W]: W = head_dim, or head_dim + 2
    for int8 rows with their in-band scale (pagellm/quant/kv_cache.py)."""

    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] (new tokens). Writes k, v into the cache, returns [T, H, D]."""
        raise NotImplementedError

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, dtype: torch.dtype, num_heads: int,
                    num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, keep: torch.Tensor | None = None) -> torch.Tensor:
        """qkv: [T, (H + 2 * KV) * D], the fused projection's output (q, k, v heads side by side in each row);
        rotary: the model's RotaryEmbedding; dtype: the activations' (a bf16 product's qkv is cast to it).
        Rotates q and k, writes k and v into the cache and attends: [T, H, D], or with `keep` (row indices) only
        those rows' outputs, [len(keep), H, D], every row's k and v still written. This is the unfused path, step
        by step; a backend with a kernel that does several steps in one pass overrides it (triton_paged)."""
        # q and k heads sit side by side; a bf16 product's qkv comes back as a rotated float32 copy
        qkv = rotary(positions, qkv, num_heads + num_kv_heads, dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(-1, num_heads, head_dim)
        k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
        if keep is None:
            return self.forward(q, k, v, kv_cache, meta, scale)
        return self.forward_rows(q, k, v, kv_cache, meta, scale, keep)

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, keep: torch.Tensor) -> torch.Tensor:
        """forward's outputs of the rows `keep` only. Here every row attends and the rest are dropped; a backend
        that can attend a subset of rows overrides it (cpu_paged)."""
        return self.forward(q, k, v, kv_cache, meta, scale).index_select(0, keep)

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
        # Float caches store k, v cast to their dtype; int8 / fp8 ones quantize each row (quant/kv_cache.py).
        write_rows(kv_cache[0], slot_mapping, k)
        write_rows(kv_cache[1], slot_mapping, v)
