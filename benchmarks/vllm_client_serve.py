"""The issue's serving comparison with vLLM's own client: `vllm bench serve` (run from vLLM's virtual environment,
`vllm.benchmarks.serve`; the wheel's console script fails on its metadata) against a fresh `pagellm serve --dtype
auto --no-enable-prefix-caching` and a fresh vLLM OpenAI server (bf16, prefix caching off, the environment `pagellm
bench serve --peer vllm` gives it), one server at a time, alternating for --rounds rounds. The workload is issue
#18's: random dataset, 64 requests, prompts 128-384 tokens, outputs 64-192, ignore_eos, the same seed (the same
prompts) for both; --request-rate inf sends them all at once. One line per run: output tok/s, median TTFT, median
TPOT, P99 ITL, as vLLM's client reports them. --ttft-groups also prints the requests' first tokens grouped, one
group per prefill step when they are sent at once (how the thirty-first session saw pagellm's first big step take
670 ms against vLLM's 356, then ~460 ms after the fix).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/vllm_client_serve.py --rounds 2
    ... --request-rate 4
    ... --servers pagellm --ttft-groups
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_cpu_split import launch, start_server  # noqa: E402

from pagellm.bench import peer_vllm  # noqa: E402

CLIENT = """
import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args())
"""
FIELDS = ("Output token throughput", "Median TTFT", "Median TPOT", "P99 ITL")


def start_vllm(python: str, model: str) -> tuple[subprocess.Popen, str]:
    return launch(lambda port: peer_vllm.server_command(python, model, None, "127.0.0.1", port),
                  peer_vllm.vllm_env(2), ready_s=300.0)


def client(python: str, url: str, tokenizer: str, rate: str) -> tuple[str, list[float]]:
    """vLLM's client against url: its printed report, and each request's TTFT in seconds (--save-detailed)."""
    name = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))["data"][0]["id"]
    with tempfile.TemporaryDirectory() as d:
        cmd = [python, "-c", CLIENT, "--backend", "openai", "--base-url", url, "--model", name, "--tokenizer",
               tokenizer, "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
               "--random-range-ratio", "0.5", "--num-prompts", "64", "--ignore-eos", "--request-rate", rate,
               "--seed", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--save-detailed", "--result-dir", d, "--result-filename", "result.json"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=d, env=env)
        if out.returncode:
            raise SystemExit(f"vllm bench serve failed: {out.stderr[-2000:]}")
        with open(os.path.join(d, "result.json")) as f:
            return out.stdout, json.load(f)["ttfts"]


def ttft_clusters(ttfts: list[float], gap_s: float = 0.05) -> list[tuple[int, int]]:
    """(ms, requests) per group of first tokens less than gap_s apart: with requests sent at once, one group per
    prefill step, so the gaps between groups are the steps' times as the client sees them."""
    groups: list[list[float]] = []
    for t in sorted(ttfts):
        if groups and t - groups[-1][-1] < gap_s:
            groups[-1].append(t)
        else:
            groups.append([t])
    return [(round(g[0] * 1000), len(g)) for g in groups]


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--servers", nargs="+", default=["pagellm", "vllm"], choices=["pagellm", "vllm"])
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the runs, the command and the CPU")
    ap.add_argument("--ttft-groups", action="store_true",
                    help="also print the requests' first tokens in groups (one per prefill step when sent at once)")
    ns = ap.parse_args()
    python, model = peer_vllm.resolve(None, None, None)
    runs = []
    for r in range(ns.rounds):
        for name in ns.servers:
            server, url = start_server([]) if name == "pagellm" else start_vllm(python, model)
            try:
                out, ttfts = client(python, url, model, ns.request_rate)
            finally:
                stop(server)
            found = [re.search(rf"^{key}\D*([0-9.]+)", out, re.M | re.I) for key in FIELDS]
            runs.append({"round": r + 1, "server": name, **{key: float(m.group(1)) if m else None
                                                            for key, m in zip(FIELDS, found, strict=True)}})
            print(f"round {r + 1} {name:8s} " + "  ".join(f"{key} {m.group(1) if m else '?'}"
                                                      for key, m in zip(FIELDS, found, strict=True)), flush=True)
            if ns.ttft_groups:
                print("  first tokens by group (ms, requests):", ttft_clusters(ttfts)[:10], flush=True)
    if ns.json:
        from pagellm.platforms import get_platform

        with open(ns.json, "w") as f:
            json.dump({"benchmark": "vllm bench serve against both servers", "date": time.strftime("%Y-%m-%d"),
                       "command": " ".join(["benchmarks/vllm_client_serve.py", *sys.argv[1:]]),
                       "platform": get_platform("cpu").summary_line(), "request_rate": ns.request_rate,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
