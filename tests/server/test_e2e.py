"""End to end on the embedded SmolLM2-135M-Instruct over real HTTP with the official `openai`
client: chat (plain and streamed), stop strings, usage, every error, disconnects, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from dspark_serve.drafter.config import DrafterConfig
from dspark_serve.scheduler.async_engine import AsyncEngine
from dspark_serve.scheduler.builder import build_engine
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.metrics import EngineMetrics
from dspark_serve.server.app import build_app
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.serve import uvicorn_config
from dspark_serve.verifier.config import ModelConfig

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(
        self,
        drafter="ngram",
        api_key=None,
        max_num_seqs=8,
        max_waiting=64,
        verify_policy="static:4",
        build=None,
        max_len=MAX_LEN,
        server_config=None,
    ):
        """build(metrics) -> EngineBundle replaces the embedded model (e.g. a tiny one)."""
        registry = CollectorRegistry()
        metrics = EngineMetrics(registry, MODEL)
        cfgs = (
            ModelConfig(max_model_len=MAX_LEN, kv_cache_tokens=16384, dtype="float32"),
            DrafterConfig(drafter=drafter, block_size=4 if drafter != "none" else None),
            # A static policy keeps seeded sampling reproducible across requests: n-gram
            # confidences are global state, so the load-aware policy's lengths (and hence
            # the random draws) depend on earlier requests.
            SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting, verify_policy=verify_policy),
        )
        make = (
            (lambda: build(metrics))
            if build
            else (lambda: build_engine(*cfgs, metrics=metrics, profile=False))
        )
        self.engine = AsyncEngine(make, MODEL, max_len)
        self.engine.start()
        assert self.engine.wait_ready(timeout=300), self.engine.load_error
        self.port = free_port()
        cfg = dataclasses.replace(
            server_config or ServerConfig(), port=self.port, api_key=api_key, log_level="warning"
        )
        app = build_app(self.engine, cfg, registry)
        self.server = uvicorn.Server(uvicorn_config(app, cfg))  # the guarded protocol, as served
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()

    def idle(self, timeout=30.0) -> bool:
        """All requests gone and every KV block back in the pool."""
        eng = self.engine.bundle.engine
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            b = eng.blocks
            if not eng.running and not eng.waiting and b.num_free_blocks == b.num_blocks:
                return True
            time.sleep(0.1)
        return False


def tiny_server(
    tokenizer, model, drafter, chat_template: str, policy: str = "static:3", **sched
) -> LiveServer:
    """A LiveServer on a tiny model behind `tokenizer` (float32), with `drafter` and a shipped
    chat template."""
    import torch

    from dspark_serve.scheduler.builder import EngineBundle
    from dspark_serve.scheduler.engine import Engine
    from dspark_serve.verifier.loader import DtypeChoice
    from tests.helpers import runner_for

    def build(metrics):
        engine = Engine(
            runner_for(model, num_blocks=256, block_size=16),
            tokenizer,
            SchedulerConfig(max_num_seqs=4, verify_policy=policy, **sched),
            max_model_len=1024,
            drafter=drafter,
            metrics=metrics,
        )
        return EngineBundle(engine, tokenizer, DtypeChoice(torch.float32, "test: tiny model"))

    return LiveServer(build=build, max_len=1024, server_config=ServerConfig(chat_template=chat_template))


@pytest.fixture(scope="module")
def live():
    s = LiveServer()
    yield s
    s.close()


MSG = [{"role": "user", "content": "List the days of the week, one per line."}]


def test_chat_non_streaming_matches_streaming_and_usage(live):
    c = live.client()
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and len(text) > 10
    assert r.usage.completion_tokens <= 40 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.usage.model_extra["spec_decode"]  # this request's own speculative stats
    assert spec["rounds"] >= 1 and spec["accepted_tokens"] <= spec["draft_tokens"]
    stream = c.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text  # greedy: same text both ways
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string_is_cut_exactly(live):
    c = live.client()
    full = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = c.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=40, temperature=0, stop=[stop, "never-appears"]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=40, temperature=0, stop=stop, stream=True
        )
        if ch.choices
    )
    assert streamed == text[: text.find(stop)]


def test_completions_and_models(live):
    c = live.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8


def test_seeded_sampling_is_reproducible(live):
    c = live.client()
    kw = dict(model=MODEL, messages=MSG, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_errors(live):
    c = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSG, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSG, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=MAX_LEN)
    msg = e.value.body["message"]
    assert str(MAX_LEN) in msg and str(MAX_LEN + int(msg.split("(")[1].split()[0])) in msg
    r = httpx.post(
        live.url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert live.idle()


def test_client_disconnect_aborts_and_frees_kv(live):
    with httpx.Client(base_url=live.url, timeout=30) as h:
        with h.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": MSG, "max_tokens": 600, "stream": True, "ignore_eos": True},
        ) as s:
            lines = s.iter_lines()
            for _ in range(4):
                next(lines)
            eng = live.engine.bundle.engine
            assert eng.running, "the request should still be running"
    assert live.idle(), "KV blocks leaked after a disconnect"


def test_metrics_prometheus_text(live):
    live.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=8)
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "dspark:num_requests_running",
        "dspark:num_requests_waiting",
        "dspark:kv_cache_usage_perc",
        "dspark:prompt_tokens_total",
        "dspark:generation_tokens_total",
        "dspark:time_to_first_token_seconds_bucket",
        "dspark:inter_token_latency_seconds_bucket",
        "dspark:e2e_request_latency_seconds_count",
        "dspark:spec_decode_num_drafts_total",
        "dspark:spec_decode_num_accepted_tokens_total",
        "dspark:spec_decode_acceptance_length_bucket",
        "dspark:spec_decode_verify_budget_bucket",
    ):
        assert name in text, name


def test_api_key_and_queue_full():
    s = LiveServer(drafter="none", api_key="k3y", max_num_seqs=1, max_waiting=1)
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        r = httpx.get(s.url + "/v1/models")  # no Authorization header at all
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        async def burst():
            async with httpx.AsyncClient(
                base_url=s.url, timeout=120, headers={"Authorization": "Bearer k3y"}
            ) as h:
                body = {"model": MODEL, "messages": MSG, "max_tokens": 16}
                return await asyncio.gather(*[h.post("/v1/chat/completions", json=body) for _ in range(6)])

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        assert s.idle()
    finally:
        s.close()


def test_streamed_provenance_with_the_official_client(live):
    msgs = [{"role": "user", "content": "Repeat this line four times: the cat sat on the mat."}]
    stream = live.client().chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=40,
        temperature=0,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"dspark": {"provenance": True}},
    )
    records, text, usage = [], "", None
    for ch in stream:
        ext = (ch.model_extra or {}).get("dspark")
        if ch.choices:
            content = ch.choices[0].delta.content or ""
            text += content
            if ext is not None:
                assert "".join(t["text"] for t in ext["tokens"]) == content
        if ext is not None:
            records += ext["tokens"]
        usage = ch.usage or usage
    assert len(records) == usage.completion_tokens
    kinds = {t["kind"] for t in records}
    assert records[0]["kind"] == "plain" and "draft" in kinds and len(kinds) >= 2, kinds
    for t in records:
        assert (t["position"] is not None) == (t["kind"] == "draft")
    assert "".join(t["text"] for t in records) == text
    plain = live.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True)
    assert all("dspark" not in (ch.model_extra or {}) for ch in plain)
