"""The Responses API through the official `openai` client over the app (a scripted engine):
input items to the chat the engine sees, output items whole and as typed stream events,
function calls and their outputs, reasoning items, text.format, the stateless refusal."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from dspark_serve.scheduler.client import EngineError, StreamDelta
from dspark_serve.server.app import build_app
from dspark_serve.server.config import ServerConfig
from tests.server.test_openai_surface import ScriptEngine

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class RecordingEngine(ScriptEngine):
    """A scripted engine that keeps the messages each request was templated from."""

    def __init__(self, words):
        super().__init__(words)
        self.messages = []

    def tokenize_chat(self, messages, tools=None, template=None, template_kwargs=None):
        self.messages.append(messages)
        return super().tokenize_chat(messages, tools, template, template_kwargs)


def client_for(engine, **cfg) -> openai.OpenAI:
    app = build_app(engine, ServerConfig(**cfg), CollectorRegistry())
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=TestClient(app))


def test_text_whole_and_streamed():
    eng = RecordingEngine(["Hel", "lo ", "there"])
    c = client_for(eng)
    r = c.responses.create(model="fake-model", input="Hi!", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "Hello there"
    assert r.usage.output_tokens == 3 and r.output[0].type == "message"
    assert eng.messages[-1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    events = list(c.responses.create(model="fake-model", input="Hi!", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == "Hello there"


def test_a_function_call_round_trip():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    eng = RecordingEngine([call[:20], call[20:]])
    c = client_for(eng)
    r = c.responses.create(model="fake-model", input="Weather in Paris?", tools=[TOOL])
    (fc,) = [o for o in r.output if o.type == "function_call"]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id
    events = list(
        c.responses.create(model="fake-model", input="Weather in Paris?", tools=[TOOL], stream=True)
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    # the second turn: the call and its output go back to the model as the chat's tool turn
    eng.words = ["Sunny."]
    r2 = c.responses.create(
        model="fake-model",
        tools=[TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
            {"type": "function_call_output", "call_id": fc.call_id, "output": "24 C, sun"},
        ],
    )
    assert r2.output_text == "Sunny."
    msgs = eng.messages[-1]
    assert msgs[-1] == {"role": "tool", "content": "24 C, sun"}
    assert any('"get_weather"' in m["content"] for m in msgs if m["role"] == "assistant")  # the json format


def test_reasoning_comes_back_as_a_reasoning_item():
    eng = RecordingEngine(["<think>Two plus", " two.</think>\n\n", "4"])
    c = client_for(eng, reasoning_parser="qwen3")
    r = c.responses.create(model="fake-model", input="2+2?")
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "4"
    assert r.output[0].content[0].text == "Two plus two."
    events = list(c.responses.create(model="fake-model", input="2+2?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two plus two."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "4"


def test_text_format_becomes_the_grammar_and_state_is_refused():
    eng = RecordingEngine(['{"a": 1}'])
    c = client_for(eng)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c.responses.create(
        model="fake-model",
        input="JSON please",
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}},
        max_output_tokens=7,
    )
    params = eng.calls[-1][2]
    assert params.grammar.kind == "json_schema" and json.loads(params.grammar.schema) == schema
    assert params.max_tokens == 7
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="fake-model", input="again", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


class EndingEngine(ScriptEngine):
    """Streams its words, then ends the way a cut or failed request ends: `cut` a drain's final
    delta (finish_reason "abort", an error, the counts so far), `fail` an EngineError."""

    def __init__(self, words, end):
        super().__init__(words)
        self.end = end

    async def generate(self, request_id, prompt_ids, params):
        self.calls.append((request_id, prompt_ids, params))
        for i, w in enumerate(self.words):
            yield StreamDelta(w, [i], False, None, len(prompt_ids), i + 1)
        n = len(self.words)
        if self.end == "cut":
            yield StreamDelta("", [], True, "abort", len(prompt_ids), n, error="the server is shutting down")
        else:
            raise EngineError("the grammar could not be compiled", 400, "tools", "grammar_error")


def streamed(c, **kw):
    return list(c.responses.create(model="fake-model", input="Hi!", stream=True, **kw))


def test_a_stream_the_server_cuts_ends_incomplete_with_its_usage():
    events = streamed(client_for(EndingEngine(["Hel", "lo ", "the"], "cut")))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "server_shutdown"
    assert last.usage.output_tokens == 3 and last.usage.input_tokens > 0
    assert last.output[0].status == "incomplete" and last.output[0].content[0].text == "Hello the"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_stream_that_fails_midway_ends_with_an_error_and_response_failed():
    events = streamed(client_for(EndingEngine(["{", '"ci'], "fail")), tools=[TOOL], tool_choice="required")
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
    assert events[-2].code == "grammar_error" and "grammar" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "grammar_error"
    assert failed.usage.output_tokens == 2
    assert all(item.status == "incomplete" for item in failed.output)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_every_response_object_echoes_the_requests_own_parameters():
    c = client_for(ScriptEngine(["ok"]))
    kw = {
        "tools": [TOOL],
        "tool_choice": "required",
        "temperature": 0.3,
        "top_p": 0.9,
        "max_output_tokens": 50,
    }
    events = streamed(c, parallel_tool_calls=False, metadata={"k": "v"}, **kw)
    for response in (events[0].response, events[-1].response):
        assert response.tool_choice == "required" and response.temperature == 0.3 and response.top_p == 0.9
        assert response.max_output_tokens == 50 and response.parallel_tool_calls is False
        assert response.metadata == {"k": "v"}
        assert [t.name for t in response.tools] == ["get_weather"] and response.tools[0].parameters == TOOL[
            "parameters"
        ]
    named = c.responses.create(
        model="fake-model", input="Hi", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert named.tool_choice.name == "get_weather"
    plain = c.responses.create(model="fake-model", input="Hi")
    assert plain.tool_choice == "auto" and plain.temperature == 1.0 and plain.tools == []
