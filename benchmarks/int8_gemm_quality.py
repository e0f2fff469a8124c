"""What W8A8 many-row products would cost in quality: `--dtype auto`'s bf16 GEMMs replaced by int8 x int8
(torch._int_mm, VNNI) with per-row activation scales and per-output-channel weight scales, against
`--dtype float32` on the prompts of tests/test_dtype_auto.py. `skip_down` keeps the down projection (whose
input carries the largest outliers) in bf16. Prints logprob differences while the greedy outputs agree
and float32's top-1 margins where they part. The GEMMs themselves run 1.8-2.5x bf16 at 512 rows on the
Zen 5 VM (benchmarks/microbench_bf16_gemm.py's int8 column), but the quality ruled them out.

    .venv/bin/python benchmarks/int8_gemm_quality.py all|skip_down
"""

from __future__ import annotations

import statistics
import sys

import torch

import pagellm.quant.linear_method as linear_method
from pagellm import LLM, SamplingParams

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dtype_auto_quality import PROMPTS, compare  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "all"


def int8_matmul(self, layer, x):
    if not hasattr(layer, "w_i8"):
        w = (layer.weight_bf16.to_dense() if layer.weight_bf16.is_mkldnn else layer.weight_bf16).float()
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        layer.w_i8 = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()
        layer.w_s = s
    x = x.float()
    if MODE == "skip_down" and layer.in_features > layer.out_features:
        y = x.to(torch.bfloat16).float() @ layer.w_i8.float() * layer.w_s  # bf16 x int8-rounded weights
    else:
        xs = x.abs().amax(1).clamp_min(1e-8) / 127
        xi = (x / xs[:, None]).round().clamp(-127, 127).to(torch.int8)
        y = torch._int_mm(xi, layer.w_i8).float() * xs[:, None] * layer.w_s[None, :]
    return y if layer.bias is None else y.add_(layer.bias)


def main() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    a = LLM(None, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    linear_method.LinearMethod.bf16_matmul = int8_matmul
    llm = LLM(None, dtype="auto")
    for m in llm.engine.model.modules():
        if hasattr(m, "bf16_out"):
            m.bf16_out = False  # int8 products return float32
    diffs, margins = compare(a, llm.generate(PROMPTS, params, use_tqdm=False))
    print(f"{MODE}: {len(diffs)} tokens while outputs agree: median {statistics.median(diffs):.3f}, "
          f"p90 {diffs[int(0.9 * len(diffs))]:.3f}, max {diffs[-1]:.3f} nats; {len(margins)} of {len(PROMPTS)} "
          f"sequences parted; float32 top-1 margins there: {margins}")


if __name__ == "__main__":
    main()
