"""Many-row q4_1 products on AMX tiles (pagellm/kernels/amx.py) against oneDNN's bf16 product on the bf16 copy
(what `--dtype auto` runs otherwise): one decode step's 120 layer products (SmolLM2-135M's shapes, 30 layers of
distinct random weights, so each product finds its weights in memory as in an engine step), then its q8_0 LM
head (49,152 x 576, float32 logits from the tiles, bf16 from oneDNN), 2 threads, milliseconds (median of 7),
at several row counts.

    OMP_NUM_THREADS=2 env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_amx.py \
        [--vdpbf16ps] [--rows 8 16 ...]

Run it alone: the machine has 2 cores. Needs a CPU with AMX-BF16 (pagellm info: "amx-bf16-q4"), or with
--vdpbf16ps one with AVX-512 BF16 ("avx512-bf16-q4": the same blocks on vdpbf16ps, the path CPUs without AMX take).
"""

import argparse

import torch
from timing import median_ms

from pagellm.kernels import amx
from pagellm.quant.formats import PackedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down: [N, K]
LAYERS = 30


def random_q8_0(n: int, k: int) -> PackedWeight:
    return PackedWeight("q8_0", torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 0.002,
                        None)


def random_q4_1(n: int, k: int) -> PackedWeight:
    return PackedWeight("q4_1", torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                        torch.rand(n, k // 32) * 0.02, -torch.rand(n, k // 32) * 0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--vdpbf16ps", action="store_true", help="the AVX-512 BF16 kernel instead of AMX tiles")
    args = ap.parse_args()
    tiles_on = not args.vdpbf16ps
    if tiles_on and not amx.amx_ready():
        raise SystemExit("no AMX tiles here (build path amx-bf16-q4, or the OS refused the tile state)")
    if not tiles_on and not amx.bf16dp_ready():
        raise SystemExit("no AVX-512 BF16 kernel here (build path avx512-bf16-q4)")
    name = "AMX q4_1 tiles" if tiles_on else "vdpbf16ps q4_1"
    torch.set_num_threads(2)
    weights = [[random_q4_1(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    tiles = [[amx.pack(w) for w in layer] for layer in weights]
    bf16 = [[torch.ops.mkldnn._reorder_linear_weight(w.dequantize().to(torch.bfloat16), 64) for w in layer]
            for layer in weights]
    head = random_q8_0(49152, 576)
    head_tiles = amx.pack(head)
    head_bf16 = torch.ops.mkldnn._reorder_linear_weight(head.dequantize().to(torch.bfloat16), 64)
    gb = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{LAYERS} layers x {len(SHAPES)} products, {gb / 1e6:.0f} M weights: bf16 copy {2 * gb / 1e6:.0f} MB, "
          f"tile-order q4_1 {sum(t.nbytes for layer in tiles for t in layer) / 1e6:.0f} MB")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}

        def onednn(xs=xs):
            for layer in bf16:
                for (_, k), w in zip(SHAPES, layer, strict=True):
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        def tiled(xs=xs):
            for layer in tiles:
                for (_, k), w in zip(SHAPES, layer, strict=True):
                    amx.linear(xs[k], w, torch.bfloat16, tiles=tiles_on)

        a, b = median_ms(onednn), median_ms(tiled)
        ha = median_ms(lambda xs=xs: torch.ops.mkldnn._linear_pointwise(xs[576], head_bf16, None, "none", [], ""))
        hb = median_ms(lambda xs=xs: amx.linear(xs[576], head_tiles, tiles=tiles_on))
        print(f"{rows:4d} rows: layers oneDNN bf16 {a:6.2f} ms, {name} {b:6.2f} ms ({a / b:.2f}x); "
              f"LM head {ha:5.2f} vs {hb:5.2f} ms ({ha / hb:.2f}x)")


if __name__ == "__main__":
    main()
