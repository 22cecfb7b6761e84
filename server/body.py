"""A request body, from raw bytes to a validated request model (`decode`). No torch here.

Before pydantic sees it, the body must be a JSON object no deeper than `max_json_depth`, hold
no value that no parameter can (lone surrogates, integer literals too long to convert), no
content part other than text, and no parameter outside the request model: parameters of the
OpenAI API this server does not implement (UNSUPPORTED) are refused by name, never silently
ignored. Every rule about the parameters' values is the request model's (`protocol.py`).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dspark_serve.server.errors import ApiError, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

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
UNSUPPORTED_CODE = "unsupported_parameter"  # the error code of a parameter refused by name
# OpenAI parameters that do not change what is generated; accepted and not used.
ACCEPTED_UNUSED = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")

# Integer literals longer than this many digits are refused by name before any conversion
# (Python refuses to convert literals over 4,300 digits at all; no parameter needs 40).
MAX_INT_DIGITS = 40


def decode(raw: bytes, schema: type[ModelT], max_depth: int) -> ModelT:
    """JSON -> validated request, or an ApiError naming what is wrong. CPU work: run it in a
    worker thread, never on the event loop."""
    try:
        body = parse_body(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {max_depth} levels") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if json_depth_exceeds(body, max_depth):
        raise ApiError(400, f"request body nests deeper than {max_depth} levels")
    check_values(body)
    check_content_parts(body)
    body = known_parameters(body, schema)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


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


def json_depth_exceeds(obj: object, limit: int) -> bool:
    """True when arrays/objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = o.values()
        elif not isinstance(o, list):
            continue
        if d > limit:
            return True
        stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(s: str) -> str | None:
    """The first lone surrogate in s, as U+XXXX (JSON's "\\ud800" escapes decode to them);
    searched in C (a megabyte-long prompt must not hold the interpreter for long)."""
    found = None if s.isascii() else _SURROGATE.search(s)
    return None if found is None else f"U+{ord(found.group()):04X}"


def check_values(body: Any) -> None:
    """Refuses the first value no parameter can hold: a lone surrogate in a string or a key
    (text must be valid Unicode: it could be neither tokenized nor echoed in an error), or an
    integer literal over MAX_INT_DIGITS digits."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        param = ".".join(path) or None
        if isinstance(value, _LongInt):
            what = param or "a value"
            raise ApiError(400, f"{what}: an integer of {value.digits} digits is out of range", param)
        if isinstance(value, str) and (bad := _lone_surrogate(value)) is not None:
            what = param or "a value"
            message = f"{what}: the text holds a lone surrogate ({bad}); it must be valid Unicode"
            raise ApiError(400, message, param)
        if isinstance(value, dict):
            for k, v in value.items():
                if (bad := _lone_surrogate(k)) is not None:
                    where = f" in {param}" if param else ""
                    message = f"a key{where} holds a lone surrogate ({bad}); it must be valid Unicode"
                    raise ApiError(400, message, param)
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(value))


def check_content_parts(body: dict[str, Any]) -> None:
    """A readable error for non-text content parts (images, audio, files)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                message = f"content parts of type `{kind}` are not supported: this model reads text only"
                raise ApiError(400, message, f"messages.{i}.content.{j}")


def known_parameters(body: dict[str, Any], schema: type[BaseModel]) -> dict[str, Any]:
    """The body without the accepted-but-unused parameters and the neutral unsupported ones;
    any other parameter outside `schema` is refused by name."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in schema.model_fields:
            out[key] = value
        elif key in ACCEPTED_UNUSED:
            continue
        elif key in UNSUPPORTED:
            if value is None or any(value == v and type(value) is type(v) for v in UNSUPPORTED[key]):
                continue
            raise ApiError(400, f"`{key}` is not supported by this server", key, UNSUPPORTED_CODE)
        else:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", key, UNSUPPORTED_CODE)
    return out
