"""OpenAI's error object for every failure: {"error": {"message", "type", "param", "code"}}.

Whatever a client sends must map to a 4xx with a message naming the offending field; a 500 is only
ever a bug, and even then the body is an error object, never a traceback.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pagellm")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# SamplingParams and the server raise "FIELD must be ...", "logit_bias[5] must be ...", "FIELD requires ...".
_FIELD_RE = re.compile(r"^([A-Za-z_]\w*)(?:\.[\w.]+)?(?:\[[^\]]*\])?(?: keys)? (?:must|requires)\b")  # a.b: a


def bad_request(error: Exception | str, default_param: str | None = None) -> APIError:
    message = str(error)
    m = _FIELD_RE.match(message)
    param = m.group(1) if m else default_param
    return APIError(400, message, param=param)


# Fields whose type is a union: pydantic reports one error per member, so say what the field may be.
_SHAPES = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
           "stop": "a string or a list of strings", "tokens": "a list of token ids (integers)"}


def _member(error: dict) -> tuple:
    """The location of the union member (a model class, pydantic's capitalized location part) an error is in."""
    loc = tuple(error.get("loc", ()))
    at = next((i for i, part in enumerate(loc) if isinstance(part, str) and part[:1].isupper()), len(loc) - 1)
    return loc[:at + 1]


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    top = first.get("loc", ())[:2]
    if len(errors) > 1 and top and top[-1] not in _SHAPES:
        # A union's members each report; the one that got furthest into the value says what is wrong (a
        # Responses input item's unknown part type, not "input: Input should be a valid string"), leaving out
        # members whose "type" tag did not match (the member whose tag matched knows the item).
        same = [e for e in errors if e.get("loc", ())[:2] == top]
        mismatched = {_member(e) for e in same
                      if e.get("type") == "literal_error" and tuple(e["loc"]) == _member(e) + ("type",)}
        tagged = [e for e in same if _member(e) not in mismatched]
        if not any(len(e["loc"]) > len(top) + 1 for e in tagged):  # only a scalar member left (input: str)
            tagged = same
        first = max(tagged, key=lambda e: len(e.get("loc", ())))
    loc = [f"[{x}]" if isinstance(x, int) else str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        if first.get("type") == "missing":
            return APIError(400, "request body is missing: send a JSON object")
        return APIError(400, f"request body: {first.get('msg')}")
    # Union members add their type name to the location (prompt.str, prompt.list[int]): keep only the
    # path a user wrote.
    path = [p for p in loc if not re.fullmatch(r"[a-z_]+\[.*\]|str|int|float|bool|function-\w+|[A-Z]\w*", p)]
    field = path[0] if path else loc[0]
    where = ".".join(path).replace(".[", "[") or field
    if first.get("type") == "missing":
        return APIError(400, f"{where} is required", param=field)
    if field in _SHAPES and len(path) <= 2 and len(errors) > 1:  # a union (one error per member): its shapes
        return APIError(400, f"{field} must be {_SHAPES[field]}", param=field)
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=field)


def _not_json(request: Request, exc: RequestValidationError) -> APIError | None:
    """A body sent as a form or as text (curl -d without -H 'Content-Type: application/json'): say so,
    rather than that it is not an object."""
    first = exc.errors()[0] if exc.errors() else {}
    kind = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) != ("body",) or "json" in kind.lower():
        return None
    return APIError(400, f"request body must be JSON sent with the header 'Content-Type: application/json' "
                         f"(this one came as {kind[:60]!r})" if kind else
                         "request body must be a JSON object (send 'Content-Type: application/json')")


def internal_error(exc: Exception) -> APIError:
    return APIError(500, f"internal server error ({type(exc).__name__})", code="internal_error")


class InternalErrorMiddleware:
    """A bug's 500 answered here, inside Starlette's ServerErrorMiddleware, which answers with the app's
    handler and then re-raises, so that uvicorn drops the connection: a client reusing it then lost its next
    request (6 of 10 follow-ups were reset in a probe). Once a response has started (a stream), the error
    goes on up: nothing can be answered then."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error", exc_info=exc)
            await internal_error(exc).response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI's error object for every failure. Call before adding other middleware: the 500 middleware is
    then innermost, so that the others (the request id's header) still see its answer."""
    app.add_middleware(InternalErrorMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return (_not_json(request, exc) or _validation_error(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)  # what InternalErrorMiddleware does not see (another middleware's bug)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error", exc_info=exc)
        return internal_error(exc).response()
