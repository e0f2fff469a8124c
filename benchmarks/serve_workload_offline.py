"""The serving benchmark's workload (64 random requests, prompts 128-384 tokens, outputs 64-192, ignore_eos)
offline in one `LLM.generate`, prefix caching off: what the engine does for `pagellm bench serve`'s load
without the server, its client or the API process. Compare with `pagellm bench serve --peer pagellm` on the
same machine to see what serving costs.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_workload_offline.py [--profile]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main() -> None:
    llm = LLM(None, enable_prefix_caching=False, dtype="auto")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    wl = random_workload(64, llm.engine.model_config.vocab_size, (128, 384), (64, 192), 0)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in wl]

    def run():
        return llm.generate([r.prompt_token_ids for r in wl], params, use_tqdm=False)

    if "--profile" in sys.argv:
        prof = cProfile.Profile(time.perf_counter)
        prof.runcall(run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        return
    t = time.perf_counter()
    out = run()
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in out)
    print(f"{wall:.2f} s, {n / wall:.1f} output tok/s ({n} tokens)")


if __name__ == "__main__":
    main()
