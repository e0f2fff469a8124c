"""The native ops that take a bf16 product's output as is under --dtype auto, against casting it first:
`rope_bf16` (qkv cast and rotated in one pass) and `add_bf16_rmsnorm` (o_proj/down_proj summed into the
residual), SmolLM2's widths, medians of 200 interleaved calls in microseconds. Run it alone (2 threads).

    .venv/bin/python benchmarks/microbench_bf16_fusions.py
"""

import statistics
import time

import torch

from pagellm.kernels import ops
from pagellm.model.layers.rotary import RotaryEmbedding


def row(m: int, rot: RotaryEmbedding) -> str:
    qkv, pos = torch.randn(m, 960).bfloat16(), torch.randint(0, 4000, (m,))
    x, res, w = torch.randn(m, 576).bfloat16(), torch.randn(m, 576), torch.randn(576)
    calls = {"cast + rope_": lambda: ops.rope_(qkv.float(), 12, 64, rot.cos, rot.sin, pos),
             "rope_bf16": lambda: ops.rope_bf16(qkv, 12, 64, rot.cos, rot.sin, pos),
             "cast + add_rmsnorm": lambda: ops.add_rmsnorm(x.float(), res, w, 1e-5),
             "add_bf16_rmsnorm": lambda: ops.add_bf16_rmsnorm(x, res, w, 1e-5)}
    times = {k: [] for k in calls}
    for _ in range(200):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return f"{m} rows: " + ", ".join(f"{k} {1e6 * statistics.median(v):.1f} us" for k, v in times.items())


def main() -> None:
    rot = RotaryEmbedding(64, 4096, 10000.0)
    for m in (64, 512, 2048):
        print(row(m, rot))


if __name__ == "__main__":
    main()
