"""How a plain batch-4 decode step's time moves on this machine: REPS runs (default 6) of the grounded task's
prompt x 4, 300 tokens each, every engine.step() timed while 4 requests run; the median, p10, p90 and maximum, the
autocorrelation of the log step time at lags 1, 5, 20 and 100, and the medians of 50-step blocks. What
benchmarks/spec_controller_drift_sim.py's noise model was set against; the forty-second session's figures in
benchmarks/NOTES.md come from

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/step_time_noise.py 6
"""

import math
import statistics
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.common import latency_prompts


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    eng = LLM(dtype="auto").engine
    prompts = latency_prompts(eng.tokenizer, eng.model_config.vocab_size, "grounded", 128, 4)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    ms = []
    for rep in range(reps):
        for i, p in enumerate(prompts):
            eng.add_request(f"noise-{rep}-{i}", p, params)
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            if len(eng.scheduler.running) == 4:
                ms.append((time.perf_counter() - t) * 1e3)
    ms = ms[5:]  # the first steps warm up
    dec = statistics.quantiles(ms, n=10)
    print(f"{len(ms)} steps: median {statistics.median(ms):.2f} ms, p10 {dec[0]:.2f}, p90 {dec[8]:.2f}, "
          f"max {max(ms):.2f}")
    logs = [math.log(x) for x in ms]
    mean, var = statistics.mean(logs), statistics.pvariance(logs)
    for lag in (1, 5, 20, 100):
        acf = sum((logs[i] - mean) * (logs[i + lag] - mean) for i in range(len(logs) - lag)) / (len(logs) - lag) / var
        print(f"autocorrelation of the log step time at lag {lag}: {acf:.3f}")
    print("medians of 50-step blocks", [round(statistics.median(ms[i:i + 50]), 2) for i in range(0, len(ms), 50)])


if __name__ == "__main__":
    main()
