"""Tensor and pipeline parallelism on this CPU: what splitting SmolLM2 costs, and where the time goes.

For TP x PP in 1x1, 3x1 (shared-memory all-reduce, and gloo's), 1x2 (3x2 with --with-3x2; SmolLM2's 9
heads and 3 KV heads split 3 ways, not 2): W2 (`pagellm bench throughput`'s default workload: 64
requests, prompts 32-512, outputs 16-256, greedy, ignore_eos) output tok/s, single-stream decode (128-token
prompt, 128 new tokens) ms per token, each worker's busy seconds and pipeline wait (the bubble), peak RSS
per process; and a gloo all-reduce microbenchmark between two processes (the per-layer cost TP adds twice
per layer). Writes benchmarks/results/parallel_cpu_smollm2.{json,png}.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/parallel_cpu.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from pagellm import LLM, SamplingParams
from pagellm.bench.common import machine_info
from pagellm.bench.throughput import run_pagellm_throughput
from pagellm.bench.workload import random_workload
from pagellm.platforms import get_platform

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "parallel_cpu_smollm2")


def _rss_peak_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return None


def _decode_ms_per_token(llm: LLM) -> float:
    prompt = list(range(1000, 1128))
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append((time.perf_counter() - t0 - prefill) / 127 * 1e3)
    return statistics.median(times)


def measure(tp: int, pp: int, shm: bool = True) -> dict:
    t0 = time.perf_counter()
    llm = LLM(kv_cache_memory="512MiB", tensor_parallel_size=tp, pipeline_parallel_size=pp, shm_allreduce=shm)
    ready = time.perf_counter() - t0
    workload = random_workload(64, llm.engine.model_config.vocab_size, (32, 512), (16, 256), 0)
    w2 = run_pagellm_throughput(llm, workload)
    decode = _decode_ms_per_token(llm)
    row = {"tp": tp, "pp": pp, "all_reduce": "shared memory" if shm else "gloo", "ready_s": round(ready, 2),
           "w2_output_tok_s": w2["output_tokens_per_s"],
           "w2_elapsed_s": w2["elapsed_s"], "decode_ms_per_token": round(decode, 2),
           "engine_peak_rss_mib": _rss_peak_mib(os.getpid())}
    ex = llm.engine.executor
    if tp * pp > 1:
        stats = ex.stats()
        for s, p in zip(stats, ex.procs, strict=True):
            s["peak_rss_mib"] = _rss_peak_mib(p.popen.pid)
            s["bubble_fraction"] = round(s["pipeline_wait_seconds"] / max(s["busy_seconds"], 1e-9), 3)
        row["workers"] = stats
    llm.shutdown()
    print(json.dumps(row), flush=True)
    return row


def _allreduce_worker(rank: int, port: int, shapes: list, out) -> None:
    from torch.distributed import TCPStore

    from pagellm.distributed import GlooGroup

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
    group = GlooGroup(store, "bench", rank, 2)
    res = {}
    for how in ("gloo", "shared memory"):
        if how == "shared memory":
            group.use_shared_memory(store, "bench-shm", 512 * 576)
        for rows in shapes:
            t = torch.randn(rows, 576)
            for _ in range(20):
                group.all_reduce(t)
            n, t0 = 500 if rows < 64 else 100, time.perf_counter()
            for _ in range(n):
                group.all_reduce(t)
            res[f"{how}, {rows}x576 float32"] = round((time.perf_counter() - t0) / n * 1e6, 1)
    if rank == 0:
        out.put(res)


def allreduce_us(shapes=(1, 16, 64, 512)) -> dict:
    from pagellm.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, list(shapes), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    return res


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"TP{r['tp']} x PP{r['pp']}" + ("\ngloo" if r["all_reduce"] == "gloo" and r["tp"] > 1 else "")
              for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar(labels, [r["w2_output_tok_s"] for r in rows], color="#4c72b0")
    ax[0].set_title("W2 output tok/s (higher is better)")
    ax[1].bar(labels, [r["decode_ms_per_token"] for r in rows], color="#dd8452")
    ax[1].set_title("single-stream decode, ms/token (lower is better)")
    cpu = report["cpu"].split("; cpu ", 1)[-1].split(";")[0]  # the model and core count
    fig.suptitle(f"SmolLM2-135M Q4_1 GGUF, {cpu}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--with-3x2", action="store_true", help="also TP=3 x PP=2 (6 workers)")
    ns = ap.parse_args()
    configs = [(1, 1, True), (3, 1, True), (3, 1, False), (1, 2, True)] + ([(3, 2, True)] if ns.with_3x2 else [])
    plat = get_platform("cpu")
    report = {"benchmark": "parallel_cpu", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
              "cpu": plat.summary_line(plat.HARDWARE_KEYS),
              "command": "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/parallel_cpu.py"
                         + (" --with-3x2" if ns.with_3x2 else ""),
              "allreduce_us": allreduce_us(), "results": [measure(*c) for c in configs]}
    with open(OUT + ".json", "w") as f:
        json.dump(report, f, indent=2)
    plot(report, OUT + ".png")
    print(json.dumps(report["allreduce_us"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
