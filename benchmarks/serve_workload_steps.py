"""The serving benchmark's workload (64 random requests at once, prompts 128-384, outputs 64-192, ignore_eos,
temperature 1 as vLLM's client leaves it), `--dtype auto`, prefix caching off, stepped by hand: each of the first
steps' wall time, requests and tokens, and how many requests have their first token after it; then the output
tok/s and the median TTFT (from adding the requests). The thirty-first session's first-step figures
(benchmarks/NOTES.md: the first 2,048-token step 534-555 ms before the bf16 weights were reordered at load, 396
after; the later ones 345-390) come from:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_workload_steps.py [--warm TOKENS]

--warm TOKENS: one prompt of that many tokens first (the session ran 300, 700, 1,100, 1,500 and 2,048: from
1,100 tokens, past the AMX products' 1,024 rows, it takes the first big step's extra cost).

--noise DUTY: beside the run, a process that spins 0.5 ms at a time and sleeps the rest, using DUTY of one core
(the thirty-second session's 0.1: 2,048-token steps 356-409 -> 416-438 ms, as a server's own API process and a
benchmark client take CPU from the engine core's OpenMP team).
"""

import argparse
import subprocess
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=int, default=0, metavar="TOKENS")
    ap.add_argument("--steps", type=int, default=16, help="steps to list (default 16)")
    ap.add_argument("--noise", type=float, default=0.0, metavar="DUTY", help="a spinning process beside the run "
                    "using this fraction of one core (0 < DUTY <= 1)")
    ns = ap.parse_args()
    noise = subprocess.Popen([sys.executable, "-c", NOISE, str(ns.noise)]) if ns.noise else None
    try:
        run(ns)
    finally:
        if noise is not None:
            noise.kill()


# spin 0.5 ms, sleep so that the spinning is DUTY of the time
NOISE = """import sys, time
duty, spin = float(sys.argv[1]), 0.0005
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < spin:
        pass
    time.sleep(spin * (1 - duty) / duty)
"""


def run(ns: argparse.Namespace) -> None:
    llm = LLM(None, dtype="auto", enable_prefix_caching=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    if ns.warm:
        t = time.perf_counter()
        llm.generate([[(7 * i) % 1000 + 5 for i in range(ns.warm)]], SamplingParams(max_tokens=1), use_tqdm=False)
        print(f"warm-up prompt of {ns.warm} tokens: {time.perf_counter() - t:.3f} s")
    engine = llm.engine
    wl = random_workload(64, engine.model_config.vocab_size, (128, 384), (64, 192), 0)
    scheduled = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        scheduled.append((len(out.scheduled), out.num_batched_tokens))
        return out

    engine.scheduler.schedule = counting_schedule
    t0 = time.perf_counter()
    for i, r in enumerate(wl):
        engine.add_request(f"r{i}", r.prompt_token_ids,
                           SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True))
    first: dict[str, float] = {}
    tokens = 0
    print("step  requests  tokens  wall ms  first tokens so far")
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        for o in outs:
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = e - t0
            tokens += len(o.outputs[0].token_ids) if o.finished else 0
        k = len(scheduled) - 1
        if k < ns.steps:
            print(f"{k:4d}  {scheduled[k][0]:8d}  {scheduled[k][1]:6d}  {(e - s) * 1000:7.1f}  {len(first):5d}")
    wall = time.perf_counter() - t0
    ttfts = sorted(first.values())
    print(f"{tokens / wall:.1f} output tok/s, median TTFT {ttfts[len(ttfts) // 2] * 1000:.0f} ms, "
          f"{len(scheduled)} steps")


if __name__ == "__main__":
    main()
