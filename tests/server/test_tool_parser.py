"""Tool calls read back from each format's text: whole replies, every split of a streamed reply,
parallel calls, malformed output as content, calls cut by the end of the reply."""

from __future__ import annotations

import json

import pytest

from dspark_serve.server.tool_formats import HERMES, JSON, LLAMA3_JSON, MISTRAL, TOOL_FORMATS, ToolFormat
from dspark_serve.server.tool_parser import (
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ToolCallParser,
    parse_reply,
)

FUNCS = {"get_weather", "lookup"}
ARGS = [{"city": "Paris", "units": "metric", "note": 'a "quoted" } brace'}, {"q": [1, {"x": None}], "n": 2.5}]


def write(fmt: ToolFormat, calls: list[tuple[str, dict]], content: str = "") -> str:
    """A reply as the format's model writes it."""
    objs = [json.dumps(fmt.call_object(n, a)) for n, a in calls]
    if fmt is HERMES:
        body = "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
        return f"{content}\n\n{body}" if content else body
    if fmt is MISTRAL:
        return f"[TOOL_CALLS] [{', '.join(objs)}]"
    if fmt is LLAMA3_JSON:
        return "; ".join(objs)
    return objs[0] if len(objs) == 1 else f"[{', '.join(objs)}]"


def stream(fmt: ToolFormat, text: str, pieces: list[int], parallel: bool = True) -> tuple[str, list[dict]]:
    """Feeds text cut at `pieces` offsets; rebuilds content and calls from the events alone."""
    p = ToolCallParser(fmt, FUNCS, parallel)
    events = []
    cuts = [0, *pieces, len(text)]
    for a, b in zip(cuts, cuts[1:]):
        events += p.feed(text[a:b])
    events += p.close()
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls)
            calls.append({"id": e.id, "name": e.name, "arguments": ""})
        else:
            assert isinstance(e, ArgumentsDelta) and e.index == len(calls) - 1  # deltas follow their call
            calls[e.index]["arguments"] += e.text
    return content, calls


@pytest.mark.parametrize("fmt", list(TOOL_FORMATS.values()), ids=list(TOOL_FORMATS))
def test_whole_and_streamed_round_trip_at_every_split(fmt):
    calls = [("get_weather", ARGS[0]), ("lookup", ARGS[1])]
    content = "Let me check." if fmt is HERMES else ""
    text = write(fmt, calls, content)
    whole = parse_reply(fmt, text, FUNCS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert all(c.complete for c in whole.calls)
    assert whole.content == (content or None)
    ids = {c.id for c in whole.calls}
    assert len(ids) == 2 and all(len(i) == 9 if fmt is MISTRAL else i.startswith("call_") for i in ids)
    for cut in range(len(text) + 1):  # one split anywhere, then one character at a time
        got_content, got = stream(fmt, text, [cut])
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls, cut
    got_content, got = stream(fmt, text, list(range(1, len(text))))
    assert got_content == content and [c["name"] for c in got] == ["get_weather", "lookup"]


def test_arguments_stream_as_they_are_written():
    text = write(HERMES, [("get_weather", {"city": "Paris", "details": "x" * 40})])
    p = ToolCallParser(HERMES, FUNCS)
    deltas = []
    for i in range(0, len(text), 4):
        deltas += [e for e in p.feed(text[i : i + 4]) if isinstance(e, ArgumentsDelta)]
    assert len(deltas) >= 10  # every feed that adds argument text sends it
    assert "".join(d.text for d in deltas) == json.dumps({"city": "Paris", "details": "x" * 40})


def test_the_name_comes_before_any_argument_even_when_written_after():
    text = '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>'
    content, calls = stream(HERMES, text, list(range(1, len(text))))
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Rome"}


@pytest.mark.parametrize(
    "fmt,text",
    [
        (JSON, '{"name": "get_weather", "arguments": {"city": "Paris"'),
        (JSON, '{"name": "unknown_fn", "arguments": {}}'),
        (JSON, '{"answer": 42}'),
        (JSON, "Sure: {not json at all"),
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": 1}}; {"bad": '),
        (HERMES, "<tool_call>\n{oops}\n</tool_call>"),
        (HERMES, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
        (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P"}}, 7]'),
    ],
)
def test_malformed_output_is_content(fmt, text):
    """A whole reply with a call that does not parse comes back as content, never an error
    (a call cut by the end of the reply is the exception: see below)."""
    reply = parse_reply(fmt, text, FUNCS)
    if reply.calls:  # only a cut call may come back as a call
        assert not reply.calls[-1].complete
    else:
        assert reply.content == text


def test_a_call_cut_by_the_end_of_the_reply_keeps_its_name_and_arguments_so_far():
    reply = parse_reply(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', FUNCS)
    assert [(c.name, c.arguments, c.complete) for c in reply.calls] == [
        ("get_weather", '{"city": "Par', False)
    ]


def test_plain_replies_and_json_content_stay_content():
    for fmt in TOOL_FORMATS.values():
        assert parse_reply(fmt, "Hello there.", FUNCS).content == "Hello there."
        assert stream(fmt, "Hello there.\n", [3, 7]) == ("Hello there.\n", [])
    obj = '{"answer": 42, "name": "x"}'
    assert parse_reply(JSON, obj, FUNCS).content == obj
    assert stream(JSON, obj, list(range(1, len(obj)))) == (obj, [])


def test_without_parallel_calls_only_the_first_is_kept():
    text = write(HERMES, [("get_weather", ARGS[0]), ("lookup", ARGS[1])])
    assert [c.name for c in parse_reply(HERMES, text, FUNCS, parallel=False).calls] == ["get_weather"]
    assert [c["name"] for c in stream(HERMES, text, [5, 50], parallel=False)[1]] == ["get_weather"]


def test_arguments_written_as_a_json_string_are_decoded():
    text = json.dumps({"name": "lookup", "arguments": json.dumps({"q": "a"})})
    assert json.loads(parse_reply(JSON, text, FUNCS).calls[0].arguments) == {"q": "a"}
    assert json.loads(stream(JSON, text, [9, 30])[1][0]["arguments"]) == {"q": "a"}


def test_a_mistral_reply_whose_marker_the_decoder_dropped_is_still_read():
    text = json.dumps([{"name": "lookup", "arguments": {"q": 1}}])
    assert [c.name for c in parse_reply(MISTRAL, text, FUNCS).calls] == ["lookup"]
    text = '<|python_tag|>{"name": "lookup", "parameters": {"q": 1}}'
    assert [c.name for c in parse_reply(LLAMA3_JSON, text, FUNCS).calls] == ["lookup"]
