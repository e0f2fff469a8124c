"""Many-row products on q4_1 weights of SmolLM2's shapes: the float32 path (dequantized slices + numpy's
OpenBLAS, what `--dtype float32` runs above 20 rows) against torch's bfloat16 GEMM on a bf16 copy (what
`--dtype auto` runs on a CPU with AVX-512 BF16 / AMX), the bf16 copy plain and reordered once into oneDNN's
blocked layout (what `--dtype auto` keeps: bit-equal products), and int8 x int8 -> int32 (torch._int_mm, VNNI:
what W8A8 products would run at; `benchmarks/int8_gemm_quality.py` says why they are not used). Milliseconds
per product, mean of 5 after a warm-up.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_bf16_gemm.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagellm.kernels import blas
from pagellm.quant.formats import FORMATS, pack_gguf_blocks


def random_q4_1(n: int, k: int, rng: np.random.Generator):
    b = rng.integers(0, 256, size=(n * k // 32, FORMATS["q4_1"]), dtype=np.uint8)
    b[:, 0:2] = np.float16(rng.uniform(0.001, 0.1, size=(len(b), 1))).view(np.uint8)
    b[:, 2:4] = np.float16(rng.uniform(-0.5, 0.1, size=(len(b), 1))).view(np.uint8)
    return pack_gguf_blocks("q4_1", b, (n, k))


def ms(fn, reps: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    print("cpu capability:", torch.backends.cpu.get_cpu_capability(), "| threads:", torch.get_num_threads())
    for n, k in [(3072, 576), (576, 1536), (960, 576), (49152, 576)]:  # gate_up, down, qkv, LM head
        w = random_q4_1(n, k, rng)
        w_bf16 = w.dequantize().to(torch.bfloat16).contiguous()
        w_packed = torch.ops.mkldnn._reorder_linear_weight(w_bf16, 64)
        for m in (8, 64, 512):
            x = torch.randn(m, k)
            f32 = ms(lambda x=x, w=w: blas.packed_matmul(x, w))
            bf16 = ms(lambda x=x, w_bf16=w_bf16: torch.mm(x.to(torch.bfloat16), w_bf16.t()).float())
            pk = ms(lambda x=x, p=w_packed: torch.ops.mkldnn._linear_pointwise(
                x.to(torch.bfloat16), p, None, "none", [], "").float())
            xi = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            wi = torch.randint(-127, 128, (k, n), dtype=torch.int8)
            i8 = ms(lambda xi=xi, wi=wi: torch._int_mm(xi, wi))
            print(f"N={n} K={k} M={m}: float32 {f32:.2f} ms, bfloat16 {bf16:.2f} ms -> {f32 / bf16:.2f}x; "
                  f"bf16 prepacked {pk:.2f} ms -> {bf16 / pk:.2f}x of plain bf16; int8 {i8:.2f} ms -> "
                  f"{bf16 / i8:.2f}x of plain bf16")


if __name__ == "__main__":
    main()
