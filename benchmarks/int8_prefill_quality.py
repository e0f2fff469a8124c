"""What one-plane int8 activations (llama.cpp's scheme: x rounded to int8 per 32 values, one float scale each)
would cost in quality if only the many-row products (prefill) took them: the lead for a CPU whose bf16 GEMM
is at its peak and whose int8 dot products are twice as wide (AMD Zen 4: benchmarks/NOTES.md, thirty-fifth
session). No kernel: each product of more than ROWS rows multiplies the rounded x by the exact dequantized
weights in float32 (what integer sums of the same codes give, up to float32 summation order), so this runs on
any CPU. Compared against float32 with dtype_auto_quality.py's prompts and measures, beside plain auto.

    .venv/bin/python benchmarks/int8_prefill_quality.py [ROWS]   (default 32: above every decode step here)

The thirty-sixth session ran the real kernel this way on a Zen 4 (a scratch switch): no faster than oneDNN's
bf16 in the offline workload, so not kept (benchmarks/NOTES.md); its q4_1 minimums now meet the rounded x as
this emulation's do. The thirty-eighth session's wide kernel (cpu/quant_linear_int8_wide.cpp) is faster, and
auto runs prefill this way on such CPUs (OpChoices.int8_many_rows); dtype_auto_quality.py measures the real thing.
"""

from __future__ import annotations

import statistics
import sys

import torch
from dtype_auto_quality import PROMPTS, compare

from pagellm import LLM, SamplingParams
from pagellm.quant import linear_method

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
plain_apply = linear_method.GGUFBlocksLinearMethod.apply


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-value block rounded to int8 steps of absmax / 127 (float32 back)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(blocks / safe).clamp(-127, 127) * d).reshape(m, k)


def apply_int8_prefill(self, layer, x):
    if x.shape[0] <= ROWS:
        return plain_apply(self, layer, x)
    packed = layer.packed
    xq = int8_rounded(x)
    xq = xq if packed.perm is None else xq.index_select(1, packed.perm)
    y = xq @ packed.dequantize(natural_order=False).t()
    bf16_path = layer.weight_bf16 is not None or getattr(layer, "amx_blocks", None) is not None
    if bf16_path and self.bf16_output(layer):  # what the bf16 product would hand on
        y = y.to(torch.bfloat16)
    return y if layer.bias is None else y.add_(layer.bias)


def main() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    reference = LLM(None, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    for label, options, int8_prefill in (("float32, int8 prefill", {"dtype": "float32"}, True),
                                         ("auto", {"dtype": "auto"}, False),
                                         ("auto, int8 prefill", {"dtype": "auto"}, True),
                                         ("auto, max_num_seqs 4", {"dtype": "auto", "max_num_seqs": 4}, False),
                                         ("auto, max_num_seqs 4, int8 prefill", {"dtype": "auto", "max_num_seqs": 4},
                                          True)):
        linear_method.GGUFBlocksLinearMethod.apply = apply_int8_prefill if int8_prefill else plain_apply
        out = LLM(None, **options).generate(PROMPTS, params, use_tqdm=False)
        diffs, margins = compare(reference, out)
        print(f"{label}: {len(diffs)} tokens while outputs agree: median {statistics.median(diffs):.3f}, p90 "
              f"{diffs[int(0.9 * len(diffs))]:.3f}, max {diffs[-1]:.3f} nats; {len(margins)} of {len(PROMPTS)} "
              f"sequences parted; float32 top-1 margins there: {margins}", flush=True)


if __name__ == "__main__":
    main()
