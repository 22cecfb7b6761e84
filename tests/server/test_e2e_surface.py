"""The OpenAI surface under speculation, end to end on the embedded SmolLM2-135M-Instruct
(float32) over real HTTP with the official `openai` client: logprobs, penalties, n,
structured output and tools, against plain decoding and a direct forward of the target."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dspark_serve.drafter.config import DrafterConfig
from dspark_serve.scheduler.builder import build_engine
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.verifier.config import ModelConfig
from tests.server.test_e2e import MAX_LEN, MODEL, LiveServer

pytestmark = pytest.mark.slow


def server(drafter: str, policy: str) -> LiveServer:
    def build(metrics):
        return build_engine(
            ModelConfig(max_model_len=MAX_LEN, kv_cache_tokens=16384, dtype="float32"),
            DrafterConfig(drafter=drafter),
            SchedulerConfig(max_num_seqs=8, max_waiting=64, verify_policy=policy),
            metrics=metrics,
            profile=False,
        )

    return LiveServer(build=build)


@pytest.fixture(scope="module")
def spec():
    s = server("dspark+ngram", "static:7")  # the shipped DSpark drafter (block 7) and prompt lookup
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain():
    s = server("none", "none")
    yield s
    s.close()


MSG = [{"role": "user", "content": "Write a short poem about the sea."}]


REPEAT = [{"role": "user", "content": "Count from 1 to 40, separated by commas."}]


def test_logprobs_equal_plain_decoding_and_a_direct_forward(spec, plain):
    # repeated text: prompt lookup drafts whole blocks that pass (bonus tokens) and others fail
    kw = dict(model=MODEL, messages=REPEAT, max_tokens=60, temperature=0, logprobs=True, top_logprobs=5)
    s = spec.client().chat.completions.create(**kw, extra_body={"dspark": {"provenance": True}})
    p = plain.client().chat.completions.create(**kw)
    sc, pc = s.choices[0].logprobs.content, p.choices[0].logprobs.content
    assert s.choices[0].message.content == p.choices[0].message.content
    assert [x.token for x in sc] == [x.token for x in pc] and len(sc) == s.usage.completion_tokens
    kinds = [t["kind"] for t in s.model_extra["dspark"]["tokens"]]
    assert {"draft", "bonus"} <= set(kinds) and "correction" in kinds, kinds
    ids = [t["id"] for t in s.model_extra["dspark"]["tokens"]]
    eng = spec.engine.bundle.engine
    prompt = spec.engine.tokenize_chat(REPEAT)
    with torch.no_grad():
        logits = eng.runner.model(torch.tensor([prompt + ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    for j, (a, b) in enumerate(zip(sc, pc)):
        assert abs(a.logprob - b.logprob) < 1e-3, (j, kinds[j])
        assert abs(a.logprob - ref[j, ids[j]].item()) < 1e-3, (j, kinds[j])
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert len(a.top_logprobs) == 5
    streamed = [
        x.logprob
        for ch in spec.client().chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.content
    ]
    assert len(streamed) == len(sc) and max(abs(a - b.logprob) for a, b in zip(streamed, sc)) < 1e-3
    comp = spec.client().completions.create(
        model=MODEL, prompt="The sea is", max_tokens=8, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens


def test_greedy_penalties_equal_plain_decoding(spec, plain):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat the word sea ten times."}],
        max_tokens=40,
        temperature=0,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        logit_bias={"1": -100},
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05},
    )
    a = spec.client().chat.completions.create(**kw)
    b = plain.client().chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    unpenalised = plain.client().chat.completions.create(
        model=MODEL, messages=kw["messages"], max_tokens=40, temperature=0
    )
    assert unpenalised.choices[0].message.content != b.choices[0].message.content
    assert a.usage.model_extra["spec_decode"]["draft_tokens"] > 0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_twenty_schema_constrained_requests_under_static_7_all_validate(spec):
    """Twenty at once (the engine batches them, eight at a time), greedy and sampled."""
    from concurrent.futures import ThreadPoolExecutor

    c = spec.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i: int):
        return c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}],
            max_tokens=120,
            temperature=0 if i % 2 == 0 else 0.8,
            seed=i,
            response_format=fmt,
        )

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, range(20)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true, "n": 3}.'}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_required_tool_call_returns_parseable_arguments(spec):
    c = spec.client()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=80,
        temperature=0,
        tools=[WEATHER],
        tool_choice="required",
    )
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(
        call.function.arguments
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]


NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note about a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "note": {"type": "string", "minLength": 40, "maxLength": 60},
            },
            "required": ["city", "note"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_call_streams_its_arguments_step_by_step_and_equals_plain_decoding(spec, plain):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Save a note about Paris."}],
        max_tokens=120,
        temperature=0,
        tools=[NOTE],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    call = spec.client().chat.completions.create(**kw).choices[0].message.tool_calls[0]
    assert call == plain.client().chat.completions.create(**kw).choices[0].message.tool_calls[0].model_copy(
        update={"id": call.id}
    )  # greedy under speculation and grammar equals plain decoding's
    assert len(json.loads(call.function.arguments)["note"]) >= 40
    chunks = list(spec.client().chat.completions.create(**kw, stream=True))
    parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    args = [p.function.arguments for p in parts[1:] if p.function.arguments]
    assert len(args) >= 3 and "".join(args) == call.function.arguments  # as generated, not at the end


def test_a_tool_conversation_call_result_answer(spec):
    c = spec.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 24 degrees."},
    ]
    second = c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0
    )
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    alone = c.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1).usage.prompt_tokens
    # the second prompt holds the call as the model wrote it and the result after the question
    assert second.usage.prompt_tokens > alone + first.usage.completion_tokens + 5


def test_the_responses_api_on_the_embedded_model(spec):
    """The official client's `responses.create`, whole and streamed, and a function tool round
    trip (a forced call, its output, the answer), on the embedded model under speculation."""
    c = spec.client()
    r = c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=20, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens > 0
    events = list(
        c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=20, temperature=0, stream=True)
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    tool = {"type": "function", **WEATHER["function"]}
    first = c.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    second = c.responses.create(
        model=MODEL,
        tools=[tool],
        temperature=0,
        max_output_tokens=30,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."},
        ],
    )
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def test_n_three_returns_three_choices_and_usage_counts_all(spec):
    r = spec.client().chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=16, temperature=1.0, seed=3, n=3, logprobs=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # independent samples
    assert spec.idle()
