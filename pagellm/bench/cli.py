"""`pagellm bench`: the subcommands' parsers, and `bench throughput` itself (running, printing, JSON)."""

from __future__ import annotations

import argparse
import sys
import time

from pagellm import cli_types
from pagellm.bench.common import machine_info, print_platform_line, throughput_roofline
from pagellm.bench.report import check_outputs, plot_written, write_json
from pagellm.config import EngineArgs


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks; results print as a table and JSON.")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bsub.add_parser("throughput", help="offline throughput on a random workload",
                        description="Offline throughput: all requests submitted at once, greedy, ignore_eos.")
    t.add_argument("--num-prompts", type=cli_types.positive_int, default=64, help="requests (default 64)")
    t.add_argument("--input-len", type=cli_types.positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt length range, uniform (default 32 512)")
    t.add_argument("--output-len", type=cli_types.positive_int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output length range, uniform (default 16 256)")
    t.add_argument("--workload-seed", type=int, default=0, help="random.Random seed of the workload")
    t.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    t.add_argument("--plot", default=None, metavar="PATH.png", help="draw output tok/s per engine")
    EngineArgs.add_cli_args(t)
    from pagellm.bench.peers import add_peer_args

    add_peer_args(t)
    t.set_defaults(func=run_throughput_bench)
    from pagellm.bench.memory import add_memory_parser

    add_memory_parser(bsub)
    from pagellm.bench.latency import add_latency_parser

    add_latency_parser(bsub)
    from pagellm.bench.serve import add_serve_bench_args, run_serve_bench

    s = bsub.add_parser("serve", help="online benchmark against a running server",
                        description="Streaming /v1/completions requests with gamma arrivals (vLLM's "
                                    "benchmark_serving): throughput, TTFT, TPOT, ITL, E2E, goodput.")
    add_serve_bench_args(s)
    s.set_defaults(func=run_serve_bench)
    from pagellm.bench.soak import add_soak_args, run_soak

    k = bsub.add_parser("soak", help="bounded soak of a loopback server: mixed, malformed and abandoned traffic",
                        description="Mixed traffic, faults and malformed bodies against a loopback server for "
                                    "--duration; then drain and check that nothing was lost or leaked. Exits "
                                    "non-zero if any must-be-zero figure is not zero.")
    add_soak_args(k)
    k.set_defaults(func=run_soak)


def run_throughput_bench(ns: argparse.Namespace) -> int:
    from pagellm import LLM
    from pagellm.bench.throughput import run_pagellm_throughput
    from pagellm.bench.workload import random_workload

    check_outputs(ns.json, ns.plot)
    for flag, (lo, hi) in (("--input-len", ns.input_len), ("--output-len", ns.output_len)):
        if lo > hi:
            raise ValueError(f"{flag} MIN MAX: MIN {lo} is above MAX {hi}")
    print_platform_line(ns.device, ns.num_threads)
    if ns.peer:  # every engine in its own process, one table
        from pagellm.bench.peers import throughput_with_peers

        return throughput_with_peers(ns)
    t0 = time.perf_counter()
    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    ready = time.perf_counter() - t0
    workload = random_workload(ns.num_prompts, llm.engine.model_config.vocab_size, tuple(ns.input_len),
                               tuple(ns.output_len), ns.workload_seed)
    result = run_pagellm_throughput(llm, workload)
    result["ready_s"] = round(ready, 2)
    result["preemptions"] = llm.engine.scheduler.stats.num_preemptions
    report = {"benchmark": "throughput", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
              "command": "pagellm " + " ".join(sys.argv[1:]), "engine_args": vars(llm.engine.args),
              "results": [result]}
    for k, v in result.items():
        print(f"{k:>22}: {v}")
    report["roofline"] = throughput_roofline(llm.engine.model_config, workload, [result])
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:
        from pagellm.bench.peers import plot_engines

        plot_engines([result], "output_tokens_per_s", "output tokens/s (higher is better)", False, ns.plot,
                     "pagellm bench throughput")
        print(f"wrote {plot_written(ns.plot)}")
    return 0
