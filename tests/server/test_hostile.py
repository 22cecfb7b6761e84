"""Hostile load at the HTTP edge (small sizes, bounded loops, loopback only): work before
admission is bounded (a prompt that cannot fit is refused from its length before it is
tokenized; bodies are parsed and prompts tokenized a few at a time), and idle connections from
one address cannot lock other clients or the orchestrator's probes out. The Responses streams'
truthful endings are in test_responses.py, fair slots in tests/scheduler/test_fair_share.py,
and `bench/hostile.py` runs the attacks at full size against the embedded model."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from dspark_serve.server.app import build_app
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.serve import uvicorn_config
from dspark_serve.server.state import SMALL_WORK
from tests.server.test_app import FakeEngine, assert_error, chat, client
from tests.server.test_e2e import free_port


class CountingEngine(FakeEngine):
    """Tokenizes as FakeEngine (a token a character), counting the characters it was handed and
    the calls running at once; `hold` keeps each call of a long prompt until set."""

    max_chars_per_token = 4

    def __init__(self, hold: threading.Event | None = None):
        super().__init__()
        self.hold = hold
        self.chars_tokenized = 0
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def _count(self, chars: int) -> None:
        with self.lock:
            self.chars_tokenized += chars
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        if self.hold is not None and chars > SMALL_WORK:  # a long prompt is held until set
            self.hold.wait(10)
        with self.lock:
            self.running -= 1

    def tokenize_chat(self, messages, tools=None, template=None, template_kwargs=None):
        self._count(sum(len(m["content"]) for m in messages))
        return super().tokenize_chat(messages, tools, template, template_kwargs)

    def tokenize(self, text):
        self._count(len(text))
        return super().tokenize(text)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    eng = CountingEngine()  # 64 tokens of context, at most 4 characters a token
    c = client(eng)
    huge = "ab " * 200_000
    r = chat(c, messages=[{"role": "user", "content": huge}])
    assert_error(r, 400, "messages")
    assert r.json()["error"]["code"] == "context_length_exceeded" and "600000 characters" in r.text
    r = c.post("/v1/completions", json={"prompt": huge})
    assert_error(r, 400, "prompt")
    r = c.post("/v1/responses", json={"input": huge})
    assert_error(r, 400, "messages")
    assert eng.chars_tokenized == 0  # none of them reached the tokenizer
    # at the bound's edge a prompt is tokenized and refused by its tokens, as before
    edge = "x" * (2 * 4 * 64 - 1)
    assert_error(chat(c, messages=[{"role": "user", "content": edge}]), 400)
    assert eng.chars_tokenized == len(edge)
    assert chat(c).status_code == 200


def test_large_bodies_are_parsed_and_tokenized_a_few_at_a_time_small_ones_at_once():
    hold = threading.Event()
    eng = CountingEngine(hold)
    eng.max_model_len = 1_000_000  # long prompts fit: they are tokenized
    app = build_app(eng, ServerConfig(tokenize_concurrency=2), CollectorRegistry())
    long = {"messages": [{"role": "user", "content": "x" * (SMALL_WORK + 1)}], "max_tokens": 4}

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=long)) for _ in range(6)]
            await asyncio.sleep(0.5)
            running = eng.most_running
            small = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "hi"}), 5)
            hold.set()
            return running, small.status_code, [r.status_code for r in await asyncio.gather(*tasks)]

    running, small, statuses = asyncio.run(burst())
    assert running == 2  # the long ones two at a time
    assert small == 200  # a small request did not queue behind them (it was tokenized at once)
    assert eng.most_running == 3 and statuses == [200] * 6


@pytest.fixture(scope="module")
def guarded_server():
    cfg = ServerConfig(port=free_port(), max_connections=100, health_reserve=4, log_level="error")
    srv = uvicorn.Server(uvicorn_config(build_app(FakeEngine(), cfg, CollectorRegistry()), cfg))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    yield cfg
    srv.should_exit = True
    thread.join(timeout=10)


def test_idle_connections_from_one_address_lock_nobody_out(guarded_server):
    """Twice the server's connection cap of idle sockets from one address: the address is held
    to its share, and /health and another client's request are answered throughout."""
    cfg = guarded_server
    url = f"http://127.0.0.1:{cfg.port}"
    idle, refused = [], 0
    try:
        for _ in range(2 * cfg.max_connections):
            s = socket.create_connection(("127.0.0.1", cfg.port), timeout=5, source_address=("127.0.0.1", 0))
            idle.append(s)
        time.sleep(0.3)
        for s in idle:
            s.settimeout(0.01)
            try:
                refused += b"503" in s.recv(64)
            except TimeoutError:
                pass
        assert refused >= 2 * cfg.max_connections - cfg.max_client_connections
        other = httpx.Client(
            transport=httpx.HTTPTransport(local_address="127.0.0.2"), base_url=url, timeout=5
        )
        with other:
            assert other.get("/health").status_code == 200
            r = other.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
    finally:
        for s in idle:
            s.close()


def test_a_burst_of_connections_from_one_address_is_served(guarded_server):
    """Twice `max_client_pending` connections opened at once from one address, each then sending
    its request: none is refused (a connection counts as silent only after `pending_grace`)."""
    cfg = guarded_server
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    burst = [
        socket.create_connection(("127.0.0.1", cfg.port), timeout=5, source_address=("127.0.0.3", 0))
        for _ in range(2 * cfg.max_client_pending)
    ]
    try:
        for s in burst:
            s.sendall(head + body)
        answers = []
        for s in burst:
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            answers.append(got.split(b" ", 2)[1])
    finally:
        for s in burst:
            s.close()
    assert answers == [b"200"] * len(burst)


def test_large_bodies_are_received_a_few_at_a_time():
    """The guard reads bodies over the small size `tokenize_concurrency` at a time (the others
    wait in their sockets); a small body is read at once beside them."""
    from dspark_serve.server.guard import Guard

    reading = {"now": 0, "most": 0}
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"][:1])

    guard = Guard(app, ServerConfig(tokenize_concurrency=2), lambda status: None)

    def request(size: int):
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-length", str(size).encode())],
        }
        chunks = [b"x" * (size // 4)] * 3 + [b"x" * (size - 3 * (size // 4))]

        async def receive():
            if len(chunks) == 4:  # the first chunk: this body is being read
                reading["now"] += 1
                reading["most"] = max(reading["most"], reading["now"])
            await asyncio.sleep(0.01)
            chunk = chunks.pop(0)
            if not chunks:
                reading["now"] -= 1
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        return guard(scope, receive, None)

    async def burst():
        big = [asyncio.create_task(request(SMALL_WORK * 2)) for _ in range(6)]
        await asyncio.sleep(0.015)
        await asyncio.wait_for(request(100), 1)  # small: not behind the six
        small_done_with_big_pending = sum(not t.done() for t in big)
        await asyncio.gather(*big)
        return small_done_with_big_pending

    pending = asyncio.run(burst())
    assert reading["most"] == 3  # two large at a time, and the small one beside them
    assert pending >= 4 and len(seen) == 7


async def _recording_app(scope, receive, send):
    scope["seen"]["body"] = (await receive())["body"]


def _large_request(guard, size: int, chunks: int = 4):
    """A POST of `size` bytes in `chunks` pieces through `guard` (whose app is `_recording_app`);
    returns the coroutine and what the app and the client saw: the body, the status of any
    answer the guard sent, the pieces read."""
    seen: dict = {"body": None, "status": None, "read": 0}
    piece = size // chunks
    parts = [b"x" * piece] * (chunks - 1) + [b"x" * (size - piece * (chunks - 1))]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-length", str(size).encode())],
        "seen": seen,
    }

    async def receive():
        await asyncio.sleep(0.001)
        seen["read"] += 1
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    async def send(msg):
        if msg["type"] == "http.response.start":
            seen["status"] = msg["status"]
            seen["headers"] = dict(msg["headers"])

    return guard(scope, receive, send), seen


def test_a_burst_of_large_bodies_past_the_intake_line_is_refused_unread():
    """The large bodies in the server hold at most `intake_queue_bytes` declared bytes: the ones
    past it are answered 429 with Retry-After at once, without a byte of theirs read; the line
    always takes one body, however large, when empty."""
    from dspark_serve.server.guard import Guard

    size = SMALL_WORK * 4
    cfg = ServerConfig(tokenize_concurrency=1, intake_queue_bytes=3 * size)
    statuses: list = []

    async def burst():
        guard = Guard(_recording_app, cfg, statuses.append)
        requests = []
        for _ in range(6):
            coro, seen = _large_request(guard, size)
            requests.append((asyncio.create_task(coro), seen))
        await asyncio.gather(*(t for t, _ in requests))
        return [seen for _, seen in requests]

    seen = asyncio.run(burst())
    taken = [s for s in seen if s["body"] is not None]
    refused = [s for s in seen if s["status"] == 429]
    assert len(taken) == 3 and len(refused) == 3  # three fit the line, three are refused
    assert all(s["read"] == 0 for s in refused)  # refused unread
    assert all(s["headers"][b"retry-after"] == b"1" for s in refused)
    assert all(s["headers"][b"connection"] == b"close" for s in refused)
    assert statuses == [429, 429, 429]

    one = ServerConfig(intake_queue_bytes=1024)  # smaller than any large body: one at a time

    async def alone():
        coro, seen = _large_request(Guard(_recording_app, one, statuses.append), size)
        await coro
        return seen

    assert asyncio.run(alone())["body"] is not None


@pytest.mark.parametrize("busy,small", [(True, False), (False, True), (False, False)])
def test_large_bodies_are_paced_while_the_engine_serves(busy, small):
    """While the engine has requests in flight, or a small request is being handled on its way
    to it, large bodies come in at `intake_rate_busy` bytes a second at most (all of them
    together); an idle server takes them at full speed."""
    from dspark_serve.server.guard import Guard

    size = SMALL_WORK * 4
    cfg = ServerConfig(tokenize_concurrency=2, intake_rate_busy=size * 10)  # a body takes >= 0.1 s

    async def two():
        guard = Guard(_recording_app, cfg, lambda status: None, busy=lambda: busy)
        if small:
            guard.intake.small_requests += 1  # as while a small request's chat is prepared
        tasks = [_large_request(guard, size, chunks=8)[0] for _ in range(2)]
        t0 = time.monotonic()
        await asyncio.gather(*tasks)
        return time.monotonic() - t0

    seconds = asyncio.run(two())
    if busy or small:  # two bodies through one shared budget: their bytes but the last pieces paced
        assert seconds >= 2 * (7 / 8) * 0.1 * 0.95
    else:
        assert seconds < 0.1
