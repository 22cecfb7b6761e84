"""The HTTP layer alone, over a fake engine: error shapes, auth, health while loading, and that
the server side never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from dspark_serve.scheduler.client import (
    ChatTemplate,
    EngineError,
    GenerationParams,
    RuntimeInfo,
    StreamDelta,
    TokenRecord,
)
from dspark_serve.server.app import build_app
from dspark_serve.server.config import ServerConfig
from tests.server.bad_inputs import BAD_INPUTS, assert_refused


class FakeEngine:
    model_name = "fake-model"
    max_model_len = 64

    def __init__(self, ready=True):
        self._ready = ready
        self.aborted: list[str] = []
        self.last_params: GenerationParams | None = None

    @property
    def ready(self):
        return self._ready

    load_error = None
    runtime_info = RuntimeInfo(
        dtype="bfloat16", dtype_reason="auto: test", device="cpu", drafter="none", verify_policy="none"
    )

    def chat_template(self):
        return ChatTemplate(None, None, {})

    def tokenize_chat(self, messages, tools=None, template=None, template_kwargs=None):
        return [1] * sum(len(m["content"]) for m in messages)

    def tokenize(self, text):
        return [1] * len(text)

    async def generate(self, request_id, prompt_ids, params):
        self.last_params = params
        if params.max_tokens == 13:
            raise EngineError("the server is at capacity; retry later", 429)
        words = ["Hel", "lo", " wor", "ld"]
        kinds = [("plain", None), ("draft", 0), ("draft", 1), ("bonus", None)]
        for i, w in enumerate(words):
            last = i == len(words) - 1
            yield StreamDelta(
                w,
                [i],
                last,
                "stop" if last else None,
                len(prompt_ids),
                i + 1,
                tokens=[TokenRecord(i, w, *kinds[i])],
            )

    def abort(self, request_id):
        self.aborted.append(request_id)


def client(engine=None, **cfg):
    app = build_app(engine or FakeEngine(), ServerConfig(**cfg), CollectorRegistry())
    return TestClient(app)


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(c, headers=None, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return c.post("/v1/chat/completions", json=body, headers=headers or {})


def test_chat_non_streaming_and_streaming():
    c = client()
    r = chat(c, model="fake-model", max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    with c.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 5,
            "stream_options": {"include_usage": True},
        },
    ) as s:
        lines = [l for l in s.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines)
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


class LineBreakingEngine(FakeEngine):
    """Writes the characters JSON leaves raw that ``splitlines``-style readers break lines at."""

    async def generate(self, request_id, prompt_ids, params):
        words = ["a\u2028b", "\x85", "c\u2029 é\n", "end"]
        for i, w in enumerate(words):
            last = i == len(words) - 1
            yield StreamDelta(w, [i], last, "stop" if last else None, len(prompt_ids), i + 1)


def test_a_streamed_event_stays_one_line_whatever_text_the_model_writes():
    import json

    with client(LineBreakingEngine()).stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True}
    ) as s:
        raw = s.read().decode()
    # httpx's iter_lines and str.splitlines both break at U+0085/U+2028/U+2029; every event
    # must still come out as one "data:" line that parses.
    lines = [line for line in raw.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text == "a\u2028b\x85c\u2029 é\nend"
    assert "é" in raw  # non-ASCII text is not escaped wholesale


def test_errors_have_openai_shape_and_right_status():
    c = client()
    r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_error(chat(c, temperature=3.5), 400, "temperature")
    assert_error(chat(c, top_p=0), 400, "top_p")
    assert_error(chat(c, max_tokens=0), 400, "max_tokens")
    assert_error(chat(c, n=17), 400, "n")
    assert_error(chat(c, messages=[]), 400, "messages")
    assert_error(chat(c, model="gpt-17"), 404, "model")
    err = assert_error(
        chat(c, messages=[{"role": "user", "content": "x" * 60}], max_tokens=10), 400, "max_tokens"
    )
    assert "64" in err["message"] and "70" in err["message"]
    assert_error(chat(c, max_tokens=13), 429)
    assert_error(c.post("/v1/completions", json={"prompt": ""}), 400, "prompt")


def test_max_completion_tokens_and_stop_are_passed_through():
    eng = FakeEngine()
    c = client(eng)
    chat(c, max_completion_tokens=7, stop="END", top_k=5, seed=3)
    p = eng.last_params
    assert (p.max_tokens, p.stop, p.top_k, p.seed) == (7, ("END",), 5, 3)
    chat(c, stop=["a", "b"])
    assert eng.last_params.stop == ("a", "b")


def test_api_key():
    c = client(api_key="sekret")
    assert_error(chat(c), 401)
    assert_error(chat(c, headers={"Authorization": "Bearer wrong"}), 401)
    assert chat(c, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.get("/health").status_code == 200  # health and metrics stay open
    assert c.get("/metrics").status_code == 200


def test_health_is_503_while_loading():
    eng = FakeEngine(ready=False)
    c = client(eng)
    assert_error(c.get("/health"), 503)
    assert_error(chat(c), 503)
    eng._ready = True
    assert c.get("/health").status_code == 200
    models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["runtime"]["dtype"] == "bfloat16"
    assert models["data"][0]["runtime"]["dtype_reason"] == "auto: test"


def test_server_package_never_imports_torch():
    code = (
        "import sys, server.app, server.cli, server.protocol, server.config; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- issue: no request can hurt another (validation at the edge) ------------------------------


class VocabEngine(FakeEngine):
    vocab_size = 100
    loading_stage = None
    draining = False


def test_strict_types_no_coercion():
    c = client()
    assert_error(chat(c, max_tokens="10"), 400, "max_tokens")
    assert_error(chat(c, stream="true"), 400, "stream")
    assert_error(chat(c, temperature="0.5"), 400, "temperature")
    assert_error(chat(c, seed=1.5), 400, "seed")
    assert_error(c.post("/v1/completions", json={"prompt": [1, "2"]}), 400)
    assert chat(c, temperature=1).status_code == 200  # an int is a valid float


def test_seed_range():
    eng = FakeEngine()
    c = client(eng)
    assert_error(chat(c, seed=2**64), 400, "seed")
    assert_error(chat(c, seed=-(2**63) - 1), 400, "seed")
    assert chat(c, seed=2**64 - 1).status_code == 200 and eng.last_params.seed == 2**64 - 1


def test_prompt_token_ids_range_checked():
    eng = VocabEngine()
    c = client(eng)
    for bad in ([-1], [100], [5, 10**12]):
        err = assert_error(c.post("/v1/completions", json={"prompt": bad, "max_tokens": 4}), 400, "prompt")
        assert "out of range" in err["message"]
    assert c.post("/v1/completions", json={"prompt": [0, 99], "max_tokens": 4}).status_code == 200


def test_unsupported_parameters_are_named():
    c = client()
    for key, value in (
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "x"}),
        ("prediction", {"type": "content", "content": "x"}),
    ):
        err = assert_error(chat(c, **{key: value}), 400, key)
        assert key in err["message"]
    # supported now, but malformed values are named
    for key, value in (
        ("response_format", {"type": "xml"}),
        ("tools", [{"type": "function"}]),
        ("tool_choice", "auto"),  # without tools
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"5": 101}),
        ("top_logprobs", 2),  # without logprobs: true
        ("top_logprobs", 21),
        ("parallel_tool_calls", 1),
    ):
        err = assert_error(chat(c, **{key: value}), 400)
        assert err["param"].split(".")[0] == key, (key, err)
    for key, value in (("echo", True), ("suffix", "x"), ("best_of", 3), ("tools", [])):
        assert_error(c.post("/v1/completions", json={"prompt": "hi", key: value}), 400, key)
    err = assert_error(chat(c, frobnicate=1), 400, "frobnicate")
    assert "Unrecognized" in err["message"]
    # neutral values and parameters that do not change generation are fine
    assert (
        chat(
            c,
            response_format={"type": "text"},
            tools=[],
            logit_bias=None,
            store=False,
            metadata={"a": "b"},
            user="u",
        ).status_code
        == 200
    )


def test_image_content_part_gets_a_readable_error():
    c = client()
    err = assert_error(
        chat(
            c,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ],
        ),
        400,
    )
    assert err["param"] == "messages.0.content.1" and "image_url" in err["message"]


def test_completions_max_tokens_null_is_16():
    eng = FakeEngine()
    c = client(eng)
    assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": None}).status_code == 200
    assert eng.last_params.max_tokens == 16
    c.post("/v1/completions", json={"prompt": "hi"})
    assert eng.last_params.max_tokens == 16


def test_body_limit_and_json_depth():
    c = client(max_body_bytes=2048, max_json_depth=8)
    err = assert_error(
        c.post("/v1/chat/completions", content=b"x" * 5000, headers={"content-type": "application/json"}), 413
    )
    assert "2048" in err["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(5):
            yield b"x" * 1000

    assert_error(
        c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}), 413
    )
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 9 + b"]" * 9 + b"}"
    assert_error(
        c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"}), 400
    )
    very_deep = b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert_error(
        client(max_json_depth=8).post(
            "/v1/chat/completions", content=very_deep, headers={"content-type": "application/json"}
        ),
        400,
    )
    assert c.get("/health").status_code == 200


def test_http_details_allow_retry_after_auth_headers():
    r = client().get("/v1/chat/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    r = chat(client(), max_tokens=13)
    assert_error(r, 429)
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    c = client(api_key="sekret")
    r = chat(c)
    assert_error(r, 401)
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert chat(c, headers={"Authorization": "bearer sekret"}).status_code == 200
    assert chat(c, headers={"Authorization": "BEARER sekret"}).status_code == 200
    assert_error(chat(c, headers={"Authorization": "Basic sekret"}), 401)


def test_errors_are_counted_in_metrics():
    c = client()
    chat(c, max_tokens=13)
    chat(c, max_tokens=13)
    chat(c, n=50)
    text = c.get("/metrics").text
    assert 'dspark:http_errors_total{status="429"} 2.0' in text
    assert 'dspark:http_errors_total{status="400"} 1.0' in text
    assert 'dspark:http_errors_total{status="413"} 0.0' in text


def test_model_by_id():
    c = client()
    assert c.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert_error(c.get("/v1/models/other"), 404, "model")


def test_openapi_documents_bodies_errors_and_metrics():
    doc = client().get("/openapi.json").json()
    for path, schema in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(schema) and schema in doc["components"]["schemas"]
        for status in ("400", "413", "429", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "ErrorResponse"
            )
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "/v1/models/{model_id}" in doc["paths"]


def test_health_shows_what_is_loading_and_draining():
    eng = VocabEngine(ready=False)
    eng.loading_stage = "measuring the cost table"
    c = client(eng)
    err = assert_error(c.get("/health"), 503)
    assert "measuring the cost table" in err["message"]
    eng._ready, eng.draining = True, True
    assert assert_error(c.get("/health"), 503)["code"] == "draining"
    assert_error(chat(c), 503)


def test_api_key_from_environment_or_file(tmp_path):
    from dspark_serve.server.cli import resolve_api_key

    cfg = ServerConfig()
    assert resolve_api_key(cfg, {}).api_key is None
    assert resolve_api_key(cfg, {"DSPARK_API_KEY": "from-env"}).api_key == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_api_key(ServerConfig(api_key_file=str(f)), {"DSPARK_API_KEY": "x"}).api_key == "from-file"
    with pytest.raises(ValueError, match="nope"):
        resolve_api_key(ServerConfig(api_key_file=str(tmp_path / "nope")), {})
    with pytest.raises(ValueError, match="30000"):
        ServerConfig(shutdown_timeout=30000)
    with pytest.raises(ValueError, match="12"):
        ServerConfig(max_body_bytes=12)


PROVENANCE = [
    {"id": 0, "text": "Hel", "kind": "plain", "position": None},
    {"id": 1, "text": "lo", "kind": "draft", "position": 0},
    {"id": 2, "text": " wor", "kind": "draft", "position": 1},
    {"id": 3, "text": "ld", "kind": "bonus", "position": None},
]


def test_provenance_is_opt_in_and_namespaced():
    import json

    c = client()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert "dspark" not in chat(c, **{k: v for k, v in body.items() if k != "messages"}).json()
    r = c.post("/v1/chat/completions", json={**body, "dspark": {"provenance": True}})
    assert r.json()["dspark"] == {"tokens": PROVENANCE}
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    for opt, want in (({}, []), ({"dspark": {"provenance": True}}, PROVENANCE)):
        with c.stream("POST", "/v1/chat/completions", json={**body, **opt, "stream": True}) as s:
            chunks = [json.loads(l[6:]) for l in s.iter_lines() if l and l != "data: [DONE]"]
        got = [t for ch in chunks for t in ch.get("dspark", {}).get("tokens", [])]
        assert got == want
        for ch in chunks:  # each chunk's tokens carry exactly that chunk's text
            if "dspark" in ch:
                assert (
                    "".join(t["text"] for t in ch["dspark"]["tokens"]) == ch["choices"][0]["delta"]["content"]
                )
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "dspark": {"provenance": True}})
    assert r.json()["dspark"]["tokens"] == PROVENANCE
    assert_error(
        c.post("/v1/chat/completions", json={**body, "dspark": {"provenence": True}}),
        400,
        "dspark.provenence",
    )


def test_live_page_is_served_self_contained():
    c = client(api_key="k3y")  # the page itself needs no key; it asks for one
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for needle in (
        'id="prompt"',
        'id="output"',
        'id="g-running"',
        'id="g-kv"',
        'id="cost-chart"',
        "dspark: {provenance: true}",
        "/metrics",
        "sessionStorage",
    ):
        assert needle in page, needle
    # no build step, no CDN: nothing is loaded from another origin
    import re

    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script src" not in page and "@import" not in page


@pytest.mark.parametrize("bad", [b for b in BAD_INPUTS if not b.needs_engine], ids=lambda b: b.kind)
def test_inputs_that_once_answered_500_are_refused_by_name(bad):
    class Engine(FakeEngine):
        vocab_size = 1000

    c = TestClient(build_app(Engine(), ServerConfig(), CollectorRegistry()), raise_server_exceptions=False)
    resp = c.post(bad.path, content=bad.raw, headers={"content-type": "application/json"})
    assert_refused(resp, bad)
