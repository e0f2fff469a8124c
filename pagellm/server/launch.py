"""`pagellm serve`: load the engine, then serve the app with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket

from pagellm import cli_types, generation_config
from pagellm.config import EngineArgs, parse_bytes
from pagellm.server.middleware import HttpOptions
from pagellm.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagellm")


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve the OpenAI API under /v1 (completions, chat completions, "
                                   "responses, embeddings, models) and vLLM's /health, /ping, /metrics, /tokenize, "
                                   "/detokenize, /version and /invocations; /docs describes them.")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    s.add_argument("--port", type=cli_types.port, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGELLM_API_KEY)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from the first line of PATH (keeps it out of `ps` and the shell history)")
    s.add_argument("--protect-metrics", action="store_true",
                   help="require the API key on /metrics, /health and /ping too (default: open, for probes)")
    s.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="allow browser pages from these origins (CORS, e.g. https://app.example.com; '*' for "
                        "any); default: none, CORS off")
    s.add_argument("--max-request-body-bytes", default="32MiB", metavar="SIZE",
                   help="answer 413 to a request body larger than this, before reading it all (default 32MiB)")
    s.add_argument("--log-requests", "--enable-log-requests", action="store_true",
                   help="log each request's prompt and output (default: never logged)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: --model as given, or the model file's name)")
    s.add_argument("--max-queue-len", type=cli_types.positive_int, default=None, metavar="N",
                   help="answer 503 + Retry-After while N requests wait (default: unbounded)")
    s.add_argument("--request-timeout", type=cli_types.positive_seconds, default=None, metavar="SECONDS",
                   help="abort a request still running after this long (default: none)")
    s.add_argument("--shutdown-timeout", type=cli_types.nonnegative_seconds, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, let in-flight requests finish this long, then abort them "
                        "(default 10)")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for requests that "
                        "leave them out: auto (default) from the model directory's generation_config.json, as vLLM; "
                        "vllm: the OpenAI defaults; DIR: that directory's generation_config.json")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprob tokens as "token_id:N" (vLLM), unless a request sets return_tokens_as_token_ids')
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="add X-Request-Id to every response (the client's, or a generated one)")
    s.add_argument("--root-path", default="", metavar="PATH",
                   help="path prefix a proxy serves this server under (FastAPI root_path; shown in /openapi.json)")
    s.add_argument("--vllm-metric-names", action="store_true",
                   help="export every /metrics series also under vLLM's prefix vllm: (for vLLM dashboards)")
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (tokenizer class, special tokens, chat template)")
    s.add_argument("--disable-fastapi-docs", action="store_true",
                   help="do not serve /openapi.json, /docs and /redoc")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="jinja chat template to use instead of the model's (a file, or the template text)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template sent with a request (sandboxed jinja; refused by default, as vLLM)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default with tools) read calls from the text; needs '
                        "--tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (vLLM's names): hermes <tool_call>{...}</tool_call>, "
                        "llama3_json, mistral [TOOL_CALLS][...], pythonic [f(a=1)]")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (scheduler, model, steps) in its own process, so that it and the HTTP "
                        "front end (streaming, tokenization) do not share a GIL (default: on)")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own logging (default warning; info adds an access log)")
    EngineArgs.add_cli_args(s)
    s.set_defaults(func=serve)


def default_model_name(model_arg: str | None, model_path: str) -> str:
    if model_arg:
        return model_arg
    name = os.path.basename(model_path.rstrip("/"))
    return name[:-5] if name.endswith(".gguf") else name


def resolve_api_key(ns: argparse.Namespace) -> str | None:
    """--api-key-file's first line, else --api-key (whose default is $PAGELLM_API_KEY); never both."""
    if ns.api_key_file is None:
        return ns.api_key or None
    if ns.api_key and ns.api_key != os.environ.get("PAGELLM_API_KEY"):
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    with open(ns.api_key_file, encoding="utf-8") as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"--api-key-file {ns.api_key_file}: the first line is empty")
    return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def serve(ns: argparse.Namespace) -> int:
    from pagellm.executor.multiproc import run_headless
    from pagellm.server.app import build_app
    from pagellm.server.chat_templates import load_chat_template
    from pagellm.server.http_server import GracefulServer, uvicorn_config
    from pagellm.server.serving_chat_tools import ChatSettings

    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    if ns.served_model_name and any(not name.strip() for name in ns.served_model_name):
        raise ValueError("--served-model-name must not be empty (clients send it as \"model\")")
    if ns.root_path and not ns.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {ns.root_path!r}")
    api_key = resolve_api_key(ns)
    try:
        body_cap = parse_bytes(ns.max_request_body_bytes)
    except ValueError as e:
        raise ValueError(f"--max-request-body-bytes: {e}") from None
    http = HttpOptions(body_cap, ns.protect_metrics, ns.allowed_origins)
    if http.protect_metrics and not api_key:
        raise ValueError("--protect-metrics needs an API key (--api-key, --api-key-file or $PAGELLM_API_KEY)")
    if not api_key and not is_loopback(ns.host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can use the model "
                       "(set --api-key-file, --api-key or $PAGELLM_API_KEY)", ns.host)
    # Flags checked before the model loads, so a typo fails in a second.
    chat = ChatSettings(load_chat_template(ns.chat_template) if ns.chat_template else None,
                        ns.enable_auto_tool_choice, ns.tool_call_parser, ns.trust_request_chat_template)
    # "vllm" or an explicit directory: read (and checked) before the model loads; "auto" needs its path
    sampling_defaults = None if ns.generation_config == "auto" else generation_config.load(ns.generation_config, None)
    args = EngineArgs.from_cli_args(ns)
    if args.node_rank > 0:  # a worker node of a multi-node deployment: no engine, no HTTP
        return run_headless((args.master_addr, args.master_port), args.nnodes, args.node_rank)
    check_listen(ns.host, ns.port)  # a port in use or a host that is not this machine's: before the load
    async_engine, shutdown = start_engine(args, ns.engine_process, ns.max_queue_len)
    try:
        names = ns.served_model_name or [default_model_name(ns.model, async_engine.info.model_path)]
        if sampling_defaults is None:
            sampling_defaults = generation_config.load("auto", async_engine.info.model_path)
        if sampling_defaults:  # vLLM says so too: a request without them does not sample at the OpenAI defaults
            logger.info("sampling defaults from generation_config.json for requests that leave them out: %s "
                        "(--generation-config vllm keeps the OpenAI defaults)", sampling_defaults)
        async_engine.log_requests = ns.log_requests
        app = build_app(async_engine, names, api_key=api_key, request_timeout=ns.request_timeout,
                        enable_request_id_headers=ns.enable_request_id_headers, root_path=ns.root_path,
                        vllm_metric_names=ns.vllm_metric_names,
                        enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                        disable_fastapi_docs=ns.disable_fastapi_docs, chat=chat, http=http)
        app.state.ctx.return_tokens_as_token_ids = ns.return_tokens_as_token_ids
        app.state.ctx.sampling_defaults = sampling_defaults
        config = uvicorn_config(app, ns.host, ns.port, ns.uvicorn_log_level)
        server = GracefulServer(config, async_engine, names[0], ns.shutdown_timeout)
        server.run()
    finally:
        shutdown()  # the engine core process and worker processes, if any
    return server.exit_code


def check_listen(host: str, port: int) -> None:
    """ValueError unless sockets can listen on host:port now, on every address it names, as asyncio's
    create_server (uvicorn) binds them: SO_REUSEADDR, "" for all interfaces, addresses this machine lacks
    skipped. vLLM checks this before it loads the model too; a port taken in between still fails in uvicorn."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio: v4 binds alone
                try:
                    sock.bind(addr)
                except OSError as e:
                    if e.errno != errno.EADDRNOTAVAIL:  # asyncio skips those
                        raise
    except OSError as e:  # socket.gaierror too
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def start_engine(args: EngineArgs, engine_process: bool, max_queue_len: int | None):
    """(the async engine the app drives, what stops whatever processes it started)."""
    if engine_process:
        from pagellm.engine.core_client import EngineProcessClient

        client = EngineProcessClient.launch(args, max_queue_len=max_queue_len)
        return client, client.shutdown
    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    return AsyncLLMEngine(engine, max_queue_len=max_queue_len), engine.shutdown
