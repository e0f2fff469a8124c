"""What a speculative verification step costs at batch B with K drafts per request, and where it goes: the
grounded prompt B times, every request given K drafts that are never accepted (so each step verifies B x (K + 1)
rows and yields B tokens), 60 decode steps per round, median of 3 rounds; then one round under cProfile for the
split: the one-call decoder (products and attention), the LM head on int8 tiles (where it runs there), the
drafts' verification in the sampler, and the whole model call.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/verify_step_costs.py \\
        [--dtype auto] [--batch 4 16] [--drafts 0 1 2 4]

The ratio of a step's cost to the plain one (K = 0) against the tokens its drafts bring is what decides whether
speculation pays at that batch size (spec_decode/adaptive.py measures the same online). Run it alone: the
machine has 2 cores.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from pagellm import LLM, SamplingParams, cli_types
from pagellm.bench.common import latency_prompts
from pagellm.config import COMPUTE_DTYPES

# (module file, function) -> column; cumulative time per step
SPLIT = {("decoder.py", "forward"): "decoder", ("int8_tiles.py", "linear"): "LM head (int8 tiles)",
         ("step.py", "_verify"): "verify", ("runner.py", "_execute"): "model call"}


def _round(eng, prompts, params, k: int, tag: str, prof: cProfile.Profile | None = None) -> tuple[int, float]:
    def propose(running):
        for r in running:  # a token the model never picks here: every draft is rejected
            r.spec_token_ids = [13] * min(k, eng.proposer.budget(r))

    eng.proposer.propose = propose
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    eng.step()  # the prefill
    steps, t = 0, time.perf_counter()
    if prof:
        prof.enable()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    if prof:
        prof.disable()
    return steps, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", choices=list(COMPUTE_DTYPES))
    ap.add_argument("--batch", type=cli_types.positive_int, nargs="+", default=[4, 16])
    ap.add_argument("--drafts", type=cli_types.nonnegative_int, nargs="+", default=[0, 1, 2, 4])
    ns = ap.parse_args()
    try:  # a dtype this CPU cannot run (float16): one line, as the CLI says it
        llm = LLM(None, dtype=ns.dtype, speculative_method="ngram", num_speculative_tokens=max(max(ns.drafts), 1),
                  speculative_adaptive=False)
    except ValueError as e:
        ap.error(str(e))
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    print("| batch | drafts | rows | ms per step | vs plain | " + " | ".join(f"{c} ms" for c in SPLIT.values()) + " |")
    print("|---" * (5 + len(SPLIT)) + "|")
    for batch in ns.batch:
        prompts = latency_prompts(eng.tokenizer, 0, "grounded", 0, batch)
        plain = None
        for k in ns.drafts:
            per_step = []
            for rnd in range(3):
                steps, seconds = _round(eng, prompts, params, k, f"b{batch}-k{k}-{rnd}")
                per_step.append(1e3 * seconds / steps)
            prof = cProfile.Profile()
            steps, _ = _round(eng, prompts, params, k, f"b{batch}-k{k}-profile", prof)
            stats = pstats.Stats(prof).stats
            split = {name: 0.0 for name in SPLIT.values()}
            for (path, _, func), (_, _, _, cumulative, _) in stats.items():
                name = SPLIT.get((path.rsplit("/", 1)[-1], func))
                if name:
                    split[name] += 1e3 * cumulative / steps
            ms = statistics.median(per_step)
            plain = ms if k == 0 else plain
            ratio = f"{ms / plain:.2f}" if plain else "-"
            print(f"| {batch} | {k} | {batch * (k + 1)} | {ms:.2f} | {ratio} | "
                  + " | ".join(f"{v:.2f}" for v in split.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
