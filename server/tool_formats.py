"""The ways models write tool calls, one `ToolFormat` each, picked by name from one registry
(`--tool-call-parser`, vLLM's names) or detected from the chat template and model family.

- `json`: this server's own format for templates that have none (the embedded SmolLM2's): the
  tools are described in a system message and a call is the whole reply as one JSON object
  `{"name": ..., "arguments": {...}}` (several: a JSON array of them).
- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  per call, after optional content.
- `llama3_json` (Llama 3.1-3.3): the reply is `{"name": ..., "parameters": {...}}` (several
  separated by `; `), optionally after the `<|python_tag|>` token.
- `mistral` (Mistral v0.3 templates): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

The three model formats render `tools`, earlier calls and tool results through the chat template
(the model's own, or one of `server/templates/`); `json` writes them into the messages itself.
Under tool_choice "required" or a named function, `forced_grammar` constrains the reply to calls
in the format, each call's arguments to its function's parameter schema.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from dspark_serve.scheduler.client import ChatTemplate, GrammarSpec
from dspark_serve.server.reasoning import REASONING_FORMATS, ReasoningFormat, reasoning_format
from dspark_serve.server.tools import Function, call_schema
from dspark_serve.verifier.grammar_check import LARK_PREFIX

IdStyle = Literal["openai", "mistral"]


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls.

    name: the `--tool-call-parser` name.
    args_key: the key of a call object that holds the arguments.
    opener: the marker that starts a call (hermes) or the list of calls (mistral, llama3's
        optional python tag); None: calls are bare JSON at the start of the reply.
    closer: the marker that ends each call (hermes), or None.
    bare: whether a reply that starts with a call object ("{", or "[" for a list) is a call
        without the opener (json; llama3_json; mistral, whose marker a decoder may drop).
    list_calls: the calls are a JSON array (mistral; json when parallel).
    separator: what the grammar puts between two calls.
    renders_tools: the chat template renders `tools`, earlier calls and tool results itself.
    id_style: tool call ids as OpenAI writes them, or Mistral's nine alphanumerics (its
        templates refuse any other).
    template_marks: text whose presence in a chat template identifies the format.
    families: model types (config.model_type) whose templates use the format.
    """

    name: str
    args_key: str = "arguments"
    opener: str | None = None
    closer: str | None = None
    bare: bool = False
    list_calls: bool = False
    separator: str = "\n"
    renders_tools: bool = True
    id_style: IdStyle = "openai"
    template_marks: tuple[str, ...] = ()
    families: tuple[str, ...] = ()

    def call_object(self, name: str, arguments: Any) -> dict[str, Any]:
        """A call as the model writes it (arguments: the decoded JSON value)."""
        return {"name": name, self.args_key: arguments}

    def new_id(self) -> str:
        if self.id_style == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


JSON = ToolFormat("json", bare=True, renders_tools=False)
HERMES = ToolFormat(
    "hermes",
    opener="<tool_call>",
    closer="</tool_call>",
    template_marks=("<tool_call>",),
    families=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
)
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    args_key="parameters",
    opener="<|python_tag|>",
    bare=True,
    separator="; ",
    template_marks=("<|python_tag|>", '"parameters": '),
    families=("llama",),
)
MISTRAL = ToolFormat(
    "mistral",
    opener="[TOOL_CALLS]",
    bare=True,
    list_calls=True,
    separator=", ",
    id_style="mistral",
    template_marks=("[TOOL_CALLS]",),
    families=("mistral", "mixtral"),
)

TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (JSON, HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_NAMES = ("auto", *TOOL_FORMATS)


def detect(template: str | None, model_type: str | None) -> ToolFormat:
    """The format a chat template writes calls in: by the markers it renders, then by the model
    family when its template renders `tools`; `json` when it renders none."""
    if template:
        for fmt in (HERMES, MISTRAL, LLAMA3_JSON):
            if any(mark in template for mark in fmt.template_marks):
                return fmt
        if "tools" in template and model_type:
            for fmt in (HERMES, MISTRAL, LLAMA3_JSON):
                if model_type in fmt.families:
                    return fmt
    return JSON


VENDORED_TEMPLATES = ("hermes", "llama3_json", "mistral", "qwen3")


def vendored_template(name: str) -> str:
    """The chat template shipped for a format (`server/templates/<name>.jinja`)."""
    return resources.files("dspark_serve.server").joinpath("templates", f"{name}.jinja").read_text("utf-8")


@dataclass(frozen=True)
class ChatSetup:
    """How the server formats chats for the loaded model.

    template: the chat template used in place of the model's own (None: the model's).
    tools: the tool format.
    marker_ids: the vocabulary's added tokens by text (a grammar names markers as tokens).
    reasoning: how the model marks its reasoning (None: no split).
    """

    template: str | None
    tools: ToolFormat
    marker_ids: Mapping[str, int]
    reasoning: ReasoningFormat | None = None


def chat_setup(
    parser: str, template: str | None, model: ChatTemplate, reasoning_parser: str = "none"
) -> ChatSetup:
    """The setup for `--tool-call-parser parser` ("auto": detected from the template in use),
    `--chat-template template` (a shipped template's name or a file; None: the model's) and
    `--reasoning-parser` ("auto": by the model family)."""
    text = None
    if template is not None:
        text = (
            vendored_template(template)
            if template in VENDORED_TEMPLATES
            else Path(template).read_text("utf-8")
        )
    fmt = detect(text or model.template, model.model_type) if parser == "auto" else TOOL_FORMATS[parser]
    in_use = text or model.template or ""
    reasoning = reasoning_format(reasoning_parser, model.model_type)
    if reasoning is None and reasoning_parser == "auto" and "<think>" in in_use and "</think>" in in_use:
        reasoning = REASONING_FORMATS["qwen3"]  # a template that writes think blocks
    return ChatSetup(text, fmt, model.added_tokens, reasoning)


@dataclass(frozen=True)
class ToolMode:
    """How one request uses its tools.

    functions: every declared function (described to the model, recognised in the reply).
    allowed: the functions a constrained reply may call (all, or the named one).
    grammar: under tool_choice "required" or a named function, the grammar that forces the
        reply to be calls of `allowed` (None: the reply is free).
    parallel: several calls in one reply (`parallel_tool_calls`, on unless false).
    format: how the model writes calls (`tool_formats.py`).
    """

    functions: list[Function]
    allowed: list[Function]
    grammar: GrammarSpec | None
    parallel: bool
    format: ToolFormat

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)


# -- forced calls ------------------------------------------------------------------------------


def forced_grammar(
    fmt: ToolFormat, functions: Sequence[Function], parallel: bool, marker_ids: Mapping[str, int]
) -> GrammarSpec:
    """The grammar of a reply that is one call (several when `parallel`) of `functions` in the
    format. A marker that is one token of the vocabulary (marker_ids) is named as that token,
    otherwise as its text. Mistral's forced calls are its JSON array without the `[TOOL_CALLS]`
    token (as vLLM forces them): llguidance cannot roll a rejected draft back over that token."""
    schema = call_schema(functions, fmt.args_key)
    if fmt.list_calls or fmt is JSON:
        if parallel or fmt.list_calls:
            defs = schema.pop("$defs")
            many = {"type": "array", "items": {"$ref": "#/$defs/call"}, "minItems": 1}
            if not parallel:  # mistral, one call: a list of one
                many["maxItems"] = 1
            # json: one call as an object, several as an array of them
            top = many if fmt.list_calls else {"anyOf": [{"$ref": "#/$defs/call"}, many]}
            schema = {**top, "$defs": {**defs, "call": schema}}
        return GrammarSpec("json_schema", json.dumps(schema), "tools")
    call = f"%json {json.dumps(schema)}"
    if fmt.closer is not None:  # each call wrapped: hermes
        opener, closer = _marker(fmt.opener, marker_ids), _marker(fmt.closer, marker_ids)
        one = f'{opener} "\\n" {call} "\\n" {closer}'
        start = f"one ({_lit(fmt.separator)} one)*" if parallel else "one"
        lark = f"start: {start}\none: {one}\n"
    else:  # bare, separated: llama3_json
        start = f"call ({_lit(fmt.separator)} call)*" if parallel else "call"
        lark = f"start: {start}\ncall: {call}\n"
    return GrammarSpec("lark", LARK_PREFIX + lark, "tools")


def _marker(text: str | None, marker_ids: Mapping[str, int]) -> str:
    assert text is not None
    token = marker_ids.get(text)
    return f"<[{token}]>" if token is not None else _lit(text)


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes
