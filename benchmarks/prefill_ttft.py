"""One request's time to first token under `--dtype auto`, prefix caching off: 12 random prompts of TOKENS tokens
(one warm-up first), median and minimum in ms, with AMX products taking steps of up to AMX_ROWS rows
(`pagellm.platforms.cpu.AMX_MAX_ROWS`, read when the engine's ops are chosen). --profile: 30 prompts under
cProfile (wall clock), the top functions by own time: where a prefill's milliseconds go. The figures behind
AMX_MAX_ROWS and benchmarks/NOTES.md (sixteenth session) come from, alternating:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/prefill_ttft.py 64 128
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/prefill_ttft.py 128 128 [--profile]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import pagellm.platforms.cpu as cpu
from pagellm import LLM, SamplingParams


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cpu.AMX_MAX_ROWS = int(args[0]) if args else cpu.AMX_MAX_ROWS
    tokens = int(args[1]) if len(args) > 1 else 128
    profile = "--profile" in sys.argv
    llm = LLM(None, dtype="auto", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (tokens,), generator=g).tolist() for _ in range(30 if profile else 12)]
    llm.generate([prompts[0]], params, use_tqdm=False)  # kernel build, first touches

    def one(ids: list[int]) -> float:
        t = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    if profile:
        prof = cProfile.Profile(time.perf_counter)
        prof.runcall(lambda: [one(ids) for ids in prompts])
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        return
    ms = sorted(one(ids) for ids in prompts)
    print(f"AMX_MAX_ROWS {cpu.AMX_MAX_ROWS}, {tokens} tokens: median TTFT {ms[len(ms) // 2]:.1f} ms, min {ms[0]:.1f}")


if __name__ == "__main__":
    main()
