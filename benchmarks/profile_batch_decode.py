"""Decode of one batch (BATCH requests, prompts 100-200 tokens, 128 greedy tokens each, `--dtype auto`, prefix
caching off): wall seconds once, then the same run under cProfile (wall clock) with the top functions by own
time. The gap between the kernels' own time and the wall time is what Python costs per step; the figures for
the one-call decoder's AMX steps in benchmarks/NOTES.md (fourteenth session) come from here:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/profile_batch_decode.py [BATCH]
"""

import cProfile
import pstats
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    llm = LLM(None, dtype="auto", enable_prefix_caching=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    wl = random_workload(batch, llm.engine.model_config.vocab_size, (100, 200), (128, 128), 0)
    ids = [r.prompt_token_ids for r in wl]
    params = [SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True) for _ in wl]
    t = time.perf_counter()
    llm.generate(ids, params, use_tqdm=False)
    print(f"batch {batch}: {time.perf_counter() - t:.2f} s wall")
    prof = cProfile.Profile(time.perf_counter)
    prof.runcall(llm.generate, ids, params, use_tqdm=False)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
