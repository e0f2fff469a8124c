"""The native paged-attention kernel alone (SmolLM2's shapes: 9 query heads, 3 KV heads, head_dim 64).

    .venv/bin/python benchmarks/microbench_attention.py

1. Batched decode: 64 rows (one per request) over 300 keys each, float32 vs float16 vs int8 KV cache; then
   the same rows over 30 caches in turn (float16 and int8) (out of the L3 cache, as in an engine step).
2. Verification rows: requests of 1, 2 or 5 rows at consecutive positions over 450 keys (int8, 30 caches in
   turn), against as many one-row requests.
3. int8 KV at longer contexts and few rows (1 x 2,000, 5 x 2,000, 16 x 1,000 keys, in cache).
4. Prefill chunks: the kernel vs the SDPA reference path (`TorchSdpaReferenceAttention.attend`), which is what
   `CpuPagedAttention.max_native_queries` chooses between. Milliseconds, median of 7.
Run it alone: the machine has 2 cores.
"""

from functools import partial

import torch
from timing import median_ms

from pagellm.kernels import ops
from pagellm.model.attention.base import AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention
from pagellm.quant.kv_cache import quantize_rows

BS, KV, H, D = 16, 3, 9, 64


def batched_decode(rows: int = 64, keys: int = 300) -> None:
    per = -(-keys // BS)
    cache = torch.randn(2, rows * per, BS, KV, D)
    table = torch.randperm(rows * per).reshape(rows, per)
    pos, seq, q = torch.full((rows,), keys - 1), torch.arange(rows), torch.randn(rows, H, D)
    for dtype in (torch.float32, torch.float16, torch.int8):
        c = quantize_rows(cache, dtype) if dtype == torch.int8 else cache.to(dtype)
        ms = median_ms(partial(ops.paged_attention, q, c, table, seq, pos, None, 0.125))
        print(f"{rows} decode rows x {keys} keys, {str(dtype).removeprefix('torch.')} KV: {ms:.2f} ms")


def cold_batched_decode(rows: int = 64, keys: int = 300, layers: int = 30, dtype: torch.dtype = torch.float16) -> None:
    """As batched_decode, over `layers` caches in turn (~430 MiB in float16): each call finds its keys in
    memory, not in the L3 cache, as in an engine step. A kernel change that wins above can lose here: on the
    Zen 5 VM, one that loaded each float16 key once for its 3 query heads ran 1.3x faster above and 1.5x
    slower here; on the Xeon VM the grouped kernel now built (attention_grouped.h, accumulators in
    registers) runs 0.82 -> 0.61 ms above and 1.14 -> 1.07 here (benchmarks/NOTES.md, fourteenth session)."""
    per = -(-keys // BS)
    table = torch.randperm(rows * per).reshape(rows, per)
    pos, seq, q = torch.full((rows,), keys - 1), torch.arange(rows), torch.randn(rows, H, D)
    caches = [quantize_rows(torch.randn(2, rows * per, BS, KV, D), dtype) if dtype == torch.int8 else
              torch.randn(2, rows * per, BS, KV, D).to(dtype) for _ in range(layers)]

    def step():
        for c in caches:
            ops.paged_attention(q, c, table, seq, pos, None, 0.125)

    ms = median_ms(step) / layers
    print(f"{rows} decode rows x {keys} keys, {str(dtype).removeprefix('torch.')} KV, {layers} caches in turn: "
          f"{ms:.2f} ms per cache")


def verification_rows(keys: int = 450, layers: int = 30) -> None:
    """Speculative verification steps: each request's next token and its drafts are rows at consecutive positions
    over the same keys (int8 KV, 30 caches in turn); on AVX-512 VNNI builds they walk the keys together
    (attention_spans.h). 16 requests x 5 rows over 450 keys: 0.845 -> 0.590 ms per cache on the Xeon VM
    (benchmarks/NOTES.md, thirty-third session)."""
    for reqs, per_req in ((16, 1), (16, 2), (16, 5), (80, 1), (4, 1), (4, 5)):
        per = -(-keys // BS)
        table = torch.randperm(reqs * per).reshape(reqs, per)
        seq = torch.arange(reqs).repeat_interleave(per_req)
        pos, q = torch.arange(keys - per_req, keys).repeat(reqs), torch.randn(reqs * per_req, H, D)
        caches = [quantize_rows(torch.randn(2, reqs * per, BS, KV, D), torch.int8) for _ in range(layers)]

        def step(caches=caches, table=table, seq=seq, pos=pos, q=q):
            for c in caches:
                ops.paged_attention(q, c, table, seq, pos, None, 0.125)

        print(f"{reqs} requests x {per_req} rows over {keys} keys, int8 KV, {layers} caches in turn: "
              f"{median_ms(step) / layers:.3f} ms per cache")


def long_contexts() -> None:
    for rows, keys in ((1, 2000), (5, 2000), (16, 1000)):
        per = -(-keys // BS)
        table = torch.randperm(rows * per).reshape(rows, per)
        pos, seq, q = torch.full((rows,), keys - 1), torch.arange(rows), torch.randn(rows, H, D)
        c = quantize_rows(torch.randn(2, rows * per, BS, KV, D), torch.int8)
        ms = median_ms(partial(ops.paged_attention, q, c, table, seq, pos, None, 0.125))
        print(f"{rows} rows x {keys} keys, int8 KV: {ms:.3f} ms")


def prefill_chunks() -> None:
    cache = torch.randn(2, 64, BS, KV, D)
    for seq_len, new in ((128, 128), (512, 512), (512, 64), (1000, 200)):
        table = torch.arange(-(-seq_len // BS)).unsqueeze(0)
        pos, seq = torch.arange(seq_len - new, seq_len), torch.zeros(new, dtype=torch.long)
        q = torch.randn(new, H, D)
        meta = AttentionMetadata(seq, table, [0, new], [seq_len], BS, None, seq, pos)
        native = median_ms(partial(ops.paged_attention, q, cache, table, seq, pos, None, 0.125))
        sdpa = median_ms(partial(TorchSdpaReferenceAttention().attend, q, cache, meta, 0.125, [0]))
        print(f"prefill chunk of {new} rows at {seq_len} keys: native {native:.2f} ms, SDPA {sdpa:.2f} ms")


if __name__ == "__main__":
    batched_decode()
    cold_batched_decode()
    cold_batched_decode(dtype=torch.int8)
    verification_rows()
    long_contexts()
    prefill_chunks()
