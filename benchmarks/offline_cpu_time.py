"""The offline workload (64 requests, prompts 32-512, outputs 16-256, ignore_eos, prefix caching off) once
in a fresh engine with the given options (JSON), reporting wall time and the process's CPU time. On a
shared 2-core VM the wall time swings 2-3x with other processes; with OpenMP threads sleeping instead of
spinning (OMP_WAIT_POLICY=passive) the CPU time moves a few percent, so A/B comparisons of kernel changes
here were made on CPU time:

    OMP_WAIT_POLICY=passive env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/offline_cpu_time.py '{"dtype": "auto"}' [--profile]

--profile: the run under cProfile with a CPU-time clock, the top functions by own CPU time (--wall: with
the wall clock). --runs N: the workload N times in the same engine. Each run prints its minor page faults
and the peak RSS so far, after the engine's start-up time (the eighteenth session's page-fault figures:
'{"dtype": "auto"}' --runs 3, and '{"dtype": "auto", "prefault_kv_cache": true}' against '{"dtype": "auto"}').
--temperature T: sample at T (default 0, greedy; vLLM's `bench serve` sends no temperature, so 1).
--gc: also the garbage collections during each run, by generation, and their time (the twenty-eighth
session's count, with benchmarks/serve_workload_offline.py --gc).
"""

from __future__ import annotations

import cProfile
import gc
import json
import pstats
import resource
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main(prompt_lens: tuple[int, int] = (32, 512), output_lens: tuple[int, int] = (16, 256),
         default_options: dict | None = None) -> None:
    """64 random requests with lengths in these ranges; engine options from argv[1] (JSON) or the default."""
    given = len(sys.argv) > 1 and not sys.argv[1].startswith("--")
    options = json.loads(sys.argv[1]) if given else dict(default_options or {})
    t0 = time.perf_counter()
    llm = LLM(None, enable_prefix_caching=False, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    print(f"ready after {time.perf_counter() - t0:.2f} s", flush=True)
    wl = random_workload(64, llm.engine.model_config.vocab_size, prompt_lens, output_lens, 0)
    temperature = float(sys.argv[sys.argv.index("--temperature") + 1]) if "--temperature" in sys.argv else 0.0
    params = [SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True) for r in wl]

    def run():
        return llm.generate([r.prompt_token_ids for r in wl], params, use_tqdm=False)

    if "--profile" in sys.argv:
        prof = cProfile.Profile(time.perf_counter if "--wall" in sys.argv else time.process_time)
        prof.runcall(run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(__import__("os").environ.get("PROFILE_TOP", "20")))
        return
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 1
    collections: dict[int, list[float]] = {}  # generation -> [count, seconds]
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            c = collections.setdefault(info["generation"], [0, 0.0])
            c[0], c[1] = c[0] + 1, c[1] + time.perf_counter() - started[0]

    if "--gc" in sys.argv:
        gc.callbacks.append(on_gc)
    for _ in range(runs):
        collections.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t, c = time.perf_counter(), time.process_time()
        out = run()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        n = sum(len(o.outputs[0].token_ids) for o in out)
        usage = resource.getrusage(resource.RUSAGE_SELF)  # ru_maxrss: KiB on Linux
        print(f"{options}: {wall:.2f} s wall, {cpu:.2f} s CPU, {n / wall:.1f} output tok/s, "
              f"{usage.ru_minflt - faults} minor faults, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB", flush=True)
        if "--gc" in sys.argv:
            print("  gc collections by generation: " + (", ".join(
                f"{g}: {n} in {s * 1000:.1f} ms" for g, (n, s) in sorted(collections.items())) or "none"), flush=True)


if __name__ == "__main__":
    main()
