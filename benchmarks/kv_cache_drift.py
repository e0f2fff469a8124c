"""Quantized KV caches over long outputs: SmolLM2 (the default GGUF, float32 compute) generates 200 greedy tokens
for 4 prompts with a float32 KV cache; each --kv-cache-dtype then scores those same tokens, one per step through
its cache (teacher forcing, so every position is compared, not only those before the outputs part). Prints, per
dtype and position range, the median and max |chosen-token logprob - float32's| and how many of float32's top-1
tokens that led by more than 0.5 nats it keeps.

    .venv/bin/python benchmarks/kv_cache_drift.py [DTYPE ...]   (default: int8 fp8 fp8_e5m2 float16)
"""

import sys

import torch

from pagellm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
NEW, MARGIN, RANGES = 200, 0.5, ((0, 50), (50, 100), (100, 200))


def scored(llm: LLM, seqs: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Each sequence's rows for its generated positions (the distribution each generated token came from)."""
    return [llm.next_token_logprobs([s], start=p - 1, chunk=1)[0][:-1] for s, p in zip(seqs, starts, strict=True)]


def main() -> None:
    dtypes = sys.argv[1:] or ["int8", "fp8", "fp8_e5m2", "float16"]
    ref_llm = LLM(None, kv_cache_memory="64MiB", kv_cache_dtype="float32")
    outs = ref_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                            use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    starts = [len(o.prompt_token_ids) for o in outs]
    ref = scored(ref_llm, seqs, starts)
    for kv in dtypes:
        got = scored(LLM(None, kv_cache_memory="64MiB", kv_cache_dtype=kv), seqs, starts)
        drift = {r: [] for r in RANGES}
        kept = wide = 0
        for s, p, r, g in zip(seqs, starts, ref, got, strict=True):
            tgt = torch.tensor(s[p:])[:, None]
            d = (g.gather(1, tgt) - r.gather(1, tgt)).abs()[:, 0]
            for a, b in RANGES:
                drift[(a, b)] += d[a:b].tolist()
            top2 = r.topk(2, dim=-1).values
            lead = (top2[:, 0] - top2[:, 1]) > MARGIN
            kept += int((g.argmax(-1) == r.argmax(-1))[lead].sum())
            wide += int(lead.sum())
        cells = ", ".join(f"{a}-{b}: median {torch.tensor(v).median():.4f} max {max(v):.3f}"
                          for (a, b), v in drift.items())
        print(f"{kv}: {cells}; float32 top-1 kept where it led by > {MARGIN}: {kept}/{wide}", flush=True)


if __name__ == "__main__":
    main()
