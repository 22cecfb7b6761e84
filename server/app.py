"""The HTTP layer: OpenAI-compatible routes over an EngineClient. No torch here."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict
from importlib import resources
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.client import EngineClient, EngineError, GenerationParams, StreamDelta
from server.config import ServerConfig
from server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_exceeded", 500: "internal_server_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
        "param": param, "code": code or (None if status < 500 else str(status))}})


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _param_of(err: dict) -> str | None:
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    return ".".join(loc) if loc else None


def _validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    err = exc.errors()[0]
    param = _param_of(err)
    return ApiError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


def build_app(engine: EngineClient, config: ServerConfig, registry: CollectorRegistry) -> FastAPI:
    app = FastAPI(title="dspark-serve", docs_url=None, redoc_url=None)

    def served_name() -> str:
        return config.served_model_name or engine.model_name

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(_: Request, exc: RequestValidationError):
        e = _validation_error(exc)
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal server error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {config.api_key}":
                return error_response(401, "invalid or missing API key", code="invalid_api_key")
        return await call_next(request)

    @app.get("/", include_in_schema=False)
    async def live_page():
        """The live page: a chat box streaming token provenance and gauges from /metrics
        (server/static/index.html; everything it needs is in that one file)."""
        page = resources.files("server").joinpath("static", "index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok"}
        if engine.load_error:
            return error_response(503, f"model failed to load: {engine.load_error}")
        return error_response(503, "model is loading")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        entry = {"id": served_name(), "object": "model", "created": 0, "owned_by": "dspark-serve",
                 "max_model_len": engine.max_model_len}
        info = engine.runtime_info
        if info is not None:
            entry["runtime"] = asdict(info)
        return {"object": "list", "data": [entry]}

    async def parse(request: Request, schema):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc)
        if req.model is not None and req.model != served_name():
            raise ApiError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
        if not engine.ready:
            raise ApiError(503, "model is loading")
        if req.n != 1:
            raise ApiError(400, f"n={req.n} is not supported; only n=1", "n")
        if req.presence_penalty or req.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported",
                           "presence_penalty" if req.presence_penalty else "frequency_penalty")
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", "logprobs")
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
                400, f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion.",
                "max_tokens", "context_length_exceeded")
        return GenerationParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=max(req.top_k, 0), seed=req.seed, stop=req.stop_list(),
                                ignore_eos=req.ignore_eos)

    def usage(d: StreamDelta | None, prompt_len: int, completion: int) -> dict:
        u = {"prompt_tokens": prompt_len, "completion_tokens": completion,
             "total_tokens": prompt_len + completion}
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
            raise ApiError(exc.status, str(exc), exc.param, exc.code)
        except StopAsyncIteration:
            return None

    def token_records(d: StreamDelta | None) -> list[dict]:
        return [] if d is None else [{"id": t.token_id, "text": t.text, "kind": t.kind,
                                      "position": t.draft_position} for t in d.tokens]

    async def run(request: Request, kind: str, prompt_ids: list[int], params: GenerationParams,
                  stream: bool, include_usage: bool, provenance: bool = False):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        gen = engine.generate(rid, prompt_ids, params)
        first = await first_delta(gen)
        name = served_name()

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if kind == "chat":
                body = {"content": text} if delta else {"role": "assistant", "content": text}
                return {"index": 0, ("delta" if delta else "message"): body, "logprobs": None,
                        "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if not stream:
            watcher = asyncio.create_task(watch_disconnect(request, rid))
            parts, last = [], first
            records = token_records(first) if provenance else []
            try:
                if first is not None:
                    parts.append(first.text)
                    async for d in gen:
                        parts.append(d.text)
                        if provenance:
                            records += token_records(d)
                        last = d
            except EngineError as exc:
                raise ApiError(exc.status, str(exc), exc.param)
            finally:
                watcher.cancel()
                await gen.aclose()
            completion = last.completion_tokens if last else 0
            body = {"id": rid, "object": obj, "created": created, "model": name,
                    "choices": [choice("".join(parts), last.finish_reason if last else "stop", False)],
                    "usage": usage(last, len(prompt_ids), completion)}
            if provenance:
                body["dspark"] = {"tokens": records}
            return body

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
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                pending = [first] if first is not None else []
                while True:
                    for d in pending:
                        last = d
                        tokens = token_records(d) if provenance else None
                        if d.text or tokens:
                            yield chunk([choice(d.text, None, True)], tokens=tokens)
                        if d.finished:
                            yield chunk([{**choice("", d.finish_reason, True),
                                          **({"delta": {}} if kind == "chat" else {})}])
                    if last is None or last.finished:
                        break
                    pending = [await gen.__anext__()]
                if include_usage and last is not None:
                    yield chunk([], usage(last, len(prompt_ids), last.completion_tokens))
                yield "data: [DONE]\n\n"
            except EngineError as exc:
                yield sse({"error": {"message": str(exc), "type": ERROR_TYPES.get(exc.status),
                                     "param": exc.param, "code": str(exc.status)}})
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()  # a client that went away aborts its request here

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in req.messages]
        try:
            prompt_ids = engine.tokenize_chat(messages)
        except Exception as exc:  # templates reject odd role orders
            raise ApiError(400, f"messages could not be formatted: {exc}", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = gen_params(req, len(prompt_ids), max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, "chat", prompt_ids, params, req.stream, include_usage,
                         bool(req.dspark and req.dspark.provenance))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompt_ids = list(p)
        else:
            if isinstance(p, list):
                if len(p) != 1:
                    raise ApiError(400, "only one prompt per request is supported", "prompt")
                p = p[0]
            prompt_ids = engine.tokenize(p)
        if not prompt_ids:
            raise ApiError(400, "prompt must not be empty", "prompt")
        params = gen_params(req, len(prompt_ids), req.max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, "completion", prompt_ids, params, req.stream, include_usage,
                         bool(req.dspark and req.dspark.provenance))

    return app
