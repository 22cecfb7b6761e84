"""The Responses API (`POST /v1/responses`), stateless: a request's `input` items and
`instructions` become a chat (`to_chat`), which runs like any chat (tool formats, grammars,
reasoning), and its reply comes back as Responses output items (`reasoning`, `message`,
`function_call`), whole or as the typed stream events. Nothing is stored, so
`previous_response_id` is a 400. No torch here.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from dspark_serve.scheduler.client import StreamDelta
from dspark_serve.server.errors import ApiError
from dspark_serve.server.protocol import ChatCompletionRequest, DsparkOptions, Int, RuleError
from dspark_serve.server.reasoning import split_reply
from dspark_serve.server.render import ChoiceProgress, Reply, sse_event, usage
from dspark_serve.server.tool_parser import ArgumentsDelta, CallStarted, ContentDelta, ToolEvent, parse_reply

# -- the request --------------------------------------------------------------------------------


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # ids and statuses a client echoes back


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]


def _item_type(v: Any) -> str:
    return str(v.get("type", "message")) if isinstance(v, dict) else str(getattr(v, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses request this server serves; the conversation comes whole
    in `input` (a string: one user message)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    dspark: DsparkOptions | None = None

    def echo(self) -> dict[str, Any]:
        """The request's own parameters as a Response object repeats them (every event's
        `response`), defaults filled in as OpenAI's are."""
        choice = self.tool_choice
        text = (
            self.text.model_dump(exclude_none=True, by_alias=True)
            if self.text
            else {"format": {"type": "text"}}
        )
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "text": text,
            "truncation": self.truncation or "disabled",
            "user": self.user,
        }

    @model_validator(mode="after")
    def _stateless(self) -> Self:
        if self.previous_response_id is not None:
            raise RuleError(
                "previous_response_id",
                "this server keeps no responses: send the whole conversation in `input`",
            )
        return self


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat a Responses request asks for (`chat_messages` for the conversation)."""
    messages = chat_messages(req)
    if not messages:
        raise ApiError(400, "input must hold at least one message", "input")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "dspark": req.dspark.model_dump() if req.dspark is not None else None,
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Instructions as the system message, message items as messages, function calls as the
    assistant's tool_calls, their outputs as tool messages (reasoning items are left out, as
    reasoning models' templates leave earlier reasoning out)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


# -- the response -------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": status, "content": [part]}


def _reasoning(text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": content}


def _call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class StreamedItems:
    """What one streamed response has sent: its events' sequence, its output items so far and
    the item still open (reasoning, message or a call), with its text."""

    seq: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None
    text: str = ""


@dataclass
class ResponsesProgress(ChoiceProgress):
    items: StreamedItems = field(default_factory=StreamedItems)


@dataclass(frozen=True)
class ResponsesReply(Reply):
    """A Responses reply: the same engine deltas and parsers as a chat, written as a response
    object (whole) or as typed events (streamed). One choice. `echo`: the request's own
    parameters (`ResponsesRequest.echo`), repeated in every response object.

    Every stream ends in the event that tells how it ended: `response.completed`,
    `response.incomplete` (the output limit, or the server cutting it: `incomplete_details`
    says which) or, when it fails after its first event, an `error` event and
    `response.failed` carrying that error; the open output item is closed first, marked
    incomplete when the text was cut, and usage counts the tokens streamed."""

    echo: Mapping[str, Any] = field(default_factory=dict)

    def body(
        self,
        output: list[dict[str, Any]],
        status: str,
        last: StreamDelta | None,
        completion: int,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        u = usage(last, self.prompt_tokens, completion)
        response_usage = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
            **({"spec_decode": u["spec_decode"]} if "spec_decode" in u else {}),
        }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "incomplete_details": {"reason": _incomplete_reason(last)} if status == "incomplete" else None,
            **self.echo,
            "usage": response_usage if status != "in_progress" else None,
            "error": error,
        }

    def whole(self, results: list[list[StreamDelta]]) -> dict[str, Any]:
        deltas = results[0]
        last = deltas[-1] if deltas else None
        if last is not None and last.error:
            raise ApiError(503, last.error, code="draining")
        text = "".join(d.text for d in deltas)
        output: list[dict[str, Any]] = []
        if self.reasoning is not None:
            split = split_reply(self.reasoning, text)
            text = split.content
            if split.reasoning:
                output.append(_reasoning(split.reasoning))
        calls = []
        if self.tools is not None:
            reply = parse_reply(self.tools.format, text, self.tools.names, self.tools.parallel)
            if reply.calls:
                text, calls = reply.content or "", reply.calls
        if text or not calls:
            output.append(_message(text))
        output += [_call(c.id, c.name, c.arguments) for c in calls]
        return self.body(output, _status(last), last, last.completion_tokens if last else 0)

    # -- streamed ----------------------------------------------------------------------------

    def progress(self) -> ChoiceProgress:
        base = super().progress()
        return ResponsesProgress(parser=base.parser, reasoner=base.reasoner)

    def _event(self, items: StreamedItems, kind: str, **fields: Any) -> str:
        items.seq += 1
        return sse_event({"type": f"response.{kind}", "sequence_number": items.seq - 1, **fields})

    def opening_events(self, progress: list[ChoiceProgress]) -> list[str]:
        items = _items(progress[0])
        response = self.body([], "in_progress", None, 0)
        return [
            self._event(items, "created", response=response),
            self._event(items, "in_progress", response=response),
        ]

    def delta_events(self, i: int, d: StreamDelta, progress: ChoiceProgress) -> list[str]:
        assert isinstance(progress, ResponsesProgress)
        progress.completion_tokens = d.completion_tokens
        events: list[str] = []
        text = d.text
        if progress.reasoner is not None:
            split = progress.reasoner.feed(text)
            text = split.content
            events += self._reasoning_delta(progress.items, split.reasoning)
        tool_events: list[ToolEvent] = (
            progress.parser.feed(text) if progress.parser is not None else [ContentDelta(text)]
        )
        events += self._tool_events(progress.items, tool_events)
        if d.finished:
            events += self._finish(progress, d)
        return events

    def _of_open(self, items: StreamedItems, kind: str, **fields: Any) -> str:
        """An event of the open item (its id and output index filled in)."""
        assert items.open is not None
        return self._event(
            items, kind, item_id=items.open["id"], output_index=len(items.output) - 1, **fields
        )

    def _reasoning_delta(self, items: StreamedItems, text: str) -> list[str]:
        if not text:
            return []
        events = self._open(items, _reasoning(""))
        items.text += text
        return [*events, self._of_open(items, "reasoning_text.delta", content_index=0, delta=text)]

    def _tool_events(self, items: StreamedItems, tool_events: list[ToolEvent]) -> list[str]:
        events: list[str] = []
        for e in tool_events:
            if isinstance(e, ContentDelta) and e.text:
                events += self._open(items, _message("", "in_progress"))
                if not items.text:
                    part = {"type": "output_text", "text": "", "annotations": []}
                    events.append(self._of_open(items, "content_part.added", content_index=0, part=part))
                items.text += e.text
                events.append(
                    self._of_open(items, "output_text.delta", content_index=0, delta=e.text, logprobs=[])
                )
            elif isinstance(e, CallStarted):
                events += self._open(items, _call(e.id, e.name, "", "in_progress"))
            elif (
                isinstance(e, ArgumentsDelta)
                and items.open is not None
                and items.open["type"] == "function_call"
            ):
                items.text += e.text
                events.append(self._of_open(items, "function_call_arguments.delta", delta=e.text))
        return events

    def _open(self, items: StreamedItems, item: dict[str, Any]) -> list[str]:
        """Close the open item unless it is of this kind (a call is always new), then open `item`."""
        if items.open is not None and items.open["type"] == item["type"] and item["type"] != "function_call":
            return []
        events = self._close(items)
        items.open, items.text = item, ""
        items.output.append(item)
        events.append(self._event(items, "output_item.added", output_index=len(items.output) - 1, item=item))
        return events

    def _close(self, items: StreamedItems, status: str = "completed") -> list[str]:
        """Close the open item (`status`: "incomplete" where its text was cut)."""
        item, text = items.open, items.text
        if item is None:
            return []
        if item["type"] == "reasoning":
            item["content"][0]["text"] = text
            events = [self._of_open(items, "reasoning_text.done", content_index=0, text=text)]
        elif item["type"] == "message":
            item["content"][0]["text"], item["status"] = text, status
            events = [
                self._of_open(items, "output_text.done", content_index=0, text=text, logprobs=[]),
                self._of_open(items, "content_part.done", content_index=0, part=item["content"][0]),
            ]
        else:
            item["arguments"], item["status"] = text, status
            events = [self._of_open(items, "function_call_arguments.done", arguments=text)]
        events.append(self._event(items, "output_item.done", output_index=len(items.output) - 1, item=item))
        items.open, items.text = None, ""
        return events

    def _finish(self, progress: ResponsesProgress, d: StreamDelta) -> list[str]:
        """The reply's end: what the parsers held back, then the open item closed."""
        items = progress.items
        events: list[str] = []
        held = ""
        if progress.reasoner is not None:
            split = progress.reasoner.close()
            events += self._reasoning_delta(items, split.reasoning)
            held = split.content
        if progress.parser is not None:
            tail = progress.parser.feed(held) + progress.parser.close()
        else:
            tail = [ContentDelta(held)] if held else []
        events += self._tool_events(items, tail)
        return events + self._close(items, "incomplete" if _status(d) == "incomplete" else "completed")

    def closing_events(self, progress: list[ChoiceProgress], last: StreamDelta | None) -> list[str]:
        items = _items(progress[0])
        status = _status(last)
        response = self.body(items.output, status, last, progress[0].completion_tokens)
        return [self._event(items, status, response=response)]

    def failure_events(
        self, progress: list[ChoiceProgress], last: StreamDelta | None, error: dict[str, Any]
    ) -> list[str]:
        """A stream that failed mid-way: the open item closed as incomplete, the `error` event,
        then `response.failed` with the error and the tokens streamed."""
        items = _items(progress[0])
        events = self._close(items, "incomplete")
        fields = {k: error.get(k) for k in ("code", "message", "param")}
        items.seq += 1
        events.append(sse_event({"type": "error", "sequence_number": items.seq - 1, **fields}))
        response = self.body(items.output, "failed", last, progress[0].completion_tokens, fields)
        return [*events, self._event(items, "failed", response=response)]


def _status(last: StreamDelta | None) -> str:
    """How a reply ended: "incomplete" when the output limit or the server cut it."""
    return "incomplete" if last is not None and last.finish_reason in ("length", "abort") else "completed"


def _incomplete_reason(last: StreamDelta | None) -> str:
    if last is not None and last.finish_reason == "abort":
        return "server_shutdown" if last.error else "aborted"
    return "max_output_tokens"


def _items(progress: ChoiceProgress) -> StreamedItems:
    assert isinstance(progress, ResponsesProgress)
    return progress.items
