"""Where one long prompt's time to first token goes: `LLM.generate` of one random prompt with max_tokens=1,
prefix caching off, twice for the time, then once under cProfile (wall clock), top functions by own time.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/profile_prefill.py 2048 auto

Arguments: prompt tokens (default 2048), --dtype (default auto). Run it alone: the machine has 2 cores.
"""

import cProfile
import pstats
import random
import sys
import time

from pagellm import LLM, SamplingParams


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
    llm = LLM(None, enable_prefix_caching=False, dtype=dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for _ in range(2):
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        print(f"{n}-token prompt, --dtype {dtype}: {1e3 * (time.perf_counter() - t):.1f} ms to the first token")
    prof = cProfile.Profile(time.perf_counter)
    prof.runcall(lambda: llm.generate([prompt], params, use_tqdm=False))
    pstats.Stats(prof).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
