"""Tool calls read out of a model's text as it streams (`ToolCallParser.feed`) or whole
(`parse_reply`), for one `ToolFormat`.

Streamed, a call is announced (`CallStarted`: index, id, name) as soon as its name is complete,
and its arguments follow as `ArgumentsDelta`s of the raw JSON text the model writes, so they
concatenate to the call's `arguments`. Text outside calls is `ContentDelta`; whitespace between
content and a call, or after the last call, is held back and dropped. Nothing is sent for a
bare call object (json, llama3_json) until its name shows it is a call: a reply that merely
starts with "{" stays content.

Whole, a reply whose calls do not parse (bad JSON, an unknown function) is content, never an
error; a call cut by the end of the reply (max_tokens) is returned with the arguments it has.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from dspark_serve.server.tool_formats import ToolFormat


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStarted | ArgumentsDelta


@dataclass
class ParsedCall:
    """One call read from the reply: `arguments` is its JSON text (complete when `complete`)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(frozen=True)
class ParsedReply:
    """A whole reply: its content (None when it is only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall]


State = Literal["start", "content", "calls", "object", "text"]
_BLANK = " \t\r\n"


@dataclass
class _Object:
    """The scan of one call object: JSON structure at depth 1 (keys and where values lie)."""

    start: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    expect: Literal["key", "colon", "value", "comma"] = "key"
    key_start: int = -1
    key: str | None = None
    value_key: str | None = None  # the key whose value is being read at depth 1
    value_start: int = -1
    primitive: bool = False
    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    args_string: bool = False
    call: ParsedCall | None = None
    sent: int = 0  # characters of the arguments already sent


class ToolCallParser:
    """Reads one reply's text; see the module docstring. `functions`: the names a call may use;
    `parallel` False: calls after the first are left out."""

    def __init__(self, fmt: ToolFormat, functions: Collection[str], parallel: bool = True) -> None:
        self.fmt = fmt
        self.functions = frozenset(functions)
        self.parallel = parallel
        self.buf = ""
        self.pos = 0  # next character to read
        self.state: State = "start"
        self.content_from = 0  # content not yet sent starts here
        self.content: list[str] = []
        self.calls: list[ParsedCall] = []
        self.malformed = False  # a call that started did not parse
        self.open_block = False  # inside <tool_call> ... </tool_call>, or a list's [ ... ]
        self.obj: _Object | None = None
        self.new_id: Callable[[], str] = fmt.new_id

    # -- the outer loop --------------------------------------------------------------------

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        events: list[ToolEvent] = []
        while self.pos < len(self.buf):
            before = (self.state, self.pos)
            step = {
                "start": self._start,
                "content": self._content,
                "calls": self._calls,
                "object": self._object,
                "text": self._text,
            }[self.state]
            events += step()
            if (self.state, self.pos) == before:
                break  # waiting for more text
        return events

    def close(self) -> list[ToolEvent]:
        """The end of the reply: content held back is sent (unless it is blank after calls)."""
        events: list[ToolEvent] = []
        if self.state == "object" and self.obj is not None:
            if self.obj.call is None:  # a bare object that never named a known function
                self.malformed = self.malformed or not self.fmt.bare or self.open_block or bool(self.calls)
                self.state = "content"
            else:
                events += self._send_arguments(len(self.buf))
        if self.state in ("start", "content", "text"):
            rest = self.buf[self.content_from :]
            if rest and (rest.strip() or not self.calls):
                events += self._send_content(len(self.buf))
        self.content_from = self.pos = len(self.buf)
        return events

    def _send_content(self, upto: int) -> list[ToolEvent]:
        text = self.buf[self.content_from : upto]
        self.content_from = max(self.content_from, upto)
        if not text:
            return []
        self.content.append(text)
        return [ContentDelta(text)]

    # -- states ------------------------------------------------------------------------------

    def _start(self) -> list[ToolEvent]:
        """Before any non-blank text: a bare format's call may open here."""
        rest = self.buf[self.pos :]
        stripped = rest.lstrip(_BLANK)
        if not stripped:
            self.pos = len(self.buf)
            return []
        at = len(self.buf) - len(stripped)
        opener = self.fmt.opener
        if opener is not None and opener.startswith(stripped[: len(opener)]):
            if len(stripped) < len(opener):
                return []  # maybe the opener, not complete yet
            self.state = "content"
            return []
        if self.fmt.bare and stripped[0] in "{[":
            self.pos = at
            self.state = "calls"
            return []
        self.state = "content"
        return []

    def _content(self) -> list[ToolEvent]:
        """Plain text: sent as it comes, up to an opener (text that may begin one waits)."""
        opener = self.fmt.opener
        if opener is not None:
            at = self.buf.find(opener, self.content_from)
            if at >= 0:
                events = self._send_content(len(self.buf[:at].rstrip(_BLANK)))
                self.content_from = self.pos = at + len(opener)
                self.open_block = self.fmt.closer is not None
                self.state = "calls"
                return events
            hold = _partial_suffix(self.buf, opener)
        else:
            hold = 0
        end = len(self.buf) - hold
        blank_tail = len(self.buf[:end]) - len(self.buf[:end].rstrip(_BLANK))
        self.pos = len(self.buf)
        return self._send_content(end - blank_tail)

    def _text(self) -> list[ToolEvent]:
        """Everything from here on is content."""
        self.pos = len(self.buf)
        return self._send_content(len(self.buf))

    def _calls(self) -> list[ToolEvent]:
        """Between calls: blanks, separators, the list's brackets and the closer are skipped."""
        closer = self.fmt.closer
        while self.pos < len(self.buf):
            c = self.buf[self.pos]
            if c in _BLANK or c in ",;[":
                self.open_block = self.open_block or c == "["
                self.pos += 1
                continue
            if closer is not None and self.buf.startswith(closer, self.pos):
                self.pos += len(closer)
                self.open_block = False
                self.content_from = self.pos
                self.state = "content"
                return []
            if closer is not None and _partial_suffix(self.buf, closer) == len(self.buf) - self.pos:
                return []  # maybe the closer, not complete yet
            if c == "]":
                self.open_block = False
                self.pos += 1
                self.content_from = self.pos
                self.state = "content"
                return []
            if c == "{":
                self.obj = _Object(self.pos)
                self.state = "object"
                return []
            # anything else after calls is content; inside an open hermes block it is malformed
            self.malformed = self.malformed or self.open_block
            self.content_from = self.pos
            self.state = "text"
            return []
        return []

    # -- one call object ---------------------------------------------------------------------

    def _object(self) -> list[ToolEvent]:
        """Scan the call object's characters: keys and values at depth 1 (the name, where the
        arguments lie), nesting and strings below it."""
        o = self.obj
        assert o is not None
        events: list[ToolEvent] = []
        buf = self.buf
        while self.pos < len(buf):
            i, c = self.pos, buf[self.pos]
            self.pos += 1
            if o.in_string:
                events += self._string_char(o, i, c)
            elif c == '"':
                o.in_string = True
                if o.depth == 1 and o.expect == "key":
                    o.key_start = i
                elif o.depth == 1 and o.expect == "value":
                    self._value_start(o, i)
            elif c in "{[":
                if o.depth == 1 and o.expect == "value":
                    self._value_start(o, i)
                o.depth += 1
            elif c in "}]":
                if o.primitive:
                    events += self._value_end(o, i)
                o.depth -= 1
                if o.depth == 1 and o.value_key is not None:
                    events += self._value_end(o, i + 1)
                if o.depth <= 0:
                    return events + self._object_end(o, i + 1)
            elif o.depth == 1:
                events += self._top_level_char(o, i, c)
        if o.call is not None and o.args_start >= 0 and o.args_end < 0 and not o.args_string:
            events += self._send_arguments(self.pos)
        return events

    def _string_char(self, o: _Object, i: int, c: str) -> list[ToolEvent]:
        if o.escaped:
            o.escaped = False
        elif c == "\\":
            o.escaped = True
        elif c == '"':
            o.in_string = False
            if o.depth == 1 and o.expect == "key":
                o.key = _loads(self.buf[o.key_start : i + 1])
                o.expect = "colon"
            elif o.depth == 1 and o.value_key is not None:
                return self._value_end(o, i + 1)
        return []

    def _top_level_char(self, o: _Object, i: int, c: str) -> list[ToolEvent]:
        """A character between the object's keys and values (not in a string or a nested value)."""
        events: list[ToolEvent] = []
        if c == ":" and o.expect == "colon":
            o.expect = "value"
        elif c == "," or c in _BLANK:
            if o.primitive:
                events += self._value_end(o, i)
            if c == ",":
                o.expect = "key"
        elif o.expect == "value" and not o.primitive:
            self._value_start(o, i)
            o.primitive = True
        return events

    def _value_start(self, o: _Object, i: int) -> None:
        o.value_key, o.value_start, o.expect = o.key, i, "comma"
        if o.key == self.fmt.args_key:
            o.args_start, o.args_string = i, self.buf[i] == '"'

    def _value_end(self, o: _Object, end: int) -> list[ToolEvent]:
        key, start = o.value_key, o.value_start
        o.value_key, o.primitive = None, False
        events: list[ToolEvent] = []
        if key == "name" and o.name is None:
            name = _loads(self.buf[start:end])
            if not isinstance(name, str) or name not in self.functions:
                return self._not_a_call(o)
            o.name = name
            events += self._start_call(o)
        elif key == self.fmt.args_key:
            o.args_end = end
            if o.call is not None:
                events += self._send_arguments(end)
        return events

    def _start_call(self, o: _Object) -> list[ToolEvent]:
        assert o.name is not None
        if not self.parallel and self.calls:
            o.call = ParsedCall(-1, "", o.name)  # read but left out
            return []
        o.call = ParsedCall(len(self.calls), self.new_id(), o.name)
        self.calls.append(o.call)
        events: list[ToolEvent] = [CallStarted(o.call.index, o.call.id, o.name)]
        if o.args_start >= 0:
            events += self._send_arguments(o.args_end if o.args_end >= 0 else self.pos)
        return events

    def _send_arguments(self, upto: int) -> list[ToolEvent]:
        o = self.obj
        if o is None or o.call is None or o.args_start < 0:
            return []
        if o.args_string:  # arguments written as a JSON string: sent whole when complete
            if o.args_end < 0 or o.sent:
                return []
            text = _loads(self.buf[o.args_start : o.args_end])
            text = text if isinstance(text, str) else ""
            o.sent = len(text) or 1
        else:
            text = self.buf[o.args_start + o.sent : upto]
            o.sent += len(text)
        if not text:
            return []
        o.call.arguments += text
        return [ArgumentsDelta(o.call.index, text)] if o.call.index >= 0 else []

    def _object_end(self, o: _Object, end: int) -> list[ToolEvent]:
        self.obj = None
        value = _loads(self.buf[o.start : end])
        if o.call is None:  # the object closed without naming a known function
            return self._not_a_call(o)
        args = value.get(self.fmt.args_key) if isinstance(value, dict) else None
        if isinstance(args, str):
            args = _loads(args)
        events: list[ToolEvent] = []
        if o.args_start < 0:  # no arguments written: an empty object
            o.call.arguments = "{}"
            if o.call.index >= 0:
                events.append(ArgumentsDelta(o.call.index, "{}"))
        o.call.complete = isinstance(value, dict) and isinstance(args, dict | None)
        self.malformed = self.malformed or not o.call.complete
        self.state = "calls"
        return events

    def _not_a_call(self, o: _Object) -> list[ToolEvent]:
        """An object that is no call: content from its start (or, after a marker, malformed)."""
        self.obj = None
        if not self.fmt.bare or self.open_block or self.calls:
            self.malformed = True
        self.content_from = min(self.content_from, o.start) if self.calls else self.content_from
        self.state = "text"
        return []


def parse_reply(fmt: ToolFormat, text: str, functions: Collection[str], parallel: bool = True) -> ParsedReply:
    """A whole reply's content and calls; malformed calls leave the whole reply as content."""
    parser = ToolCallParser(fmt, functions, parallel)
    parser.feed(text)
    parser.close()
    if parser.malformed or not parser.calls:
        return ParsedReply(text, [])
    content = "".join(parser.content)
    return ParsedReply(content or None, parser.calls)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
