"""The one interface between the HTTP server and the engine: plain Python, no torch, so the
server stays importable (and testable) without the model stack."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineError(ValueError):
    """A request the engine refuses, with the HTTP status and the parameter to blame."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass(frozen=True)
class GenerationParams:
    """Everything a request asks of generation, as the server parsed it."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    """None: no logprobs; k >= 0: each token's logprob and its k most likely alternatives."""
    grammar: GrammarSpec | None = None
    """Constrain the output (structured output, required tool calls), or None."""
    priority: int = 0
    """Lower is served first where the engine schedules by priority (vLLM's meaning)."""
    owner: str = ""
    """Whom the request's slot counts against for fair slots (`SchedulerConfig.fair_slots`):
    the n choices of one HTTP request share their request's id; empty: the request alone."""
    tenant: str = ""
    """Whose share the owner's slots count against in turn (fair slots): the caller's API key,
    or its client address; empty: none above the owner."""
    key_name: str = ""
    """The name of the API key the request came with (the per-key metrics); empty: none."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, as the server parsed it.

    kind: "json_object" (any JSON object), "json_schema" (`schema` holds the JSON schema text)
        or "lark" (`schema` holds an llguidance Lark grammar, which may embed JSON schemas).
    schema: the JSON schema or the grammar (kinds "json_schema" and "lark").
    param: the request parameter it came from (named in errors: response_format, tools)."""

    kind: str
    schema: str | None = None
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "lark"):
            raise ValueError(f"grammar kind must be json_object, json_schema or lark, got {self.kind!r}")
        if (self.kind != "json_object") != (self.schema is not None):
            raise ValueError(f"a schema goes with kinds json_schema and lark only (kind {self.kind!r})")


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a position: token id, its text on its own, its log-probability."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a generated token and of the most likely tokens at its
    position, from the raw logits (before penalties, temperature, top-k/top-p and grammar).

    token: the token's text on its own (OpenAI's `token` field).
    top: the `top_logprobs` most likely tokens, most likely first (empty when 0 were asked)."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


# How a generated token came to be (TokenRecord.kind).
PROVENANCE_KINDS = ("draft", "correction", "bonus", "plain")


@dataclass(frozen=True)
class TokenRecord:
    """One generated token as it travels from the engine to the HTTP layer (the per-token
    record any further per-token data, such as a logprob, joins)."""

    token_id: int
    text: str
    """Characters this token added to the decoded text ("" while a multi-byte character is
    incomplete; it then arrives with a later token). Before any stop string is cut."""
    kind: str
    """"draft": a drafted token the target accepted; "correction": the target's own token at
    the first rejected draft position; "bonus": the target's token after every verified draft
    was accepted; "plain": no draft was verified for it (prefill's first token, or a step that
    verified none)."""
    draft_position: int | None = None
    """For "draft": its 0-based position in the drafted block; else None."""
    logprob: TokenLogprob | None = None
    """Its log-probability (and the top alternatives) when the request asked for logprobs."""

    def __post_init__(self) -> None:
        if self.kind not in PROVENANCE_KINDS:
            raise ValueError(f"kind must be one of {PROVENANCE_KINDS}, got {self.kind!r}")
        if (self.kind == "draft") != (self.draft_position is not None):
            raise ValueError(
                f"draft_position {self.draft_position!r} must be set exactly for drafts (kind {self.kind!r})"
            )


def round_provenance(accepted: int, verified: int) -> list[tuple[str, int | None]]:
    """(kind, draft_position) for the accepted + 1 tokens of one verification round in which
    `verified` drafts were checked and the first `accepted` of them survived."""
    if not 0 <= accepted <= verified:
        raise ValueError(f"accepted {accepted!r} must be within 0..verified ({verified!r})")
    last = "plain" if verified == 0 else ("bonus" if accepted == verified else "correction")
    return [("draft", k) for k in range(accepted)] + [(last, None)]


@dataclass
class StreamDelta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: dict[str, Any] | None = field(default=None)
    tokens: list[TokenRecord] = field(default_factory=list)
    """One record per token of token_ids, in order."""
    error: str | None = None  # set on a final delta when the server cut the request (drain)


@dataclass(frozen=True)
class DrainReport:
    """What a drain did: requests that finished on their own, requests cut at the timeout."""

    finished: int
    cut: int
    seconds: float


@dataclass(frozen=True)
class ChatTemplate:
    """What the server reads of the model's chat template: its text (None: the tokenizer has
    none), the model family (`config.model_type`), and the vocabulary's added tokens by text
    (markers such as `<tool_call>` that a grammar names as single tokens)."""

    template: str | None
    model_type: str | None
    added_tokens: Mapping[str, int]


@dataclass(frozen=True)
class RuntimeInfo:
    """How the loaded engine runs (shown on /v1/models): dtype and why, what the weights are
    (the GGUF's own blocks, Q8_0 made at load, or dense floats) and why, device, drafter."""

    dtype: str
    dtype_reason: str
    device: str
    drafter: str
    verify_policy: str
    weights: str = ""
    weights_reason: str = ""


class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    @property
    def ready(self) -> bool: ...

    @property
    def load_error(self) -> str | None: ...

    @property
    def runtime_info(self) -> RuntimeInfo | None: ...

    def chat_template(self) -> ChatTemplate: ...

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the chat template (`template`: a template's text in place of
        the model's), with `tools` for templates that render them and `template_kwargs` as extra
        template variables (`enable_thinking`, ...)."""
        ...

    def tokenize(self, text: str) -> list[int]: ...

    def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[StreamDelta, None]: ...

    def abort(self, request_id: str) -> None: ...

    # Optional (the server falls back when missing): the vocabulary size once loaded (token ids
    # are range-checked against it), the most characters a token holds (prompts are bounded by
    # their length before they are tokenized), what is still loading, and graceful drain.
    # vocab_size: int | None; max_chars_per_token: int | None; loading_stage: str | None;
    # draining: bool
    # async def drain(self, timeout: float) -> DrainReport
