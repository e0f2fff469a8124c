"""pagellm command line: generate | info | bench (serve, chat and eval live in their own modules)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagellm.config import EngineArgs
from pagellm.executor.errors import WorkerFailedError


def _generate(ns: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed_sampling, stop=ns.stop or None)
    args = EngineArgs.from_cli_args(ns)
    if args.node_rank > 0:  # a worker node of a multi-node run: node 0 prints the output
        from pagellm.executor.multiproc import run_headless

        return run_headless((args.master_addr, args.master_port), args.nnodes, args.node_rank)
    llm = LLM(**vars(args))
    try:
        if ns.chat:
            out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate([ns.prompt], params, use_tqdm=False)[0]
    finally:  # the workers stopped in order, not by exit-time clean-up (which, with the watchdog thread holding
        llm.shutdown()  # the engine, aborted node 0 of a two-node run after its output in 3 runs of 8)
    c = out.outputs[0]
    if ns.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    else:
        print(c.text)
    return 0


def _info(ns: argparse.Namespace) -> int:
    from pagellm.platforms import get_platform

    # "device" first, whatever order describe() uses: it says which platform the lines below describe.
    info = {"device": ns.device, **get_platform(ns.device).describe()}
    if ns.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """Argument errors on one line, as every other CLI error (argparse printed the whole usage first: 40-50 lines
    for serve or generate before the one that matters). Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="pagellm", description="A readable LLM inference engine: paged KV cache, "
                                "continuous batching, OpenAI-compatible server.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate a completion for one prompt and print it.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="max new tokens (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    g.add_argument("--seed", dest="seed_sampling", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=_generate)

    i = sub.add_parser("info", help="what the platform detected and chose",
                       description="Print what the platform layer detected (CPU, ISA flags, kernel build) "
                                   "and chose (dtype per op class, attention backend, threads), one "
                                   "`key: value` per line.")
    i.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the device to describe (default cpu)")
    i.add_argument("--json", action="store_true", help="print one JSON object instead")
    i.set_defaults(func=_info)

    from pagellm.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from pagellm.server.launch import add_serve_parser

    add_serve_parser(sub)
    from pagellm.chat_cli import add_chat_parser

    add_chat_parser(sub)
    from pagellm.plan.plan_cli import add_plan_parser

    add_plan_parser(sub)
    from pagellm.quant.quantize_cli import add_quantize_parser

    add_quantize_parser(sub)
    from pagellm.bench.eval_cli import add_eval_parser

    add_eval_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except (ValueError, OSError, TypeError) as e:  # OSError: unreadable model files (permissions, a dir)
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2
    except WorkerFailedError as e:  # a tensor/pipeline-parallel worker process died or failed
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
