"""vLLM's service routes beside the OpenAI API: /version, /invocations (SageMaker) and /tokenizer_info.

(/ping lives next to /health in app.py: it is the same check.)
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagellm import __version__
from pagellm.server.common import ServerContext
from pagellm.server.errors import APIError
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.server.serving_chat import create_chat_completion
from pagellm.server.serving_completions import create_completion
from pagellm.server.serving_embeddings import EmbeddingRequest, create_embedding

version_router = APIRouter()
invocations_router = APIRouter()  # mounted behind the API key: it generates like /v1 does
tokenizer_info_router = APIRouter()  # only with --enable-tokenizer-info-endpoint, as in vLLM


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


@version_router.get("/version")
async def version():
    return {"version": __version__}


_INVOCATION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": f"#/components/schemas/{m.__name__}"}
    for m in (ChatCompletionRequest, CompletionRequest, EmbeddingRequest)]}}}}}


@invocations_router.post("/invocations", openapi_extra=_INVOCATION_BODY)
async def invocations(request: Request):
    """SageMaker's single endpoint: a body with "messages" is a chat completion, one with "prompt" a
    completion, one with "input" an embedding (vLLM's order). The body is then validated as that request
    only, so an error names the field that is wrong rather than "no handler matched"."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # json's C decoder gives up on ~10**5 nested arrays or objects
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if "messages" in body:
        kind, handler = ChatCompletionRequest, create_chat_completion
    elif "prompt" in body:
        kind, handler = CompletionRequest, create_completion
    elif "input" in body:
        kind, handler = EmbeddingRequest, create_embedding
    else:
        raise APIError(400, "cannot route this request: send a chat completion body (with \"messages\"), a "
                            "completion body (with \"prompt\") or an embedding body (with \"input\")",
                       param="messages")
    try:
        parsed = kind.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    return await handler(parsed, request, _ctx(request))


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's tokenizer_config.json equivalent: the tokenizer class, its special tokens, the chat template."""
    ctx = _ctx(request)
    tok = ctx.engine.tokenizer
    info = {"tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
            "model_max_length": ctx.engine.max_model_len, **tok.special_tokens,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "eos_token_ids": sorted(ctx.engine.info.eos_token_ids)}
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info
