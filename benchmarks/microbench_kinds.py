"""Few-row packed matmuls per PackedWeight kind (and the GGUF types held as it) on SmolLM2-135M's shapes:
1 and 4 rows, float32 activations and, where a kind has them, int8 ones (llama.cpp's one plane, and the
two-plane INT8_FINE that `--dtype auto` chooses on AVX-512 VNNI CPUs).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/microbench_kinds.py [--repeats 7] [--rows 1 4]
        [--kinds q4_1 ...]

Per kind, the 30 layers' fused q/k/v [960, 576], o [576, 576], gate/up [3072, 576] and down [576, 1536]
products of one decode step, as random valid blocks (weights stream from memory as in decode: ~30 layers
of distinct matrices); milliseconds per step (median of the repeats). Kinds are interleaved within each
repeat so drifts in machine load hit every kind alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagellm.kernels import ops
from pagellm.quant.formats import KINDS, NIBBLE_KINDS, PackedWeight, group_size

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
# The GGUF types held as each kind. SmolLM2's K = 576 is no multiple of 256, so a real file holds no K-quant
# there (llama.cpp falls back to other types): the weights are random valid codes of the kind itself.
TYPES = {"q4_1": "Q4_0 Q4_1 Q4_K", "q8_0": "Q5_0 Q8_0", "q8_1": "Q5_1 Q5_K", "fp8_e4m3": "-",
         "q4_1_16": "Q2_K Q3_K", "q8_0_16": "Q6_K", "q8_1_16": "fused shards of differing types"}


def random_weight(kind: str, n: int, k: int, rng: np.random.Generator) -> PackedWeight:
    """Random codes (fp8: non-NaN patterns), scales 0..0.01, minimums for the kinds that have them."""
    groups = k // group_size(kind)
    d = torch.from_numpy(rng.uniform(0, 0.01, (n, groups)).astype(np.float32))
    m = torch.from_numpy(rng.uniform(-0.1, 0, (n, groups)).astype(np.float32)) \
        if kind in ("q4_1", "q8_1", "q4_1_16", "q8_1_16") else None
    if kind in NIBBLE_KINDS:
        qs = torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    elif kind == "fp8_e4m3":
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3B
        qs = torch.from_numpy(codes)
    else:
        qs = torch.from_numpy(rng.integers(-128, 128, (n, k), dtype=np.int8))
    return PackedWeight(kind, qs, d, m)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows per product (default 1 4)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    kinds, row_counts = args.kinds, args.rows
    weights = {kind: [random_weight(kind, n, k, rng) for _ in range(30) for n, k in SHAPES] for kind in kinds}
    xs = {(rows, k): torch.randn(rows, k) for rows in row_counts for k in (576, 1536)}
    cases = [(kind, rows, i8) for kind in kinds for rows in row_counts
             for i8 in ((ops.INT8_OFF, ops.INT8, ops.INT8_FINE) if kind in ops.INT8_ACTIVATION_KINDS
                        else (ops.INT8_OFF,))]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for kind, rows, i8 in cases:
            t = time.perf_counter()
            for w in weights[kind]:
                ops.packed_linear(xs[(rows, w.in_features)], w, int8_activations=i8)
            times[(kind, rows, i8)].append(1e3 * (time.perf_counter() - t))
    print(f"threads {torch.get_num_threads()}; ms per decode step's 120 matmuls (median of {args.repeats})")
    modes = ("", ", int8 x", ", two-plane")
    print("| kind (GGUF type) | bytes/weight | " + " | ".join(f"{r} rows{m}" for m in modes for r in row_counts) + " |")
    print("|---|---|" + "---|" * (len(modes) * len(row_counts)))
    for kind in kinds:
        per_weight = sum(w.nbytes for w in weights[kind]) / sum(w.out_features * w.in_features for w in weights[kind])
        cells = [f"{statistics.median(times[(kind, r, i8)]):.2f}" if (kind, r, i8) in times else "-"
                 for i8 in (ops.INT8_OFF, ops.INT8, ops.INT8_FINE) for r in row_counts]
        print(f"| {kind} ({TYPES[kind]}) | {per_weight:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
