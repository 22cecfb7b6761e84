"""No request can hurt another, over real HTTP on the embedded model (float32, greedy): eight
streams run while one malicious request of each kind arrives (tests/server/bad_inputs.py and
the older kinds here), and finish with the text they get without them; a non-streaming request
whose client goes away frees its KV within one step; /health is
answered while a 10 MB body is being refused and while a big prompt is tokenized."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.bad_inputs import BAD_INPUTS, assert_refused
from tests.server.test_e2e import MODEL, LiveServer

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it


@pytest.fixture(scope="module")
def plain():
    s = LiveServer(drafter="none", verify_policy="none")
    yield s
    s.close()


PROMPTS = [
    "List the days of the week, one per line.",
    "Count from one to ten in words.",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Give two uses of a paperclip.",
    "Spell the word banana backwards.",
    "Name a fruit that is yellow.",
]


def chat_body(text, **kw):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 48,
        "temperature": 0,
        **kw,
    }


def stream_text(url, body, out, key):
    parts, finish = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                for ch in ev["choices"]:
                    parts.append(ch["delta"].get("content") or "")
                    finish = ch["finish_reason"] or finish
                if len(parts) == 3:
                    out.setdefault("started", []).append(time.monotonic())
    out[key] = ("".join(parts), finish, time.monotonic())


def malicious(url: str) -> list[tuple[str, int]]:
    """One request of each kind that used to hurt others; returns (kind, status)."""
    got = []
    with httpx.Client(base_url=url, timeout=60) as c:

        def post(kind, path="/v1/completions", **kw):
            got.append((kind, c.post(path, **kw).status_code))

        post("token id -1", json={"prompt": [-1], "max_tokens": 4})
        post("token id >= vocab", json={"prompt": [1, 10**9], "max_tokens": 4})
        post("seed 2**64", json={"prompt": "hi", "max_tokens": 4, "seed": 2**64})
        post(
            "deep JSON",
            content=b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}",
            headers={"content-type": "application/json"},
        )
        post("10 MB body", content=b"x" * (10 * 2**20), headers={"content-type": "application/json"})
        post(
            "unsupported parameter",
            path="/v1/chat/completions",
            json={**chat_body("hi"), "functions": [{"name": "f"}]},
        )
        post("string max_tokens", json={"prompt": "hi", "max_tokens": "10"})
        post(
            "image part",
            path="/v1/chat/completions",
            json={
                **chat_body("x"),
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
        )
        post("huge top_k", json={"prompt": "hi", "max_tokens": 4, "top_k": 10**30})
        for bad in BAD_INPUTS:
            resp = c.post(bad.path, content=bad.raw, headers={"content-type": "application/json"})
            assert_refused(resp, bad)
            got.append((bad.kind, resp.status_code))
        post(
            "schema that does not compile",
            json={
                "prompt": "hi",
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 7}},
                },
            },
        )
        try:  # a client that goes away mid-request (non-streaming)
            c.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True}, timeout=0.5
            )
        except httpx.TimeoutException:
            got.append(("disconnect", 499))
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as s:
            next(s.iter_lines())  # a stream dropped after its first event
        got.append(("stream disconnect", 499))
    return got


def streams(url, with_attacks):
    """The eight prompts streamed together; with_attacks: every malicious kind sent while
    they run. Returns (per prompt (text, finish, end time), stream start times, attacks)."""
    out: dict = {}
    threads = [
        threading.Thread(target=stream_text, args=(url, chat_body(p), out, i)) for i, p in enumerate(PROMPTS)
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while len(out.get("started", [])) < len(PROMPTS) and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    attacks = malicious(url) if with_attacks else []
    for t in threads:
        t.join(timeout=300)
    return out, attacks


def test_eight_streams_survive_one_malicious_request_of_each_kind(plain):
    normal, _ = streams(plain.url, with_attacks=False)
    together, attacks = streams(plain.url, with_attacks=True)
    for kind, status in attacks:
        assert status < 500, (kind, status)
    assert dict(attacks)["10 MB body"] == 413
    assert all(s == 400 for k, s in attacks if k not in ("10 MB body", "disconnect", "stream disconnect"))
    for i in range(len(PROMPTS)):
        assert together[i][:2] == normal[i][:2], (PROMPTS[i], together[i], normal[i])
    # the streams really ran while the attacks came in
    assert min(together[i][2] for i in range(len(PROMPTS))) > min(together["started"])
    assert plain.idle()


def test_non_streaming_disconnect_frees_kv_within_one_step(plain):
    engine = plain.engine.bundle.engine
    steps = {"n": 0}
    real_step, real_abort, real_engine_abort = engine.step, plain.engine.abort, engine.abort
    seen: dict = {}

    def counting_step():
        steps["n"] += 1
        return real_step()

    def server_abort(rid):  # the HTTP side noticed the client is gone
        seen.setdefault("asked", (steps["n"], time.monotonic()))
        real_abort(rid)

    def engine_abort(rid):  # the engine thread frees the request
        out = real_engine_abort(rid)
        if out is not None:
            seen["freed"] = (steps["n"], engine.blocks.num_free_blocks)
        return out

    engine.step, engine.abort = counting_step, engine_abort
    plain.engine.abort = server_abort
    try:
        t_gone = None
        try:
            httpx.post(
                plain.url + "/v1/completions",
                json={"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True},
                timeout=2.0,
            )
        except httpx.TimeoutException:
            t_gone = time.monotonic()
        assert t_gone is not None, "the request should still have been running"
        assert plain.idle(timeout=10)
        assert "asked" in seen and "freed" in seen
        assert seen["asked"][1] - t_gone < 2.0  # noticed promptly
        assert seen["freed"][0] - seen["asked"][0] <= 1  # freed within one step
        assert seen["freed"][1] == engine.blocks.num_blocks
    finally:
        del engine.step, engine.abort
        del plain.engine.abort


def test_health_answers_while_a_big_body_is_refused_or_parsed(plain):
    url = plain.url
    done: dict = {}

    def big_slow_body():
        for _ in range(160):  # 10 MB in 64 KiB chunks, no Content-Length
            time.sleep(0.005)
            yield b"x" * 65536

    def send_big(kind, **kw):
        r = httpx.post(url + "/v1/completions", timeout=120, **kw)
        done[kind] = (r.status_code, time.monotonic())
        done[kind + "_code"] = r.json()["error"]["code"]

    big_prompt = json.dumps({"prompt": "word " * 700_000, "max_tokens": 4}).encode()  # 3.5 MB
    for kind, kw in (
        ("10MB", {"content": big_slow_body(), "headers": {"content-type": "application/json"}}),
        ("tokenize", {"content": big_prompt, "headers": {"content-type": "application/json"}}),
    ):
        t = threading.Thread(target=send_big, args=(kind,), kwargs=kw)
        t.start()
        answered = []
        with httpx.Client(base_url=url, timeout=30) as h:
            time.sleep(0.05)
            while t.is_alive() and len(answered) < 200:
                t0 = time.monotonic()
                assert h.get("/health").status_code == 200
                answered.append((t0, time.monotonic()))
                time.sleep(0.02)
        t.join()
        status, t_big = done[kind]
        assert status == (413 if kind == "10MB" else 400), (kind, status)
        if kind == "tokenize":  # refused from its length before the tokenizer sees it
            assert done["tokenize_code"] == "context_length_exceeded"
            continue
        # Requests sent well before the big one's answer (a quarter second: a /health answer
        # can take tens of milliseconds on two busy cores) must have ended before it; one that
        # waited for the big body would end after it.
        sent_before = [a for a in answered if a[0] < t_big - 0.25]
        assert sent_before, f"{kind}: no /health request went out while the big body was handled"
        assert all(end < t_big for _, end in sent_before), kind  # none waited for the big one
        assert max(end - start for start, end in sent_before) < 1.0, kind


def test_aborted_non_streaming_handler_is_released(plain):
    """An abort (client gone) ends the waiting handler too: nothing stays in flight."""
    try:
        httpx.post(
            plain.url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True},
            timeout=1.0,
        )
    except httpx.TimeoutException:
        pass
    assert plain.idle(timeout=10)
    t0 = time.monotonic()
    while plain.engine.in_flight and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert plain.engine.in_flight == 0
