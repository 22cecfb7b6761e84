"""The HTTP layer: OpenAI-compatible routes over an EngineClient. No torch here."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import asdict
from importlib import resources
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark_serve.scheduler.client import (
    EngineClient,
    EngineError,
    GenerationParams,
    GrammarSpec,
    StreamDelta,
)
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.protocol import (
    SEED_MAX,
    TOKEN_ID_KEY,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerationRequest,
    NamedToolChoice,
    check_content_parts,
    check_extras,
    check_values,
    parse_body,
)
from dspark_serve.server.tools import (
    Function,
    ToolCall,
    ToolMode,
    call_schema,
    parse_call,
    render_call,
    with_tools,
)

RequestT = TypeVar("RequestT", bound=GenerationRequest)
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
RETRY_AFTER_S = 1  # told to clients answered 429 (the queue drains in about a request's time)


# Characters JSON leaves raw that many line splitters (Python's str.splitlines, httpx's
# iter_lines) take for a line break; SSE itself breaks lines only at CR and LF.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: Mapping[str, Any]) -> str:
    """One SSE ``data:`` event holding ``payload`` as JSON on a single line.

    Text stays UTF-8 (no ASCII escaping of every non-ASCII character), but the three characters
    above are escaped: a model can write them, and a client splitting the stream with
    ``splitlines`` would otherwise cut the event in two.
    """
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


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


def live_page_html() -> str:
    """The live page, read from the installed package's static/ folder."""
    return resources.files("dspark_serve.server").joinpath("static", "index.html").read_text(encoding="utf-8")


def _json_depth_exceeds(obj: object, limit: int) -> bool:
    """True when arrays/objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = o.values()
        elif not isinstance(o, list):
            continue
        if d > limit:
            return True
        stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return False


class Guard:
    """Pure ASGI middleware (an `@app.middleware("http")` would hide client disconnects from
    the routes): the API key on /v1/*, and the request body limit, checked on the declared
    length before anything is read and again while the body is buffered."""

    def __init__(self, app: ASGIApp, config: ServerConfig, on_error: Callable[[int], None]) -> None:
        self.app, self.config, self.on_error = app, config, on_error
        self._key = config.api_key.encode() if config.api_key else None

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v
                break
        scheme, _, token = header.partition(b" ")
        key = self._key
        return key is not None and scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._key is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
            return await self._reply(scope, receive, send, 401, "invalid or missing API key")
        limit = self.config.max_body_bytes
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await self._reply(scope, receive, send, 400, "invalid Content-Length")
            if declared > limit:
                return await self._reply(scope, receive, send, 413, self._too_large(declared))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Buffer the body (bounded), then hand it on; later receive() calls reach the server
        # again, so the routes still see the client disconnect.
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return await self._reply(scope, receive, send, 413, self._too_large(None))
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            late = f"the request body was not received within {self.config.body_timeout:g}s"
            return await self._reply(scope, receive, send, 408, late, {"connection": "close"})
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return body
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, declared: int | None) -> str:
        got = f" ({declared} bytes)" if declared is not None else ""
        return f"request body too large{got}; the limit is {self.config.max_body_bytes} bytes"

    async def _reply(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.on_error(status)
        await error_response(status, message, headers=headers)(scope, receive, send)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "TextPart"}


def _param_of(err: Mapping[str, Any]) -> str | None:
    # pydantic names the union member tried (`prompt.str`, `prompt.list[str]`): not a parameter
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    loc = [x for x in loc if x not in _TYPE_TAGS and "[" not in x and not x.startswith("function-")]
    return ".".join(loc) if loc else None


def _validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    if len(loc) >= 2 and loc[-1] == "[key]":  # a dict key failed: name the dict, show the key short
        param = _param_of({"loc": loc[:-2]})
        key = loc[-2] if len(loc[-2]) <= 24 else loc[-2][:24] + "..."
        return ApiError(400, f"{param}: key {key!r}: {err.get('msg')}", param)
    param = _param_of(err)
    return ApiError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


def below_pattern(n: int) -> str:
    """A regular expression matching the decimal integers in [0, n) (leading zeros allowed),
    for a schema to say which token ids a key may name. n >= 1."""
    top = str(n - 1)
    k = len(top)
    alts = [f"[0-{top}]"] if k == 1 else ["[0-9]"]
    alts += [f"[1-9][0-9]{{{length - 1}}}" for length in range(2, k)]
    for i in range(k if k > 1 else 0):
        lo, hi = (1 if i == 0 else 0), int(top[i]) - 1
        if hi >= lo:
            rest = k - i - 1
            alts.append(top[:i] + f"[{lo}-{hi}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if k > 1:
        alts.append(top)
    return f"^0*({'|'.join(alts)})$"


def _narrow_schema(props: dict[str, Any], model: str, max_len: int, vocab: int | None) -> None:
    """Document what is accepted, not merely what parses: the values checked after parsing
    (n, penalties, logprobs, stop, model, token ids) so a schema-driven client or fuzzer sends
    valid requests when it means to. Anything outside still gets a 400 naming the parameter."""
    null = {"type": "null"}
    props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, null], "default": None}
    props["n"] = {"type": "integer", "minimum": 1, "maximum": 16, "default": 1}
    for k in ("presence_penalty", "frequency_penalty"):
        props[k] = {"type": "number", "minimum": -2, "maximum": 2, "default": 0}
    if "top_logprobs" in props:  # chat: logprobs is a flag, top_logprobs the count
        props["logprobs"] = {"anyOf": [{"type": "boolean"}, null], "default": None}
        props["top_logprobs"] = {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": 20}, null],
            "default": None,
        }
    else:
        props["logprobs"] = {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": 20}, null],
            "default": None,
        }
    word = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [word, {"type": "array", "items": word, "maxItems": 16}, null], "default": None}
    for k in ("max_tokens", "max_completion_tokens"):
        if k in props:
            props[k] = {
                "anyOf": [{"type": "integer", "minimum": 1, "maximum": max_len - 1}, null],
                "default": props[k].get("default"),
            }
    key: dict[str, Any] = {"pattern": TOKEN_ID_KEY}
    if vocab is not None:
        key = {"allOf": [key, {"pattern": below_pattern(vocab)}]}
    bias = {"type": "number", "minimum": -100, "maximum": 100}
    props["logit_bias"] = {
        "anyOf": [{"type": "object", "propertyNames": key, "additionalProperties": bias}, null],
        "default": None,
    }
    if "prompt" in props:
        ids = {"type": "integer", "minimum": 0}
        if vocab is not None:
            ids["maximum"] = vocab - 1
        props["prompt"] = {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": ids, "minItems": 1},
            ]
        }


def build_app(engine: EngineClient, config: ServerConfig, registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title="dspark-serve", docs_url=None, redoc_url=None)
    errors = Counter(
        "dspark:http_errors",
        "Error responses by HTTP status (429: queue full).",
        ["status"],
        registry=registry,
    )
    for st in (400, 401, 404, 408, 413, 429, 500, 503):
        errors.labels(status=str(st))  # exported at zero from the start

    def count_error(status: int) -> None:
        errors.labels(status=str(status)).inc()

    def fail(
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> JSONResponse:
        count_error(status)
        return error_response(status, message, param, code, headers)

    app.add_middleware(Guard, config=config, on_error=count_error)

    def served_name() -> str:
        return config.served_model_name or engine.model_name

    def draining() -> bool:
        return bool(getattr(engine, "draining", False))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return fail(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        e = _validation_error(exc)
        return fail(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return fail(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return fail(500, "internal server error")

    errs = {
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

    @app.get("/", include_in_schema=False)
    async def live_page() -> HTMLResponse:
        """The live page: a chat box streaming token provenance and gauges from /metrics
        (server/static/index.html; everything it needs is in that one file)."""
        return HTMLResponse(live_page_html(), headers={"Cache-Control": "no-cache"})

    @app.get("/health", responses={503: errs[503]}, response_model=None)
    async def health() -> JSONResponse | dict[str, str]:
        if draining():
            return fail(503, "the server is draining (shutting down)", code="draining")
        if engine.ready:
            return {"status": "ok"}
        if engine.load_error:
            return fail(503, f"model failed to load: {engine.load_error}", code="load_failed")
        stage = getattr(engine, "loading_stage", None)
        return fail(503, f"model is loading: {stage}" if stage else "model is loading", code="loading")

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition",
            }
        },
    )
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        entry = {
            "id": served_name(),
            "object": "model",
            "created": 0,
            "owned_by": "dspark-serve",
            "max_model_len": engine.max_model_len,
        }
        info = engine.runtime_info
        if info is not None:
            entry["runtime"] = asdict(info)
        return entry

    @app.get("/v1/models", responses={401: errs[401]}, response_model=None)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={401: errs[401], 404: errs[404]}, response_model=None)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served_name():
            raise ApiError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_card()

    def decode(raw: bytes, schema: type[RequestT]) -> RequestT:
        """JSON -> validated request; runs in a worker thread, never on the event loop."""
        try:
            body = parse_body(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        except RecursionError:
            raise ApiError(400, f"request body nests deeper than {config.max_json_depth} levels") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if _json_depth_exceeds(body, config.max_json_depth):
            raise ApiError(400, f"request body nests deeper than {config.max_json_depth} levels")
        param, msg = check_values(body)
        if param is not None or msg is not None:
            raise ApiError(400, str(msg), param)
        param, msg = check_content_parts(body)
        if param is not None:
            raise ApiError(400, str(msg), param)
        body, param, msg = check_extras(body, schema)
        if param is not None:
            raise ApiError(400, str(msg), param, "unsupported_parameter")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from exc

    async def parse(request: Request, schema: type[RequestT]) -> RequestT:
        if draining():
            raise ApiError(503, "the server is draining (shutting down)", code="draining")
        req = await run_in_threadpool(decode, await request.body(), schema)
        if req.model is not None and req.model != served_name():
            raise ApiError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
        if not engine.ready:
            raise ApiError(503, "model is loading")
        if getattr(req, "top_logprobs", None) is not None and not getattr(req, "logprobs", None):
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        vocab = getattr(engine, "vocab_size", None)
        if req.logit_bias and vocab is not None:  # keys and values: the request model's
            for key in req.logit_bias:
                if int(key) >= vocab:
                    raise ApiError(
                        400, f"logit_bias token id {key} is out of range [0, {vocab})", "logit_bias"
                    )
        rf = req.response_format
        if (
            rf is not None
            and rf.type == "json_schema"
            and (rf.json_schema is None or rf.json_schema.schema_ is None)
        ):
            raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
        if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
            raise ApiError(400, "json_schema goes with response_format type json_schema", "response_format")
        stops = req.stop_list()
        if len(stops) > 16 or any(not s for s in stops):
            raise ApiError(400, "stop must be up to 16 non-empty strings", "stop")
        return req

    def tool_mode(req: ChatCompletionRequest) -> ToolMode | None:
        """What the request's tools and tool_choice ask for (None: no tools in play)."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None
        functions = [
            Function(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
            for t in req.tools
        ]
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools must have distinct function names", "tools")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f.name == choice.function.name]
            if not named:
                raise ApiError(
                    400, f"tool_choice names an unknown function {choice.function.name!r}", "tool_choice"
                )
            return ToolMode(functions, named, True, True)
        return ToolMode(functions, functions, choice == "required", True)

    def logprobs_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
        if isinstance(req, ChatCompletionRequest):
            return (req.top_logprobs or 0) if req.logprobs else None
        return req.logprobs

    def grammar_of(
        req: ChatCompletionRequest | CompletionRequest, tools: ToolMode | None
    ) -> GrammarSpec | None:
        if tools is not None and tools.constrained:
            return GrammarSpec("json_schema", json.dumps(call_schema(tools.allowed)), "tools")
        rf = req.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return GrammarSpec("json_object")
        assert rf.json_schema is not None and rf.json_schema.schema_ is not None
        return GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_), "response_format")

    def gen_params(
        req: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        max_tokens: int | None,
        tools: ToolMode | None = None,
    ) -> GenerationParams:
        limit = engine.max_model_len
        if max_tokens is None:
            max_tokens = max(1, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        return GenerationParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            seed=req.seed,
            stop=req.stop_list(),
            ignore_eos=req.ignore_eos,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items())),
            logprobs=logprobs_of(req),
            grammar=grammar_of(req, tools),
        )

    def sample_params(params: GenerationParams, i: int) -> GenerationParams:
        """The i-th of n samples: its own seed (seed + i) when the request is seeded."""
        if i == 0 or params.seed is None:
            return params
        seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
        return dataclasses.replace(params, seed=seed)

    def usage(d: StreamDelta | None, prompt_len: int, completion: int) -> dict[str, Any]:
        u: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        }
        if d is not None and d.spec is not None:
            u["spec_decode"] = d.spec
        return u

    async def watch_disconnect(request: Request, request_id: str) -> None:
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                engine.abort(request_id)
                return

    async def first_delta(stream: AsyncIterator[StreamDelta]) -> StreamDelta | None:
        """Start the request so engine-side rejections become HTTP errors before any SSE byte."""
        try:
            return await stream.__anext__()
        except EngineError as exc:
            raise ApiError(exc.status, str(exc), exc.param, exc.code) from exc
        except StopAsyncIteration:
            return None

    def token_records(d: StreamDelta | None) -> list[dict[str, Any]]:
        return (
            []
            if d is None
            else [
                {"id": t.token_id, "text": t.text, "kind": t.kind, "position": t.draft_position}
                for t in d.tokens
            ]
        )

    def logprob_items(d: StreamDelta) -> list[dict[str, Any]]:
        """OpenAI chat `logprobs.content` entries for a delta's tokens."""
        out = []
        for t in d.tokens:
            lp = t.logprob
            if lp is None:
                continue
            out.append(
                {
                    "token": lp.token,
                    "logprob": lp.logprob,
                    "bytes": list(lp.token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": a.token, "logprob": a.logprob, "bytes": list(a.token.encode("utf-8"))}
                        for a in lp.top
                    ],
                }
            )
        return out

    def completion_logprobs(deltas: list[StreamDelta], offset: int) -> dict[str, Any]:
        """OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
        tokens, lps, tops, offsets = [], [], [], []
        for d in deltas:
            for t in d.tokens:
                if t.logprob is None:
                    continue
                tokens.append(t.logprob.token)
                lps.append(t.logprob.logprob)
                tops.append({a.token: a.logprob for a in t.logprob.top})
                offsets.append(offset)
                offset += len(t.text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
        body = {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        return body if index is None else {"index": index, **body}

    async def run(
        request: Request,
        kind: str,
        prompt_ids: list[int],
        params: GenerationParams,
        stream: bool,
        include_usage: bool,
        provenance: bool = False,
        n: int = 1,
        tools: ToolMode | None = None,
    ) -> Response | dict[str, Any]:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        want_logprobs = params.logprobs is not None
        # n independent samples: one engine request each (its own drafter state; the prompt's
        # KV shared through the prefix cache); a seeded request's i-th sample uses seed + i.
        ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        gens = [engine.generate(ids[i], prompt_ids, sample_params(params, i)) for i in range(n)]

        async def abort_all() -> None:
            """Close every stream (an unfinished one aborts its engine request)."""
            for i, g in zip(ids, gens):
                try:
                    await g.aclose()
                except RuntimeError:  # still being iterated by a task that is going away
                    engine.abort(i)

        # Watch for the client going away from the start: while queued and prefilling too.
        watchers = [asyncio.create_task(watch_disconnect(request, i)) for i in ids]
        firsts = await asyncio.gather(*(first_delta(g) for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for w in watchers:
                w.cancel()
            await abort_all()
            raise failed
        first_deltas = [cast(StreamDelta | None, f) for f in firsts]
        name = served_name()

        def choice(
            i: int, text: str, finish: str | None, delta: bool, logprobs: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            if kind == "chat":
                body = {"content": text} if delta else {"role": "assistant", "content": text}
                return {
                    "index": i,
                    ("delta" if delta else "message"): body,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def final_choice(i: int, text: str, finish: str | None, deltas: list[StreamDelta]) -> dict[str, Any]:
            call = parse_call(text, tools.functions) if tools is not None and tools.parse else None
            if call is not None and finish == "stop":
                return {
                    "index": i,
                    "message": {"role": "assistant", "content": None, "tool_calls": [tool_call_json(call)]},
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                }
            lp = None
            if want_logprobs:
                lp = (
                    {"content": [x for d in deltas for x in logprob_items(d)]}
                    if kind == "chat"
                    else completion_logprobs(deltas, 0)
                )
            return choice(i, text, finish, False, lp)

        if not stream:

            async def collect(
                first: StreamDelta | None, gen: AsyncIterator[StreamDelta]
            ) -> list[StreamDelta]:
                got = [] if first is None else [first]
                if first is not None and not first.finished:
                    async for d in gen:
                        got.append(d)
                return got

            tasks = [asyncio.create_task(collect(f, g)) for f, g in zip(first_deltas, gens)]
            try:
                results = await asyncio.gather(*tasks)
            except EngineError as exc:
                raise ApiError(exc.status, str(exc), exc.param, exc.code) from exc
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for w in watchers:
                    w.cancel()
                await abort_all()
            choices, records, completion = [], [], 0
            lasts = []
            for i, deltas in enumerate(results):
                last = deltas[-1] if deltas else None
                if last is not None and last.error:
                    raise ApiError(503, last.error, code="draining")
                completion += last.completion_tokens if last else 0
                text = "".join(d.text for d in deltas)
                choices.append(final_choice(i, text, last.finish_reason if last else "stop", deltas))
                if provenance:
                    records += [t for d in deltas for t in token_records(d)]
                lasts.append(last)
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage(lasts[0] if n == 1 else None, len(prompt_ids), completion),
            }
            if provenance:
                body["dspark"] = {"tokens": records}
            return body

        # From here the streaming response notices a disconnect itself (and closes the streams).
        for w in watchers:
            w.cancel()
        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(
            choices: list[dict[str, Any]],
            u: dict[str, Any] | None = None,
            tokens: list[dict[str, Any]] | None = None,
        ) -> str:
            p = {"id": rid, "object": chunk_obj, "created": created, "model": name, "choices": choices}
            if include_usage:
                p["usage"] = u
            if tokens:
                p["dspark"] = {"tokens": tokens}
            return sse_event(p)

        # Tool calls are recognised on the whole reply: a request that may call a tool streams
        # its reply when it is complete (as content, or as one tool-call delta with its name and
        # arguments), the way OpenAI streams a tool call's chunks, only in one piece.
        buffered = tools is not None and tools.parse

        async def merged() -> AsyncGenerator[tuple[int, StreamDelta], None]:
            """(choice index, delta) from all n streams as they come."""
            q: asyncio.Queue[Any] = asyncio.Queue()

            async def pump(i: int, first: StreamDelta | None, gen: AsyncIterator[StreamDelta]) -> None:
                try:
                    if first is not None:
                        await q.put((i, first))
                    if first is not None and not first.finished:
                        async for d in gen:
                            await q.put((i, d))
                except Exception as exc:  # handed to the consumer
                    await q.put((i, exc))
                finally:
                    await q.put((i, None))

            tasks = [asyncio.create_task(pump(i, f, g)) for i, (f, g) in enumerate(zip(first_deltas, gens))]
            try:
                open_ = n
                while open_:
                    i, item = await q.get()
                    if item is None:
                        open_ -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        stream_all = merged()

        async def events() -> AsyncGenerator[str, None]:
            completion = [0] * n
            texts: list[list[str]] = [[] for _ in range(n)]
            offsets = [0] * n
            last_spec = None
            try:
                if kind == "chat":
                    for i in range(n):
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                async for i, d in stream_all:
                    completion[i] = d.completion_tokens
                    last_spec = d
                    tokens = token_records(d) if provenance else None
                    if buffered:
                        texts[i].append(d.text)
                    elif d.text or tokens or (want_logprobs and d.tokens):
                        lp = None
                        if want_logprobs:
                            lp = (
                                {"content": logprob_items(d)}
                                if kind == "chat"
                                else completion_logprobs([d], offsets[i])
                            )
                        offsets[i] += sum(len(t.text) for t in d.tokens)
                        yield chunk([choice(i, d.text, None, True, lp)], tokens=tokens)
                    if d.finished:
                        finish = d.finish_reason
                        if buffered:
                            text = "".join(texts[i])
                            call = parse_call(text, tools.functions) if tools is not None else None
                            if call is not None and finish == "stop":
                                delta = {"tool_calls": [tool_call_json(call, 0)]}
                                yield chunk(
                                    [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]
                                )
                                finish = "tool_calls"
                            elif text:
                                yield chunk([choice(i, text, None, True)])
                        yield chunk(
                            [{**choice(i, "", finish, True), **({"delta": {}} if kind == "chat" else {})}]
                        )
                    if d.error:  # cut by a drain: say so after the finish_reason
                        yield sse_event(error_body(d.error, 503, None, "draining"))
                if include_usage:
                    spec = last_spec if n == 1 else None
                    yield chunk([], usage(spec, len(prompt_ids), sum(completion)))
                yield "data: [DONE]\n\n"
            except EngineError as exc:
                count_error(exc.status)
                yield sse_event(error_body(str(exc), exc.status, exc.param, exc.code or str(exc.status)))
                yield "data: [DONE]\n\n"
            finally:
                await stream_all.aclose()
                await abort_all()  # a client that went away aborts its requests here

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    gen_responses: dict[int | str, dict[str, Any]] = {
        **{k: errs[k] for k in (400, 401, 404, 413, 429, 503)},
        200: {
            "content": {"application/json": {}, "text/event-stream": {}},
            "description": "A completion, or with `stream: true` server-sent events",
        },
    }

    def body_doc(schema: type[BaseModel]) -> dict[str, Any]:
        return {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}
                },
            }
        }

    @app.post(
        "/v1/chat/completions",
        responses=gen_responses,
        openapi_extra=body_doc(ChatCompletionRequest),
        response_model=None,
    )
    async def chat(request: Request) -> Response | dict[str, Any]:
        req = await parse(request, ChatCompletionRequest)
        messages = []
        for m in req.messages:
            content = m.text()
            if m.role == "assistant" and m.tool_calls:
                calls = [render_call(c.function.name, c.function.arguments) for c in m.tool_calls]
                content = "\n".join(([content] if content else []) + calls)
            messages.append({"role": m.role if m.role != "developer" else "system", "content": content})
        tools = tool_mode(req)
        if tools is not None and tools.parse:
            messages = with_tools(messages, tools.functions)
        try:  # off the event loop: a long conversation must not hold up other requests
            prompt_ids = await run_in_threadpool(engine.tokenize_chat, messages)
        except Exception as exc:  # templates reject odd role orders
            raise ApiError(400, f"messages could not be formatted: {exc}", "messages") from exc
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = gen_params(req, len(prompt_ids), max_tokens, tools)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(
            request,
            "chat",
            prompt_ids,
            params,
            req.stream,
            include_usage,
            bool(req.dspark and req.dspark.provenance),
            req.n,
            tools,
        )

    @app.post(
        "/v1/completions",
        responses=gen_responses,
        openapi_extra=body_doc(CompletionRequest),
        response_model=None,
    )
    async def completions(request: Request) -> Response | dict[str, Any]:
        req = await parse(request, CompletionRequest)
        p = req.prompt
        prompt_ids: list[int]
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompt_ids = [int(x) for x in p]
            vocab = getattr(engine, "vocab_size", None)
            bad = [x for x in prompt_ids if x < 0 or (vocab is not None and x >= vocab)]
            if bad:
                raise ApiError(
                    400,
                    f"prompt token id {bad[0]} is out of range"
                    + (f" [0, {vocab})" if vocab is not None else " (negative)"),
                    "prompt",
                )
        else:
            text: object = p
            if isinstance(p, list):
                if len(p) != 1:
                    raise ApiError(400, "only one prompt per request is supported", "prompt")
                text = p[0]
            prompt_ids = await run_in_threadpool(engine.tokenize, str(text))
        if not prompt_ids:
            raise ApiError(400, "prompt must not be empty", "prompt")
        params = gen_params(req, len(prompt_ids), 16 if req.max_tokens is None else req.max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(
            request,
            "completion",
            prompt_ids,
            params,
            req.stream,
            include_usage,
            bool(req.dspark and req.dspark.provenance),
            req.n,
        )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest, ErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                _narrow_schema(
                    comps[name]["properties"],
                    served_name(),
                    engine.max_model_len,
                    getattr(engine, "vocab_size", None),
                )
            for op in doc["paths"].get("/v1/models/{model_id}", {}).values():
                for prm in op.get("parameters", []):
                    prm["schema"] = {"type": "string", "enum": [served_name()]}
            if config.api_key:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, ops in doc["paths"].items():
                    if path.startswith("/v1/"):
                        for op in ops.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
