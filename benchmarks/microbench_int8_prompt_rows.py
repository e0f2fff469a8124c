"""A prompt step's 120 q4_1 layer products of SmolLM2 at ROWS rows (default 2048 512 64): one-plane int8 over the int8
tile order (int8_tiles.linear; on an AVX2 build cpu/quant_linear_int8_avx2.cpp, on AVX-512 VNNI the wide kernel)
against OpenBLAS's sgemm over dequantized slices (blas.packed_matmul, what float32 prompt rows take), best and median
of 4, milliseconds, and the int8 products' relative error against the float ones. The forty-first session's AVX2
figures in benchmarks/NOTES.md come from

    PAGELLM_CPU_ISA=avx2 OPENBLAS_CORETYPE=Haswell env -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/microbench_int8_prompt_rows.py 2048 512 64
"""

import statistics
import sys
import time

import torch

from pagellm import LLM
from pagellm.kernels import blas, int8_tiles, ops


def main() -> None:
    model = LLM(None, dtype="float32").engine.model
    layers = [m for n, m in model.named_modules()
              if getattr(m, "packed", None) is not None and "layers." in n and m.packed.kind == "q4_1"]
    tiles = {id(m): int8_tiles.pack(m.packed) for m in layers}
    for rows in [int(a) for a in sys.argv[1:]] or (2048, 512, 64):
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        int8 = int8_tiles.linear(xs[layers[0].in_features], tiles[id(layers[0])], ops.INT8)
        ref = blas.packed_matmul(xs[layers[0].in_features], layers[0].packed)
        print(f"{rows} rows: int8 relative error {((int8 - ref).norm() / ref.norm()).item():.4f}", flush=True)
        paths = {"int8": lambda m, xs=xs: int8_tiles.linear(xs[m.in_features], tiles[id(m)], ops.INT8),
                 "OpenBLAS": lambda m, xs=xs: blas.packed_matmul(xs[m.in_features], m.packed)}
        times = {name: [] for name in paths}
        for _ in range(4):
            for name, fn in paths.items():  # alternating: a noisy minute hits both
                t = time.perf_counter()
                for m in layers:
                    fn(m)
                times[name].append((time.perf_counter() - t) * 1e3)
        for name, ms in times.items():
            print(f"{rows} rows {name}: {min(ms):.1f} ms (median {statistics.median(ms):.1f})", flush=True)


if __name__ == "__main__":
    main()
