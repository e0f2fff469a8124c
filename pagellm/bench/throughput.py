"""Offline throughput: submit the whole workload at once and time until every request finishes."""

from __future__ import annotations

import time

from pagellm.bench.workload import BenchRequest, check_fits


def warm_up_pagellm(llm, prompts: list[list[int]]) -> None:
    from pagellm import SamplingParams

    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)


def run_pagellm_throughput(llm, workload: list[BenchRequest], warm_up: bool = True) -> dict:
    from pagellm import SamplingParams

    check_fits([(len(r.prompt_token_ids), r.output_len) for r in workload], llm.engine.max_model_len)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    prompts = [r.prompt_token_ids for r in workload]
    if warm_up:
        warm_up_pagellm(llm, prompts)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(r.output_len for r in workload)
    if n_out != expected:
        raise RuntimeError(f"engine produced {n_out} output tokens, the workload asks for {expected}")
    return summarize("pagellm", workload, elapsed)


def summarize(engine: str, workload: list[BenchRequest], elapsed: float) -> dict:
    n_in = sum(len(r.prompt_token_ids) for r in workload)
    n_out = sum(r.output_len for r in workload)
    return {
        "engine": engine,
        "num_requests": len(workload),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
    }
