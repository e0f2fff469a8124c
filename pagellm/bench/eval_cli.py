"""`pagellm eval`: the parser, one configuration or a --matrix of them against one baseline, the table, the
JSON (rewritten after every row, so a stopped matrix resumes where it stopped) and the plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pagellm import cli_types
from pagellm.bench.report import check_outputs, plot_written

# The columns printed per configuration (every figure is in the JSON).
_COLUMNS = (("perplexity", "ppl", "{:.4f}"), ("kl_mean", "kl_mean", "{:.2e}"), ("kl_p99", "kl_p99", "{:.2e}"),
            ("greedy_agreement", "greedy", "{:.3f}"), ("greedy_agreement_worst", "worst", "{:.3f}"),
            ("top1_agreement_wide_margin", "top1_wide", "{:.4f}"), ("weights_bytes", "weights_MiB", "MiB"),
            ("kv_bytes_per_token", "kv_B/tok", "{}"), ("kv_tokens", "kv_tokens", "{}"),
            ("prefill_tok_s", "prefill_tok/s", "{:.0f}"), ("decode_tok_s", "decode_tok/s", "{:.1f}"),
            ("wall_s", "wall_s", "{:.0f}"))


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="quality of a configuration against a float32 baseline",
                       description="Perplexity, greedy agreement, teacher-forced KL and top-1 agreement of a "
                                   "configuration against a float32 baseline on a shipped text and 16 prompts, "
                                   "with weight/KV bytes and speed (pagellm/bench/eval_quality.py).")
    e.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2 GGUF)")
    e.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    e.add_argument("-q", "--quantization", default="auto", help="weight format, passed to the engine as given")
    e.add_argument("--dtype", default="float32", help="compute dtype (float32|auto|bfloat16)")
    e.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype, passed to the engine as given")
    e.add_argument("--int8-activations", action="store_true", help="packed matmuls round activations to int8")
    e.add_argument("--baseline", default=None, help="baseline model path (default: --model)")
    e.add_argument("--baseline-quantization", default="none",
                   help="baseline weight format (default none: dequantized to float32)")
    e.add_argument("--text", default=None, help="perplexity text file (default: the shipped text)")
    e.add_argument("--prompts", default=None, help="JSON list of prompts (default: the shipped 16)")
    e.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send prompts as they are (default: through the model's chat template)")
    e.add_argument("--max-tokens", type=int, default=256, help="greedy tokens per prompt (default 256)")
    e.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget of both engines (default 1GiB)")
    e.add_argument("--score-chunk", type=int, default=16,
                   help="rows per teacher-forced forward (default 16: the few-row path decoding runs on)")
    e.add_argument("--margin", type=cli_types.nonnegative_number, default=1.0,
                   help="top1_agreement_wide_margin counts positions whose baseline top-1 beats top-2 by more "
                        "than this many nats (default 1.0)")
    e.add_argument("--decode-tokens", type=int, default=64, help="single-stream tokens timed (default 64)")
    e.add_argument("--num-threads", type=int, default=None, help="torch threads (default: the platform's)")
    e.add_argument("--matrix", default=None, metavar="CONFIGS.json",
                   help='a JSON list of configurations, each {"name": ..., EngineArgs fields...}, run against '
                        "one baseline; rows already in --json with the same configuration are kept")
    e.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    e.add_argument("--plot", default=None, metavar="PATH.png", help="bar charts of kl_p99, agreement, kv_tokens")
    e.set_defaults(func=run_eval)


def run_eval(ns: argparse.Namespace) -> int:
    # imported here: `pagellm --help` and the other subcommands need not load torch for this one
    from pagellm.bench.eval_quality import (
        BASELINE_CONFIG,
        check_paths,
        config_of,
        engine_args,
        load_eval_data,
        run_candidate,
        run_reference,
    )
    from pagellm.platforms import get_platform

    check_outputs(ns.json, ns.plot)
    for name in ("max_tokens", "score_chunk", "decode_tokens"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    data = load_eval_data(ns.text, ns.prompts)
    configs = _matrix(ns.matrix) if ns.matrix else [(_single_name(ns), {
        "quantization": ns.quantization, "dtype": ns.dtype, "kv_cache_dtype": ns.kv_cache_dtype,
        "int8_activations": ns.int8_activations})]
    base_args = engine_args(ns.baseline or ns.model, ns.tokenizer, ns.kv_cache_memory, ns.num_threads,
                            dict(BASELINE_CONFIG, quantization=ns.baseline_quantization))
    # every configuration is validated before the baseline spends a minute loading and generating
    runs = [(name, engine_args(ns.model, ns.tokenizer, ns.kv_cache_memory, ns.num_threads, cfg))
            for name, cfg in configs]
    settings = {"max_tokens": ns.max_tokens, "score_chunk": ns.score_chunk, "margin": ns.margin, "chat": ns.chat,
                "decode_tokens": ns.decode_tokens, "text": data.text_source, "prompts": data.prompts_source}
    report = {"benchmark": "eval", "date": time.strftime("%Y-%m-%d"), "command": "pagellm " + " ".join(sys.argv[1:]),
              "platform": None, "baseline": config_of(base_args), "settings": settings, "results": []}
    done = _previous_rows(ns.json, report) if ns.matrix else {}
    # the paths of what will run (a resumed matrix's finished rows do not, and their models may be gone)
    pending = [args for name, args in runs if _row_key(name, config_of(args)) not in done]
    for args in ([base_args] if pending else []) + pending:
        check_paths(args)
    report["platform"] = get_platform("cpu").summary_line()
    print(report["platform"], flush=True)
    ref = None
    for name, args in runs:
        row = done.get(_row_key(name, config_of(args)))
        if row is not None:
            print(f"{name}: kept from {ns.json}", flush=True)
        else:
            if ref is None:
                ref = run_reference(base_args, data, ns.max_tokens, ns.score_chunk, ns.chat)
                report["baseline_wall_s"] = round(ref.wall_s, 1)
                report["baseline_phase_s"] = ref.phase_s
                print(f"baseline {report['baseline']}: perplexity {ref.perplexity:.4f}, "
                      f"{sum(map(len, ref.outputs))} greedy tokens over {len(ref.outputs)} prompts "
                      f"({ref.wall_s:.0f} s: {ref.phase_s})", flush=True)
            figures = run_candidate(args, data, ref, ns.score_chunk, ns.chat, ns.margin, ns.decode_tokens)
            row = {"name": name, "config": config_of(args), **figures}
        report["results"].append(row)
        _print_row(row, header=len(report["results"]) == 1)
        if ns.json:
            _write(ns.json, report)
    if ns.json:
        print(f"wrote {ns.json}")
    if ns.plot:
        plot_eval(report, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    return 0


def _single_name(ns: argparse.Namespace) -> str:
    parts = [f"q={ns.quantization}", f"dtype={ns.dtype}", f"kv={ns.kv_cache_dtype}"]
    return " ".join(parts + (["int8-act"] if ns.int8_activations else []))


def _matrix(path: str) -> list[tuple[str, dict]]:
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"matrix file {path}: cannot be read as JSON ({getattr(e, 'strerror', None) or e})") \
            from None
    if not isinstance(items, list) or not items or not all(isinstance(c, dict) for c in items):
        raise ValueError(f'matrix file {path}: expected a non-empty JSON list of {{"name": ..., options...}}')
    out = []
    for i, item in enumerate(items):
        # a row may name its own "model" (another file of the same weights: a GGUF type, a quantized
        # checkpoint); its tokenization must equal the baseline's, which run_candidate checks
        cfg = {k: v for k, v in item.items() if k != "name"}
        out.append((str(item.get("name", f"config{i}")), cfg))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"matrix file {path}: configuration names must be unique, got {names}")
    return out


def _previous_rows(path: str | None, report: dict) -> dict:
    """Rows of an earlier run of the same baseline and settings, by (name, configuration)."""
    from pagellm.bench.eval_quality import EVAL_FIELDS

    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    if old.get("baseline") != report["baseline"] or old.get("settings") != report["settings"]:
        return {}
    return {_row_key(r["name"], r["config"]): r for r in old.get("results", []) if all(f in r for f in EVAL_FIELDS)}


def _row_key(name: str, config: dict) -> tuple[str, str]:
    """A row's identity across runs: its name and its configuration."""
    return name, json.dumps(config, sort_keys=True)


def _write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)  # a run stopped mid-write leaves the previous, complete table


def _print_row(row: dict, header: bool) -> None:
    cells = []
    for key, _, fmt in _COLUMNS:
        v = row.get(key)
        cells.append(f"{v / 2**20:.1f}" if fmt == "MiB" else fmt.format(v) if v is not None else "-")
    if header:
        print(" | ".join(["name".ljust(28)] + [label for _, label, _ in _COLUMNS]))
    print(" | ".join([row["name"][:28].ljust(28)] + cells), flush=True)


def plot_eval(report: dict, path: str) -> None:
    import textwrap

    from matplotlib.figure import Figure

    rows = report["results"]
    names = [r["name"] for r in rows]
    fig = Figure(figsize=(max(8, 1.3 * len(rows)), 10))
    panels = [("kl_p99", "KL(baseline || config) p99, nats (lower is better; 0 is drawn at the floor)", True),
              ("greedy_agreement", "greedy agreement: mean and worst prompt (higher is better)", False),
              ("kv_tokens", f"KV tokens in {report['baseline']['kv_cache_memory']} (higher is better)", False)]
    for i, (key, title, log) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        values = [r[key] for r in rows]
        if log:
            floor = min([v for v in values if v > 0] or [1e-12]) / 10  # exact rows (KL 0) still show a bar
            values = [max(v, floor) for v in values]
            ax.set_yscale("log")
        ax.bar(names, values, color="tab:blue", label="mean" if key == "greedy_agreement" else None)
        if key == "greedy_agreement":
            ax.bar(names, [r["greedy_agreement_worst"] for r in rows], color="tab:orange", width=0.4,
                   label="worst prompt")
            ax.set_ylim(0, 1.05)
            ax.legend(loc="lower right")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"pagellm eval vs {report['baseline']['quantization']}/{report['baseline']['dtype']} baseline\n"
                 + textwrap.fill(report["platform"], 150), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
