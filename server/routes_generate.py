"""The two generate routes, /v1/chat/completions and /v1/completions: each reads its request,
turns it into engine parameters (`params.py`) and hands it to `generate.respond`. No torch here.

Both read the body themselves (not through FastAPI's body parameters): the raw checks and the
request model's own errors give OpenAI-shaped 400s naming the parameter (`body.py`).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from dspark_serve.server.body import decode
from dspark_serve.server.errors import ERROR_DOCS, ApiError, validation_error
from dspark_serve.server.generate import Generation, respond
from dspark_serve.server.params import (
    chat_messages,
    check_logit_bias,
    check_prompt_ids,
    generation_params,
    message_chars,
    template_tools,
    tool_mode,
)
from dspark_serve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from dspark_serve.server.responses import ResponsesReply, ResponsesRequest, to_chat
from dspark_serve.server.state import AppState, State

RequestT = TypeVar("RequestT", bound=GenerationRequest | ResponsesRequest)

router = APIRouter()

GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **{k: ERROR_DOCS[k] for k in (400, 401, 404, 413, 429, 503)},
    200: {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "A completion, or with `stream: true` server-sent events",
    },
}


def body_doc(schema: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads `schema` itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}},
        }
    }


async def read_request(state: AppState, request: Request, schema: type[RequestT]) -> RequestT:
    """The validated request, once the server can take it: not draining, the model served,
    loaded, and the request's token ids in its vocabulary."""
    if state.draining:
        raise ApiError(503, "the server is draining (shutting down)", code="draining")
    raw = await request.body()
    async with state.preparing(len(raw)):  # parsing a large body is work before admission: bounded
        req = await run_in_threadpool(decode, raw, schema, state.config.max_json_depth)
    if req.model is not None and req.model != state.served_model_name:
        raise ApiError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
    if not state.engine.ready:
        raise ApiError(503, "model is loading")
    if isinstance(req, GenerationRequest):
        check_logit_bias(req, state.vocab_size)
    return req


@router.post(
    "/v1/chat/completions",
    responses=GENERATE_RESPONSES,
    openapi_extra=body_doc(ChatCompletionRequest),
    response_model=None,
)
async def chat(request: Request, state: State) -> Response | dict[str, Any]:
    req = await read_request(state, request, ChatCompletionRequest)
    return await respond(state, request, await chat_generation(state, req))


async def chat_generation(state: AppState, req: ChatCompletionRequest) -> Generation:
    """A chat request as the engine runs it: the tool mode and grammar in the model's format,
    the prompt through the chat template, the engine's parameters."""
    setup = state.chat
    tools = tool_mode(req, setup)
    messages = chat_messages(req, setup.tools, tools)
    chars = message_chars(messages)
    state.check_prompt_chars(chars, "messages")
    try:  # off the event loop, long ones a few at a time: a long conversation holds up no other
        async with state.preparing(chars):
            prompt_ids = await run_in_threadpool(
                state.engine.tokenize_chat,
                messages,
                template_tools(tools),
                setup.template,
                req.chat_template_kwargs,
            )
    except Exception as exc:  # templates reject odd role orders
        raise ApiError(400, f"messages could not be formatted: {exc}", "messages") from exc
    return Generation(
        kind="chat",
        prompt_ids=prompt_ids,
        params=generation_params(req, len(prompt_ids), state.engine.max_model_len, tools, setup),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        provenance=bool(req.dspark and req.dspark.provenance),
        tools=tools,
        reasoning=setup.reasoning,
    )


@router.post(
    "/v1/responses",
    responses=GENERATE_RESPONSES,
    openapi_extra=body_doc(ResponsesRequest),
    response_model=None,
)
async def responses(request: Request, state: State) -> Response | dict[str, Any]:
    """The Responses API, stateless: the request's input as a chat, answered as a response."""
    req = await read_request(state, request, ResponsesRequest)
    try:
        chat_req = to_chat(req)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    gen = await chat_generation(state, chat_req)
    return await respond(state, request, gen, functools.partial(ResponsesReply, echo=req.echo()), "resp")


@router.post(
    "/v1/completions",
    responses=GENERATE_RESPONSES,
    openapi_extra=body_doc(CompletionRequest),
    response_model=None,
)
async def completions(request: Request, state: State) -> Response | dict[str, Any]:
    req = await read_request(state, request, CompletionRequest)
    prompt_ids = req.prompt_token_ids()
    if prompt_ids is not None:
        check_prompt_ids(prompt_ids, state.vocab_size)
    else:
        text = req.prompt_text()
        state.check_prompt_chars(len(text), "prompt")
        async with state.preparing(len(text)):
            prompt_ids = await run_in_threadpool(state.engine.tokenize, text)
    if not prompt_ids:
        raise ApiError(400, "prompt must not be empty", "prompt")
    gen = Generation(
        kind="completion",
        prompt_ids=prompt_ids,
        params=generation_params(req, len(prompt_ids), state.engine.max_model_len),
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        provenance=bool(req.dspark and req.dspark.provenance),
    )
    return await respond(state, request, gen)
