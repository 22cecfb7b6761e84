"""Slow and surplus clients over real sockets: a client that dawdles over its headers or its
body is answered 408 and dropped at the deadline, on a fresh connection and on a kept-alive
one; one connection over a cap (in all, per client address, per address without a request) is
answered 503 and closed; the probes are answered past the cap; other clients (other loopback
addresses) are served throughout."""

from __future__ import annotations

import json
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
from tests.server.test_app import FakeEngine
from tests.server.test_e2e import free_port

DEADLINE = 0.6


def implementations() -> list[str]:
    names = ["h11"]
    try:
        import httptools  # noqa: F401

        names.append("httptools")
    except ImportError:  # uvicorn then serves with h11 alone
        pass
    return names


@pytest.fixture(scope="module", params=implementations())
def server(request):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if request.param == "h11":
        base: type = H11Protocol
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    cfg = ServerConfig(
        port=free_port(),
        header_timeout=DEADLINE,
        body_timeout=DEADLINE,
        first_byte_timeout=DEADLINE,
        max_connections=6,
        health_reserve=1,
        max_client_connections=4,
        max_client_pending=3,
        pending_grace=0.05,
        trusted_proxies="127.0.0.8",
        log_level="error",
    )
    srv = uvicorn.Server(uvicorn_config(build_app(FakeEngine(), cfg, CollectorRegistry()), cfg, base))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    yield cfg.port
    srv.should_exit = True
    thread.join(timeout=10)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` (any 127.x address is this machine: another client)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    s.settimeout(10)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def post_head(length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def served(port: int, source: str = "127.0.0.1") -> bool:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as c:
        r = c.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
    return r.status_code == 200


def ask(s: socket.socket, head: bytes) -> bytes:
    """One request on an open connection -> its response (up to the JSON body's end)."""
    s.sendall(head)
    got = b""
    while not got.rstrip().endswith(b"}"):
        got += s.recv(65536)
    return got


def test_headers_sent_too_slowly_are_answered_408_and_dropped(server):
    s = connect(server)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    for _ in range(3):  # a byte now and then never completes the headers in time
        time.sleep(DEADLINE / 4)
        s.sendall(b"x")
    status, err = error_of(read_all(s))
    took = time.monotonic() - t0
    assert status == 408 and err["code"] == "request_timeout" and "headers" in err["message"]
    assert DEADLINE * 0.9 < took < DEADLINE + 2.0
    assert served(server)


def test_a_silent_connection_is_dropped_at_the_header_deadline(server):
    s = connect(server)
    t0 = time.monotonic()
    status, _ = error_of(read_all(s))
    assert status == 408 and time.monotonic() - t0 < DEADLINE + 2.0


def test_a_body_never_finished_is_answered_408_and_dropped(server):
    s = connect(server)
    s.sendall(post_head(1000) + b'{"messages": [')
    t0 = time.monotonic()
    status, err = error_of(read_all(s))
    assert status == 408 and "body" in err["message"] and err["type"] == "invalid_request_error"
    assert time.monotonic() - t0 < DEADLINE + 2.0
    assert served(server)


def test_a_kept_alive_connection_has_the_same_header_deadline(server):
    s = connect(server)
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    s.sendall(post_head(len(body)) + body)
    first = b""
    while b'"finish_reason"' not in first:
        first += s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # the next request stalls mid-headers
    rest = read_all(s)
    assert b"HTTP/1.1 408" in rest


def test_past_the_cap_only_the_probes_are_answered_then_503(server):
    held = [connect(server, f"127.0.0.{1 + i % 3}") for i in range(6)]  # two from each of three
    try:
        time.sleep(0.1)
        reserve = connect(server, "127.0.0.4")  # over the cap: the health reserve's one place
        assert ask(reserve, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
        extra = connect(server, "127.0.0.5")  # the reserve is taken: refused at once
        status, err = error_of(read_all(extra))
        assert status == 503 and err["code"] == "too_many_connections"
        status, err = error_of(ask(reserve, post_head(2) + b"{}"))  # a probe's place, not a request's
        assert status == 503 and err["code"] == "too_many_connections" and "/health" in err["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert served(server)


def test_one_address_cannot_hold_more_silent_or_open_connections_than_its_share(server):
    silent = [connect(server, "127.0.0.5") for _ in range(3)]
    try:
        time.sleep(0.1)
        status, err = error_of(read_all(connect(server, "127.0.0.5")))
        assert status == 503 and "sent no request" in err["message"]
        assert served(server, "127.0.0.6")  # another client is served meanwhile
    finally:
        for s in silent:
            s.close()
    time.sleep(0.2)
    proxied = [connect(server, "127.0.0.8") for _ in range(4)]  # a trusted proxy: exempt
    try:
        proxied[-1].settimeout(DEADLINE / 2)
        with pytest.raises(TimeoutError):  # not refused: it waits for its request
            proxied[-1].recv(1)
    finally:
        for s in proxied:
            s.close()
    time.sleep(0.2)
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    busy = [connect(server, "127.0.0.7") for _ in range(4)]
    try:
        for s in busy:  # each has sent a request: open, no longer silent
            assert ask(s, post_head(len(body)) + body).startswith(b"HTTP/1.1 200")
        status, err = error_of(read_all(connect(server, "127.0.0.7")))
        assert status == 503 and "4 open connections" in err["message"]
    finally:
        for s in busy:
            s.close()
