"""Hostile clients against a real `dspark-serve` (the embedded default, with an API key), on
loopback only, each attack bounded in count and time; the figures go to a JSON file.

1. huge bodies: N concurrent ~4 MB chats that cannot fit the context, sent over plain sockets
   (an attacker elsewhere spends none of this host's CPU; here it spends as little as it can);
   each one's status and time to be refused, the CPU seconds of the server and of the
   attacker, the server's RSS before, at its peak and after, and another client's short chat
   (from another loopback address) meanwhile against its unloaded latency.
2. idle connections: M sockets from one address that send nothing; /health and an
   authenticated chat from another address meanwhile.
3. wide requests: two `n=16` streams of 1000 tokens (ignore_eos) take the slots; a short chat
   sent after them, its latency. Then one key's many long single requests (more than the slots)
   and a short chat with another key from the same address: its latency, and the hog key's
   share of the slots from /metrics before and after it.
4. cut streams: a Responses stream cut by SIGTERM (a second server with a short drain), and one
   that fails mid-way (a tool whose pattern blows up the grammar): the events they end with.

    python bench/hostile.py --out bench/results/hostile-zen4.json
    python bench/hostile.py --bodies 8 --idle 500 --out /tmp/h.json -- --drafter ngram
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, metric_value, running_server  # noqa: E402

KEY = "hostile-bench-key"
HOG_KEY = "hostile-bench-hog-key"  # a second key: the one whose many requests fill the slots
OTHER = "127.0.0.2"  # another client: a loopback address of its own
SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def client(url: str, source: str = "127.0.0.1", timeout: float = 120, key: str = KEY) -> httpx.Client:
    return httpx.Client(
        base_url=url,
        transport=httpx.HTTPTransport(local_address=source),
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def timed(fn: Callable[[], httpx.Response]) -> tuple[int, float]:
    t0 = time.monotonic()
    status = fn().status_code
    return status, time.monotonic() - t0


def short_chat(url: str, model: str) -> tuple[int, float]:
    with client(url, OTHER) as c:
        return timed(lambda: c.post("/v1/chat/completions", json={**SHORT, "model": model}))


def unloaded(url: str, model: str, n: int = 5) -> float:
    return statistics.median(short_chat(url, model)[1] for _ in range(n))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post_raw(port: int, body: bytes) -> tuple[int, float]:
    """One chat POST of `body` over a plain socket (the attacker spends no interpreter time on
    HTTP: on a shared host its CPU would otherwise stand in for the server's) -> the status and
    seconds to the answer."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    t0 = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        with contextlib.suppress(OSError):  # a server refusing a body unread closes the socket
            s.sendall(head + body)
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                answer += chunk
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, time.monotonic() - t0


def send_bodies(port: int, body: bytes, n: int) -> tuple[list[tuple[int, float]], float]:
    """n bodies at once (threads of a process of their own: the probing client in the main
    process keeps its interpreter) -> each one's status and seconds to its answer, and the CPU
    seconds the attacking process spent."""
    res: list[tuple[int, float]] = [(0, 0.0)] * n
    cpu0 = cpu_seconds(os.getpid())

    def one(i: int) -> None:
        res[i] = post_raw(port, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res, cpu_seconds(os.getpid()) - cpu0


def huge_bodies(url: str, model: str, pid: int, port: int, n: int) -> dict[str, Any]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ab " * 1_300_000}]}).encode()
    base = unloaded(url, model)
    before = rss_mib(pid)
    peak = [before]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak.append(rss_mib(pid))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        pool.submit(int).result()  # the process started before the clock
        server_cpu = cpu_seconds(pid)
        t0 = time.monotonic()
        sent = pool.submit(send_bodies, port, body, n)
        time.sleep(0.05)
        probes = []
        while not sent.done():
            probes.append(short_chat(url, model))
        refused, attacker_cpu = sent.result()
        seconds = time.monotonic() - t0
        server_cpu = cpu_seconds(pid) - server_cpu
    stop.set()
    w.join()
    time.sleep(1.0)
    during = [t for _, t in probes]
    return {
        "bodies": n,
        "body_bytes": len(body),
        "statuses": {str(s): sum(1 for st, _ in refused if st == s) for s in sorted({s for s, _ in refused})},
        "refused_seconds_median": statistics.median(t for _, t in refused),
        "refused_seconds_max": max(t for _, t in refused),
        "attack_seconds": seconds,
        "server_cpu_seconds": server_cpu,
        "attacker_cpu_seconds": attacker_cpu,
        "rss_mib_before": before,
        "rss_mib_peak": max(peak),
        "rss_mib_after": rss_mib(pid),
        "short_chat_unloaded_s": base,
        "short_chat_during_s": during,
        "short_chat_during_median_s": statistics.median(during) if during else None,
        "short_chat_during_statuses": sorted({s for s, _ in probes}),
    }


def idle_connections(url: str, model: str, port: int, m: int) -> dict[str, Any]:
    socks: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(m):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            s.settimeout(0.005)
            try:
                refused += b" 503 " in s.recv(64)
            except (TimeoutError, OSError):
                pass
        health, chats = [], []
        with client(url, OTHER, timeout=10) as c:
            for _ in range(5):
                health.append(timed(lambda: c.get("/health")))
                chats.append(timed(lambda: c.post("/v1/chat/completions", json={**SHORT, "model": model})))
    finally:
        for s in socks:
            s.close()
    return {
        "idle": m,
        "refused_at_once": refused,
        "health": health,
        "chat_from_another_address": chats,
    }


def wide_requests(url: str, model: str) -> dict[str, Any]:
    base = unloaded(url, model)
    wide = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "n": 16,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Barrier(3)

    def hog() -> None:
        with client(url) as c, c.stream("POST", "/v1/chat/completions", json=wide) as r:
            started.wait()
            for _ in r.iter_lines():
                pass

    hogs = [threading.Thread(target=hog) for _ in range(2)]
    for t in hogs:
        t.start()
    started.wait()
    time.sleep(3.0)
    probe = short_chat(url, model)
    for t in hogs:
        t.join()
    return {"short_chat_unloaded_s": base, "short_chat_beside_hogs": probe}


def metric(url: str, name: str, labels: str) -> float | None:
    """One sample of the server's /metrics (`name{...labels...}`), or None."""
    return metric_value(httpx.get(url + "/metrics").text, name, labels)


def many_requests_of_one_key(url: str, model: str, n: int) -> dict[str, Any]:
    """One key's n long single requests, each from an address of its own (an application's many
    users behind one key), fill the slots (each is its own request: fair slots by request alone
    would keep them all); a short chat with another key sent once the hog key holds every
    slot; then the hog's streams are closed."""
    base = unloaded(url, model)
    long = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    stop = threading.Event()
    statuses: list[int] = []

    def hog(i: int) -> None:
        with (
            client(url, f"127.0.1.{i + 1}", key=HOG_KEY) as c,
            c.stream("POST", "/v1/chat/completions", json=long) as r,
        ):
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    hogs = [threading.Thread(target=hog, args=(i,)) for i in range(n)]
    for t in hogs:
        t.start()
    deadline = time.monotonic() + 30
    while (metric(url, "dspark:key_slot_share", 'key="hog"') or 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    share = metric(url, "dspark:key_slot_share", 'key="hog"')
    waiting = metric(url, "dspark:num_requests_waiting", "")
    with client(url, "127.0.0.1") as c:
        probe = timed(lambda: c.post("/v1/chat/completions", json={**SHORT, "model": model}))
    share_after = metric(url, "dspark:key_slot_share", 'key="hog"')
    stop.set()
    for t in hogs:
        t.join()
    return {
        "hog_requests": n,
        "hog_statuses": sorted(set(statuses)),
        "short_chat_unloaded_s": base,
        "hog_slot_share_before": share,
        "waiting_before": waiting,
        "short_chat_other_key": probe,
        "hog_slot_share_after": share_after,
        "bench_key_waits": metric(url, "dspark:key_queue_wait_seconds_count", 'key="bench"'),
    }


def response_events(url: str, body: dict[str, Any], on_first: Callable[[], None] | None = None) -> list[dict]:
    events: list[dict] = []
    with client(url) as c, c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return [{"type": f"HTTP {r.status_code}", "response": {"error": json.loads(r.read())}}]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if on_first is not None and len(events) == 3:
                    on_first()
    return events


def ending(events: list[dict]) -> dict[str, Any]:
    last = events[-1] if events else {}
    resp = last.get("response") or {}
    return {
        "events": len(events),
        "last_event": last.get("type"),
        "status": resp.get("status"),
        "incomplete_details": resp.get("incomplete_details"),
        "error": resp.get("error"),
        "output_tokens": (resp.get("usage") or {}).get("output_tokens"),
        "text_deltas": sum(e.get("type", "").endswith(".delta") for e in events),
    }


def failing_stream(url: str, model: str) -> dict[str, Any]:
    tool = {
        "type": "function",
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "string", "pattern": "^(x{1000}){1000}$"}},
            "required": ["x"],
        },
    }
    body = {"model": model, "input": "Call f.", "tools": [tool], "tool_choice": "required"}
    return ending(response_events(url, body))


def cut_stream(port: int, flags: list[str]) -> dict[str, Any]:
    with running_server(port, [*flags, "--shutdown-timeout", "0"], api_key=KEY) as srv:
        body = {
            "model": srv.model,
            "input": "Write the numbers from 1 to 2000, one per line.",
            "max_output_tokens": 1500,
        }
        events = response_events(srv.url, body, lambda: srv.proc.send_signal(signal.SIGTERM))
        return ending(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--bodies", type=int, default=32)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--hog-requests", type=int, default=40, help="one key's long requests (> max-num-seqs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("server_flags", nargs=argparse.REMAINDER, help="-- then flags for dspark-serve")
    args = ap.parse_args()
    flags = args.server_flags[1:] if args.server_flags[:1] == ["--"] else args.server_flags
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 1024)), hard))
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(f"bench {KEY}\nhog {HOG_KEY}\n")
    keyed = [*flags, "--api-key-file", f.name]
    result: dict[str, Any] = {"machine": machine(), "server_flags": keyed[:-1]}
    try:
        with running_server(args.port, keyed, api_key=KEY) as srv:
            pid, url = srv.proc.pid, srv.url
            result["huge_bodies"] = huge_bodies(url, srv.model, pid, args.port, args.bodies)
            print("huge bodies:", result["huge_bodies"], flush=True)
            result["idle_connections"] = idle_connections(url, srv.model, args.port, args.idle)
            print("idle connections:", result["idle_connections"], flush=True)
            result["wide_requests"] = wide_requests(url, srv.model)
            print("wide requests:", result["wide_requests"], flush=True)
            result["one_key_many_requests"] = many_requests_of_one_key(url, srv.model, args.hog_requests)
            print("one key, many requests:", result["one_key_many_requests"], flush=True)
            result["failing_stream"] = failing_stream(url, srv.model)
            print("failing stream:", result["failing_stream"], flush=True)
            result["rss_mib_end"] = rss_mib(pid)
        result["cut_stream"] = cut_stream(args.port + 1, keyed)
        print("cut stream:", result["cut_stream"], flush=True)
    finally:
        os.unlink(f.name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
