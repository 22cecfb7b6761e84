"""The HTTP side of logprobs, n, structured output and tools over a fake engine: what reaches
the engine, and the OpenAI shapes that come back (streamed and not)."""

from __future__ import annotations

import json

from dspark_serve.scheduler.client import StreamDelta, TokenLogprob, TokenRecord, TopLogprob
from tests.server.test_app import FakeEngine, assert_error, chat, client


class ScriptEngine(FakeEngine):
    """Replies with `words` (one token each), with logprobs when asked; records every call."""

    max_model_len = 4096

    def __init__(self, words=("Hel", "lo"), finish="stop"):
        super().__init__()
        self.words = list(words)
        self.finish = finish
        self.calls = []

    async def generate(self, request_id, prompt_ids, params):
        self.calls.append((request_id, prompt_ids, params))
        n = len(self.words)
        for i, w in enumerate(self.words):
            lp = None
            if params.logprobs is not None:
                top = tuple(TopLogprob(j, f"t{j}", -0.5 * (j + 1)) for j in range(params.logprobs))
                lp = TokenLogprob(w, -0.25 * (i + 1), top)
            yield StreamDelta(
                w,
                [i],
                i == n - 1,
                self.finish if i == n - 1 else None,
                len(prompt_ids),
                i + 1,
                tokens=[TokenRecord(i, w, "plain", None, lp)],
            )


def sse(resp):
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


def test_n_returns_n_choices_with_their_own_seeds_and_usage_counts_all():
    eng = ScriptEngine()
    r = chat(client(eng), n=3, seed=7)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 2
    assert sorted(p.seed for _, _, p in eng.calls) == [7, 8, 9]
    assert len({rid for rid, _, _ in eng.calls}) == 3
    chunks = sse(chat(client(ScriptEngine()), n=2, stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"].get("content") or ""
    assert text == {0: "Hello", 1: "Hello"}
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_logprobs_shape_streamed_and_not():
    eng = ScriptEngine()
    body = chat(client(eng), logprobs=True, top_logprobs=2).json()
    assert eng.calls[0][2].logprobs == 2
    content = body["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == ["Hel", "lo"]
    assert [x["logprob"] for x in content] == [-0.25, -0.5]
    assert content[0]["bytes"] == list(b"Hel")
    assert [a["token"] for a in content[0]["top_logprobs"]] == ["t0", "t1"]
    assert (
        chat(client(ScriptEngine()), logprobs=True).json()["choices"][0]["logprobs"]["content"][0][
            "top_logprobs"
        ]
        == []
    )
    assert chat(client(ScriptEngine())).json()["choices"][0]["logprobs"] is None
    chunks = sse(chat(client(ScriptEngine()), logprobs=True, top_logprobs=1, stream=True))
    got = [
        x["logprob"]
        for c in chunks
        for ch in c["choices"]
        if ch["logprobs"]
        for x in ch["logprobs"]["content"]
    ]
    assert got == [-0.25, -0.5]


def test_completion_logprobs_shape():
    c = client(ScriptEngine())
    lp = c.post("/v1/completions", json={"prompt": "hi", "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hel", "lo"] and lp["token_logprobs"] == [-0.25, -0.5]
    assert lp["top_logprobs"] == [{"t0": -0.5}, {"t0": -0.5}] and lp["text_offset"] == [0, 3]
    assert_error(c.post("/v1/completions", json={"prompt": "hi", "logprobs": 21}), 400, "logprobs")


def test_penalties_bias_and_min_p_reach_the_engine():
    eng = ScriptEngine()
    chat(
        client(eng),
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        logit_bias={"7": 3, "2": -100},
    )
    p = eng.calls[0][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -0.5, 1.2, 0.1)
    assert p.logit_bias == ((2, -100.0), (7, 3.0))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_becomes_a_grammar():
    eng = ScriptEngine()
    c = client(eng)
    chat(
        c,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
        },
    )
    g = eng.calls[-1][2].grammar
    assert g.kind == "json_schema" and json.loads(g.schema) == SCHEMA and g.param == "response_format"
    chat(c, response_format={"type": "json_object"})
    assert eng.calls[-1][2].grammar.kind == "json_object"
    chat(c, response_format={"type": "text"})
    assert eng.calls[-1][2].grammar is None
    assert_error(chat(c, response_format={"type": "json_schema"}), 400, "response_format")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop"}},
]
CALL = '{"name": "get_weather", "arguments": {"a": 3}}'


def test_required_and_named_tool_choice_constrain_the_reply_and_return_tool_calls():
    eng = ScriptEngine([CALL[:10], CALL[10:]])
    c = client(eng)
    body = chat(c, tools=TOOLS, tool_choice="required").json()
    prompt = eng.calls[-1][1]
    g = eng.calls[-1][2].grammar
    schema = json.loads(g.schema)  # one call as an object, or several as an array
    assert g.param == "tools" and len(schema["$defs"]["call"]["anyOf"]) == 2
    assert schema["anyOf"][1]["items"] == {"$ref": "#/$defs/call"}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"a": 3} and call["id"].startswith("call_")
    # the tools are described to the model (the fake tokenizer counts characters)
    assert len(prompt) > 200
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat(c, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    one = json.loads(eng.calls[-1][2].grammar.schema)  # one call: the object alone
    assert one["properties"]["name"] == {"const": "get_weather"} and "anyOf" not in one
    assert_error(
        chat(c, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "zz"}}), 400, "tool_choice"
    )
    # auto: not constrained, but a reply that is a call comes back as one
    body = chat(c, tools=TOOLS).json()
    assert eng.calls[-1][2].grammar is None and body["choices"][0]["finish_reason"] == "tool_calls"
    # none: plain content, the tools not described
    body = chat(c, tools=TOOLS, tool_choice="none").json()
    assert body["choices"][0]["message"]["content"] == CALL and len(eng.calls[-1][1]) < 20


def test_tool_call_streams_as_openai_streams_it():
    """The call's id and name first, then its arguments as each engine step writes them."""
    pieces = [CALL[i : i + 6] for i in range(0, len(CALL), 6)]
    chunks = sse(chat(client(ScriptEngine(pieces)), tools=TOOLS, tool_choice="required", stream=True))
    deltas = [ch for c in chunks for ch in c["choices"]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d.get("delta", {})]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) >= 2 and all(set(c) == {"index", "function"} and c["index"] == 0 for c in rest)
    assert json.loads("".join(c["function"]["arguments"] for c in rest)) == {"a": 3}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in deltas)


TWO_CALLS = [
    "I will look both up.\n\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "noop", ',
    '"arguments": {}}\n</tool_call>',
]


def test_parallel_calls_come_back_with_their_ids_and_indexes_after_the_content():
    eng = ScriptEngine(TWO_CALLS)
    c = client(eng, tool_call_parser="hermes")
    msg = chat(c, tools=TOOLS).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "I will look both up."
    calls = msg["message"]["tool_calls"]
    assert [x["function"]["name"] for x in calls] == ["get_weather", "noop"] and len(
        {x["id"] for x in calls}
    ) == 2
    assert [json.loads(x["function"]["arguments"]) for x in calls] == [{"a": 1}, {}]
    chunks = sse(chat(c, tools=TOOLS, stream=True))
    deltas = [ch["delta"] for x in chunks for ch in x["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "I will look both up."
    starts = [t for d in deltas for t in d.get("tool_calls") or [] if "id" in t]
    assert [(t["index"], t["function"]["name"]) for t in starts] == [(0, "get_weather"), (1, "noop")]
    # parallel_tool_calls false: the first call only
    one = chat(c, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
    assert [x["function"]["name"] for x in one] == ["get_weather"]


def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call():
    eng = ScriptEngine([CALL[:20], CALL[20:-3]], finish="length")  # cut inside the arguments
    body = chat(client(eng), tools=TOOLS, tool_choice="required").json()["choices"][0]
    assert body["finish_reason"] == "length"
    (call,) = body["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"a": '}
    chunks = sse(chat(client(eng), tools=TOOLS, tool_choice="required", stream=True))
    finishes = [ch["finish_reason"] for x in chunks for ch in x["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]


def test_earlier_tool_calls_and_results_are_rendered():
    eng = ScriptEngine(["ok"])
    chat(
        client(eng),
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"a": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    assert eng.calls[-1][2].grammar is None


REF_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "place",
            "parameters": {
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/point"}, "next": {"$ref": "#/properties/at"}},
                "required": ["at"],
                "additionalProperties": False,
                "$defs": {
                    "point": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "label",
            "parameters": {
                "type": "object",
                "properties": {"text": {"$ref": "#/$defs/point"}, "tag": {"enum": [{"$ref": "#/x"}]}},
                "required": ["text"],
                "$defs": {"point": {"type": "string", "maxLength": 4}},
            },
        },
    },
]


def test_tool_parameters_with_ref_and_defs_keep_their_meaning_in_a_forced_call():
    """Each function's `$defs` and `#`-pointers are rebased under the call schema, so the
    forced-call grammar compiles and takes exactly the calls the parameters describe (two
    functions whose `$defs` share a name included; enum data is left alone)."""
    from tests.verifier.test_grammar import byte_compiler

    eng = ScriptEngine([CALL])
    chat(client(eng), tools=REF_TOOLS, tool_choice="required")
    schema = eng.calls[-1][2].grammar.schema
    assert json.loads(schema)["$defs"]["fn_label"]["properties"]["tag"] == {"enum": [{"$ref": "#/x"}]}
    g = byte_compiler().compile("json_schema", schema)

    def takes(text: str) -> bool:
        toks = list(text.encode())
        return g.valid_prefix(toks) == len(toks)

    assert takes('{"name":"place","arguments":{"at":{"x":1,"y":2},"next":{"x":3,"y":4}}}')
    assert takes('{"name":"label","arguments":{"text":"abcd"}}')
    assert not takes('{"name":"place","arguments":{"at":"abcd"')  # place's point is an object
    assert not takes('{"name":"label","arguments":{"text":{')  # label's point is a string
    assert not takes('{"name":"place","arguments":{"at":{"x":1,"z"')


THOUGHT = "<think>\nThe user greets me; 2 < 3.\n</think>\n\nHello there!"


def test_reasoning_is_split_out_whole_and_streamed_at_every_cut():
    """`reasoning_content` beside `content` (qwen3 format), the same whichever way the engine's
    deltas cut the reply (a drafted block crossing the end tag, the tag in pieces)."""
    for cut in range(1, len(THOUGHT)):
        eng = ScriptEngine([THOUGHT[:cut], THOUGHT[cut:]])
        c = client(eng, reasoning_parser="qwen3")
        msg = chat(c).json()["choices"][0]["message"]
        assert (
            msg["reasoning_content"] == "\nThe user greets me; 2 < 3.\n" and msg["content"] == "Hello there!"
        )
        deltas = [ch["delta"] for x in sse(chat(c, stream=True)) for ch in x["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"], cut
        assert "".join(d.get("content") or "" for d in deltas) == "Hello there!", cut
    plain = chat(client(ScriptEngine([THOUGHT]), reasoning_parser="none")).json()["choices"][0]["message"]
    assert plain["content"] == THOUGHT and "reasoning_content" not in plain


def test_reasoning_then_a_tool_call():
    eng = ScriptEngine(
        [
            "<think>I need the weather.</think>\n",
            '<tool_call>\n{"name": "get_weather", ',
            '"arguments": {"a": 1}}\n</tool_call>',
        ]
    )
    c = client(eng, reasoning_parser="qwen3", tool_call_parser="hermes")
    msg = chat(c, tools=TOOLS).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "I need the weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    deltas = [ch["delta"] for x in sse(chat(c, tools=TOOLS, stream=True)) for ch in x["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I need the weather."
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or [] if "id" in t] == [
        "get_weather"
    ]


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused():
    eng = ScriptEngine()
    seen = []
    real = eng.tokenize_chat

    def tokenize_chat(messages, tools=None, template=None, template_kwargs=None):
        seen.append(template_kwargs)
        return real(messages, tools, template, template_kwargs)

    eng.tokenize_chat = tokenize_chat
    c = client(eng)
    assert chat(c, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert seen[-1] == {"enable_thinking": False}
    assert_error(chat(c, chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs")
