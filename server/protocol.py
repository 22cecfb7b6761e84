"""OpenAI request/response schemas (the subset this server implements), and the owner of every
rule a request can break without the engine: ranges, lengths, and the rules that tie one
parameter to another (`RuleError`). What only the engine knows (vocabulary size, context
length, whether a grammar compiles) is checked in `params.py` and by the engine.

Fields are strict: a string is never coerced to a number (`"max_tokens": "10"` is a 400), a
number never to a bool. Parameters of the OpenAI API that this server does not implement are
refused by name before validation (`body.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


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
BIAS_LIMIT = 100  # a logit_bias value lies in [-BIAS_LIMIT, BIAS_LIMIT]
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_KEY)]
Bias = Annotated[float, Field(ge=-BIAS_LIMIT, le=BIAS_LIMIT)]
# repetition_penalty divides positive logits: below this it scales them past any useful range
# (1e-300 overflowed them to inf).
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 10.0
PENALTY_LIMIT = 2  # presence_penalty and frequency_penalty lie in [-PENALTY_LIMIT, PENALTY_LIMIT]
MAX_CHOICES = 16  # n
MAX_STOPS = 16  # stop strings in one request
MAX_TOP_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions)
MAX_TOOLS = 128
COMPLETION_MAX_TOKENS = 16  # completions' max_tokens when left out or null (OpenAI's default)


class RuleError(ValueError):
    """A request that breaks one of the rules below: the parameter to name and the message, as
    the client reads them (the error mapping answers 400 with both, `errors.py`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


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

    def check(self) -> None:
        """json_schema comes with its schema, and only with type json_schema."""
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise RuleError("response_format", "response_format json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise RuleError("response_format", "json_schema goes with response_format type json_schema")


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
    n: Int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    priority: Int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    user: str | None = None
    dspark: DsparkOptions | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @model_validator(mode="after")
    def _check_sampling_rules(self) -> Self:
        # After the fields (a field's own error is reported first): the rules across fields.
        if self.response_format is not None:
            self.response_format.check()
        stops = self.stop_list()
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise RuleError("stop", f"stop must be up to {MAX_STOPS} non-empty strings")
        return self


GenerationRequest = _Sampling  # the fields every generation request has


# what the server itself passes to the chat template: not for a request to override
TEMPLATE_RESERVED = frozenset(
    {"messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize", "return_dict"}
)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (vLLM's field), e.g. `{"enable_thinking": false}`."""

    @model_validator(mode="after")
    def _check_chat_rules(self) -> Self:
        if self.top_logprobs is not None and not self.logprobs:
            raise RuleError("top_logprobs", "top_logprobs needs logprobs: true")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED)
        if reserved:
            raise RuleError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise RuleError("tool_choice", "tool_choice needs tools")
            return self
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise RuleError("tools", "tools must have distinct function names")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RuleError("tool_choice", f"tool_choice names an unknown function {choice.function.name!r}")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int]
    # OpenAI's default; `null` means the default too (not "up to the context limit").
    max_tokens: Int | None = Field(default=COMPLETION_MAX_TOKENS, ge=1)
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_prompt(self) -> Self:
        p = self.prompt
        if isinstance(p, list) and len(p) != 1 and not self.prompt_token_ids():
            raise RuleError("prompt", "only one prompt per request is supported")
        return self

    def prompt_token_ids(self) -> list[int] | None:
        """The prompt when it is given as token ids (a non-empty list of integers), else None."""
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            return [int(x) for x in p]
        return None

    def prompt_text(self) -> str:
        """The prompt given as text (a string, or a list of one string); for a prompt that
        `prompt_token_ids` does not take."""
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt[0])


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server returns: `{"error": {message, type, param, code}}`."""

    error: ErrorDetail
