"""The FastAPI app: OpenAI routes under /v1 (behind the API key), plus vLLM's /health, /ping, /metrics,
/tokenize, /detokenize, /version, /invocations and /tokenizer_info; /openapi.json and /docs describe them."""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pagellm import __version__
from pagellm.engine.engine_front import EngineFront
from pagellm.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from pagellm.server.common import ServerContext
from pagellm.server.errors import APIError, install_error_handlers
from pagellm.server.middleware import HttpOptions, install_http_guards
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagellm.server.protocol_responses import ResponsesRequest
from pagellm.server.request_id import RequestIdHeaderMiddleware
from pagellm.server.request_limits import MAX_MESSAGES, check_list_length
from pagellm.server.routes_misc import invocations_router, tokenizer_info_router, version_router
from pagellm.server.serving_chat import create_chat_completion, render_chat
from pagellm.server.serving_chat_tools import ChatSettings, tokenize_plan
from pagellm.server.serving_completions import create_completion
from pagellm.server.serving_embeddings import EmbeddingRequest, create_embedding
from pagellm.server.serving_responses import ResponseStore, create_response, delete_response, retrieve_response


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# Declared through HTTPBearer so that /openapi.json (and /docs' Authorize button) know the scheme; the check
# itself stays ours, to answer with OpenAI's error object.
_bearer = HTTPBearer(auto_error=False, description="the server's --api-key")


def _check_api_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    key = _ctx(request).api_key
    if key is None:
        return
    token = credentials.credentials.strip() if credentials is not None else None
    if token is None or not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])
misc = APIRouter()


def _model_card(ctx: ServerContext, name: str) -> dict:
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "pagellm", "root": ctx.model_name,
            "parent": None, "max_model_len": ctx.engine.max_model_len, "permission": []}


@v1.get("/models")
async def list_models(request: Request):
    ctx = _ctx(request)
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]}


@v1.get("/models/{model:path}")  # the openai client's models.retrieve(); a served name may hold a slash
async def retrieve_model(model: str, request: Request):
    ctx = _ctx(request)
    if not model:  # /v1/models/ with its trailing slash: the list, as before this route
        return await list_models(request)
    return _model_card(ctx, ctx.check_model(model))


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(body, request, _ctx(request))


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(body, request, _ctx(request))


@v1.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return await create_embedding(body, request, _ctx(request))


@v1.post("/responses")
async def responses(body: ResponsesRequest, request: Request):
    return await create_response(body, request, _ctx(request))


@v1.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return retrieve_response(request, response_id)


@v1.delete("/responses/{response_id}")
async def remove_response(response_id: str, request: Request):
    return delete_response(request, response_id)


@misc.get("/health")
@misc.get("/ping")  # vLLM's SageMaker health check, GET and POST
@misc.post("/ping")
async def health(request: Request):
    engine = _ctx(request).engine
    if not engine.is_running:
        raise APIError(503, "the engine loop is not running", code="engine_dead")
    if not engine.is_accepting:  # a shutdown drains the in-flight requests: load balancers should look elsewhere
        raise APIError(503, "the server is shutting down", code="shutting_down")
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
    if body.prompt is not None and body.chat_only_fields():
        raise APIError(400, f"{body.chat_only_fields()[0]} only applies to messages", param=body.chat_only_fields()[0])
    check_list_length("messages", body.messages, MAX_MESSAGES)  # rendered as for a chat completion
    # Off the event loop, as for generation: a long prompt must not stall other clients.
    if body.messages is not None:
        ids = await asyncio.to_thread(render_chat, ctx, body.messages, body.add_generation_prompt,
                                      bool(body.add_special_tokens), plan=tokenize_plan(body.tools, ctx.chat),
                                      body=body)
    else:
        ids = await asyncio.to_thread(tok.encode, body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids, "token_strs": strs}


@misc.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    ctx = _ctx(request)
    ctx.check_model(body.model)
    vocab = ctx.engine.info.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def build_app(engine: EngineFront, model_names: list[str], api_key: str | None = None,
              request_timeout: float | None = None, *, enable_request_id_headers: bool = False,
              root_path: str = "", vllm_metric_names: bool = False, enable_tokenizer_info_endpoint: bool = False,
              disable_fastapi_docs: bool = False, chat: ChatSettings | None = None,
              http: HttpOptions | None = None) -> FastAPI:
    """The app owns the engine loop: started and stopped by its lifespan. root_path: the path prefix a
    proxy serves this app under (it shows in /openapi.json's servers; routes stay at /)."""
    metrics = EngineMetrics(engine, model_names[0], vllm_names=vllm_metric_names)
    ctx = ServerContext(engine, metrics, list(model_names), api_key or None, request_timeout or None,
                        created=int(time.time()), chat=chat or ChatSettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if disable_fastapi_docs else {}
    app = FastAPI(title="pagellm", version=__version__, lifespan=lifespan,
                  summary="OpenAI-compatible server (vLLM's API) of the pagellm engine", **docs)
    # Set on the app (as vLLM does), not on uvicorn: requests are then routed with or without the prefix,
    # whether or not the proxy strips it. (FastAPI only deprecates the constructor argument.)
    app.root_path = root_path or ""
    app.state.ctx = ctx
    app.state.responses = ResponseStore()
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(misc)
    app.include_router(version_router)
    app.include_router(invocations_router, dependencies=[Depends(_check_api_key)])
    if enable_tokenizer_info_endpoint:
        app.include_router(tokenizer_info_router)
    install_http_guards(app, http or HttpOptions(), ctx.api_key)  # body cap, key before the body, CORS
    if enable_request_id_headers:  # outermost: a guard's 401 or 413 carries the id too
        app.add_middleware(RequestIdHeaderMiddleware)
    return app
