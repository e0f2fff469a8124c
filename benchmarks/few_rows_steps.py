"""Whole decode steps at a few rows under `--dtype auto`: engines with different few-row limits
(`BF16_PACKED_MAX_ROWS`, `INT8_PACKED_MAX_ROWS` where few-row products take int8 activations, or
`AMX_PACKED_MAX_ROWS` / `AMX_INT8_PACKED_MAX_ROWS` where many-row ones run on AMX tiles, above which steps leave
the packed kernels and the one-call decoder for the bf16 GEMMs or the AMX products), the same batch of
requests (prompts 100-200 tokens, 64 greedy tokens each) run three times in
turn; wall and CPU seconds per run. The limits 6, 12, 4 and 6 in pagellm/platforms/cpu.py come from this:

    OMP_WAIT_POLICY=passive env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/few_rows_steps.py BATCH 20,8,6,4
"""

from __future__ import annotations

import sys
import time

import pagellm.platforms.cpu as cpu
from pagellm import LLM, SamplingParams
from pagellm.bench.workload import random_workload


def main() -> None:
    batch, limits = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
    engines = {}
    for limit in limits:
        # read when the engine's ops are chosen
        cpu.BF16_PACKED_MAX_ROWS = cpu.INT8_PACKED_MAX_ROWS = limit
        cpu.AMX_PACKED_MAX_ROWS = cpu.AMX_INT8_PACKED_MAX_ROWS = limit
        engines[limit] = LLM(None, dtype="auto", enable_prefix_caching=False)
        engines[limit].generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    wl = random_workload(batch, 49152, (100, 200), (64, 64), 0)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in wl]
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in limits}
    for _ in range(3):
        for limit, llm in engines.items():
            t, c = time.perf_counter(), time.process_time()
            llm.generate([r.prompt_token_ids for r in wl], params, use_tqdm=False)
            times[limit].append((time.perf_counter() - t, time.process_time() - c))
    for limit, runs in times.items():
        print(f"limit {limit:>2}: wall {[round(w, 2) for w, _ in runs]} s, CPU {[round(c, 2) for _, c in runs]} s")


if __name__ == "__main__":
    main()
