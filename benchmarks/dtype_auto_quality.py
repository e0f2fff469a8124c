"""`--dtype auto` against `--dtype float32` on SmolLM2: chosen-token logprob differences while the greedy
outputs agree, and float32's top-1 margin where they part (the figures behind tests/test_dtype_auto.py's
bounds; the prompts are the test's). Twice: all 27 prompts in one batch (decode steps of 27 rows: the bf16
GEMMs), and at most 4 running at once (decode steps of <= 4 rows: the packed kernels, with int8 activations
where the platform chose them), the same with `--no-int8-activations` (float32 few-row products); then
float32 with `--int8-activations` at most 4 at once; then auto with an int8 KV cache, both ways.

    .venv/bin/python benchmarks/dtype_auto_quality.py [--long] [WORD ...]   (only the configs whose label has a WORD)
"""

from __future__ import annotations

import statistics
import sys

from pagellm import LLM, SamplingParams

PROMPTS = [f"Item {i}: the capital of country number {i} in a long list of countries is" for i in range(24)]
PROMPTS += ["The three primary colors are", "def add(a, b):\n    return", "Water boils at a temperature of"]
# --long: each prompt behind this instruction, past every platform's few-row limit (20 tokens), so that where prompt
# rows take one-plane int8 (OpChoices.int8_many_rows) every prompt does: on AVX2, whose limit is 20, the plain
# prompts (5-20 tokens) take the few-row kernels
LONG_PREFIX = "Answer each of the following questions about geography, science or code briefly and correctly.\n"


def compare(a, b) -> tuple[list[float], list[float]]:
    """(chosen-token |logprob difference| while the outputs agree, float32's top-1 margin where they part)"""
    diffs, margins = [], []
    for x, y in zip(a, b, strict=True):
        for ta, tb, la, lb in zip(x.outputs[0].token_ids, y.outputs[0].token_ids, x.outputs[0].logprobs,
                                  y.outputs[0].logprobs, strict=True):
            if ta != tb:
                top2 = sorted((v.logprob for v in la.values()), reverse=True)[:2]
                margins.append(round(top2[0] - top2[1], 3))
                break
            diffs.append(abs(la[ta].logprob - lb[tb].logprob))
    return sorted(diffs), margins


def main() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    wanted = [w for w in sys.argv[1:] if w != "--long"]  # labels containing any of these words (all configs without)
    prompts = [LONG_PREFIX + p for p in PROMPTS] if "--long" in sys.argv[1:] else PROMPTS
    a = LLM(None, dtype="float32").generate(prompts, params, use_tqdm=False)
    configs = [("auto, max_num_seqs 256", {"dtype": "auto", "max_num_seqs": 256}),
               ("auto, max_num_seqs 4", {"dtype": "auto", "max_num_seqs": 4}),
               ("auto --no-int8-activations, max_num_seqs 4",
                {"dtype": "auto", "max_num_seqs": 4, "int8_activations": False}),
               ("float32 + int8 activations, max_num_seqs 4", {"int8_activations": True, "max_num_seqs": 4}),
               ("auto --kv-cache-dtype int8, max_num_seqs 256",
                {"dtype": "auto", "max_num_seqs": 256, "kv_cache_dtype": "int8"}),
               ("auto --kv-cache-dtype int8, max_num_seqs 4",
                {"dtype": "auto", "max_num_seqs": 4, "kv_cache_dtype": "int8"})]
    for label, options in configs:
        if wanted and not any(w in label for w in wanted):
            continue
        b = LLM(None, **options).generate(prompts, params, use_tqdm=False)
        diffs, margins = compare(a, b)
        print(f"{label}: {len(diffs)} tokens while outputs agree: median "
              f"{statistics.median(diffs):.3f}, p90 {diffs[int(0.9 * len(diffs))]:.3f}, max {diffs[-1]:.3f} nats; "
              f"{len(margins)} of {len(prompts)} sequences parted; float32 top-1 margins there: {margins}")


if __name__ == "__main__":
    main()
