"""`pagellm serve`: load the engine, then serve the app with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import os

from pagellm.config import EngineArgs
from pagellm.server.tool_parsers import TOOL_PARSERS


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve the OpenAI API under /v1 (completions, chat completions, "
                                   "responses, embeddings, models) and vLLM's /health, /ping, /metrics, /tokenize, "
                                   "/detokenize, /version and /invocations; /docs describes them.")
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
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default with tools) read calls from the text; needs '
                        "--tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (vLLM's names): hermes <tool_call>{...}</tool_call>, "
                        "llama3_json, mistral [TOOL_CALLS][...], pythonic [f(a=1)]")
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
    from pagellm.server.chat_templates import load_chat_template
    from pagellm.server.http_server import GracefulServer, uvicorn_config
    from pagellm.server.serving_chat_tools import ChatSettings

    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    # Flags checked before the model loads, so a typo fails in a second.
    chat = ChatSettings(load_chat_template(ns.chat_template) if ns.chat_template else None,
                        ns.enable_auto_tool_choice, ns.tool_call_parser)
    engine = LLMEngine(EngineArgs.from_cli_args(ns))
    names = ns.served_model_name or [default_model_name(ns.model, engine.model_path)]
    async_engine = AsyncLLMEngine(engine, max_queue_len=ns.max_queue_len)
    app = build_app(async_engine, names, api_key=ns.api_key, request_timeout=ns.request_timeout,
                    enable_request_id_headers=ns.enable_request_id_headers, root_path=ns.root_path,
                    vllm_metric_names=ns.vllm_metric_names,
                    enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                    disable_fastapi_docs=ns.disable_fastapi_docs, chat=chat)
    app.state.ctx.return_tokens_as_token_ids = ns.return_tokens_as_token_ids
    config = uvicorn_config(app, ns.host, ns.port, ns.uvicorn_log_level)
    GracefulServer(config, async_engine, names[0], ns.shutdown_timeout).run()
    return 0
