"""Tool calling in a generic JSON format (for chat templates that have no tool format of their
own, such as the embedded SmolLM2's, which ignores `tools`).

The format (documented in docs/api.md):
- the tools are described in a system message: an instruction followed by one JSON line per
  function (`{"name", "description", "parameters"}`); it joins the first system message, or
  comes first when there is none;
- a call is the whole assistant reply as one JSON object `{"name": ..., "arguments": {...}}`;
- earlier assistant calls (`tool_calls` in the history) are rendered in that same format, and
  tool results keep their role `tool`.

tool_choice "none": the tools are not described and the reply is plain content. "auto": they
are, and a reply that is exactly one call of a listed function is returned as a tool call.
"required" or a named function: the reply is constrained (a JSON schema grammar) to a call
of one of the tools (of that one), its arguments to the function's parameter schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_INSTRUCTION = (
    "You can call functions. To call one, reply with only a JSON object of the form "
    '{"name": <function name>, "arguments": <object of arguments>} and nothing else.\n'
    "Available functions:"
)


@dataclass(frozen=True)
class Function:
    """One callable function as the request declared it (parameters: its JSON schema)."""

    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def describe(functions: list[Function]) -> str:
    """The system-prompt text that declares the tools."""
    lines = [
        json.dumps(
            {"name": f.name, "description": f.description or "", "parameters": f.parameters},
            ensure_ascii=False,
        )
        for f in functions
    ]
    return "\n".join([TOOL_INSTRUCTION, *lines])


def with_tools(messages: list[dict[str, str]], functions: list[Function]) -> list[dict[str, str]]:
    """The conversation with the tools declared in its system message."""
    text = describe(functions)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{"role": "system", "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_call(name: str, arguments: str) -> str:
    """An earlier call, as the assistant would have written it."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        args = arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def call_schema(functions: list[Function]) -> dict[str, Any]:
    """The JSON schema of a call to one of `functions`.

    Each function's parameters move whole under the call schema's `$defs` (as `fn_<name>`)
    and its local `$ref`s ("#", "#/$defs/a", ...) are rewritten to point there, so parameter
    schemas that use `$ref` and `$defs` keep their meaning inside the call."""
    defs: dict[str, Any] = {}
    options = []
    for f in functions:
        key = f"fn_{f.name}"
        defs[key] = _rebase_refs(f.parameters, f"#/$defs/{key}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs}


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _rebase_refs(schema: Any, base: str) -> Any:
    """schema with every local `$ref` ("#..." pointers into itself) prefixed by base."""
    if isinstance(schema, dict):
        out = {k: v if k in _DATA_KEYWORDS else _rebase_refs(v, base) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def parse_call(text: str, functions: list[Function]) -> ToolCall | None:
    """The reply as a call of a listed function, or None when it is not exactly one."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    name, args = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    if name not in {f.name for f in functions}:
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class ToolMode:
    """How one request uses its tools.

    functions: every declared function (described to the model, recognised in the reply).
    allowed: the functions a constrained reply may call (all, or the named one).
    constrained: tool_choice "required" or a named function: the reply is a grammar-constrained call.
    parse: the reply is returned as a tool call when it is one (auto, required, named).
    """

    functions: list[Function]
    allowed: list[Function]
    constrained: bool
    parse: bool
