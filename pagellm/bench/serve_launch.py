"""`pagellm bench serve --peer vllm` (or `--peer pagellm`): the benchmark starts the servers itself.

Each server in turn (pagellm's first, then the peers) starts on a free local port, must answer /health
within --launch-timeout, gets the identical workload (the same token ids, built once from the benchmarked
model's tokenizer before any server starts; vLLM's export of the model has the same vocabulary), and is
stopped (SIGTERM, then SIGKILL to its whole process group after a grace period, so that no engine or
worker process outlives it). One table compares them; the JSON holds every server's full report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

from pagellm import cli_types

SERVERS = ("pagellm", "vllm")
HOST = "127.0.0.1"
STOP_GRACE_S = 30.0
COUNTS = ("completed", "failed")  # rows without a ratio
ROWS = (("completed", "completed"), ("failed", "failed"), ("ready s", "ready_s"), ("peak RSS MiB", "peak_rss_mib"),
        ("duration s", "duration"), ("request throughput req/s", "request_throughput"),
        ("output throughput tok/s", "output_throughput"), ("total token throughput tok/s", "total_token_throughput"),
        *((f"{stat} {key.upper()} ms", f"{stat}_{key}_ms") for key in ("ttft", "tpot", "itl", "e2el")
          for stat in ("mean", "median", "p99")))


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launched servers (instead of --url)")
    g.add_argument("--peer", action="append", choices=SERVERS, default=[],
                   help="start this server here and benchmark it (repeatable); pagellm's always runs first, so "
                        "--peer vllm compares the two on the same token ids; a peer that is not installed is "
                        "skipped with a one-line message")
    g.add_argument("--serve-args", default="", metavar="ARGS",
                   help='options of the launched `pagellm serve`, one string, e.g. --serve-args="--dtype '
                        'bfloat16 --kv-cache-memory 512MiB"; its --model (default: the default model) is the '
                        "benchmarked model, whose tokenizer makes the prompts unless --tokenizer is given")
    g.add_argument("--peer-serve-args", default="", metavar="ARGS",
                   help='more options of vLLM\'s server, e.g. --peer-serve-args="--max-num-seqs 64"')
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="vLLM's Python (default: $PAGELLM_VLLM_PYTHON, else .peers/venv-vllm/bin/python)")
    g.add_argument("--peer-model", default=None, metavar="DIR",
                   help="vLLM's safetensors copy of the model (default: smollm2-135m-f32 next to vLLM's venv)")
    g.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16"],
                   help="vLLM's --dtype (default bfloat16); pagellm's comes from --serve-args")
    g.add_argument("--launch-timeout", type=cli_types.positive_seconds, default=600.0, metavar="SECONDS",
                   help="how long a launched server may take to answer /health (default 600)")


class LaunchError(RuntimeError):
    pass


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float, log_path: str) -> float:
    """Seconds until GET /health answers 200; LaunchError if the server exits first or takes over `timeout`."""
    import httpx

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise LaunchError(f"exited with code {proc.returncode} before answering /health:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise LaunchError(f"no answer on {base}/health after {timeout:.0f} s (--launch-timeout):\n"
                              f"{_tail(log_path)}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM (both servers shut their engines down on it), then SIGKILL to the server's process group
    (started as its own session), whatever is left of it: no orphaned engine or worker processes."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def launched(cmd: list[str], env: dict, base: str, timeout: float):
    """Start `cmd` (its output to a temporary log), wait for `base`/health; yields (process, ready s) and
    stops the server on the way out, whatever happened."""
    with tempfile.NamedTemporaryFile("w", prefix="pagellm-bench-server-", suffix=".log", delete=False) as log:
        log_path = log.name
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        ready = wait_healthy(proc, base, timeout, log_path)
        yield proc, ready
    finally:
        stop(proc)
        os.unlink(log_path)


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "\n".join(f.read().strip().splitlines()[-lines:])


def _server_peak_rss_mib(pid: int) -> float:
    from pagellm.bench.peer_vllm import descendants_peak_rss_mib

    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        own = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")), 0.0)
        return round(own + descendants_peak_rss_mib(pid)[0], 1)
    return 0.0  # no /proc (not Linux)


def _commands(ns, serve_args: list[str], model: str, threads: int) -> dict[str, tuple | str]:
    """name -> (command with a {port} placeholder, environment), or why it is skipped."""
    from pagellm.bench import peer_vllm
    from pagellm.bench.peer_engines import PeerUnavailable

    out: dict[str, tuple | str] = {}
    for name in ["pagellm"] + [p for p in dict.fromkeys(ns.peer) if p != "pagellm"]:
        if name == "pagellm":  # our --host/--port last: argparse keeps the last value
            out[name] = ([sys.executable, "-m", "pagellm.cli", "serve", *serve_args, "--host", HOST, "--port",
                          "{port}"], dict(os.environ, PYTHONUNBUFFERED="1"))
            continue
        try:
            python, vmodel = peer_vllm.resolve(ns.peer_python, ns.peer_model, model)
        except PeerUnavailable as e:
            out[name] = str(e)
            continue
        out[name] = (peer_vllm.server_command(python, vmodel, ns.peer_dtype, HOST, "{port}",
                                              shlex.split(ns.peer_serve_args)), peer_vllm.vllm_env(threads))
    return out


def run_launched(ns: argparse.Namespace, slos: dict[str, float], kind: str, path: str | None) -> int:
    from pagellm.bench import serve
    from pagellm.bench.report import plot_written, write_json
    from pagellm.config import EngineArgs
    from pagellm.model.loader import load_config, resolve_model_path
    from pagellm.server.launch import add_serve_parser

    if ns.url or ns.model:
        raise ValueError("--peer starts the servers here: it takes neither --url nor --model (the model is "
                         "--serve-args' --model, vLLM's --peer-model)")
    serve_args = shlex.split(ns.serve_args)
    parser = argparse.ArgumentParser(prog="pagellm")
    add_serve_parser(parser.add_subparsers())  # `pagellm serve`'s own parser (cli.py, the top, is not imported)
    try:  # what `pagellm serve` will make of them (argparse prints why not)
        engine_args = EngineArgs.from_cli_args(parser.parse_args(["serve", *serve_args]))
    except SystemExit:
        raise ValueError(f"--serve-args {ns.serve_args!r}: not options of pagellm serve") from None
    model = resolve_model_path(engine_args.model)
    threads = engine_args.num_threads
    if not threads:  # pagellm serve's default, which vLLM's OpenMP binding then matches
        import torch

        threads = torch.get_num_threads()
    # The workload, once, from the benchmarked model's tokenizer: every server gets the same token ids.
    run_ns = argparse.Namespace(**vars(ns))
    run_ns.tokenizer = ns.tokenizer or engine_args.tokenizer or model
    max_len = engine_args.max_model_len or load_config(model).max_position_embeddings
    requests = asyncio.run(serve.make_requests(run_ns, None, None, kind, path, max_len))
    reports, skipped, failed = [], [], []
    for name, launch in _commands(ns, serve_args, model, threads).items():
        if isinstance(launch, str):
            print(f"skipping {name}: {launch}")
            skipped.append(f"{name}: {launch}")
            continue
        port = free_port()
        cmd, env = [c.replace("{port}", str(port)) for c in launch[0]], launch[1]
        base = f"http://{HOST}:{port}"
        print(f"starting {name}: {shlex.join(cmd)}", flush=True)
        try:
            with launched(cmd, env, base, ns.launch_timeout) as (proc, ready):
                print(f"{name} ready in {ready:.1f} s; running {len(requests)} requests", flush=True)
                report = asyncio.run(serve._bench(run_ns, slos, kind, path, base, requests))
                report.update(server=name, server_command=cmd, ready_s=round(ready, 2),
                              peak_rss_mib=_server_peak_rss_mib(proc.pid))
        except (LaunchError, ValueError) as e:
            print(f"{name} failed: {e}", file=sys.stderr)
            failed.append({"server": name, "failed": str(e)})
            if name == "pagellm":
                return 1
            continue
        reports.append(report)
        for err in sorted({r["error"] for r in report["requests"] if r["error"]})[:5]:
            print(f"{name} error: {err}", file=sys.stderr)
    ratios = _print_table(reports)
    out = {"benchmark": "serve", "mode": "launched", "date": time.strftime("%Y-%m-%d"),
           "command": "pagellm " + " ".join(sys.argv[1:]), "threads": threads, "pagellm_over_server": ratios,
           "results": reports, "skipped": skipped, "failed": failed}
    if ns.json:
        write_json(ns.json, out)
    if ns.plot:
        plot_servers(reports, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    ok = all(r["results"]["completed"] == len(requests) for r in reports)
    return 0 if ok and not failed else 1


def _print_table(reports: list[dict]) -> dict[str, dict]:
    """One column per server and one pagellm/peer ratio per peer (throughput: >1 = pagellm faster;
    latency and memory: <1 = pagellm lower)."""
    def value(r: dict, key: str):
        return r["results"].get(key, r.get(key))

    names = [r["server"] for r in reports]
    ratios = {r["server"]: {} for r in reports[1:]}
    head = f"{'metric':<30}" + "".join(f"{n:>12}" for n in names) + "".join(f"{'pagellm/' + n:>16}" for n in ratios)
    print("{s:{c}^{w}}".format(s=" Serving Benchmark: launched servers ", c="=", w=len(head)))
    print(head)
    for label, key in ROWS:
        vals = [value(r, key) for r in reports]
        line = f"{label:<30}" + "".join(f"{v:>12.2f}" if isinstance(v, float) else f"{v:>12}" for v in vals)
        for r, v in zip(reports[1:], vals[1:], strict=True):
            if key in COUNTS:
                line += " " * 16
                continue
            ratio = round(vals[0] / v, 3) if v else None
            ratios[r["server"]][key] = ratio
            line += f"{'-' if ratio is None else f'{ratio:.2f}x':>16}"
        print(line.rstrip())
    print("=" * len(head))
    if ratios:
        print("pagellm/peer: throughput >1 means pagellm is faster; latency, ready time and memory <1 mean lower")
    return ratios


def plot_servers(reports: list[dict], path: str) -> None:
    """plot_serve's two panels, one row per server."""
    from matplotlib.figure import Figure

    from pagellm.bench.plot import latency_timeline, percentile_bars

    fig = Figure(figsize=(13, 4.5 * len(reports)), layout="constrained")
    axes = fig.subplots(len(reports), 2, squeeze=False)
    for (left, right), r in zip(axes, reports, strict=True):
        percentile_bars(left, r["results"])
        latency_timeline(right, r["requests"], r.get("goodput_slo_ms"))
        res = r["results"]
        left.set_title(f"{r['server']}: {res['output_throughput']:.1f} output tok/s, "
                       f"{res['request_throughput']:.2f} req/s, {res['completed']} ok / {res['failed']} failed")
    fig.suptitle(f"pagellm bench serve, launched servers: {reports[0]['num_prompts']} prompts, rate "
                 f"{reports[0]['request_rate']}/s", fontsize=10)
    fig.savefig(path, dpi=110)
