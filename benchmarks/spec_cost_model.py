"""What n-gram speculation can gain on this machine: measured step cost by draft count, times the
n-gram proposer replayed on the real greedy output of `pagellm bench latency`'s grounded task.

    .venv/bin/python benchmarks/spec_cost_model.py [DTYPE]     (float32, or auto)

1. Cost: single-stream decode steps that verify k drafts (k = 0..8; the drafts are never accepted, so every
   step yields one token) -> ms per step and its ratio to a plain step (median of 3 rounds).
2. Replay: the grounded prompt's greedy output (identical with and without speculation) is walked as
   the engine would: the real proposer (pagellm.spec_decode.ngram) proposes from the tokens so far, the
   accepted prefix is what matches the output. Predicted speed-up = tokens / sum of the step costs.
3. The same replay for a hypothetical per-draft cost a (cost(k) = 1 + a * k): the a that 2x needs.
Run it alone: the machine has 2 cores.
"""

import statistics
import time

from pagellm import LLM, SamplingParams
from pagellm.bench.common import latency_prompts
from pagellm.spec_decode.ngram import propose_ngram

MAX_K = 8


def step_costs(llm: LLM) -> list[float]:
    """Seconds per decode step (the prefill step excluded) with k drafts, k = 0..MAX_K."""
    eng, times = llm.engine, {k: [] for k in range(MAX_K + 1)}
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    prompt = eng.tokenizer.encode("Tell me a story about a dragon and a knight.")
    for rnd in range(3):
        for k in times:
            def propose(running, k=k):
                for r in running:  # a token the model never picks here: every draft is rejected
                    r.spec_token_ids = [13] * min(k, eng.proposer.budget(r))

            eng.proposer.propose = propose
            eng.add_request(f"cost-{rnd}-{k}", prompt, params)
            eng.step()  # the prefill
            steps, t = 0, time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            times[k].append((time.perf_counter() - t) / steps)
    return [statistics.median(times[k]) for k in range(MAX_K + 1)]


def replay(prompt: list[int], out: list[int], k: int, cost: list[float]) -> tuple[float, float]:
    """(tokens per step, predicted speed-up) of n-gram speculation with k drafts per step."""
    tokens, pos, spent, steps = list(prompt) + out[:1], 1, 0.0, 0
    while pos < len(out):
        drafts = propose_ngram(tokens, min(k, len(out) - pos - 1), 2, 4)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == out[pos + accepted]:
            accepted += 1
        n = min(accepted + 1, len(out) - pos)
        tokens += out[pos:pos + n]
        pos, spent, steps = pos + n, spent + cost[len(drafts)], steps + 1
    return (len(out) - 1) / steps, (len(out) - 1) / spent


def main() -> None:
    import sys

    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    # adaptive drafting off: it would drop the never-accepted drafts and time plain steps instead (it did,
    # until the thirteenth session: the costs printed before then are plain steps')
    llm = LLM(None, dtype=dtype, speculative_method="ngram", num_speculative_tokens=MAX_K, speculative_adaptive=False)
    prompt = latency_prompts(llm.engine.tokenizer, 0, "grounded", 0, 1)[0]
    greedy = LLM(None, dtype=dtype).generate([prompt], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)
    out = list(greedy[0].outputs[0].token_ids)
    costs = step_costs(llm)
    ratio = [c / costs[0] for c in costs]
    print(f"{len(out)} greedy tokens; plain step {1e3 * costs[0]:.2f} ms")
    print("| drafts k | ms per step | cost vs plain | tokens per step | predicted speed-up |")
    print("|---|---|---|---|---|")
    for k in range(1, MAX_K + 1):
        per_step, speedup = replay(prompt, out, k, ratio)
        print(f"| {k} | {1e3 * costs[k]:.2f} | {ratio[k]:.2f} | {per_step:.2f} | {speedup:.2f}x |")
    marginal = (ratio[4] - 1) / 4
    print(f"measured per-draft cost a = {marginal:.3f} of a plain step (k = 4)")
    for a in (0.08, 0.12, 0.16, 0.2, 0.25, 0.3):
        best = max(replay(prompt, out, k, [1 + a * i for i in range(MAX_K + 1)])[1] for k in range(1, MAX_K + 1))
        print(f"if a = {a:.2f}: best predicted speed-up over k = 1..{MAX_K}: {best:.2f}x")


if __name__ == "__main__":
    main()
