"""The twenty-eighth session's two quality findings under `--dtype auto` (benchmarks/NOTES.md), from a probe's
scripts, on random-id prompts:

1. ties: the top-5 logprobs of the first sampled token for batches of 12, 13 and 16 prompts, and how many
   neighbouring entries are exactly equal (bf16-rounded logits tie; float32 ones practically never do). With
   `PAGELLM_CPU_AMX=0` on an AMX CPU the products past 12 rows run on oneDNN, whose output is bf16.
2. repetition: prompt 11 of the probe's seed-2 set (150 ids) in float32, float32 with an int8 KV cache, auto with
   a float32 KV cache, and auto (int8 KV by default on AVX-512 CPUs): the chosen tokens and their logprobs.

    [PAGELLM_CPU_AMX=0] .venv/bin/python benchmarks/auto_quality_probes.py ties|repetition
"""

import random
import sys

from pagellm import LLM, SamplingParams


def probe_prompts() -> list[list[int]]:
    random.seed(2)
    return [[random.randint(100, 40000) for _ in range(random.choice([3, 9, 33, 70, 150, 260]))] for _ in range(64)]


def ties() -> None:
    prompts = probe_prompts()
    llm = LLM(None, dtype="auto", num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    for batch in (12, 13, 16):
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        tops = [sorted((v.logprob for v in o.outputs[0].logprobs[0].values()), reverse=True)[:5] for o in outs]
        tied = sum(a == b for top in tops for a, b in zip(top, top[1:], strict=False))
        pairs = sum(len(top) - 1 for top in tops)
        print(f"batch {batch}: {tied} of {pairs} neighbouring top-5 logprobs tie; prompt 0: "
              f"{[round(x, 5) for x in tops[0]]}")


def repetition() -> None:
    prompt = probe_prompts()[11]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = (("float32", {"dtype": "float32"}), ("float32, int8 KV", {"dtype": "float32", "kv_cache_dtype": "int8"}),
            ("auto, float32 KV", {"dtype": "auto", "kv_cache_dtype": "float32"}), ("auto", {"dtype": "auto"}))
    for name, kw in runs:
        o = LLM(None, num_threads=1, **kw).generate([prompt], params, use_tqdm=False)[0].outputs[0]
        print(f"{name:<17}", [(t, round(d[t].logprob, 3)) for t, d in zip(o.token_ids, o.logprobs, strict=True)],
              flush=True)


if __name__ == "__main__":
    {"ties": ties, "repetition": repetition}[sys.argv[1] if len(sys.argv) > 1 else "ties"]()
