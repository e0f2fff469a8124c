"""Packed (GGUF q4_1) few-row matmuls through the native kernels (float32 or int8 activations) vs float32
GEMMs (torch's MKL and pagellm.kernels.blas's OpenBLAS), by row count.

    .venv/bin/python benchmarks/microbench_packed.py

Uses SmolLM2's 30 real q4_1 gate/up matrices (fused, [3072, 576]) so weights stream from memory as in
a decode step; milliseconds for all 30 products (median of 7). This is what sets PACKED_MAX_ROWS.
Run it alone: the machine has 2 cores.
"""

import statistics
import time

import torch

from pagellm.kernels import blas, ops
from pagellm.model.loader import resolve_model_path
from pagellm.model.loader.gguf_loader import dequantize_tensor
from pagellm.model.loader.gguf_reader import GGUFFile
from pagellm.quant.formats import PackedWeight, pack_gguf_blocks


def main() -> None:
    gf = GGUFFile(resolve_model_path(None))
    packed, wts = [], []
    for i in range(30):
        names = [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]
        packed.append(PackedWeight.cat([pack_gguf_blocks("q4_1", gf.raw(n), gf.tensors[n].shape) for n in names]))
        wts.append(torch.cat([dequantize_tensor(gf, n) for n in names]).t().contiguous())
    print(f"threads {torch.get_num_threads()}; float32 weights {sum(w.numel() * 4 for w in wts) / 2**20:.0f} MiB, "
          f"packed {sum(p.nbytes for p in packed) / 2**20:.0f} MiB")
    rows = (1, 4, 8, 12, 16, 20, 24, 32, 48, 64)
    times = {m: ([], [], [], []) for m in rows}
    xs = {m: torch.randn(m, 576) for m in rows}
    for _ in range(7):  # interleaved, so drifts in machine load hit every row count alike
        for m in rows:
            t = time.perf_counter()
            for p in packed:
                ops.packed_linear(xs[m], p)
            times[m][0].append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            for p in packed:
                ops.packed_linear(xs[m], p, int8_activations=True)
            times[m][1].append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            for w in wts:
                xs[m] @ w
            times[m][2].append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            for w in wts:
                blas.matmul(xs[m], w)
            times[m][3].append(1e3 * (time.perf_counter() - t))
    print("| rows | packed q4_1 (ms) | packed q4_1, int8 x (ms) | float32 torch (MKL) | float32 OpenBLAS |")
    print("|---|---|---|---|---|")
    for m, ts in times.items():
        print(f"| {m} | " + " | ".join(f"{statistics.median(t):.1f}" for t in ts) + " |")


if __name__ == "__main__":
    main()
