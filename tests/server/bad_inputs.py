"""Inputs that once answered 500 or hurt other requests, as one table the tests iterate: each is
sent raw (lone surrogates and 5,000-digit literals cannot be written as Python JSON values)
and must be answered 4xx with an OpenAI-shaped error naming the parameter."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.verifier.test_grammar_check import RECURSIVE, SLOW

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = '[{"role": "user", "content": "hi"}]'
HUGE = "9" * 5000


@dataclass(frozen=True)
class BadInput:
    kind: str
    path: str
    body: str  # raw JSON text (may hold "\\ud800" escapes and long literals)
    param: str | None
    status: int = 400
    needs_engine: bool = False  # only a real engine can refuse it (grammar compilation)

    @property
    def raw(self) -> bytes:
        return self.body.encode("utf-8")


def _chat(extra: str) -> str:
    return '{"messages": ' + MESSAGES + ', "max_tokens": 4, ' + extra + "}"


def _schema(schema: dict) -> str:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return _chat('"response_format": ' + json.dumps(rf))


BAD_INPUTS = [
    BadInput("lone surrogate as model", CHAT, _chat('"model": "\\ud800"'), "model"),
    BadInput("lone surrogate as a parameter's name", CHAT, _chat('"\\ud800": 1'), None),
    BadInput(
        "lone surrogate as a content part's type",
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "\\ud800", "text": "x"}]}]}',
        "messages.0.content.0.type",
    ),
    BadInput("lone surrogate in a prompt", COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    BadInput("lone surrogate in a stop string", CHAT, _chat('"stop": ["\\udfff"]'), "stop.0"),
    BadInput("5,000-digit max_tokens", CHAT, _chat(f'"max_tokens": {HUGE}'), "max_tokens"),
    BadInput("5,000-digit seed", CHAT, _chat(f'"seed": -{HUGE}'), "seed"),
    BadInput("5,000-digit logit_bias key", CHAT, _chat('"logit_bias": {"' + HUGE + '": 1}'), "logit_bias"),
    BadInput("logit_bias key ²", CHAT, _chat('"logit_bias": {"\u00b2": 1}'), "logit_bias"),
    BadInput(
        "logit_bias key in Arabic digits", CHAT, _chat('"logit_bias": {"\u0661\u0662": 1}'), "logit_bias"
    ),
    BadInput(
        "logit_bias key past the vocabulary", CHAT, _chat('"logit_bias": {"4000000000": 1}'), "logit_bias"
    ),
    BadInput("repetition_penalty 1e-300", CHAT, _chat('"repetition_penalty": 1e-300'), "repetition_penalty"),
    BadInput("dspark.provenance 0", CHAT, _chat('"dspark": {"provenance": 0}'), "dspark.provenance"),
    BadInput("self-requiring schema", CHAT, _schema(RECURSIVE), "response_format", needs_engine=True),
    BadInput("regex a million long", CHAT, _schema(SLOW), "response_format", needs_engine=True),
]


def assert_refused(resp, bad: BadInput) -> None:
    assert resp.status_code == bad.status, (bad.kind, resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, (bad.kind, err)
    assert err["type"] == "invalid_request_error" and err["message"], (bad.kind, err)
    assert err["param"] == bad.param, (bad.kind, err)
    assert len(err["message"]) < 400, (bad.kind, err)  # never the whole offending input echoed
