"""One decode step's random draw for 64 rows of SmolLM2's 49,152 logits, ms per call (best of 5 rounds of 20):
torch's exponential race (exponential_ noise, then argmax of p / noise: the sampler before the thirtieth session),
torch.multinomial, the inverse-CDF draw on given probabilities (ops.sample_rows), torch's copy + temperature +
softmax that it needs, and the fused native temperature + softmax + draw (ops.softmax_draw).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_sampling.py [ROWS]
"""

import sys

import torch
from timing import best_ms

from pagellm.kernels import ops
from pagellm.platforms import get_platform
from pagellm.sample.draw import uniforms


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    print(get_platform("cpu").summary_line())
    x = torch.randn(rows, 49_152, generator=torch.Generator().manual_seed(0)) * 3
    probs = x.softmax(-1)
    u = uniforms([None] * rows)
    inv = torch.ones(rows)
    cases = {
        "exponential race (exponential_ + argmax)": lambda: (probs / torch.empty_like(probs).exponential_()).argmax(-1),
        "torch.multinomial": lambda: torch.multinomial(probs, 1),
        "inverse CDF on probs (ops.sample_rows)": lambda: ops.sample_rows(probs, u),
        "copy + temperature + softmax (torch)": lambda: (x.clone().div_(0.7)).softmax(-1),
        "fused temperature + softmax + draw (ops.softmax_draw)": lambda: ops.softmax_draw(x, inv, u),
    }
    for name, fn in cases.items():
        print(f"{name:55s} {best_ms(fn, calls=20, rounds=5, warmup=1):8.3f} ms")


if __name__ == "__main__":
    main()
