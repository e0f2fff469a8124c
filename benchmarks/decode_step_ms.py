"""Milliseconds per decode step under `--dtype auto` at each batch size, with 16-token and with 400-token prompts
(random ids, greedy, `ignore_eos`, prefix caching off): the difference is what attending to the longer context
costs a step. Each figure is (66-token run - 2-token run) / 64 with the same prompts, so the prefill cancels. The
figures in benchmarks/NOTES.md (seventeenth session) come from:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/decode_step_ms.py 8,32,64

Run it alone: the machine has 2 cores. Each figure's runs start at the `time.monotonic()` printed before it,
so a profile can take just those seconds (the eighteenth session's breakdown of a 64-row step):

    perf record -k CLOCK_MONOTONIC -e cpu-clock -F 1999 -g -o /tmp/p.data \\
        .venv/bin/python benchmarks/decode_step_ms.py 64
    perf report -i /tmp/p.data --time START,END --no-children --sort dso,symbol -g none
"""

import sys
import time

import torch

from pagellm import LLM, SamplingParams


def main() -> None:
    batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "8,32,64").split(",")]
    llm = LLM(None, dtype="auto", enable_prefix_caching=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # kernel build, first touches
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        for prompt_len in (16, 400):
            prompts = [torch.randint(100, 40000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
            seconds = []
            print(f"monotonic {time.monotonic():.3f}: batch {batch}, {prompt_len}-token prompts", flush=True)
            for out in (2, 66):
                params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - t0)
            print(f"batch {batch}, {prompt_len}-token prompts: {(seconds[1] - seconds[0]) / 64 * 1e3:.1f} ms per "
                  "decode step", flush=True)


if __name__ == "__main__":
    main()
