"""The HTTP layer: OpenAI-compatible routes over an EngineClient. No torch here."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_serve.scheduler.client import EngineClient, EngineError, GenerationParams, StreamDelta
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    check_content_parts,
    check_extras,
)

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}
DEFAULT_CODES = {401: "invalid_api_key", 413: "request_too_large", 429: "rate_limit_exceeded"}
RETRY_AFTER_S = 1  # told to clients answered 429 (the queue drains in about a request's time)


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    headers = dict(headers or {})
    if status == 429:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if status == 401:
        headers.setdefault("WWW-Authenticate", 'Bearer realm="dspark-serve"')
    if code is None:
        code = DEFAULT_CODES.get(status, None if status < 500 else str(status))
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "invalid_request_error"),
                "param": param,
                "code": code,
            }
        },
    )


def _json_depth_exceeds(obj, limit: int) -> bool:
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

    def __init__(self, app, config: ServerConfig, on_error) -> None:
        self.app, self.config, self.on_error = app, config, on_error
        self._key = config.api_key.encode() if config.api_key else None

    def _authorized(self, scope) -> bool:
        header = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v
                break
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope, receive, send) -> None:
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
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return body
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, declared: int | None) -> str:
        got = f" ({declared} bytes)" if declared is not None else ""
        return f"request body too large{got}; the limit is {self.config.max_body_bytes} bytes"

    async def _reply(self, scope, receive, send, status: int, message: str) -> None:
        self.on_error(status)
        await error_response(status, message)(scope, receive, send)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "StreamOptions", "TextPart"}


def _param_of(err: dict) -> str | None:
    # pydantic names the union member tried (`prompt.str`, `prompt.list[str]`): not a parameter
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    loc = [x for x in loc if x not in _TYPE_TAGS and "[" not in x and not x.startswith("function-")]
    return ".".join(loc) if loc else None


def _validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    err = exc.errors()[0]
    param = _param_of(err)
    return ApiError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


def _narrow_schema(props: dict, model: str, max_len: int, vocab: int | None) -> None:
    """Document what is accepted, not merely what parses: the values checked after parsing
    (n, penalties, logprobs, stop, model, token ids) so a schema-driven client or fuzzer sends
    valid requests when it means to. Anything outside still gets a 400 naming the parameter."""
    null = {"type": "null"}
    props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, null], "default": None}
    props["n"] = {"type": "integer", "minimum": 1, "maximum": 1, "default": 1}
    for k in ("presence_penalty", "frequency_penalty"):
        props[k] = {"type": "number", "minimum": 0, "maximum": 0, "default": 0}
    props["logprobs"] = {"anyOf": [{"type": "boolean", "enum": [False]}, null], "default": None}
    if "top_logprobs" in props:
        props["top_logprobs"] = {"anyOf": [{"type": "integer", "enum": [0]}, null], "default": None}
    word = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [word, {"type": "array", "items": word, "maxItems": 16}, null], "default": None}
    for k in ("max_tokens", "max_completion_tokens"):
        if k in props:
            props[k] = {
                "anyOf": [{"type": "integer", "minimum": 1, "maximum": max_len - 1}, null],
                "default": props[k].get("default"),
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
    for st in (400, 401, 404, 413, 429, 500, 503):
        errors.labels(status=str(st))  # exported at zero from the start

    def count_error(status: int) -> None:
        errors.labels(status=str(status)).inc()

    def fail(
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> JSONResponse:
        count_error(status)
        return error_response(status, message, param, code, headers)

    app.add_middleware(Guard, config=config, on_error=count_error)

    def served_name() -> str:
        return config.served_model_name or engine.model_name

    def draining() -> bool:
        return bool(getattr(engine, "draining", False))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return fail(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(_: Request, exc: RequestValidationError):
        e = _validation_error(exc)
        return fail(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return fail(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception):
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
    async def live_page():
        """The live page: a chat box streaming token provenance and gauges from /metrics
        (server/static/index.html; everything it needs is in that one file)."""
        page = resources.files("server").joinpath("static", "index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health", responses={503: errs[503]})
    async def health():
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
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
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

    @app.get("/v1/models", responses={401: errs[401]})
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses={401: errs[401], 404: errs[404]})
    async def model(model_id: str):
        if model_id != served_name():
            raise ApiError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_card()

    def decode(raw: bytes, schema):
        """JSON -> validated request; runs in a worker thread, never on the event loop."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        except RecursionError:
            raise ApiError(400, f"request body nests deeper than {config.max_json_depth} levels") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if _json_depth_exceeds(body, config.max_json_depth):
            raise ApiError(400, f"request body nests deeper than {config.max_json_depth} levels")
        param, msg = check_content_parts(body)
        if param is not None:
            raise ApiError(400, msg, param)
        body, param, msg = check_extras(body, schema)
        if param is not None:
            raise ApiError(400, msg, param, "unsupported_parameter")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from exc

    async def parse(request: Request, schema):
        if draining():
            raise ApiError(503, "the server is draining (shutting down)", code="draining")
        req = await run_in_threadpool(decode, await request.body(), schema)
        if req.model is not None and req.model != served_name():
            raise ApiError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
        if not engine.ready:
            raise ApiError(503, "model is loading")
        if req.n != 1:
            raise ApiError(400, f"n={req.n} is not supported; only n=1", "n")
        if req.presence_penalty or req.frequency_penalty:
            raise ApiError(
                400,
                "presence_penalty and frequency_penalty are not supported",
                "presence_penalty" if req.presence_penalty else "frequency_penalty",
            )
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", "logprobs")
        if getattr(req, "top_logprobs", None):
            raise ApiError(400, "top_logprobs is not supported", "top_logprobs")
        stops = req.stop_list()
        if len(stops) > 16 or any(not s for s in stops):
            raise ApiError(400, "stop must be up to 16 non-empty strings", "stop")
        return req

    def gen_params(req, prompt_len: int, max_tokens: int | None) -> GenerationParams:
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
        )

    def usage(d: StreamDelta | None, prompt_len: int, completion: int) -> dict:
        u = {
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

    async def first_delta(stream: AsyncIterator[StreamDelta]):
        """Start the request so engine-side rejections become HTTP errors before any SSE byte."""
        try:
            return await stream.__anext__()
        except EngineError as exc:
            raise ApiError(exc.status, str(exc), exc.param, exc.code) from exc
        except StopAsyncIteration:
            return None

    def token_records(d: StreamDelta | None) -> list[dict]:
        return (
            []
            if d is None
            else [
                {"id": t.token_id, "text": t.text, "kind": t.kind, "position": t.draft_position}
                for t in d.tokens
            ]
        )

    async def run(
        request: Request,
        kind: str,
        prompt_ids: list[int],
        params: GenerationParams,
        stream: bool,
        include_usage: bool,
        provenance: bool = False,
    ):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        gen = engine.generate(rid, prompt_ids, params)
        # Watch for the client going away from the start: while queued and prefilling too.
        watcher = asyncio.create_task(watch_disconnect(request, rid))
        try:
            first = await first_delta(gen)
        except BaseException:
            watcher.cancel()
            raise
        name = served_name()

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if kind == "chat":
                body = {"content": text} if delta else {"role": "assistant", "content": text}
                return {
                    "index": 0,
                    ("delta" if delta else "message"): body,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if not stream:
            parts, last = [], first
            records = token_records(first) if provenance else []
            try:
                if first is not None and not first.finished:
                    parts.append(first.text)
                    async for d in gen:
                        parts.append(d.text)
                        if provenance:
                            records += token_records(d)
                        last = d
                elif first is not None:
                    parts.append(first.text)
            except EngineError as exc:
                raise ApiError(exc.status, str(exc), exc.param, exc.code) from exc
            finally:
                watcher.cancel()
                await gen.aclose()
            if last is not None and last.error:
                raise ApiError(503, last.error, code="draining")
            completion = last.completion_tokens if last else 0
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": [choice("".join(parts), last.finish_reason if last else "stop", False)],
                "usage": usage(last, len(prompt_ids), completion),
            }
            if provenance:
                body["dspark"] = {"tokens": records}
            return body

        # From here the streaming response notices a disconnect itself (and closes `gen`).
        watcher.cancel()
        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def chunk(choices: list, u: dict | None = None, tokens: list[dict] | None = None) -> str:
            p = {"id": rid, "object": chunk_obj, "created": created, "model": name, "choices": choices}
            if include_usage:
                p["usage"] = u
            if tokens:
                p["dspark"] = {"tokens": tokens}
            return sse(p)

        async def events():
            last = first
            try:
                if kind == "chat":
                    yield chunk(
                        [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                pending = [first] if first is not None else []
                while True:
                    for d in pending:
                        last = d
                        tokens = token_records(d) if provenance else None
                        if d.text or tokens:
                            yield chunk([choice(d.text, None, True)], tokens=tokens)
                        if d.finished:
                            yield chunk(
                                [
                                    {
                                        **choice("", d.finish_reason, True),
                                        **({"delta": {}} if kind == "chat" else {}),
                                    }
                                ]
                            )
                        if d.error:  # cut by a drain: say so after the finish_reason
                            yield sse(
                                {
                                    "error": {
                                        "message": d.error,
                                        "type": ERROR_TYPES[503],
                                        "param": None,
                                        "code": "draining",
                                    }
                                }
                            )
                    if last is None or last.finished:
                        break
                    pending = [await gen.__anext__()]
                if include_usage and last is not None:
                    yield chunk([], usage(last, len(prompt_ids), last.completion_tokens))
                yield "data: [DONE]\n\n"
            except EngineError as exc:
                count_error(exc.status)
                yield sse(
                    {
                        "error": {
                            "message": str(exc),
                            "type": ERROR_TYPES.get(exc.status),
                            "param": exc.param,
                            "code": exc.code or str(exc.status),
                        }
                    }
                )
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()  # a client that went away aborts its request here

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    gen_responses = {
        **{k: errs[k] for k in (400, 401, 404, 413, 429, 503)},
        200: {
            "content": {"application/json": {}, "text/event-stream": {}},
            "description": "A completion, or with `stream: true` server-sent events",
        },
    }

    def body_doc(schema: type[BaseModel]) -> dict:
        return {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}
                },
            }
        }

    @app.post("/v1/chat/completions", responses=gen_responses, openapi_extra=body_doc(ChatCompletionRequest))
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages
        ]
        try:  # off the event loop: a long conversation must not hold up other requests
            prompt_ids = await run_in_threadpool(engine.tokenize_chat, messages)
        except Exception as exc:  # templates reject odd role orders
            raise ApiError(400, f"messages could not be formatted: {exc}", "messages") from exc
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = gen_params(req, len(prompt_ids), max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(
            request,
            "chat",
            prompt_ids,
            params,
            req.stream,
            include_usage,
            bool(req.dspark and req.dspark.provenance),
        )

    @app.post("/v1/completions", responses=gen_responses, openapi_extra=body_doc(CompletionRequest))
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompt_ids = list(p)
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
            if isinstance(p, list):
                if len(p) != 1:
                    raise ApiError(400, "only one prompt per request is supported", "prompt")
                p = p[0]
            prompt_ids = await run_in_threadpool(engine.tokenize, p)
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
        )

    def openapi() -> dict:
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

    app.openapi = openapi
    return app
