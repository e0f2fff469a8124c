"""POST /v1/embeddings (OpenAI's shape): pooled final hidden states, L2-normalized, as float lists or
base64 (little-endian float32, what the openai client asks for by default)."""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import uuid
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from pagellm.engine.embedding import check_token_ids, embed_token_ids
from pagellm.engine.request_stream import EngineStoppedError, RequestTimeoutError
from pagellm.server.common import ServerContext, admission_error, now_s, unless_disconnected
from pagellm.server.errors import APIError
from pagellm.server.fields import Flag, Int, TokenId
from pagellm.server.request_checks import token_ids_of
from pagellm.server.request_limits import MAX_INPUTS, check_list_length


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None
    # vLLM / pagellm extras
    pooling: Literal["last", "mean"] | None = None  # default: the server's --embedding-pooling
    normalize: Flag = True
    add_special_tokens: Flag = True
    truncate_prompt_tokens: Int | None = None  # keep the last N tokens of each input (-1: max_model_len)

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise APIError(400, "input must not be empty", param="input")
        if isinstance(x[0], int):
            return [list(x)]
        return list(x)


async def create_embedding(body: EmbeddingRequest, request: Request, ctx: ServerContext) -> dict:
    model = ctx.check_model(body.model)
    hidden = ctx.engine.info.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"dimensions must be {hidden} (this model's hidden size; no other is supported), "
                            f"got {body.dimensions}", param="dimensions")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < 1 and \
            body.truncate_prompt_tokens != -1:
        raise APIError(400, f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got "
                            f"{body.truncate_prompt_tokens}", param="truncate_prompt_tokens")
    inputs = body.inputs()
    check_list_length("input", inputs, MAX_INPUTS)  # each is a job between steps (minutes for 10**5)
    try:
        inputs = await _token_ids(ctx, inputs, body)
    except ValueError as e:
        raise admission_error(e, "input") from None
    job = functools.partial(embed_token_ids, pooling=body.pooling, normalize=body.normalize)

    async def run_all():
        work = asyncio.gather(*(ctx.engine.run_job(functools.partial(job, ids=p)) for p in inputs))
        try:  # --request-timeout as for generation: the jobs not yet run are dropped (cancelled)
            return await asyncio.wait_for(work, ctx.request_timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"request timed out after {ctx.request_timeout:g} s") from None

    try:
        results = await unless_disconnected(request, run_all())
    except (ValueError, EngineStoppedError, RequestTimeoutError) as e:
        raise admission_error(e, "input") from None
    data = [{"object": "embedding", "index": i, "embedding": _encode(vec, body.encoding_format)}
            for i, (vec, _) in enumerate(results)]
    tokens = sum(n for _, n in results)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": now_s(), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _token_ids(ctx: ServerContext, inputs: list[str | list[int]], body: EmbeddingRequest) -> list[list[int]]:
    """Every input as token ids, cut to truncate_prompt_tokens and checked here, in the API process (the engine
    core runs embeddings between steps: embed_token_ids)."""
    out = []
    for ids in await token_ids_of(ctx.engine.tokenizer, inputs, body.add_special_tokens):
        if body.truncate_prompt_tokens is not None:
            keep = ctx.engine.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
            ids = ids[-keep:]
        check_token_ids(ids, "input", ctx.engine.info.model_config.vocab_size, ctx.engine.max_model_len)
        out.append(ids)
    return out


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
