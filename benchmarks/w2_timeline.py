"""Where the offline workload's wall time goes, by step kind: the steps that carry prompt tokens (prefill chunks, with
the decode rows that ride along), and decode-only steps by their row count, each with its time, tokens and tok/s;
then the wall time inside the model's main parts (the native decoder's forward, the LM head, the bf16 products
through oneDNN) and around it (scheduling, sampling). One run in a fresh engine, prefix caching off, greedy:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/w2_timeline.py '{"dtype": "auto"}'

The figures in benchmarks/NOTES.md (thirty-seventh session) come from this command. Run it alone: on a 2-core VM
a second busy process slows every OpenMP region several-fold.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
import time

import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload

ROW_BUCKETS = [(1, 4), (5, 12), (13, 32), (33, 64), (65, 256)]


def timed(obj, name: str, label: str, seconds: collections.Counter, calls: collections.Counter) -> None:
    """Replace obj.name by a wrapper that adds its wall time to seconds[label]."""
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - t0
            calls[label] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"dtype": "auto"}
    llm = LLM(None, enable_prefix_caching=False, **options)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    engine = llm.engine
    runner = engine.executor.runner
    workload = random_workload(64, engine.model_config.vocab_size, (32, 512), (16, 256), 0)

    steps: list[tuple[int, int, float]] = []  # (requests, tokens, seconds) per step
    scheduled = {}
    schedule = engine.scheduler.schedule

    def schedule_and_keep():
        scheduled["out"] = schedule()
        return scheduled["out"]

    engine.scheduler.schedule = schedule_and_keep
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        outputs = step()
        out = scheduled["out"]
        steps.append((len(out.scheduled), out.num_batched_tokens, time.perf_counter() - t0))
        return outputs

    engine.step = timed_step
    seconds, calls = collections.Counter(), collections.Counter()
    if runner.compiled_decoder is not None:
        timed(runner.compiled_decoder, "forward", "native decoder forward", seconds, calls)
    timed(runner.model, "compute_logits", "LM head (compute_logits)", seconds, calls)
    timed(engine.scheduler, "schedule", "scheduler.schedule", seconds, calls)
    timed(engine.scheduler, "update", "scheduler.update", seconds, calls)
    timed(torch.ops.mkldnn, "_linear_pointwise", "oneDNN bf16 products", seconds, calls)

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    t0 = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in workload)
    print(f"wall {wall:.2f} s, {len(steps)} steps, {out_tokens / wall:.1f} output tok/s")
    mixed = [s for s in steps if s[1] > s[0]]
    print(f"steps with prompt tokens: {len(mixed)}, {sum(s[2] for s in mixed):.2f} s, "
          f"{sum(s[1] for s in mixed)} tokens")
    for lo, hi in ROW_BUCKETS:
        bucket = [s for s in steps if s[1] == s[0] and lo <= s[0] <= hi]
        if bucket:
            t, n = sum(s[2] for s in bucket), sum(s[0] for s in bucket)
            print(f"decode-only steps of {lo}-{hi} rows: {len(bucket)}, {t:.2f} s, {n} tokens, {n / t:.0f} tok/s, "
                  f"{1e3 * t / len(bucket):.1f} ms a step")
    for label, s in seconds.items():
        print(f"{label}: {s:.2f} s in {calls[label]} calls")


if __name__ == "__main__":
    main()
