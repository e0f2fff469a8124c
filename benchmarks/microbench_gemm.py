"""Reproduces the GEMM figures in benchmarks/NOTES.md: weight layout, MKL vs numpy's OpenBLAS, bf16, int8.

    .venv/bin/python benchmarks/microbench_gemm.py

40 distinct 576x3072 weights are cycled so they stream from memory, as in a decode step; times are
milliseconds for all 40 products (median of 5). Run it alone: the machine has 2 cores.
"""

import torch
import torch.nn.functional as F
from timing import median_ms


def ms(fn) -> float:
    return median_ms(fn, reps=5, warmup=1)


def row(m: int, ws, wts, nps, lm, lmt) -> list[float]:
    x = torch.randn(m, 576)
    xb = x.bfloat16()
    wbs = [w.bfloat16() for w in ws[:8]]
    scales = [w.abs().amax(dim=1) / 127 for w in ws[:8]]
    q8 = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(ws[:8], scales, strict=True)]
    return [
        ms(lambda: [F.linear(x, w) for w in ws]),
        ms(lambda: [x @ w for w in wts]),
        ms(lambda: [x.numpy() @ w for w in nps]),
        5 * ms(lambda: [F.linear(xb, w) for w in wbs]),  # 8 weights, scaled to 40
        5 * ms(lambda: [torch.ops.aten._weight_int8pack_mm(xb, q, s.bfloat16())
                        for q, s in zip(q8, scales, strict=True)]),
        ms(lambda: F.linear(x, lm)),
        ms(lambda: x @ lmt),
    ]


def main() -> None:
    print("cpu capability:", torch.backends.cpu.get_cpu_capability(), "| threads:", torch.get_num_threads())
    ws = [torch.randn(3072, 576) for _ in range(40)]  # [out, in], as F.linear wants
    wts = [w.t().contiguous() for w in ws]  # [in, out], pagellm's Linear layout
    nps = [w.numpy() for w in wts]
    lm = torch.randn(49152, 576)
    lmt = lm.t().contiguous()
    cols = ["F.linear", "x@W_t", "numpy", "bf16", "int8pack", "LM F.linear", "LM x@W_t"]
    print(f"{'M':>3} " + " ".join(f"{c:>11}" for c in cols))
    for m in (1, 4, 7, 16, 64):
        print(f"{m:>3} " + " ".join(f"{v:>11.1f}" for v in row(m, ws, wts, nps, lm, lmt)))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
