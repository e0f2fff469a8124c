"""HTTP-level guards, applied before any route runs: the API key (on /v1 and /invocations, and with
`--protect-metrics` on /metrics and /health too), the request-body cap, and CORS (`--allowed-origins`; off
when none are listed).

Pure ASGI middleware, so that a client without the key is refused before its body is read, a body over
the cap is refused while it arrives (from Content-Length when the client declares it, else by counting a
chunked upload) and is never parsed, and streamed responses pass through untouched. The /v1 routes also
check the key themselves (app.py), which declares it in /openapi.json; both compare in constant time.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
# Behind the key whenever there is one (as vLLM: the OpenAI routes); /tokenize, /version, /docs stay open.
KEYED_PREFIXES = ("/v1/", "/invocations")
# Routes that --protect-metrics puts behind the key too (vLLM's /ping is /health).
PROTECTED_OPS_PATHS = frozenset({"/metrics", "/health", "/ping"})
# After answering 413, keep reading (and dropping) what the client still sends, up to this many times the
# cap: a client that writes its whole body before reading would otherwise get a reset connection instead
# of the 413. Past it, the connection is simply closed.
_DRAIN_FACTOR = 4


@dataclass
class HttpOptions:
    """The serve flags these guards read (pagellm/server/launch.py)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    protect_metrics: bool = False
    allowed_origins: list[str] = field(default_factory=list)


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer <key>`, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.strip().encode(), key.encode())


def _too_large(limit: int, declared: int | None = None) -> APIError:
    size = f"{declared} bytes" if declared is not None else f"over {limit} bytes"
    return APIError(413, f"request body too large: {size}, the limit is {limit} bytes "
                         f"(--max-request-body-bytes)", code="request_too_large")


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`; the body is read in full (up to the cap) before the app sees it."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await APIError(400, f"invalid Content-Length header: {declared[:40]!r}").response()(
                    scope, receive, send)
                return
            if length > self.max_bytes:
                await self._refuse(_too_large(self.max_bytes, length), scope, receive, send, length)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(_too_large(self.max_bytes), scope, receive, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        lone = lone_surrogate(body)
        if lone is not None:
            await APIError(400, f"request body: {lone}").response()(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages (http.disconnect) come from the client as usual

        await self.app(scope, replay, send)

    async def _refuse(self, error: APIError, scope: Scope, receive: Receive, send: Send,
                      declared: int | None) -> None:
        await error.response()(scope, receive, send)
        budget = self.max_bytes * _DRAIN_FACTOR
        if declared is not None and declared > budget:
            return
        while budget > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            budget -= len(message.get("body", b""))


# The start of an escaped UTF-16 surrogate half (\\ud800-\\udfff): a body without one (most) is not parsed here.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(body: bytes) -> str | None:
    """Where a JSON body escapes half of a UTF-16 surrogate pair alone (\\ud800 without its low half): such a
    string is no Unicode text, and the tokenizer, the JSON encoder of an error naming it and every other
    consumer fail on it (a 500). None where there is none, or where the body is no JSON (the route says so).
    Parsed and re-encoded in C only when an escaped half is there at all: a Python loop over the escapes took
    ~0.2 s for 3 MB of escaped text, stalling every stream."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"a string holds U+{ord(e.object[e.start]):04X}, half of a UTF-16 surrogate pair, alone: strings "
                f"must be valid Unicode")
    except (ValueError, RecursionError):  # not JSON: FastAPI's parse answers that
        return None
    return None


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` on /v1 and /invocations, and with `protect_ops` on /metrics,
    /health and /ping. A CORS preflight (OPTIONS) carries no credentials and is never refused here."""

    def __init__(self, app: ASGIApp, key: str, protect_ops: bool = False):
        self.app = app
        self.key = key
        self.protect_ops = protect_ops

    def _keyed(self, path: str) -> bool:
        path = path.rstrip("/") or "/"
        return (path + "/").startswith(KEYED_PREFIXES) or (self.protect_ops and path in PROTECTED_OPS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path, root = scope["path"], scope.get("root_path") or ""
            if root and path.startswith(root):
                path = path[len(root):] or "/"
            if self._keyed(path) and not key_matches(Headers(scope=scope).get("authorization"), self.key):
                error = APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer "
                                      "<key>'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_http_guards(app, options: HttpOptions, api_key: str | None) -> None:
    """Add the guards to a FastAPI app. The last added is outermost: CORS, so that its headers reach every
    answer (a 401 or 413 too) and a preflight is answered first; then the key, then the body cap."""
    if options.protect_metrics and not api_key:
        raise ValueError("--protect-metrics needs an API key (--api-key, --api-key-file or $PAGELLM_API_KEY)")
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=options.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, key=api_key, protect_ops=options.protect_metrics)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["X-Request-Id", "Retry-After"])
