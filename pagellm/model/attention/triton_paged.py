"""Paged attention on CUDA through Triton kernels (pagellm/kernels/triton/): the KV write and one launch of
unified attention for the whole flat batch, prefill chunks and decodes together.

The kernels read query_start_loc and seq_lens as int32 device tensors: `meta.query_start_loc_t` /
`meta.seq_lens_t` when the caller gives them (a CUDA-graph runner keeps persistent ones), else built here
from the lists once per step and kept on `meta` for the other layers. Float caches (float32, float16,
bfloat16) are written by the Triton kernel, fp8 ones by the torch path (quant/kv_cache.py: its clamp and
rounding); attention reads all of them. Int8 rows with an in-band scale are not supported.

The model hands over the qkv projection's output (`forward_qkv`): one kernel rotates q and k in place and
writes k and v into a float cache (rope_write_kv), and attention reads q from qkv, with no torch rotary, no
split copies and no second KV write.
"""

from __future__ import annotations

import torch

from pagellm.kernels.triton import triton_available
from pagellm.model.attention.base import AttentionBackend, AttentionMetadata

# A decode-only batch with fewer (request, KV head) programs than the GPU has SMs splits each one's keys
# (a power of two, at most 16, so that the programs about fill the SMs) when some sequence has this many.
DECODE_SPLIT_MIN_KEYS = 512


class TritonPagedAttention(AttentionBackend):
    name = "triton_paged"

    def __init__(self, kv_dtype: torch.dtype | None = None, decode_splits: int | None = None):
        """decode_splits: key slices for batches of decodes only (flash-decoding); None chooses per step from
        the GPU's SM count and the longest of meta.seq_lens (under a CUDA graph: the lists it was captured
        with, which then hold for every replay; any number of slices gives the same result up to rounding)."""
        if kv_dtype == torch.int8:
            raise ValueError(int8_refusal())
        if not triton_available():
            raise ValueError("attention backend 'triton_paged' needs the triton package (pip install 'pagellm[cuda]')")
        from pagellm.kernels.triton import kv_write, paged_attention

        self._kv_write, self._attention = kv_write, paged_attention
        self.decode_splits = decode_splits
        self._sms: int | None = None

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        self._check(q, kv_cache)
        if kv_cache.dtype in self._kv_write.WRITABLE_DTYPES:
            self._kv_write.write_kv(k, v, kv_cache, meta.slot_mapping)
        else:
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    def forward_qkv(self, qkv, positions, rotary, dtype, num_heads, num_kv_heads, head_dim, kv_cache,
                    meta: AttentionMetadata, scale: float, keep: torch.Tensor | None = None):
        """One kernel rotates q and k in place in qkv and writes k and v into the cache (rope_write_kv), where
        the unfused path runs torch's rotary (a gather, temporaries and several elementwise kernels) and then
        the KV write; attention then reads q from qkv. Where the kernel does not do what that path would (a cast
        first, another rotary, an fp8 cache), the unfused path."""
        if not self._fusable(qkv, rotary, dtype, num_heads, num_kv_heads, head_dim, kv_cache):
            return super().forward_qkv(qkv, positions, rotary, dtype, num_heads, num_kv_heads, head_dim, kv_cache,
                                       meta, scale, keep)
        self._check(qkv, kv_cache)
        self._kv_write.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, kv_cache, meta.slot_mapping, num_heads,
                                     num_kv_heads)
        q = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)  # rows strided by the whole qkv row
        out = self._attend(q, kv_cache, meta, scale)
        return out if keep is None else out.index_select(0, keep)

    def _fusable(self, qkv, rotary, dtype, num_heads, num_kv_heads, head_dim, kv_cache) -> bool:
        """rope_write_kv does what the unfused path does only for qkv already in the activations' dtype (the
        unfused path casts first), a rotate-half rotary over the whole head from cos/sin tables of [positions,
        head_dim] (RotaryEmbedding's, float32 on qkv's device), and a cache it writes (float, not fp8)."""
        cos, sin = getattr(rotary, "cos", None), getattr(rotary, "sin", None)
        return (qkv.dtype == dtype and kv_cache.dtype in self._kv_write.WRITABLE_DTYPES
                and qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
                and qkv.stride(-1) == 1 and kv_cache.shape[-1] == head_dim
                and all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == head_dim
                        and t.dtype == torch.float32 and t.device == qkv.device and t.stride(-1) == 1
                        for t in (cos, sin)))

    def _attend(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        query_start_loc, seq_lens = device_metadata(meta, q.device)
        return self._attention.paged_attention(
            q, kv_cache, meta.block_tables, seq_lens, query_start_loc, scale, meta.sliding_window,
            num_splits=self._splits(q, kv_cache, meta))

    def _check(self, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if kv_cache.dtype == torch.int8:
            raise ValueError(int8_refusal())
        if not q.is_cuda and not self._attention.is_interpreted(self._attention.paged_attention_kernel):
            raise ValueError("attention backend 'triton_paged' runs on CUDA tensors (on the CPU only under Triton's "
                             "interpreter, TRITON_INTERPRET=1, for tests); use --attention-backend auto")
        if (q.is_cuda and kv_cache.dtype == torch.float8_e4m3fn
                and torch.cuda.get_device_capability(q.device) < (8, 9)):
            raise ValueError("Triton reads fp8 e4m3 caches on compute capability 8.9 and later only; use "
                             "--kv-cache-dtype fp8_e5m2 or a 16-bit cache on this GPU")

    def _splits(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        if q.shape[0] != meta.num_reqs:  # a prefill chunk in the batch: its query tiles fill the GPU
            return 1
        if self.decode_splits is not None:
            return self.decode_splits
        if not q.is_cuda or max(meta.seq_lens, default=0) < DECODE_SPLIT_MIN_KEYS:
            return 1
        if self._sms is None:
            self._sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        programs = meta.num_reqs * kv_cache.shape[3]
        splits = 1
        while splits < 16 and programs * splits * 2 <= self._sms:
            splits *= 2
        return splits


def device_metadata(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc, seq_lens) as int32 tensors on the device; built once per step (meta is shared by
    every layer of a step)."""
    if meta.query_start_loc_t is None:
        meta.query_start_loc_t = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
    if meta.seq_lens_t is None:
        meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
    return meta.query_start_loc_t, meta.seq_lens_t


def int8_refusal() -> str:
    return ("attention backend 'triton_paged' does not read int8 KV caches (rows of head_dim + 2 with an in-band "
            "scale); use --kv-cache-dtype fp8, a 16-bit cache, or another attention backend")
