"""A prompt step's 120 one-plane int8 layer products (SmolLM2's q4_1 layers in int8 tile order, the wide kernel
from 48 rows) at 1,000, 1,600 and 2,048 rows: best and median of 5, milliseconds. Build against build (the kernel
cache rebuilds on a source change) to compare kernel versions; the thirty-ninth session's equal-chunk figures in
benchmarks/NOTES.md come from runs of

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_int8_wide_rows.py

alternating with the same at the kernel before it.
"""

import statistics
import time

import torch

from pagellm import LLM
from pagellm.kernels import int8_tiles, ops


def main() -> None:
    model = LLM(None, dtype="auto").engine.model
    layers = [m for n, m in model.named_modules() if getattr(m, "int8_tiles", None) is not None and "layers." in n]
    if not layers:
        raise SystemExit("no int8 tile-order layers here (--dtype auto on a CPU with AVX-512 VNNI)")
    for rows in (1600, 2048, 1000):
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for m in layers:
                int8_tiles.linear(xs[m.in_features], m.int8_tiles, ops.INT8)
            times.append((time.perf_counter() - t) * 1e3)
        print(f"{rows} rows: {min(times):.1f} ms (median {statistics.median(times):.1f})", flush=True)


if __name__ == "__main__":
    main()
