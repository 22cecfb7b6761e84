"""Responses in OpenAI's shapes, whole and streamed: choices, chunks, usage, logprobs, tool
calls, provenance, and the SSE framing. Pure functions of the engine's deltas. No torch here.

A request with tools in play reads its reply through the format's `ToolCallParser`: streamed,
content goes out as content deltas, each call as a first chunk with its index, id and name and
then `arguments` deltas as the model writes them (OpenAI's chunks); whole, the reply's calls are
its `tool_calls`. A reply that made calls ends with finish_reason "tool_calls" ("length" when
max_tokens cut it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dspark_serve.scheduler.client import StreamDelta
from dspark_serve.server.errors import ApiError, error_body
from dspark_serve.server.reasoning import ReasoningFormat, ReasoningParser, split_reply
from dspark_serve.server.tool_formats import ToolMode
from dspark_serve.server.tool_parser import (
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParsedCall,
    ToolCallParser,
    ToolEvent,
    parse_reply,
)

Kind = Literal["chat", "completion"]

SSE_DONE = "data: [DONE]\n\n"

# Characters JSON leaves raw that many line splitters (Python's str.splitlines, httpx's
# iter_lines) take for a line break; SSE itself breaks lines only at CR and LF.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: Mapping[str, Any]) -> str:
    """One SSE ``data:`` event holding ``payload`` as JSON on a single line.

    Text stays UTF-8 (no ASCII escaping of every non-ASCII character), but the three characters
    above are escaped: a model can write them, and a client splitting the stream with
    ``splitlines`` would otherwise cut the event in two.
    """
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


def sse_error(message: str, status: int, param: str | None, code: str | None) -> str:
    """An error as an SSE event (a stream's HTTP status is already sent)."""
    return sse_event(error_body(message, status, param, code))


def usage(last: StreamDelta | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI `usage`, with the speculative-decoding summary of `last` when given."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if last is not None and last.spec is not None:
        u["spec_decode"] = last.spec
    return u


def token_records(d: StreamDelta | None) -> list[dict[str, Any]]:
    """Provenance (`"dspark": {"tokens": [...]}`): each new token's id, text, kind, draft position."""
    if d is None:
        return []
    return [
        {"id": t.token_id, "text": t.text, "kind": t.kind, "position": t.draft_position} for t in d.tokens
    ]


def logprob_items(d: StreamDelta) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries for a delta's tokens."""
    out = []
    for t in d.tokens:
        lp = t.logprob
        if lp is None:
            continue
        out.append(
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": a.token, "logprob": a.logprob, "bytes": list(a.token.encode("utf-8"))}
                    for a in lp.top
                ],
            }
        )
    return out


def completion_logprobs(deltas: list[StreamDelta], offset: int) -> dict[str, Any]:
    """OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens, lps, tops, offsets = [], [], [], []
    for d in deltas:
        for t in d.tokens:
            if t.logprob is None:
                continue
            tokens.append(t.logprob.token)
            lps.append(t.logprob.logprob)
            tops.append({a.token: a.logprob for a in t.logprob.top})
            offsets.append(offset)
            offset += len(t.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def tool_call_json(call: ParsedCall) -> dict[str, Any]:
    """One entry of a message's `tool_calls`."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """A parser's events as chat deltas: content; a call's first chunk (index, id, name, empty
    arguments); its arguments, consecutive pieces joined."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            out.append({"content": e.text})
        elif isinstance(e, CallStarted):
            fn = {"name": e.name, "arguments": ""}
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function", "function": fn}]})
        elif isinstance(e, ArgumentsDelta):
            prev = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
            if prev is not None and prev["index"] == e.index and "id" not in prev:
                prev["function"]["arguments"] += e.text
            else:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


@dataclass
class ChoiceProgress:
    """What a streamed choice has sent so far."""

    completion_tokens: int = 0
    offset: int = 0
    """Characters sent (completions' `text_offset`)."""
    parser: ToolCallParser | None = None
    """Reads the reply's tool calls (tools in play)."""
    reasoner: ReasoningParser | None = None
    """Splits the reply's reasoning from its content (a reasoning model's chat)."""


@dataclass(frozen=True)
class Reply:
    """The shape of one request's response: its id and model, whether it is a chat, and what it
    includes (logprobs, usage in the stream, provenance, tool calls)."""

    kind: Kind
    id: str
    created: int
    model: str
    n: int
    prompt_tokens: int
    logprobs: bool
    include_usage: bool
    provenance: bool
    tools: ToolMode | None
    reasoning: ReasoningFormat | None = None

    def progress(self) -> ChoiceProgress:
        """A streamed choice's progress, with its tool-call parser when tools are in play."""
        t, r = self.tools, self.reasoning if self.kind == "chat" else None
        return ChoiceProgress(
            parser=ToolCallParser(t.format, t.names, t.parallel) if t is not None else None,
            reasoner=ReasoningParser(r) if r is not None else None,
        )

    def choice(
        self, i: int, text: str, finish: str | None, delta: bool, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if self.kind == "chat":
            body = {"content": text} if delta else {"role": "assistant", "content": text}
            key = "delta" if delta else "message"
            return {"index": i, key: body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, deltas: list[StreamDelta], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [x for d in deltas for x in logprob_items(d)]}
        return completion_logprobs(deltas, offset)

    # -- whole -------------------------------------------------------------------------------

    def whole(self, results: list[list[StreamDelta]]) -> dict[str, Any]:
        """The response body of a request that does not stream: every choice's deltas joined."""
        choices, records, completion, lasts = [], [], 0, []
        for i, deltas in enumerate(results):
            last = deltas[-1] if deltas else None
            if last is not None and last.error:
                raise ApiError(503, last.error, code="draining")
            completion += last.completion_tokens if last else 0
            text = "".join(d.text for d in deltas)
            choices.append(self._whole_choice(i, text, last.finish_reason if last else "stop", deltas))
            if self.provenance:
                records += [t for d in deltas for t in token_records(d)]
            lasts.append(last)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(lasts[0] if self.n == 1 else None, self.prompt_tokens, completion),
        }
        if self.provenance:
            body["dspark"] = {"tokens": records}
        return body

    def _whole_choice(
        self, i: int, text: str, finish: str | None, deltas: list[StreamDelta]
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.reasoning is not None and self.kind == "chat":
            split = split_reply(self.reasoning, text)
            text, extra["reasoning_content"] = split.content, split.reasoning or None
        t = self.tools
        if t is not None:
            reply = parse_reply(t.format, text, t.names, t.parallel)
            if reply.calls:
                calls = [tool_call_json(c) for c in reply.calls]
                message = {"role": "assistant", "content": reply.content, **extra, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
                return {"index": i, "message": message, "logprobs": None, "finish_reason": finish}
        choice = self.choice(i, text, finish, False, self._logprobs(deltas, 0))
        if extra:
            choice["message"].update(extra)
        return choice

    # -- streamed ----------------------------------------------------------------------------

    def chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        tokens: list[dict[str, Any]] | None = None,
    ) -> str:
        """One SSE event of the stream."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        p = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            p["usage"] = usage
        if tokens:
            p["dspark"] = {"tokens": tokens}
        return sse_event(p)

    def opening_events(self, progress: list[ChoiceProgress]) -> list[str]:
        """A chat stream opens each choice with the assistant's role."""
        if self.kind != "chat":
            return []
        opening = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}])
            for i in range(self.n)
        ]

    def delta_events(self, i: int, d: StreamDelta, progress: ChoiceProgress) -> list[str]:
        """The events for choice i's delta d: its text (held back while buffered), then, when it
        is the last, the reply's end and a drain's error."""
        progress.completion_tokens = d.completion_tokens
        events = []
        tokens = token_records(d) if self.provenance else None
        text = d.text
        if progress.reasoner is not None:
            split = progress.reasoner.feed(text)
            text = split.content
            if split.reasoning:
                events.append(self._delta_chunk(i, {"reasoning_content": split.reasoning}, tokens))
                tokens = None
        if progress.parser is not None:
            deltas = tool_deltas(progress.parser.feed(text)) or ([{}] if tokens else [])
            for delta in deltas:
                events.append(self._delta_chunk(i, delta, tokens))
                tokens = None
        elif text or tokens or (self.logprobs and d.tokens):
            lp = self._logprobs([d], progress.offset)
            progress.offset += sum(len(t.text) for t in d.tokens)
            events.append(self.chunk([self.choice(i, text, None, True, lp)], tokens=tokens))
        if d.finished:
            events += self._finish_events(i, d.finish_reason, progress)
        if d.error:  # cut by a drain: say so after the finish_reason
            events.append(sse_error(d.error, 503, None, "draining"))
        return events

    def _delta_chunk(self, i: int, delta: dict[str, Any], tokens: list[dict[str, Any]] | None) -> str:
        return self.chunk(
            [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], tokens=tokens
        )

    def _finish_events(self, i: int, finish: str | None, progress: ChoiceProgress) -> list[str]:
        events = []
        held = ""
        if progress.reasoner is not None:
            split = progress.reasoner.close()
            held = split.content
            if split.reasoning:
                events.append(self._delta_chunk(i, {"reasoning_content": split.reasoning}, None))
        if progress.parser is None and held:
            events.append(self._delta_chunk(i, {"content": held}, None))
        if progress.parser is not None:
            for delta in tool_deltas(progress.parser.feed(held) + progress.parser.close()):
                events.append(
                    self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                )
            if progress.parser.calls and finish == "stop":
                finish = "tool_calls"
        last = self.choice(i, "", finish, True)
        events.append(self.chunk([{**last, **({"delta": {}} if self.kind == "chat" else {})}]))
        return events

    def failure_events(
        self, progress: list[ChoiceProgress], last: StreamDelta | None, error: dict[str, Any]
    ) -> list[str]:
        """A stream that failed after its first event (`error`: an OpenAI error object): the
        error event, then `[DONE]`."""
        return [sse_event({"error": error}), SSE_DONE]

    def closing_events(self, progress: list[ChoiceProgress], last: StreamDelta | None) -> list[str]:
        """After every choice ended: the usage chunk (include_usage), then `[DONE]`."""
        usage_chunk = (
            [self.usage_event(last, sum(p.completion_tokens for p in progress))] if self.include_usage else []
        )
        return [*usage_chunk, SSE_DONE]

    def usage_event(self, last: StreamDelta | None, completion_tokens: int) -> str:
        """The stream's closing usage chunk (include_usage); the speculative-decoding summary
        only for a single choice."""
        return self.chunk([], usage(last if self.n == 1 else None, self.prompt_tokens, completion_tokens))
