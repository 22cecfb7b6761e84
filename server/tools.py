"""A request's tools: the functions it declares, how its tool_choice uses them (`ToolMode`),
the JSON schema of a call, and this server's own `json` tool format for chat templates that have
none (such as the embedded SmolLM2's, which ignores `tools`); the model families' formats are
`tool_formats.py`, reading calls back is `tool_parser.py`.

The `json` format (documented in docs/api.md):
- the tools are described in a system message: an instruction followed by one JSON line per
  function (`{"name", "description", "parameters"}`); it joins the first system message, or
  comes first when there is none;
- a call is the whole assistant reply as one JSON object `{"name": ..., "arguments": {...}}`,
  several calls a JSON array of them;
- earlier assistant calls (`tool_calls` in the history) are rendered in that same format, and
  tool results keep their role `tool`.

tool_choice "none": the tools are not described and the reply is plain content. "auto": they
are, and calls of listed functions in the reply are returned as tool calls. "required" or a
named function: the reply is constrained (a grammar) to calls of the tools (of that one), each
call's arguments to the function's parameter schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def decoded_arguments(arguments: str) -> Any:
    """An earlier call's arguments as a JSON value (the text itself when it is not JSON)."""
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments


def render_calls(calls: Sequence[tuple[str, str]]) -> str:
    """Earlier calls (name, arguments text) as the assistant writes them in this format: one
    JSON object, or an array of them."""
    objs = [{"name": name, "arguments": decoded_arguments(args)} for name, args in calls]
    return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)


def call_schema(functions: Sequence[Function], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of a call to one of `functions` (its arguments under `args_key`).

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
                "properties": {"name": {"const": f.name}, args_key: {"$ref": f"#/$defs/{key}"}},
                "required": ["name", args_key],
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
