"""`pagellm serve`: load the engine, then serve the app with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import os

from pagellm.config import EngineArgs


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                   "/metrics, /tokenize and /detokenize.")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGELLM_API_KEY)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: --model as given, or the model file's name)")
    s.add_argument("--max-queue-len", type=int, default=None, metavar="N",
                   help="answer 503 + Retry-After while N requests wait (default: unbounded)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request still running after this long (default: none)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, let in-flight requests finish this long, then abort them "
                        "(default 10)")
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


def serve(ns: argparse.Namespace) -> int:
    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.server.app import build_app
    from pagellm.server.http_server import GracefulServer, uvicorn_config

    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    engine = LLMEngine(EngineArgs.from_cli_args(ns))
    names = ns.served_model_name or [default_model_name(ns.model, engine.model_path)]
    async_engine = AsyncLLMEngine(engine, max_queue_len=ns.max_queue_len)
    app = build_app(async_engine, names, api_key=ns.api_key, request_timeout=ns.request_timeout)
    config = uvicorn_config(app, ns.host, ns.port, ns.uvicorn_log_level)
    GracefulServer(config, async_engine, names[0], ns.shutdown_timeout).run()
    return 0
