"""torch's float32 GEMM (MKL) vs pagellm.kernels.blas (numpy's OpenBLAS, single-threaded inside torch's
OpenMP pool) at the model's matmul shapes, GFLOP/s (median of 7, interleaved).

    .venv/bin/python benchmarks/microbench_blas.py

Do not add a numpy product with its own thread pool to this loop: its spinning threads slow whatever
runs next (benchmarks/NOTES.md). Run it alone: the machine has 2 cores.
"""

import statistics
import time

import torch

from pagellm.kernels import blas

SHAPES = ((576, 3072), (1536, 576), (576, 960), (576, 576))  # (K, N): gate/up, down, qkv, o of SmolLM2


def main() -> None:
    print(f"threads {torch.get_num_threads()}")
    print("| rows | K x N | torch (MKL) GFLOP/s | OpenBLAS in torch's pool GFLOP/s |")
    print("|---|---|---|---|")
    for m in (32, 64, 128, 512, 2048):
        for k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(k, n)
            out = torch.empty(m, n)
            torch.mm(x, w, out=out), blas.matmul(x, w)  # warm-up
            reps = max(1, 4096 // m)
            t_mkl, t_blas = [], []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(reps):
                    torch.mm(x, w, out=out)
                t_mkl.append(time.perf_counter() - t)
                t = time.perf_counter()
                for _ in range(reps):
                    blas.matmul(x, w)
                t_blas.append(time.perf_counter() - t)
            gflop = reps * 2 * m * k * n / 1e9
            mkl, ours = gflop / statistics.median(t_mkl), gflop / statistics.median(t_blas)
            print(f"| {m} | {k} x {n} | {mkl:.0f} | {ours:.0f} |")


if __name__ == "__main__":
    main()
