"""The HTTP layer alone, over a fake engine: error shapes, auth, health while loading, and that
the server side never imports torch."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from scheduler.client import EngineError, GenerationParams, RuntimeInfo, StreamDelta, TokenRecord
from server.app import build_app
from server.config import ServerConfig


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
    runtime_info = RuntimeInfo(dtype="bfloat16", dtype_reason="auto: test", device="cpu",
                               drafter="none", verify_policy="none")

    def tokenize_chat(self, messages):
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
            yield StreamDelta(w, [i], last, "stop" if last else None, len(prompt_ids), i + 1,
                              tokens=[TokenRecord(i, w, *kinds[i])])

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
    with c.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}}) as s:
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


def test_errors_have_openai_shape_and_right_status():
    c = client()
    r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_error(chat(c, temperature=3.5), 400, "temperature")
    assert_error(chat(c, top_p=0), 400, "top_p")
    assert_error(chat(c, max_tokens=0), 400, "max_tokens")
    assert_error(chat(c, n=2), 400, "n")
    assert_error(chat(c, messages=[]), 400, "messages")
    assert_error(chat(c, model="gpt-17"), 404, "model")
    err = assert_error(chat(c, messages=[{"role": "user", "content": "x" * 60}], max_tokens=10),
                       400, "max_tokens")
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
    assert c.get("/health").status_code == 200      # health and metrics stay open
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
    code = ("import sys, server.app, server.cli, server.protocol, server.config; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


PROVENANCE = [{"id": 0, "text": "Hel", "kind": "plain", "position": None},
              {"id": 1, "text": "lo", "kind": "draft", "position": 0},
              {"id": 2, "text": " wor", "kind": "draft", "position": 1},
              {"id": 3, "text": "ld", "kind": "bonus", "position": None}]


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
                assert "".join(t["text"] for t in ch["dspark"]["tokens"]) == ch["choices"][0]["delta"]["content"]
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "dspark": {"provenance": True}})
    assert r.json()["dspark"]["tokens"] == PROVENANCE
    assert_error(c.post("/v1/chat/completions", json={**body, "dspark": {"provenence": True}}), 400,
                 "dspark.provenence")


def test_live_page_is_served_self_contained():
    c = client(api_key="k3y")  # the page itself needs no key; it asks for one
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for needle in ('id="prompt"', 'id="output"', 'id="g-running"', 'id="g-kv"', 'id="cost-chart"',
                   "dspark: {provenance: true}", "/metrics", "sessionStorage"):
        assert needle in page, needle
    # no build step, no CDN: nothing is loaded from another origin
    import re
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script src" not in page and "@import" not in page
