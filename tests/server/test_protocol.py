"""The request models own every rule a request can break without the engine: each broken rule
is a RuleError naming the parameter, answered 400 with that parameter and message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dspark_serve.server.errors import validation_error
from dspark_serve.server.protocol import MAX_STOPS, ChatCompletionRequest, CompletionRequest, RuleError
from tests.server.test_app import FakeEngine, assert_error, chat, client

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}

CHAT_RULES = [
    ({"stop": [""]}, "stop", "stop must be up to 16 non-empty strings"),
    ({"stop": ["a"] * (MAX_STOPS + 1)}, "stop", "stop must be up to 16 non-empty strings"),
    ({"stop": ""}, "stop", "stop must be up to 16 non-empty strings"),
    (
        {"response_format": {"type": "json_schema"}},
        "response_format",
        "response_format json_schema needs json_schema.schema",
    ),
    (
        {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
        "response_format",
        "json_schema goes with response_format type json_schema",
    ),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [TOOL, TOOL], "tool_choice": "none"}, "tools", "tools must have distinct function names"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
        "tool_choice names an unknown function 'g'",
    ),
]


def _rule_of(schema, body) -> RuleError:
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    rule = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(rule, RuleError)
    err = validation_error(info.value)  # the 400 keeps the rule's parameter and message
    assert (err.status, err.param, err.message) == (400, rule.param, rule.message)
    return rule


@pytest.mark.parametrize(("extra", "param", "message"), CHAT_RULES)
def test_chat_rules_are_the_request_models(extra, param, message):
    rule = _rule_of(ChatCompletionRequest, {"messages": MESSAGES, **extra})
    assert (rule.param, rule.message) == (param, message)
    resp = chat(client(), **extra)
    assert assert_error(resp, 400, param)["message"] == message


@pytest.mark.parametrize("prompt", [["a", "b"], []])
def test_one_prompt_per_request(prompt):
    rule = _rule_of(CompletionRequest, {"prompt": prompt})
    assert (rule.param, rule.message) == ("prompt", "only one prompt per request is supported")


def test_prompt_forms():
    assert CompletionRequest.model_validate({"prompt": [3, 4]}).prompt_token_ids() == [3, 4]
    for prompt, text in (("hi", "hi"), (["hi"], "hi"), ([""], "")):
        req = CompletionRequest.model_validate({"prompt": prompt})
        assert req.prompt_token_ids() is None and req.prompt_text() == text


def test_valid_requests_pass_every_rule():
    ChatCompletionRequest.model_validate(
        {
            "messages": MESSAGES,
            "stop": ["a"] * MAX_STOPS,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        }
    )
    ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [], "tool_choice": "none"})


def test_a_request_that_breaks_a_rule_is_refused_before_the_engine_is_asked():
    """The request's own rules come before what depends on the engine (loading, the model name)."""
    assert_error(chat(client(FakeEngine(ready=False)), stop=[""]), 400, "stop")
    assert_error(chat(client(), model="other", top_logprobs=2), 400, "top_logprobs")
    assert_error(chat(client(), model="other"), 404, "model")
