"""Few-row products on q4_1 weights of SmolLM2's shapes: the packed kernels (float32 and int8 activations)
against torch's bfloat16 GEMM on a bf16 copy, 1-20 rows, one thread, CPU milliseconds per product (best of
three rounds of ten). Where bf16 wins is the platform's few-row limit under `--dtype auto`
(`pagellm/platforms/cpu.py`, BF16_PACKED_MAX_ROWS).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_few_rows.py
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from pagellm.kernels import ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from microbench_bf16_gemm import random_q4_1  # noqa: E402


def cpu_ms(fn, reps: int = 10) -> float:
    """CPU time of this thread (robust to other processes on a shared 2-core VM), best of three rounds."""
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t) / reps * 1e3)
    return best


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("cpu capability:", torch.backends.cpu.get_cpu_capability())
    for n, k in [(3072, 576), (576, 1536), (960, 576), (49152, 576)]:  # gate_up, down, qkv, LM head
        w = random_q4_1(n, k, rng)
        w_bf16 = w.dequantize().to(torch.bfloat16).contiguous()
        for m in (1, 2, 3, 4, 6, 8, 12, 16, 20):
            x = torch.randn(m, k)
            f32 = cpu_ms(lambda x=x, w=w: ops.packed_linear(x, w, False))
            i8 = cpu_ms(lambda x=x, w=w: ops.packed_linear(x, w, True))
            bf16 = cpu_ms(lambda x=x, w=w_bf16: torch.mm(x.to(torch.bfloat16), w.t()).float())
            print(f"N={n} K={k} M={m}: packed float32 {f32:.3f}, packed int8 act {i8:.3f}, bf16 GEMM {bf16:.3f} ms")


if __name__ == "__main__":
    main()
