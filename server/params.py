"""An OpenAI request as the engine takes it: the prompt's messages, the tool mode, the grammar,
the logprobs count and the GenerationParams, with the checks only the engine's facts allow
(token ids against the vocabulary, prompt plus completion against the context length). Every
other rule is the request model's (`protocol.py`); this module trusts it. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

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
from dspark_serve.server.reasoning import after_reasoning
from dspark_serve.server.tool_formats import ChatSetup, ToolFormat, ToolMode, forced_grammar
from dspark_serve.server.tools import Function, decoded_arguments, render_calls, with_tools


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text contents: fewer than the templated prompt holds, so a
    sound bound on its tokens (`AppState.check_prompt_chars`)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def chat_messages(
    req: ChatCompletionRequest, fmt: ToolFormat, tools: ToolMode | None
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it. Formats whose template renders tools get
    earlier calls as `tool_calls` (arguments decoded) and tool results with their call id; the
    `json` format gets earlier calls written out as the assistant wrote them, and the tools
    declared in the system message when in play."""
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            if fmt.renders_tools:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": decoded_arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            else:
                calls = render_calls([(c.function.name, c.function.arguments) for c in m.tool_calls])
                msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + [calls])
        if m.role == "tool" and fmt.renders_tools:
            msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v})
        messages.append(msg)
    if tools is not None and not fmt.renders_tools:
        messages = with_tools(messages, tools.functions)
    return messages


def template_tools(tools: ToolMode | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template that renders them takes them (OpenAI's `tools` shape)."""
    if tools is None or not tools.format.renders_tools:
        return None
    return [
        {
            "type": "function",
            "function": {"name": f.name, "description": f.description or "", "parameters": f.parameters},
        }
        for f in tools.functions
    ]


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


def tool_mode(req: ChatCompletionRequest, setup: ChatSetup) -> ToolMode | None:
    """What the request's tools and tool_choice ask for, in the model's format (None: no tools
    in play); under "required" or a named function, the grammar that forces the calls."""
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    functions = [
        Function(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
        for t in req.tools
    ]
    allowed = functions
    if isinstance(choice, NamedToolChoice):
        allowed = [f for f in functions if f.name == choice.function.name]
    constrained = isinstance(choice, NamedToolChoice) or choice == "required"
    parallel = req.parallel_tool_calls is not False
    grammar = forced_grammar(setup.tools, allowed, parallel, setup.marker_ids) if constrained else None
    return ToolMode(functions, allowed, grammar, parallel, setup.tools)


def logprobs_of(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives each token's logprob comes with (None: no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def grammar_of(
    req: ChatCompletionRequest | CompletionRequest, tools: ToolMode | None, setup: ChatSetup | None = None
) -> GrammarSpec | None:
    """The constraint on the output: a forced tool call, or the response_format; after the
    reasoning of a reasoning model."""
    spec = _grammar_of(req, tools)
    if spec is not None and setup is not None and setup.reasoning is not None:
        return after_reasoning(spec, setup.reasoning, setup.marker_ids)
    return spec


def _grammar_of(req: ChatCompletionRequest | CompletionRequest, tools: ToolMode | None) -> GrammarSpec | None:
    if tools is not None and tools.grammar is not None:
        return tools.grammar
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
    setup: ChatSetup | None = None,
) -> GenerationParams:
    """The engine's parameters for `req`; the prompt and the completion must fit the context. A
    chat with a reasoning model (`setup.reasoning`) gets its grammar after the reasoning."""
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
        grammar=grammar_of(req, tools, setup),
        priority=req.priority,
    )


def choice_params(params: GenerationParams, i: int) -> GenerationParams:
    """The i-th of n choices: its own seed (seed + i, or seed - i past the largest seed) when
    the request is seeded."""
    if i == 0 or params.seed is None:
        return params
    seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
    return dataclasses.replace(params, seed=seed)
