"""SmolLM2's q8_0 logits head alone under `--dtype auto` on a CPU with AVX-512 BF16 and VNNI (its blocks in both
tile orders): vdpbf16ps against one- and two-plane int8 activations, best of 7 x 5 calls, milliseconds, at 16-128
rows. The thirty-ninth session's figures in benchmarks/NOTES.md come from:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PAGELLM_CPU_INT8_HEAD=0 \
        .venv/bin/python benchmarks/microbench_logits_head.py
"""

import torch
from timing import best_ms

from pagellm import LLM
from pagellm.kernels import amx, int8_tiles, ops


def main() -> None:
    head = LLM(None, dtype="auto").engine.model.lm_head
    if head.amx_blocks is None or head.int8_tiles is None:
        raise SystemExit("the head lacks a tile order here (PAGELLM_CPU_INT8_HEAD=0, on AVX-512 BF16 + VNNI)")
    for rows in (16, 32, 64, 128):
        x = torch.randn(rows, head.in_features)
        ms = {"vdpbf16ps": best_ms(lambda x=x: amx.linear(x, head.amx_blocks, torch.float32, tiles=False), 5, 7),
              "int8 one plane": best_ms(lambda x=x: int8_tiles.linear(x, head.int8_tiles, ops.INT8), 5, 7),
              "int8 two planes": best_ms(lambda x=x: int8_tiles.linear(x, head.int8_tiles, ops.INT8_FINE), 5, 7)}
        print(rows, "rows:", ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)


if __name__ == "__main__":
    main()
