"""Prefill attention alone, SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64), 2 threads: torch SDPA with
the explicit causal mask, with is_causal (whole prompts only), both in bf16, and the bf16 kernel
(`ops.prefill_attention_bf16`, float16 paged cache; only where the build has it) on vdpbf16ps and, where they
run, on AMX tiles, plus the kernel's repacking alone (8 query rows over 2,048 keys). Then the backend's
long-chunk paths as the engine runs them over a paged float16 cache with scattered blocks
(`CpuPagedAttention._long_requests`): "path sdpa" (gather, cast to bf16, SDPA: the platform's choice on an AMX
CPU without the tile kernel), "path kernel" and "path float32". Milliseconds, median of 7; chunks of nq new rows
after seq_len - nq cached.

    .venv/bin/python benchmarks/microbench_prefill_attention.py

--kernel-min: only the vdpbf16ps kernel over whole prompts of 128, 272, 512 and 2,048 tokens (float16 cache, blocks
in order), the minimum of 40 runs (12 at 2,048): for A/B runs of a kernel change, builds in turn, where the
medians above move with the machine (the twenty-third session's figures in benchmarks/NOTES.md).

Run it alone: the machine has 2 cores.
"""

import sys
import time

import torch
import torch.nn.functional as F
from timing import median_ms as _median_ms

from pagellm.kernels import ops
from pagellm.model.attention.base import AttentionMetadata
from pagellm.model.attention.cpu_paged import CpuPagedAttention

H, KV, D, BS = 9, 3, 64, 16


def median_ms(fn) -> float:
    return _median_ms(fn, warmup=1)


def shape_row(nq: int, seq_len: int, kernel: bool) -> dict[str, float]:
    q = torch.randn(1, H, nq, D)
    k, v = torch.randn(1, KV, seq_len, D), torch.randn(1, KV, seq_len, D)
    mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - nq, seq_len).unsqueeze(1)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sdpa = F.scaled_dot_product_attention
    row = {"SDPA mask": median_ms(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)),
           "bf16 SDPA mask": median_ms(lambda: sdpa(qb, kb, vb, attn_mask=mask, enable_gqa=True))}
    if nq == seq_len:
        row["SDPA is_causal"] = median_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
        row["bf16 SDPA is_causal"] = median_ms(lambda: sdpa(qb, kb, vb, is_causal=True, enable_gqa=True))
    if kernel:
        blocks = -(-seq_len // BS)
        cache = torch.randn(2, blocks, BS, KV, D).half()
        table = torch.arange(blocks, dtype=torch.int64)
        qk = q[0].transpose(0, 1).contiguous()
        row["bf16 kernel vdpbf16ps"] = median_ms(
            lambda: ops.prefill_attention_bf16(qk, cache, table, seq_len, D ** -0.5, tiles=False))
        if ops.has_amx_prefill_attention():
            row["bf16 kernel AMX"] = median_ms(lambda: ops.prefill_attention_bf16(qk, cache, table, seq_len, D ** -0.5))
    row.update(backend_paths(q[0].transpose(0, 1).contiguous(), seq_len, kernel))
    return row


def backend_paths(q: torch.Tensor, seq_len: int, kernel: bool) -> dict[str, float]:
    """q: [nq, H, D]; the request's blocks lie in random order in a cache with room for others."""
    blocks = -(-seq_len // BS)
    cache = torch.randn(2, 2 * blocks, BS, KV, D).half()
    table = torch.randperm(2 * blocks)[:blocks].unsqueeze(0)
    meta = AttentionMetadata(slot_mapping=None, block_tables=table, query_start_loc=[0, q.shape[0]],
                             seq_lens=[seq_len], block_size=BS)
    modes = ["sdpa", "kernel", None] if kernel else ["sdpa", None]
    return {f"path {mode or 'float32'}": median_ms(
        lambda m=mode: CpuPagedAttention(m)._long_requests(q, cache, meta, D ** -0.5, [0])) for mode in modes}


def kernel_min() -> None:
    out = []
    for seq_len in (128, 272, 512, 2048):
        blocks = -(-seq_len // BS)
        cache = torch.randn(2, blocks, BS, KV, D).half()
        table = torch.arange(blocks, dtype=torch.int64)
        q = torch.randn(seq_len, H, D)
        run = lambda: ops.prefill_attention_bf16(q, cache, table, seq_len, D ** -0.5, tiles=False)  # noqa: B023, E731
        run()
        times = []
        for _ in range(40 if seq_len < 1024 else 12):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out.append(f"{seq_len} x {seq_len}: min {min(times) * 1e3:.3f} ms")
    print(" | ".join(out))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    if "--kernel-min" in sys.argv:
        if not ops.has_bf16_prefill_attention():
            sys.exit("this build has no bf16 prefill attention kernel")
        kernel_min()
        return
    kernel = ops.has_bf16_prefill_attention()
    for nq, seq_len in [(128, 128), (512, 512), (512, 2048), (2048, 2048), (8, 2048)]:
        row = shape_row(nq, seq_len, kernel)
        print(f"{nq} rows at {seq_len} keys: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in row.items()))


if __name__ == "__main__":
    main()
