"""OpenAI request/response schemas (the subset this server implements).

Fields are strict: a string is never coerced to a number (`"max_tokens": "10"` is a 400), a
number never to a bool. Parameters of the OpenAI API that this server does not implement are
listed in UNSUPPORTED and answered 400 by name (never silently ignored); see `check_extras`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _no_text_or_bool(v: object) -> object:
    # JSON has one number type: 10.0 is a valid integer (JSON Schema agrees), "10" and true are not.
    if isinstance(v, (str, bool)):
        raise ValueError(f"Input should be a valid integer, got {type(v).__name__}")
    return v


# An integer field: integral JSON numbers (10 or 10.0) only; never a string or a bool.
Int = Annotated[int, Field(strict=False), BeforeValidator(_no_text_or_bool)]

# Every seed torch's generator accepts (int64 and uint64 alike).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# logit_bias keys: ASCII decimal token ids (str.isdigit() would take "²" and "١٢").
TOKEN_ID_KEY = r"^[0-9]{1,10}$"
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_KEY)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# repetition_penalty divides positive logits: below this it scales them past any useful range
# (1e-300 overflowed them to inf). The engine checks the same range (SamplingParams).
REPETITION_PENALTY_MIN = 0.01


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCallMsg(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    arguments: str


class ToolCallMsg(BaseModel):
    """An earlier tool call in the conversation (an assistant message's `tool_calls`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallMsg


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMsg] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class DsparkOptions(BaseModel):
    """This server's own request extension (`"dspark": {...}` in the body; `extra_body` with
    the official client)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    provenance: bool = False
    """Add to every response / streamed chunk `"dspark": {"tokens": [...]}`: for each new token
    its id, text, kind (draft / correction / bonus / plain) and draft position."""


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (output valid against it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionName


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1, le=2**31 - 1)
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: Int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_MIN, le=10.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    user: str | None = None
    dspark: DsparkOptions | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


GenerationRequest = _Sampling  # the fields every generation request has


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int]
    # OpenAI's default; `null` means the default too (not "up to the context limit").
    max_tokens: Int | None = Field(default=16, ge=1)
    logprobs: Int | None = Field(default=None, ge=0, le=20)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server returns: `{"error": {message, type, param, code}}`."""

    error: ErrorDetail


# OpenAI parameters this server does not implement. A request that sets one to anything but its
# neutral value (listed here; a missing entry means only null) is refused with a 400 naming it.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
}
# OpenAI parameters that do not change what is generated; accepted and not used.
ACCEPTED_UNUSED = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


def check_extras(
    body: dict[str, Any], schema: type[BaseModel]
) -> tuple[dict[str, Any], str | None, str | None]:
    """Drop accepted-but-unused keys and neutral unsupported ones from a raw request body.

    Returns (cleaned body, offending parameter or None, message)."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in schema.model_fields:
            out[key] = value
        elif key in ACCEPTED_UNUSED:
            continue
        elif key in UNSUPPORTED:
            if value is None or any(value == v and type(value) is type(v) for v in UNSUPPORTED[key]):
                continue
            return out, key, f"`{key}` is not supported by this server"
        else:
            return out, key, f"Unrecognized request argument supplied: {key}"
    return out, None, None


def check_content_parts(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """A readable error for non-text content parts (images, audio, files): (param, message)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None, None
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                return (
                    f"messages.{i}.content.{j}",
                    f"content parts of type `{kind}` are not supported: this model reads text only",
                )
    return None, None


# Integer literals longer than this many digits are refused by name before any conversion
# (Python refuses to convert literals over 4,300 digits at all; no parameter needs 40).
MAX_INT_DIGITS = 40


class _LongInt:
    """An integer literal too long to convert, kept as its digit count (`parse_body`)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(literal: str) -> int | _LongInt:
    digits = len(literal.lstrip("-"))
    return _LongInt(digits) if digits > MAX_INT_DIGITS else int(literal)


def parse_body(raw: bytes) -> Any:
    """A request body's JSON (raises what json.loads raises); long integer literals stay
    unconverted until `check_values` names them."""
    return json.loads(raw, parse_int=_parse_int)


def _lone_surrogate(s: str) -> str | None:
    """The first lone surrogate in s, as U+XXXX (JSON's "\\ud800" escapes decode to them)."""
    for ch in s:
        if "\ud800" <= ch <= "\udfff":
            return f"U+{ord(ch):04X}"
    return None


def check_values(body: Any) -> tuple[str | None, str | None]:
    """The first value no parameter can hold: a lone surrogate in a string or a key (text must
    be valid Unicode: it could be neither tokenized nor echoed in an error), or an integer
    literal over MAX_INT_DIGITS digits. Returns (parameter path or None, message)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        param = ".".join(path) or None
        if isinstance(value, _LongInt):
            return param, f"{param or 'a value'}: an integer of {value.digits} digits is out of range"
        if isinstance(value, str) and (bad := _lone_surrogate(value)) is not None:
            return (
                param,
                f"{param or 'a value'}: the text holds a lone surrogate ({bad}); it must be valid Unicode",
            )
        if isinstance(value, dict):
            for k, v in value.items():
                if (bad := _lone_surrogate(k)) is not None:
                    where = f" in {param}" if param else ""
                    return param, f"a key{where} holds a lone surrogate ({bad}); it must be valid Unicode"
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(value))
    return None, None
