"""Every failure leaves the gateway as OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

- `ProtocolError` (raised by auth, serving and validation helpers) -> its own status and body.
- FastAPI's `RequestValidationError` -> 400 `invalid_request_error` naming the param, never 422.
- Starlette's HTTP errors (unknown route 404, wrong method 405, unparsable body 400) -> their status,
  OpenAI's wording (`Invalid URL (GET /v1/x)`).
- Anything else -> 500 `server_error`, logged with its traceback (the official client retries 5xx).
- Bodies over the size limit -> 413, whether announced by `Content-Length` or found while streaming in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coserve.api.protocol.base import ErrorBody, ErrorResponse, ProtocolError, error_from_validation

logger = logging.getLogger(__name__)

# FastAPI prefixes each error location with where the value came from; OpenAI's `param` is the bare name.
_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})
# Multipart boundaries and part headers around the file: a generous allowance over the file limit.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def error_json(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse with OpenAI's error body."""
    body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def protocol_error_response(exc: ProtocolError) -> JSONResponse:
    """`exc` rendered with its status."""
    return JSONResponse(exc.to_response().model_dump(mode="json"), status_code=exc.status,
                        headers=exc.headers or None)


class _StrippedErrors:
    """FastAPI's validation errors with the source prefix removed, shaped like a pydantic `ValidationError`
    for `error_from_validation` (which only calls `.errors(include_url=False)`)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        self._errors = [{**e, "loc": _strip_source(tuple(e.get("loc", ())))} for e in errors]

    def errors(self, include_url: bool = False) -> list[dict[str, Any]]:
        return self._errors


def _strip_source(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return loc[1:] if loc and loc[0] in _SOURCES else loc


def validation_error(exc: RequestValidationError) -> ProtocolError:
    """A 400 `ProtocolError` naming the first offending parameter of a FastAPI validation failure."""
    stripped: Any = _StrippedErrors(list(exc.errors()))
    converted: ValidationError = stripped  # duck-typed: see `_StrippedErrors`
    return error_from_validation(converted)


async def _on_protocol_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProtocolError)
    return protocol_error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return protocol_error_response(validation_error(exc))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = None
    if exc.status_code in (404, 405):
        # OpenAI's answer for a path or method it does not serve.
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI's "There was an error parsing the body" for a JSON body whose bytes are not text.
        message, code = "The request body is not valid UTF-8 text; send JSON encoded as UTF-8.", "invalid_json"
    else:
        message = str(exc.detail)
    return error_json(exc.status_code, message, code=code, headers=dict(exc.headers or {}))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_json(500, "The server had an error while processing your request. Sorry about that!",
                      type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(ProtocolError, _on_protocol_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


class _BodyTooLarge(Exception):
    """Raised from `receive` when a body without a (truthful) Content-Length passes the limit."""


class BodySizeLimit:
    """ASGI middleware: requests whose body exceeds their path's limit get 413 in OpenAI's shape.

    A declared `Content-Length` over the limit is refused before any byte is read. A chunked body is
    counted as it arrives; past the limit, reading stops and whatever the app would have answered
    (FastAPI turns the interrupted read into a 400) is replaced by the 413.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest body accepted (JSON endpoints).
        path_limits: exact path -> its own limit (the upload endpoint's, larger than a JSON body's).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(limit, scope, receive, send)
            return
        received = 0
        exceeded = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                exceeded = True
                raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if exceeded:
                return  # the 413 below replaces whatever the app made of the interrupted read
            response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded and not response_started:
            await self._too_large(limit, scope, receive, send)

    @staticmethod
    async def _too_large(limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_json(413, f"Request body too large: the limit is {limit} bytes.",
                              code="request_too_large")
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn's parser refuses these first; counting covers the rest
    return None
