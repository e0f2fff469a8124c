"""The FastAPI app: OpenAI routes under /v1 (behind the API key), plus vLLM's /health, /metrics,
/tokenize and /detokenize."""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from pagellm.server.common import ServerContext
from pagellm.server.errors import APIError, install_error_handlers
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagellm.server.serving_chat import create_chat_completion, render_chat
from pagellm.server.serving_completions import create_completion


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _check_api_key(request: Request) -> None:
    key = _ctx(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])
misc = APIRouter()


@v1.get("/models")
async def list_models(request: Request):
    ctx = _ctx(request)
    data = [{"id": name, "object": "model", "created": ctx.created, "owned_by": "pagellm",
             "root": ctx.model_name, "parent": None, "max_model_len": ctx.engine.max_model_len,
             "permission": []} for name in ctx.model_names]
    return {"object": "list", "data": data}


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(body, request, _ctx(request))


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(body, request, _ctx(request))


@misc.get("/health")
async def health(request: Request):
    if not _ctx(request).engine.is_running:
        raise APIError(503, "the engine loop is not running", code="engine_dead")
    return Response(status_code=200)


@misc.get("/metrics")
async def metrics(request: Request):
    return Response(_ctx(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@misc.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    ctx = _ctx(request)
    ctx.check_model(body.model)
    tok = ctx.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = render_chat(ctx, body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": strs}


@misc.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = _ctx(request)
    ctx.check_model(body.model)
    vocab = ctx.engine.engine.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def build_app(engine: AsyncLLMEngine, model_names: list[str], api_key: str | None = None,
              request_timeout: float | None = None) -> FastAPI:
    """The app owns the engine loop: started and stopped by its lifespan."""
    metrics = EngineMetrics(engine, model_names[0])
    ctx = ServerContext(engine, metrics, list(model_names), api_key or None, request_timeout or None,
                        created=int(time.time()))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="pagellm", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(misc)
    return app
