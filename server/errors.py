"""Every error this server answers, in OpenAI's shape: `{"error": {message, type, param, code}}`.

`ApiError` is what route code raises; the handlers installed here turn it, a request
validation error, an HTTP error from the router, or anything unexpected into that JSON body,
and count each answer by status (`dspark:http_errors`). No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_serve.server.protocol import ErrorResponse, RuleError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}
DEFAULT_CODES = {
    401: "invalid_api_key",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
}
COUNTED_STATUSES = (400, 401, 404, 408, 413, 429, 500, 503)  # exported at zero from the start
RETRY_AFTER_S = 1  # told to clients answered 429 (the queue drains in about a request's time)

# The error responses as the OpenAPI document lists them.
ERROR_DOCS: dict[int, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in (
        (400, "Bad parameters, JSON or prompt (the parameter is named in `param`)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body over the limit"),
        (429, "Waiting queue full (see Retry-After)"),
        (503, "Model loading or server draining"),
    )
}


class ApiError(Exception):
    """An error answer: raised anywhere below a route, turned into its JSON body by the handlers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def encodable(text: str | None) -> str | None:
    """text with anything UTF-8 cannot encode (lone surrogates) written as escapes: an error
    that echoes a client's input must still be sendable."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    """An OpenAI-shaped error object (the JSON body of an error response, or an SSE error event)."""
    return {
        "error": {
            "message": encodable(message),
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": encodable(param),
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    if status == 429:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if status == 401:
        headers.setdefault("WWW-Authenticate", 'Bearer realm="dspark-serve"')
    if code is None:
        code = DEFAULT_CODES.get(status, None if status < 500 else str(status))
    return JSONResponse(status_code=status, headers=headers, content=error_body(message, status, param, code))


# pydantic names the union member it tried (`prompt.str`, `prompt.list[str]`): not a parameter.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "TextPart"}


def _param_of(loc: list[str]) -> str | None:
    loc = [x for x in loc if x != "body"]
    loc = [x for x in loc if x not in _TYPE_TAGS and "[" not in x and not x.startswith("function-")]
    return ".".join(loc) if loc else None


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """The first error pydantic found, as a 400 naming the parameter. A broken request rule
    (`RuleError`) keeps its own parameter and message."""
    err = exc.errors()[0]
    rule = err.get("ctx", {}).get("error")
    if isinstance(rule, RuleError):
        return ApiError(400, rule.message, rule.param)
    loc = [str(x) for x in err.get("loc", ())]
    if len(loc) >= 2 and loc[-1] == "[key]":  # a dict key failed: name the dict, show the key short
        param = _param_of(loc[:-2])
        key = loc[-2] if len(loc[-2]) <= 24 else loc[-2][:24] + "..."
        return ApiError(400, f"{param}: key {key!r}: {err.get('msg')}", param)
    param = _param_of(loc)
    return ApiError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


def install_error_handlers(app: FastAPI, answer: Callable[..., JSONResponse]) -> None:
    """Every exception a route can end with becomes an OpenAI-shaped answer; `answer` is
    `AppState.fail` (the error response, counted by status)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return answer(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        e = validation_error(exc)
        return answer(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return answer(500, "internal server error")
