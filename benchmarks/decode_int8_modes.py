"""Single-stream decode under `--dtype auto` with each activation mode of the few-row products, engines in
turn in one process (the machine drifts between runs, so only ratios within one run mean much): float32 x
(`--no-int8-activations`), llama.cpp's int8 (`--int8-activations`), and the platform's choice (two-plane
int8 where the build has AVX-512 VNNI). W1's shape: a 128-token random prompt, 256 greedy tokens; output
tok/s including the prefill, three rounds after a warm-up.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/decode_int8_modes.py
"""

from __future__ import annotations

import random
import time

from pagellm import LLM, SamplingParams


def main() -> None:
    engines = {name: LLM(None, dtype="auto", enable_prefix_caching=False, int8_activations=mode)
               for name, mode in (("float32 x", False), ("int8", True), ("auto (platform's choice)", None))}
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]}
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(4):
        for name, llm in engines.items():
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if round_:  # the first round warms up
                rates[name].append(256 / (time.perf_counter() - t))
    for name, r in rates.items():
        print(f"{name}: " + " ".join(f"{x:.1f}" for x in r) + " tok/s")


if __name__ == "__main__":
    main()
