"""Packed (GGUF q4_1) few-row matmuls through the native kernel vs float32 GEMMs, by row count.

    .venv/bin/python benchmarks/microbench_packed.py

Uses SmolLM2's 30 real q4_1 gate/up matrices (fused, [3072, 576]) so weights stream from memory as in
a decode step; milliseconds for all 30 products (median of 5). This is what sets PACKED_MAX_ROWS.
Run it alone: the machine has 2 cores.
"""

import statistics
import time

import torch

from pagellm.kernels import ops
from pagellm.model.layers.quant import PackedWeight, pack_gguf_blocks
from pagellm.model.loader import resolve_model_path
from pagellm.model.loader.gguf_loader import dequantize_tensor
from pagellm.model.loader.gguf_reader import GGUFFile


def ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    gf = GGUFFile(resolve_model_path(None))
    packed, wts = [], []
    for i in range(30):
        names = [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]
        packed.append(PackedWeight.cat([pack_gguf_blocks("q4_1", gf.raw(n), gf.tensors[n].shape) for n in names]))
        wts.append(torch.cat([dequantize_tensor(gf, n) for n in names]).t().contiguous())
    fp32_bytes = sum(w.numel() * 4 for w in wts)
    print(f"threads {torch.get_num_threads()}; float32 weights {fp32_bytes / 2**20:.0f} MiB, "
          f"packed {sum(p.nbytes for p in packed) / 2**20:.0f} MiB")
    print("| rows | packed q4_1 | float32 x @ W_t | numpy (OpenBLAS) | packed GB/s equiv. |")
    print("|---|---|---|---|---|")
    for m in (1, 2, 4, 7, 8, 12, 16, 32, 64):
        x = torch.randn(m, 576)
        tp = ms(lambda x=x: [ops.packed_linear(x, p) for p in packed])
        tf = ms(lambda x=x: [x @ w for w in wts])
        tn = ms(lambda x=x: [x.numpy() @ w.numpy() for w in wts])
        print(f"| {m} | {tp:.1f} | {tf:.1f} | {tn:.1f} | {fp32_bytes / tp / 1e6:.0f} |")


if __name__ == "__main__":
    main()
