"""One decode step's 121 products (30 SmolLM2-135M layers' qkv, o, gate_up, down in q4_1, and the q8_0 LM head;
distinct random weights, so they stream from memory as in a real step) at M rows, best of 5, milliseconds:
the natural-order two-plane int8 kernel (ops.packed_linear), the tile-order one on VNNI (two planes, and one:
llama.cpp's scheme) and on AMX-INT8 tiles (kernels/int8_tiles.py, the same bits), the AMX bf16 product
(kernels/amx.py), its vdpbf16ps twin for CPUs without AMX, and the float32 product on dequantized slices
(kernels/blas.py); with --onednn, also oneDNN's bf16 product on prepacked bf16 copies (what auto runs for
many rows where the CPU has AVX-512 BF16). The figures in
quant_linear_int8_tiles.cpp and benchmarks/NOTES.md (sixteenth session) come from:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_int8_tiles.py 1 4 5 8 16 64
"""

from __future__ import annotations

import sys
import time

import torch

from pagellm.kernels import amx, blas, int8_tiles, ops
from pagellm.quant.formats import PackedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def random_weight(kind: str, n: int, k: int, g: torch.Generator) -> PackedWeight:
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    if kind == "q8_0":
        return PackedWeight(kind, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d, None)
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return PackedWeight(kind, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, m)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    weights = [random_weight("q4_1", n, k, g) for _ in range(30) for n, k in SHAPES]
    weights.append(random_weight("q8_0", 49152, 576, g))
    tiles = [int8_tiles.pack(w) for w in weights]
    blocks = [amx.pack(w) for w in weights] if amx.amx_ready() else None
    paths = {"natural order": lambda x, i: ops.packed_linear(x, weights[i], ops.INT8_FINE),
             "tiles, VNNI": lambda x, i: int8_tiles.linear(x, tiles[i], 2, "vnni"),
             "tiles, VNNI, one plane": lambda x, i: int8_tiles.linear(x, tiles[i], 1, "vnni")}
    if int8_tiles.amx_ready():
        paths["tiles, AMX-INT8"] = lambda x, i: int8_tiles.linear(x, tiles[i], 2, "tiles")
    if blocks:
        paths["AMX bf16"] = lambda x, i: amx.linear(x, blocks[i])
    # what float32 runs past the few-row kernels (and auto did on AVX-512 without BF16)
    if blas.packed_matmul(torch.zeros(1, weights[0].in_features), weights[0]) is not None:
        paths["float32 OpenBLAS"] = lambda x, i: blas.packed_matmul(x, weights[i])
    if amx.bf16dp_ready():  # what auto runs for 13-64 rows on an AVX-512 BF16 CPU without AMX (Zen 4 / Zen 5)
        bf16_blocks = blocks or [amx.pack(w) for w in weights]
        paths["vdpbf16ps"] = lambda x, i: amx.linear(x, bf16_blocks[i], tiles=False)
    if "--onednn" in sys.argv:  # what auto runs past amx_max_rows: oneDNN's bf16 product on prepacked bf16 copies
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w.dequantize().bfloat16(), 64) for w in weights]
        paths["oneDNN bf16"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x.bfloat16(), reordered[i], None, "none", [], "").float()
    print("rows | " + " | ".join(paths))
    for rows in [int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 4, 5, 8, 16]:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        times = []
        for f in paths.values():
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    f(xs[w.in_features], i)
                best = min(best, time.perf_counter() - t0)
            times.append(f"{best * 1e3:.2f}")
        print(f"{rows} | " + " | ".join(times), flush=True)


if __name__ == "__main__":
    main()
