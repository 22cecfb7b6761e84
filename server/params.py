"""An OpenAI request as the engine takes it: the prompt's messages, the tool mode, the grammar,
the logprobs count and the GenerationParams, with the checks only the engine's facts allow
(token ids against the vocabulary, prompt plus completion against the context length). Every
other rule is the request model's (`protocol.py`); this module trusts it. No torch here.
"""

from __future__ import annotations

import dataclasses
import json

from dspark_serve.scheduler.client import GenerationParams, GrammarSpec
from dspark_serve.scheduler.limits import LimitError, check_context, check_token_ids
from dspark_serve.server.errors import ApiError
from dspark_serve.server.protocol import (
    COMPLETION_MAX_TOKENS,
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    NamedToolChoice,
)
from dspark_serve.server.tools import Function, ToolMode, call_schema, render_call, with_tools


def chat_messages(req: ChatCompletionRequest, tools: ToolMode | None) -> list[dict[str, str]]:
    """The conversation as the chat template takes it: text content, earlier tool calls written
    out as the assistant would have written them, and the tools declared when in play."""
    messages = []
    for m in req.messages:
        content = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = [render_call(c.function.name, c.function.arguments) for c in m.tool_calls]
            content = "\n".join(([content] if content else []) + calls)
        messages.append({"role": m.role if m.role != "developer" else "system", "content": content})
    if tools is not None and tools.parse:
        messages = with_tools(messages, tools.functions)
    return messages


def check_prompt_ids(prompt_ids: list[int], vocab: int | None) -> None:
    """Token ids given as the prompt must lie in the vocabulary (or at least be non-negative
    while its size is unknown)."""
    try:
        check_token_ids(prompt_ids, vocab, "prompt", "prompt")
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.param) from exc


def check_logit_bias(req: GenerationRequest, vocab: int | None) -> None:
    """logit_bias names token ids of the vocabulary (the keys' form and the values' range are
    the request model's)."""
    if not req.logit_bias or vocab is None:
        return
    try:
        check_token_ids((int(key) for key in req.logit_bias), vocab, "logit_bias", "logit_bias")
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.param) from exc


def tool_mode(req: ChatCompletionRequest) -> ToolMode | None:
    """What the request's tools and tool_choice ask for (None: no tools in play)."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    functions = [
        Function(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
        for t in req.tools
    ]
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f.name == choice.function.name]
        return ToolMode(functions, named, True, True)
    return ToolMode(functions, functions, choice == "required", True)


def logprobs_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives each token's logprob comes with (None: no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def grammar_of(req: ChatCompletionRequest | CompletionRequest, tools: ToolMode | None) -> GrammarSpec | None:
    """The constraint on the output: a forced tool call, or the response_format."""
    if tools is not None and tools.constrained:
        return GrammarSpec("json_schema", json.dumps(call_schema(tools.allowed)), "tools")
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object")
    assert rf.json_schema is not None and rf.json_schema.schema_ is not None  # the model's rule
    return GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_), "response_format")


def max_tokens_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The completion's token limit as asked (None: up to the context length)."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens
    return COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def generation_params(
    req: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    max_model_len: int,
    tools: ToolMode | None = None,
) -> GenerationParams:
    """The engine's parameters for `req`; the prompt and the completion must fit the context."""
    max_tokens = max_tokens_of(req)
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
    try:
        check_context(prompt_len, max_tokens, max_model_len)
    except LimitError as exc:
        raise ApiError(400, str(exc), exc.param, exc.code) from exc
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),  # -1 and 0 both mean no top-k
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


def choice_params(params: GenerationParams, i: int) -> GenerationParams:
    """The i-th of n choices: its own seed (seed + i, or seed - i past the largest seed) when
    the request is seeded."""
    if i == 0 or params.seed is None:
        return params
    seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
    return dataclasses.replace(params, seed=seed)
