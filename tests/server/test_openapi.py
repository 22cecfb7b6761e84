"""The OpenAPI document narrows the request models to what is accepted: the limits are the
request model's own, the token ids the engine's vocabulary."""

from __future__ import annotations

import re

from dspark_serve.server.openapi import below_pattern
from dspark_serve.server.protocol import MAX_CHOICES, MAX_STOPS, MAX_TOP_LOGPROBS
from tests.server.test_app import VocabEngine, client


def test_below_pattern_matches_exactly_the_ids_below_n():
    for n in (1, 2, 7, 10, 11, 100, 101, 150, 1000, 49152, 50257):
        pattern = re.compile(below_pattern(n))
        for x in {0, 1, n - 1, n, n + 1, 9, 10, 99, 100, 10 * n, n // 2}:
            assert bool(pattern.match(str(x))) == (x < n), (n, x)
        assert pattern.match("0" * 3 + str(n - 1)) and not pattern.match("-1")


def test_narrowed_schema_states_the_request_models_limits():
    doc = client(VocabEngine()).get("/openapi.json").json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == MAX_CHOICES
    assert chat["stop"]["anyOf"][1]["maxItems"] == MAX_STOPS
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == MAX_TOP_LOGPROBS
    assert completion["logprobs"]["anyOf"][0]["maximum"] == MAX_TOP_LOGPROBS
    assert completion["prompt"]["anyOf"][2]["items"]["maximum"] == VocabEngine.vocab_size - 1
    assert chat["model"]["anyOf"][0]["enum"] == ["fake-model"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == VocabEngine.max_model_len - 1
