"""The speculation controller's predictions against what its drafting steps did: for each step where it kept drafts
(at a batch size whose plain step it has measured), the accepted drafts it expected (the kept drafts' values) and
the step cost it expected, against the accepted drafts and the seconds the step took. Grounded task at one batch size,
200 tokens, k = 4, one speculative engine, several runs. The fortieth session's figures in benchmarks/NOTES.md:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/spec_controller_calibration.py 4 4
"""

import sys

import pagellm.engine.llm_engine as llm_engine
from pagellm import LLM
from pagellm.bench.common import latency_prompts, timed_latency_run

TOTALS = ("steps", "predicted", "accepted", "predicted_s", "seconds", "plain_s")


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    llm = LLM(dtype="auto", speculative_method="ngram", num_speculative_tokens=4)
    prompts = latency_prompts(llm.engine.tokenizer, llm.engine.model_config.vocab_size, "grounded", 128, batch)
    timed_latency_run(llm, prompts[:1], 8, False)
    ctl = llm.engine.spec_controller
    totals, step = dict.fromkeys(TOTALS, 0.0), {}  # step: the drafting step under way
    plan, observe_request, observe_step = ctl.plan, ctl.observe_request, ctl.observe_step

    def wrapped_plan(proposals, batch_rows):
        keep = plan(proposals, batch_rows)
        step.clear()
        kept = sum(keep.values())
        if kept and batch_rows in ctl.step_cost:
            step.update(rows=batch_rows + kept, accepted=0, predicted_s=ctl.cost(batch_rows + kept),
                        plain_s=ctl.cost(batch_rows),
                        predicted=sum(sum(ctl.draft_values(rid, k)) for rid, k in keep.items() if k))
        return keep

    def wrapped_observe_request(rid, drafted, accepted):
        if step:
            step["accepted"] += accepted
        return observe_request(rid, drafted, accepted)

    def wrapped_observe_step(rows, seconds):
        if step.get("rows") == rows:
            step["seconds"] = seconds
        return observe_step(rows, seconds)

    ctl.plan, ctl.observe_request, ctl.observe_step = wrapped_plan, wrapped_observe_request, wrapped_observe_step
    observe = llm_engine.LLMEngine._observe_speculation

    def counted(self, sched_out, sampled, seconds):  # a step's requests are all observed before it ends
        observe(self, sched_out, sampled, seconds)
        if "seconds" in step:
            totals["steps"] += 1
            for key in ("predicted", "accepted", "predicted_s", "seconds", "plain_s"):
                totals[key] += step[key]
            step.clear()

    llm_engine.LLMEngine._observe_speculation = counted
    for i in range(runs):
        totals.update(dict.fromkeys(TOTALS, 0.0))
        tok_s = timed_latency_run(llm, prompts, 200, False)["decode_tok_s"]
        n = max(totals["steps"], 1)
        print(f"run {i}: {tok_s:.1f} tok/s; {totals['steps']:.0f} drafting steps: accepted drafts per step "
              f"{totals['predicted'] / n:.2f} predicted, {totals['accepted'] / n:.2f} real; step ms "
              f"{1e3 * totals['predicted_s'] / n:.2f} predicted, {1e3 * totals['seconds'] / n:.2f} real "
              f"(a plain step: {1e3 * totals['plain_s'] / n:.2f} predicted)", flush=True)


if __name__ == "__main__":
    main()
