"""n-gram speculation at one batch size, plain and speculative engines alternating: each run's decode tok/s and
their ratio, the drafts verified, and the speculation controller's state after it (what it kept, its exploration
period, the step costs it estimates by row count). The grounded task of `pagellm bench latency`, 200 tokens, k = 4.
The fortieth session's batch-4 figures in benchmarks/NOTES.md come from:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/spec_controller_state.py 4 8
"""

import statistics
import sys

from pagellm import LLM
from pagellm.bench.common import latency_prompts, timed_latency_run


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    engines = {}
    for name, extra in (("plain", {}), ("spec", dict(speculative_method="ngram", num_speculative_tokens=4))):
        llm = LLM(dtype="auto", **extra)
        prompts = latency_prompts(llm.engine.tokenizer, llm.engine.model_config.vocab_size, "grounded", 128, batch)
        timed_latency_run(llm, prompts[:1], 8, False)  # the bench's warm-up
        engines[name] = (llm, prompts)
    res = {k: [] for k in engines}
    for i in range(iters):
        for k, (llm, prompts) in engines.items():
            st = llm.engine.scheduler.stats
            d0, a0, s0, steps0 = st.num_draft_tokens, st.num_accepted_tokens, st.num_spec_steps, llm.engine.stats.steps
            res[k].append(timed_latency_run(llm, prompts, 200, False)["decode_tok_s"])
        ctl = engines["spec"][0].engine.spec_controller
        print(f"run {i}: plain {res['plain'][-1]:.1f} spec {res['spec'][-1]:.1f} tok/s, ratio "
              f"{res['spec'][-1] / res['plain'][-1]:.3f}; steps {llm.engine.stats.steps - steps0}, drafts "
              f"{st.num_draft_tokens - d0}, accepted {st.num_accepted_tokens - a0}, request-steps with drafts "
              f"{st.num_spec_steps - s0}; kept {ctl.kept}, exploration period {ctl.every}", flush=True)
        costs = {r: round(ctl.cost(r) * 1000, 2) for r in sorted(ctl.step_cost)}
        print("   step cost ms by rows (at the speed now)", costs, f"speed {ctl.speed:.3f}", flush=True)
    print(f"median ratio {statistics.median(res['spec']) / statistics.median(res['plain']):.3f}")


if __name__ == "__main__":
    main()
