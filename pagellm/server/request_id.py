"""Request ids across HTTP and the engine: a client's `X-Request-Id` names its engine request (as vLLM does),
and with `--enable-request-id-headers` every response carries `X-Request-Id`.

The header a response gets is the client's, or one generated here; the generated one is kept in the ASGI
scope so the endpoint uses the same id in the response body (`chatcmpl-<id>`), which lets a client match
a response's header to its body and to the server's log.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
_MAX_LEN = 128  # an engine request id is kept and logged: a client cannot make it arbitrarily long


def _client_id(headers: Headers) -> str | None:
    value = headers.get(HEADER, "").strip()
    return value[:_MAX_LEN] or None


def base_request_id(request: Request) -> str:
    """The id an endpoint builds its engine request id from: the client's X-Request-Id, else the one the
    middleware generated for the response header, else a fresh one."""
    rid = getattr(request.state, "request_id", None) or _client_id(request.headers)
    return rid or uuid.uuid4().hex


class RequestIdHeaderMiddleware:
    """Adds X-Request-Id to every HTTP response (pure ASGI: streaming bodies pass through untouched)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _client_id(Headers(scope=scope)) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)
