"""Served runs against fresh `pagellm serve --dtype auto --no-enable-prefix-caching` servers, one variant after the
other for --rounds rounds: the serving workload (64 requests at once, prompts 128-384, outputs 64-192; extra bench
options after `--`, e.g. `-- --request-rate 4`), one line per run (output tok/s, median TTFT, median TPOT, P99 ITL).
A variant is a string of the server's environment (`GOMP_SPINCOUNT=1000`, `OMP_PROC_BIND=true`, `""` for none),
where `nice=N` renices the API process's threads after start-up instead. The twenty-ninth session's A/B figures
(benchmarks/NOTES.md) come from this, run alone on the machine:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_env_ab.py --rounds 5 "" nice=10
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_cpu_split import run_workload, start_server  # noqa: E402

FIELDS = ("Output token throughput", "Median TTFT", "Median TPOT", "P99 ITL")


def served_run(variant: str, bench_args: list[str]) -> str:
    env, nice = dict(os.environ), 0
    for item in variant.split():
        name, value = item.split("=", 1)
        if name == "nice":
            nice = int(value)
        else:
            env[name] = value
    server, url = start_server([], env)
    try:
        if nice:  # every thread of the API process (the engine core process keeps its priority)
            for tid in os.listdir(f"/proc/{server.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        out = run_workload(url, bench_args)
    finally:
        server.terminate()
        server.wait(timeout=60)
    found = [re.search(rf"^{key}\D*([0-9.]+)", out, re.M | re.I) for key in FIELDS]
    return "  ".join(f"{key} {m.group(1) if m else '?'}" for key, m in zip(FIELDS, found, strict=True))


def main() -> None:
    args = sys.argv[1:]
    bench_args = args[args.index("--") + 1:] if "--" in args else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("variants", nargs="+")
    ns = p.parse_args(args[: args.index("--")] if "--" in args else args)
    for _ in range(ns.rounds):
        for variant in ns.variants:
            print(f"[{variant or 'as is'}] {served_run(variant, bench_args)}", flush=True)


if __name__ == "__main__":
    main()
