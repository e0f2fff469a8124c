"""`pagellm bench latency`: time to first token and decode speed at small batch sizes, with and without
speculative decoding, on the same engine settings and the same prompts (greedy, so outputs must match)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pagellm.bench import roofline
from pagellm.bench.common import latency_prompts, latency_roofline, print_platform_line, timed_latency_run
from pagellm.bench.report import check_outputs, plot_written, write_json
from pagellm.config import MODE_ONLY_OPTIONS, EngineArgs


def add_latency_parser(bsub) -> None:
    p = bsub.add_parser("latency", help="TTFT and decode tok/s at small batch sizes (optionally speculative)",
                        description="Latency at batch sizes 1, 4, 16...; with --speculative-method, the same "
                                    "runs without speculation too (the two engines' runs alternating), and the "
                                    "speed-up and acceptance are reported.")
    p.add_argument("--task", choices=["grounded", "random"], default="grounded",
                   help="grounded: rewrite a given code block (chat template); random: random token prompts")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens for --task random (default 128)")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="concurrent requests (default 1)")
    p.add_argument("--num-iters", type=int, default=2, help="timed runs per setting; the median is reported")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="draw decode tok/s per batch size")
    EngineArgs.add_cli_args(p)
    from pagellm.bench.peers import add_peer_args

    add_peer_args(p)
    p.set_defaults(func=run_latency)


def _engine(engine_kwargs: dict, ns, batch: int):
    """A warmed-up engine, the batch's prompts, and its draft counters after the warm-up."""
    from pagellm import LLM

    llm = LLM(**engine_kwargs)
    prompts = latency_prompts(llm.engine.tokenizer, llm.engine.model_config.vocab_size, ns.task, ns.input_len, batch)
    timed_latency_run(llm, prompts[:1], min(8, ns.output_len), ns.task == "random")  # warm-up
    return llm, prompts, _spec_counts(llm)


def _spec_counts(llm) -> tuple[int, int, int, int]:
    st = llm.engine.scheduler.stats
    return st.num_draft_tokens, st.num_accepted_tokens, st.num_spec_steps, st.num_preemptions


def _summary(llm, prompts: list[list[int]], counts_before: tuple, runs: list[dict], batch: int) -> dict:
    eng = llm.engine
    # what the roofline needs from the engine; run_latency moves it out of the row
    bytes_ = (roofline.pagellm_weight_bytes(eng.model), eng.bytes_per_block // eng.kv_cache.block_size)
    res = {
        "batch_size": batch,
        "prompt_tokens": len(prompts[0]),
        "output_tokens": runs[0]["output_tokens"],
        "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 1),
        "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
        "token_ids": runs[0]["token_ids"],
        "_bytes": bytes_,
    }
    # drafts counted over the timed runs only
    drafts, accepted, spec_steps, preempted = (now - b for now, b in zip(_spec_counts(llm), counts_before, strict=True))
    if preempted:
        res["preemptions"] = preempted
    peak = min(r["peak_running"] for r in runs)
    if peak < batch or preempted:  # requests waited: the figures are not those of a batch of this size
        res["peak_running"] = peak
    if drafts:
        res["draft_tokens"] = drafts
        res["accepted_tokens"] = accepted
        res["acceptance_rate"] = round(accepted / drafts, 3)
        # vLLM's "mean acceptance length": tokens a verifying step yields, the bonus token included
        res["mean_acceptance_length"] = round(1 + accepted / spec_steps, 2)
    return res


def _batch_row(args: dict, ns, batch: int) -> dict:
    """One batch size's row: the baseline engine, and with a speculative method the speculative one too (their
    engines are gone when it returns)."""
    plain = {k: v for k, v in args.items() if MODE_ONLY_OPTIONS.get(k, ("",))[0] != "speculative_method"}
    engines = {"baseline": _engine(dict(plain, speculative_method=None, draft_model=None), ns, batch)}
    if args.get("speculative_method"):
        engines["speculative"] = _engine(args, ns, batch)
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    # Both engines loaded, their runs alternating: a shared machine's speed drifts over a minute by more than
    # speculation gains or loses at batch 4, and drift then falls on both sides of the ratio.
    for _ in range(ns.num_iters):
        for k, (llm, prompts, _) in engines.items():
            runs[k].append(timed_latency_run(llm, prompts, ns.output_len, ns.task == "random"))
    row = {"batch_size": batch, **{k: _summary(*engine, runs[k], batch) for k, engine in engines.items()}}
    if "speculative" in row:
        base, spec = row["baseline"], row["speculative"]
        spec["speedup"] = round(spec["decode_tok_s"] / base["decode_tok_s"], 2)
        spec["identical_output"] = spec["token_ids"] == base["token_ids"]
    return row


def run_latency(ns: argparse.Namespace) -> int:
    check_outputs(ns.json, ns.plot)
    if ns.input_len is not None and ns.task != "random":  # it was ignored: the grounded prompt is its code block
        raise ValueError("--input-len sets the prompt of --task random; the grounded task's prompt is its code block")
    ns.input_len = 128 if ns.input_len is None else ns.input_len
    for name, value in (("--num-iters", ns.num_iters), ("--output-len", ns.output_len),
                        ("--batch-sizes", min(ns.batch_sizes)), ("--input-len", ns.input_len)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if max(ns.batch_sizes) > ns.max_num_seqs:  # the engine would run it in waves: not a batch of that size
        raise ValueError(f"--batch-sizes {max(ns.batch_sizes)} is more than --max-num-seqs {ns.max_num_seqs} runs "
                         "at once: raise --max-num-seqs to measure that batch")
    print_platform_line(ns.device, ns.num_threads)
    if ns.peer:  # every engine in its own process, one table; all of them ignore EOS
        from pagellm.bench.peers import latency_with_peers

        return latency_with_peers(ns)
    args = vars(EngineArgs.from_cli_args(ns))
    spec_method = args.get("speculative_method")
    rows = [_batch_row(args, ns, batch) for batch in ns.batch_sizes]
    _print_table(rows, spec_method)
    parted = [r["batch_size"] for r in rows if r.get("speculative") and not r["speculative"]["identical_output"]]
    if parted and ns.task == "random":  # (the grounded task's requests are one prompt: they finish together)
        print(f"note: outputs parted at batch {', '.join(map(str, parted))}. Drafts never change a step's "
              "arithmetic, but its rows do (under --dtype auto int8 products up to 6 rows, bf16 above): "
              "speculation makes different prompts finish at different steps, so later steps run fewer rows "
              "than the plain run's, and near-tie tokens may part there")
    short = [f"{r['batch_size']} ({k}: at most {r[k]['peak_running']} at once, {r[k].get('preemptions', 0)} "
             "preemptions)" for r in rows for k in ("baseline", "speculative") if "peak_running" in r.get(k, {})]
    if short:
        print(f"note: not every request of the batch ran at once at batch {', '.join(short)}: the KV cache (or "
              "the step's token budget) held fewer; raise --kv-cache-memory to measure that batch size")
    rl = _roofline(rows, spec_method, args["model"], args.get("num_threads"))
    for r in rows:  # token ids only served the identity check
        for k in ("baseline", "speculative"):
            r.get(k, {}).pop("token_ids", None)
            r.get(k, {}).pop("_bytes", None)
    report = {"benchmark": "latency", "date": time.strftime("%Y-%m-%d"), "task": ns.task,
              "command": "pagellm " + " ".join(sys.argv[1:]), "engine_args": args, "results": rows, "roofline": rl}
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:
        _plot(rows, spec_method, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    return 0


def _roofline(rows: list[dict], spec_method: str | None, model: str, threads: int | None) -> dict:
    """Decode floors of the baseline rows (a speculative step yields several tokens, so its figure may pass
    the one-token-per-step floor: its ratio is reported as well, as the speculative row's)."""
    from pagellm.model.loader import load_config, resolve_model_path

    weight_bytes, kv_per_token = rows[0]["baseline"]["_bytes"]  # every batch size loads the same model
    rl = latency_roofline(load_config(resolve_model_path(model)),
                          {"pagellm": (weight_bytes, kv_per_token, [r["baseline"] for r in rows])}, threads)
    if spec_method:
        for r, fl in zip(rows, rl["engines"]["pagellm"]["decode"], strict=True):
            measured = r["speculative"]["decode_tok_s"]
            fl["speculative_measured_over_floor"] = roofline.significant(measured / fl["floor_tok_s"])
    return rl


def _print_table(rows: list[dict], spec_method: str | None) -> None:
    head = f"{'batch':>5} {'TTFT ms':>8} {'decode tok/s':>12}"
    if spec_method:
        head += f" | {spec_method + ' tok/s':>12} {'speed-up':>8} {'accept':>6} {'acc len':>8} {'same out':>8}"
    print(head)
    for r in rows:
        b = r["baseline"]
        line = f"{r['batch_size']:>5} {b['ttft_ms']:>8} {b['decode_tok_s']:>12}"
        s = r.get("speculative")
        if s:
            line += (f" | {s['decode_tok_s']:>12} {s['speedup']:>8} {s.get('acceptance_rate', 0):>6} "
                     f"{s.get('mean_acceptance_length', 0):>8} {str(s['identical_output']):>8}")
        print(line)


def _plot(rows: list[dict], spec_method: str | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [str(r["batch_size"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38 if spec_method else 0.6
    ax.bar([i - (width / 2 if spec_method else 0) for i in range(len(xs))],
           [r["baseline"]["decode_tok_s"] for r in rows], width, label="no speculation")
    if spec_method:
        ax.bar([i + width / 2 for i in range(len(xs))], [r["speculative"]["decode_tok_s"] for r in rows], width,
               label=f"{spec_method} speculation")
    ax.set_xticks(range(len(xs)), xs)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("pagellm decode speed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
