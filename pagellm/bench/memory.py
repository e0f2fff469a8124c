"""`pagellm bench memory`: what the paged KV cache saves, measured on the engine itself.

a. shared system prompt: blocks held at peak and TTFT, with and without prefix caching;
b. parallel sampling (n > 1) versus the same number of independent requests (copy-on-write only);
c. fragmentation of the throughput workload versus a contiguous max_model_len reservation per request.

Peak blocks are sampled right after each `schedule()`: that is when a step's allocations are all made
and before finished requests give theirs back.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass

from pagellm import cli_types
from pagellm.bench.common import machine_info
from pagellm.bench.report import check_outputs, plot_written, write_json
from pagellm.bench.workload import BenchRequest, random_workload
from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


@dataclass
class StepSample:
    blocks: int  # device blocks held by live requests (cached-but-free ones count as free)
    tokens: int  # KV slots that hold a token once this step's forward has run
    seqs: int  # live sequences
    reserved_max_tokens: int  # slots a contiguous cache reserving prompt + max_tokens per sequence holds


def sample(sched: Scheduler, out) -> StepSample:
    new = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    live = sched.running
    kv = sched.kv_cache
    return StepSample(
        blocks=kv.num_blocks - kv.pool.num_free,
        tokens=sum(r.num_computed_tokens + new.get(r.request_id, 0) for r in live),
        seqs=len(live),
        reserved_max_tokens=sum(r.num_prompt_tokens + (r.params.max_tokens or 0) for r in live))


@contextlib.contextmanager
def track_blocks(sched: Scheduler):
    """Record a StepSample after every schedule() of this scheduler while the block is open.
    Wrapping the instance (not the engine loop) sees exactly what the engine's own step sees."""
    samples: list[StepSample] = []
    original = sched.schedule

    def schedule():
        out = original()
        samples.append(sample(sched, out))
        return out

    sched.schedule = schedule
    try:
        yield samples
    finally:
        del sched.schedule  # back to the class method


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]  # low ids hold special tokens


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@contextlib.contextmanager
def _prefix_caching(engine, enabled: bool):
    """Toggle prefix caching on a live engine between runs (no request may be in flight), cold cache."""
    kv = engine.kv_cache
    before = kv.enable_caching
    if engine.has_unfinished_requests() or not engine.reset_prefix_cache():
        raise RuntimeError("prefix caching can only be toggled on an idle engine")
    kv.enable_caching = enabled
    try:
        yield
    finally:
        kv.enable_caching = before
        engine.reset_prefix_cache()


def _run_until(engine, t_add: dict[str, float], ttft: dict[str, float], done) -> None:
    while not done():
        for out in engine.step():
            rid = out.request_id
            if rid not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[rid] = time.perf_counter() - t_add[rid]


def shared_prefix(engine, caching: bool, num_requests: int = 32, prefix_len: int = 1024,
                  question_len: int = 32, max_tokens: int = 16, seed: int = 0) -> dict:
    """Requests = one shared prefix + a distinct question each. The first is submitted alone and
    prefilled before the rest arrive: a prefix cache can only serve what has already been computed."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prefix = _ids(rng, prefix_len, vocab)
    prompts = [prefix + _ids(rng, question_len, vocab) for _ in range(num_requests)]
    t_add: dict[str, float] = {}
    ttft: dict[str, float] = {}
    hits0 = engine.kv_cache.prefix_hits
    with _prefix_caching(engine, caching), track_blocks(engine.scheduler) as samples:
        t0 = time.perf_counter()
        first = f"shared-{int(caching)}-0"
        for i, prompt in enumerate(prompts):
            rid = f"shared-{int(caching)}-{i}"
            t_add[rid] = time.perf_counter()
            engine.add_request(rid, prompt, _greedy(max_tokens))
            if i == 0:
                _run_until(engine, t_add, ttft, lambda: first in ttft)
        _run_until(engine, t_add, ttft, lambda: not engine.has_unfinished_requests())
        elapsed = time.perf_counter() - t0
    rest = [ttft[r] for r in list(t_add)[1:]]
    return {"prefix_caching": caching, "peak_blocks": max(s.blocks for s in samples),
            "ttft_first_s": round(ttft[first], 3),
            "ttft_mean_rest_s": round(sum(rest) / len(rest), 3) if rest else None,
            "prefix_hit_tokens": engine.kv_cache.prefix_hits - hits0, "elapsed_s": round(elapsed, 2)}


def shared_prefix_bench(engine, num_requests: int, prefix_len: int, question_len: int,
                        max_tokens: int) -> dict:
    bs = engine.kv_cache.block_size
    # KV slots a request fills: every token but the last sampled one, which is never fed back.
    per_req = cdiv(prefix_len + question_len + max_tokens - 1, bs)
    shared = prefix_len // bs
    runs = [shared_prefix(engine, c, num_requests, prefix_len, question_len, max_tokens) for c in (False, True)]
    off, on = runs
    return {"num_requests": num_requests, "prefix_len": prefix_len, "question_len": question_len,
            "max_tokens": max_tokens, "prefix_blocks": shared,
            "ideal_blocks_unshared": num_requests * per_req,
            "ideal_blocks_shared": shared + num_requests * (per_req - shared),
            "without_cache": off, "with_cache": on,
            "ttft_ratio": round(on["ttft_mean_rest_s"] / off["ttft_mean_rest_s"], 4)
            if on["ttft_mean_rest_s"] and off["ttft_mean_rest_s"] else None,
            "note": "request 0 is submitted alone and prefilled first; the other requests arrive together "
                    "after its first token. TTFT = add_request to first output token, mean over those "
                    "later requests; request 0's TTFT (a full prefill either way) is reported apart."}


def parallel_sampling_bench(engine, n: int = 8, prompt_len: int = 512, max_tokens: int = 16,
                            seed: int = 0) -> dict:
    """n samples of one prompt (forked block tables) versus n independent requests, prefix caching off. The
    samples are seeded draws (n greedy samples would be one sequence: nothing to fork)."""
    prompt = _ids(random.Random(seed), prompt_len, engine.model_config.vocab_size)
    kv = engine.kv_cache
    result = {"n": n, "prompt_len": prompt_len, "max_tokens": max_tokens}
    sampled = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    for name, reqs in (("parallel", [(SamplingParams(n=n, seed=seed, **sampled), "par")]),
                       ("independent", [(SamplingParams(seed=seed + i, **sampled), f"ind-{i}") for i in range(n)])):
        cow0 = kv.num_cow_copies
        with _prefix_caching(engine, False), track_blocks(engine.scheduler) as samples:
            t0 = time.perf_counter()
            for params, rid in reqs:
                engine.add_request(rid, prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - t0
        result[name] = {"peak_blocks": max(s.blocks for s in samples), "cow_copies": kv.num_cow_copies - cow0,
                        "elapsed_s": round(elapsed, 2)}
    result["ideal_blocks_independent"] = n * cdiv(prompt_len + max_tokens - 1, engine.kv_cache.block_size)
    result["block_ratio"] = round(result["parallel"]["peak_blocks"] / result["independent"]["peak_blocks"], 4)
    return result


def replay_block_usage(config, num_blocks: int, block_size: int, workload: list[BenchRequest]) -> list[StepSample]:
    """Drive a fresh Scheduler + KVCacheManager with the engine's settings through the workload, the
    model replaced by a constant token. With ignore_eos, fixed output lengths and no prefix caching,
    token values cannot change any allocation, so this is the engine's block usage without the compute
    (tests/test_bench_memory.py checks it step by step against a real engine)."""
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=False))
    for i, r in enumerate(workload):
        sched.add_request(Request(f"replay-{i}", r.prompt_token_ids, _greedy(r.output_len)))
    samples = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        samples.append(sample(sched, out))
        sched.update(out, {s.request.request_id: 0 for s in out.scheduled if s.samples})
    return samples


def _fits(lengths: list[int], budget: int) -> int:
    """How many sequences, taking `lengths` in order (cycled), fit in `budget` units at once."""
    used = count = 0
    for n in itertools.cycle(lengths):
        if used + n > budget:
            return count
        used += n
        count += 1
    return 0


def fragmentation_bench(engine, num_prompts: int = 64, contiguous_len: int = 2048, seed: int = 0) -> dict:
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    workload = random_workload(num_prompts, engine.model_config.vocab_size, (32, 512), (16, 256), seed)
    samples = replay_block_usage(engine.scheduler.config, kv.num_blocks, bs, workload)
    peak = max(samples, key=lambda s: s.blocks)
    slots = sum(s.blocks * bs for s in samples)
    full = [len(r.prompt_token_ids) + r.output_len for r in workload]
    if contiguous_len < max(full):
        raise ValueError(f"--contiguous-len {contiguous_len} cannot hold this workload's longest request "
                         f"({max(full)} tokens)")
    capacity = kv.num_blocks * bs

    def waste(allocated: int, tokens: int) -> float:
        return round(1 - tokens / allocated, 4) if allocated else 0.0

    return {
        "workload": f"random_workload({num_prompts}, vocab, (32, 512), (16, 256), seed={seed})",
        "method": "the engine's Scheduler + KVCacheManager stepped through the whole workload with the model "
                  "replaced by a constant token (allocation does not depend on token values here); sampled "
                  "after every schedule()",
        "steps": len(samples), "kv_blocks": kv.num_blocks, "block_size": bs, "kv_capacity_tokens": capacity,
        "contiguous_len": contiguous_len,
        "peak": {"blocks": peak.blocks, "seqs": peak.seqs, "tokens": peak.tokens,
                 "paged_waste": waste(peak.blocks * bs, peak.tokens),
                 "contiguous_slots": peak.seqs * contiguous_len,
                 "contiguous_waste": waste(peak.seqs * contiguous_len, peak.tokens),
                 "reserve_max_tokens_slots": peak.reserved_max_tokens,
                 "reserve_max_tokens_waste": waste(peak.reserved_max_tokens, peak.tokens)},
        "paged_waste_all_steps": waste(slots, sum(s.tokens for s in samples)),
        "max_concurrent": {"paged": _fits([cdiv(n, bs) for n in full], kv.num_blocks),
                           "reserve_max_tokens": _fits(full, capacity),
                           "contiguous": capacity // contiguous_len},
        "max_concurrent_note": "sequences of this workload's lengths (taken in order, cycled) that fit at "
                               "their full prompt + output length in the same KV budget at once",
    }


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows)


def format_report(rep: dict) -> str:
    a, b, c = rep["shared_prefix"], rep["parallel_sampling"], rep["fragmentation"]
    off, on = a["without_cache"], a["with_cache"]
    pct = "{:.1%}".format
    lines = [
        f"KV cache: {rep['kv_cache']['num_blocks']} blocks x {rep['kv_cache']['block_size']} tokens",
        "",
        f"a. shared prefix: {a['num_requests']} requests = {a['prefix_len']}-token prefix + "
        f"{a['question_len']}-token question, {a['max_tokens']} output tokens",
        _table([("", "peak blocks", "ideal", "TTFT req 0 (s)", "mean TTFT others (s)"),
                ("without prefix cache", off["peak_blocks"], a["ideal_blocks_unshared"], off["ttft_first_s"],
                 off["ttft_mean_rest_s"]),
                ("with prefix cache", on["peak_blocks"], a["ideal_blocks_shared"], on["ttft_first_s"],
                 on["ttft_mean_rest_s"])]),
        f"   TTFT with / without: {a['ttft_ratio']}; prefix = {a['prefix_blocks']} blocks. {a['note']}",
        "",
        f"b. parallel sampling: n={b['n']} on a {b['prompt_len']}-token prompt, {b['max_tokens']} output "
        "tokens, prefix caching off",
        _table([("", "peak blocks", "CoW copies"),
                (f"n={b['n']} (forked)", b["parallel"]["peak_blocks"], b["parallel"]["cow_copies"]),
                (f"{b['n']} independent requests", b["independent"]["peak_blocks"],
                 b["independent"]["cow_copies"])]),
        f"   ratio {b['block_ratio']}",
        "",
        f"c. fragmentation: {c['workload']}, {c['steps']} steps; {c['method']}",
        f"   peak: {c['peak']['seqs']} sequences, {c['peak']['blocks']} blocks, {c['peak']['tokens']} tokens",
        _table([("allocation", "slots at peak", "empty at peak", "max concurrent seqs"),
                (f"paged ({c['block_size']}-token blocks)", c["peak"]["blocks"] * c["block_size"],
                 pct(c["peak"]["paged_waste"]), c["max_concurrent"]["paged"]),
                ("contiguous, prompt + max_tokens", c["peak"]["reserve_max_tokens_slots"],
                 pct(c["peak"]["reserve_max_tokens_waste"]), c["max_concurrent"]["reserve_max_tokens"]),
                (f"contiguous, max_model_len={c['contiguous_len']}", c["peak"]["contiguous_slots"],
                 pct(c["peak"]["contiguous_waste"]), c["max_concurrent"]["contiguous"])]),
        f"   paged empty slots over all steps: {pct(c['paged_waste_all_steps'])}. "
        f"Max concurrent: {c['max_concurrent_note']} ({c['kv_capacity_tokens']} tokens).",
    ]
    return "\n".join(lines)


def plot_report(rep: dict, path: str) -> None:
    from matplotlib.figure import Figure  # not pyplot: no global state, no display needed

    a, b, c = rep["shared_prefix"], rep["parallel_sampling"], rep["fragmentation"]
    fig = Figure(figsize=(16, 4), layout="constrained")
    axes = fig.subplots(1, 4)
    panels = [
        (f"a. {a['num_requests']} reqs, {a['prefix_len']}-tok shared prefix", "peak KV blocks",
         ["no cache", "prefix cache"], [a["without_cache"]["peak_blocks"], a["with_cache"]["peak_blocks"]]),
        ("a. mean TTFT (later requests)", "seconds", ["no cache", "prefix cache"],
         [a["without_cache"]["ttft_mean_rest_s"], a["with_cache"]["ttft_mean_rest_s"]]),
        (f"b. n={b['n']}, {b['prompt_len']}-tok prompt", "peak KV blocks", ["forked", "independent"],
         [b["parallel"]["peak_blocks"], b["independent"]["peak_blocks"]]),
        (f"c. empty KV slots at peak ({c['peak']['seqs']} seqs)", "% of allocated",
         ["paged", "prompt+max", f"{c['contiguous_len']}/seq"],
         [100 * c["peak"][k] for k in ("paged_waste", "reserve_max_tokens_waste", "contiguous_waste")]),
    ]
    for ax, (title, ylabel, labels, values) in zip(axes, panels, strict=True):
        bars = ax.bar(labels, values, color=["tab:orange", "tab:blue", "tab:gray"][:len(values)])
        ax.bar_label(bars, fmt="%.4g")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
    fig.suptitle(f"pagellm KV memory ({rep['model']})", fontsize=11)
    fig.savefig(path, dpi=110)


# ---- command line ------------------------------------------------------------------------------

def add_memory_parser(bsub) -> None:
    m = bsub.add_parser("memory", help="KV-cache memory: prefix sharing, parallel sampling, fragmentation",
                        description="KV blocks at peak with and without prefix caching, n>1 forks versus "
                                    "independent requests, and paged versus contiguous waste.")
    m.add_argument("--shared-requests", type=cli_types.positive_int, default=32,
                   help="requests sharing the prefix (default 32)")
    m.add_argument("--prefix-len", type=cli_types.positive_int, default=1024,
                   help="shared prefix tokens (default 1024)")
    m.add_argument("--question-len", type=cli_types.positive_int, default=32,
                   help="distinct tokens per request (default 32)")
    m.add_argument("--max-tokens", type=cli_types.positive_int, default=16,
                   help="output tokens in a. and b. (default 16)")
    m.add_argument("--parallel-n", type=cli_types.positive_int, default=8,
                   help="n of the parallel-sampling request (default 8)")
    m.add_argument("--parallel-prompt-len", type=cli_types.positive_int, default=512,
                   help="its prompt tokens (default 512)")
    m.add_argument("--num-prompts", type=cli_types.positive_int, default=64,
                   help="requests of the fragmentation workload")
    m.add_argument("--contiguous-len", type=int, default=2048,
                   help="per-request reservation of the contiguous baseline (default 2048)")
    m.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    m.add_argument("--plot", default=None, metavar="PATH", help="draw bar charts to this PNG")
    EngineArgs.add_cli_args(m)
    # 32 x 1,071 tokens unshared need ~2,150 blocks: more than the usual 1GiB default holds.
    m.set_defaults(func=_memory, kv_cache_memory="2GiB")


def _warm_up(engine) -> None:
    """One short request first, so that no measured TTFT pays for the first forward's one-time costs."""
    with _prefix_caching(engine, False):
        engine.add_request("warm-up", list(range(100, 164)), _greedy(2))
        while engine.has_unfinished_requests():
            engine.step()


def run_memory_bench(engine, ns: argparse.Namespace) -> dict:
    _warm_up(engine)
    return {
        "kv_cache": {"num_blocks": engine.kv_cache.num_blocks, "block_size": engine.kv_cache.block_size,
                     "bytes_per_block": engine.bytes_per_block},
        "model": os.path.basename(engine.model_path),
        "shared_prefix": shared_prefix_bench(engine, ns.shared_requests, ns.prefix_len, ns.question_len,
                                             ns.max_tokens),
        "parallel_sampling": parallel_sampling_bench(engine, ns.parallel_n, ns.parallel_prompt_len, ns.max_tokens),
        "fragmentation": fragmentation_bench(engine, ns.num_prompts, ns.contiguous_len),
    }


def _memory(ns: argparse.Namespace) -> int:
    from pagellm.engine.llm_engine import LLMEngine

    check_outputs(ns.json, ns.plot)  # before a run that takes minutes
    engine = LLMEngine(EngineArgs.from_cli_args(ns))
    report = {"benchmark": "memory", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
              "command": "pagellm " + " ".join(sys.argv[1:]), "engine_args": vars(engine.args),
              **run_memory_bench(engine, ns)}
    print(format_report(report))
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:  # its directory made by check_outputs
        plot_report(report, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    return 0


