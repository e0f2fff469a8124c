"""The offline workload (64 requests, prompts 32-512, outputs 16-256, ignore_eos) three times in one
process, each with another seed (so no prefix-cache hits): seconds per run. Used to compare two source
trees in turn without the benchmark harness around them:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=<tree> .venv/bin/python benchmarks/offline_repeat.py

--profile: one more run under cProfile, the top functions by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main() -> None:
    llm = LLM(None)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches

    def run(seed: int) -> None:
        wl = random_workload(64, llm.engine.model_config.vocab_size, (32, 512), (16, 256), seed)
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in wl]
        llm.generate([r.prompt_token_ids for r in wl], params, use_tqdm=False)

    for seed in (0, 1, 2):
        t = time.perf_counter()
        run(seed)
        print(f"seed {seed}: {time.perf_counter() - t:.2f} s", flush=True)
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.runcall(run, 3)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
