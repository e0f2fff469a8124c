"""Where speculative and plain greedy outputs part on `bench latency --task random`'s prompts, and how many
requests each run had left at that step. Under `--dtype auto` a step's products are int8 up to 6 rows and bf16
above; speculation finishes different prompts at different steps, so the speculative run's later steps have
fewer rows than the plain run's, and near-tie tokens may part there (the thirty-third session: at batch 16, a
request parted at its token 114 of 200 with 5 requests left in the speculative run, 16 in the plain one).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/spec_parting.py [--batch 16]
"""

from __future__ import annotations

import argparse

from pagellm import LLM, SamplingParams, cli_types
from pagellm.bench.common import latency_prompts
from pagellm.config import COMPUTE_DTYPES


def run(batch: int, dtype: str, spec: bool) -> tuple[dict[str, list[int]], list[tuple[int, dict[str, int]]]]:
    """Each request's output, and per step (requests running before it, output lengths after it)."""
    kw = {"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}
    eng = LLM(None, dtype=dtype, **kw).engine
    prompts = latency_prompts(eng.tokenizer, eng.model_config.vocab_size, "random", 128, batch)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outs, lens, log = {}, {}, []
    while eng.has_unfinished_requests():
        running = batch - len(outs)
        for o in eng.step():
            lens[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        log.append((running, dict(lens)))
    return outs, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=cli_types.positive_int, default=16)
    ap.add_argument("--dtype", default="auto", choices=list(COMPUTE_DTYPES))
    ns = ap.parse_args()
    try:  # a dtype this CPU cannot run (float16): one line, as the CLI says it
        plain, plain_log = run(ns.batch, ns.dtype, False)
    except ValueError as e:
        ap.error(str(e))
    spec, spec_log = run(ns.batch, ns.dtype, True)
    parted = 0
    for rid in sorted(plain, key=int):
        at = next((j for j, (a, b) in enumerate(zip(plain[rid], spec[rid], strict=True)) if a != b), None)
        if at is None:
            continue
        parted += 1
        # the step that produced token `at`: the first whose output length passed it
        left = {name: next(r for r, lens in log if lens.get(rid, 0) > at)
                for name, log in (("plain", plain_log), ("speculative", spec_log))}
        print(f"request {rid} parts at output token {at} of {len(plain[rid])}: requests running then "
              f"{left['plain']} (plain) vs {left['speculative']} (speculative)")
    print(f"{parted} of {ns.batch} requests parted")


if __name__ == "__main__":
    main()
