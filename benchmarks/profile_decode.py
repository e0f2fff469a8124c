"""Where a single-stream decode step's time goes: model forward (the one-call native decoder), LM head,
and the rest (Python, sampling), per token; then cProfile's top functions.

    .venv/bin/python benchmarks/profile_decode.py                 # 256 tokens after a short prompt
    .venv/bin/python benchmarks/profile_decode.py --ngram         # the n-gram task of `pagellm bench latency`
    .venv/bin/python benchmarks/profile_decode.py --prompt-len 1024   # a random 1,024-token prompt: attention's share

Run it alone: the machine has 2 cores.
"""

import argparse
import cProfile
import pstats
import random
import time

from pagellm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ngram", action="store_true", help="n-gram speculation (K=4) on the grounded task")
    ap.add_argument("--prompt-len", type=int, default=None, help="a random prompt of this many tokens")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32")
    ns = ap.parse_args()
    kv = {} if ns.kv_cache_dtype == "auto" else {"kv_cache_dtype": ns.kv_cache_dtype}
    kv["dtype"] = ns.dtype
    if ns.ngram:
        from pagellm.bench.common import latency_prompts

        llm = LLM(None, speculative_method="ngram", num_speculative_tokens=4, **kv)
        prompt = latency_prompts(llm.engine.tokenizer, 0, "grounded", 0, 1)[0]
        params = SamplingParams(temperature=0.0, max_tokens=200)
    else:
        llm = LLM(None, **kv)
        prompt = "Tell me a long story about a dragon."
        if ns.prompt_len:
            rng = random.Random(0)
            prompt = [rng.randrange(100, 40000) for _ in range(ns.prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up (kernel build, prefix cache)

    model, spent = llm.engine.model, {"forward": 0.0, "compute_logits": 0.0}
    # few-row steps run the runner's compiled decoder (when there is one) instead of the module forward
    targets = [(model, "forward", "forward"), (model, "compute_logits", "compute_logits")]
    if llm.engine.runner.compiled_decoder is not None:
        targets.append((llm.engine.runner.compiled_decoder, "forward", "forward"))
    for obj, attr, name in targets:
        inner = getattr(obj, attr)

        def timed(*a, _inner=inner, _name=name, **k):
            t = time.perf_counter()
            out = _inner(*a, **k)
            spent[_name] += time.perf_counter() - t
            return out

        setattr(obj, attr, timed)
    steps = llm.engine.stats.steps
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    total = time.perf_counter() - t
    n, steps = len(out.token_ids), llm.engine.stats.steps - steps
    print(f"{n} tokens in {steps} steps, {1e3 * total / n:.2f} ms/token: forward {1e3 * spent['forward'] / n:.2f}, "
          f"LM head {1e3 * spent['compute_logits'] / n:.2f}, rest {1e3 * (total - sum(spent.values())) / n:.2f}; "
          f"{1e3 * spent['forward'] / steps:.1f} ms of forward per step")
    prof = cProfile.Profile()
    prof.runcall(llm.generate, [prompt], params, use_tqdm=False)
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
