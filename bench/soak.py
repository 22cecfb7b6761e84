"""Soak test (not in CI): mixed traffic against a real `dspark-serve` for a while — normal
requests, ~20% clients that go away mid-request, bursts past capacity, and malicious/bad inputs —
then checks that nothing leaked.

Reports (JSON under bench/results/): requests by kind and status, unexpected statuses (any 5xx,
or a 4xx where a 200 was due), KV blocks still held once idle, requests still running, and the
server's RSS growth from the end of the warm-up to the end.

    python -m bench.soak --duration 1800 --out bench/results/soak-30min.json
    python -m bench.soak --duration 180 -- --drafter ngram        # flags after -- go to the server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import metric_value, running_server  # noqa: E402

MODEL = None  # filled from /v1/models

PROMPTS = [
    "List the days of the week.",
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name five fruits.",
    "Summarise the plot of Hamlet in one paragraph.",
]


def bad_requests(vocab_hint: int = 10**9) -> list[tuple[str, str, dict]]:
    """(kind, path, httpx kwargs) of requests that must get a 4xx and hurt nobody."""
    j = {"content-type": "application/json"}
    return [
        ("neg-token", "/v1/completions", {"json": {"prompt": [-1], "max_tokens": 4}}),
        ("big-token", "/v1/completions", {"json": {"prompt": [1, vocab_hint], "max_tokens": 4}}),
        ("seed-overflow", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 4, "seed": 2**64}}),
        (
            "deep-json",
            "/v1/completions",
            {"content": b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", "headers": j},
        ),
        ("huge-body", "/v1/completions", {"content": b"x" * (10 * 2**20), "headers": j}),
        ("bad-json", "/v1/chat/completions", {"content": b'{"messages": [', "headers": j}),
        (
            "unsupported",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}},
        ),
        ("string-int", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": "10"}}),
        (
            "image",
            "/v1/chat/completions",
            {
                "json": {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ]
                }
            },
        ),
        ("too-long", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 10**6}}),
        ("huge-top-k", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2, "top_k": 10**30}}),
    ]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Stats:
    def __init__(self) -> None:
        self.by_kind: dict[str, dict[str, int]] = {}
        self.unexpected: list[str] = []
        self.transport_errors: dict[str, int] = {}

    def add(self, kind: str, status, ok: bool, note: str = "") -> None:
        d = self.by_kind.setdefault(kind, {})
        d[str(status)] = d.get(str(status), 0) + 1
        if not ok and len(self.unexpected) < 200:
            self.unexpected.append(f"{kind}: {status} {note[:200]}")


def body_for(rng: random.Random, stream: bool) -> tuple[str, dict]:
    p = rng.choice(PROMPTS)
    kw = {
        "model": MODEL,
        "max_tokens": rng.randint(4, 48),
        "stream": stream,
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    if rng.random() < 0.3:
        kw["seed"] = rng.randint(0, 2**63)
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**kw, "messages": [{"role": "user", "content": p}]}
    return "/v1/completions", {**kw, "prompt": p}


async def one(client: httpx.AsyncClient, rng: random.Random, stats: Stats, bad) -> None:
    r = rng.random()
    try:
        if r < 0.10:  # a bad input
            kind, path, kw = rng.choice(bad)
            resp = await client.post(path, **kw)
            stats.add("bad:" + kind, resp.status_code, 400 <= resp.status_code < 500, resp.text)
        elif r < 0.30:  # a client that goes away (~20%)
            stream = rng.random() < 0.5
            path, body = body_for(rng, stream)
            body["max_tokens"] = rng.randint(64, 256)
            if stream:
                async with client.stream("POST", path, json=body) as s:
                    n = rng.randint(1, 8)
                    async for line in s.aiter_lines():
                        if line.startswith("data: "):
                            n -= 1
                            if n <= 0:
                                break
                    stats.add("disconnect-stream", s.status_code, s.status_code in (200, 429))
            else:
                try:
                    resp = await client.post(path, json=body, timeout=rng.uniform(0.2, 2.0))
                    stats.add("disconnect-plain", resp.status_code, resp.status_code in (200, 429))
                except httpx.TimeoutException:
                    stats.add("disconnect-plain", "gone", True)
        else:  # a normal request
            stream = rng.random() < 0.5
            path, body = body_for(rng, stream)
            if stream:
                async with client.stream("POST", path, json=body) as s:
                    text = [line async for line in s.aiter_lines() if line.startswith("data: ")]
                    ok = s.status_code == 429 or (
                        s.status_code == 200
                        and text
                        and text[-1] == "data: [DONE]"
                        and not any('"error"' in t for t in text)
                    )
                    stats.add("stream", s.status_code, ok, text[-2] if len(text) > 1 else "")
            else:
                resp = await client.post(path, json=body)
                stats.add("plain", resp.status_code, resp.status_code in (200, 429), resp.text)
    except httpx.TransportError as exc:
        k = type(exc).__name__
        stats.transport_errors[k] = stats.transport_errors.get(k, 0) + 1
        stats.add("transport-error", k, False, repr(exc))


async def drive(url: str, args, stats: Stats, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    bad = bad_requests()
    t_end = time.monotonic() + args.duration
    t_warm = time.monotonic() + min(args.warmup, args.duration / 4)
    rss = {"samples": []}
    limits = httpx.Limits(max_connections=args.concurrency + args.burst_size + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker(i):
            wr = random.Random(args.seed * 1000 + i)
            while time.monotonic() < t_end:
                await one(client, wr, stats, bad)

        async def bursts():
            while time.monotonic() < t_end:
                await asyncio.sleep(args.burst_every)
                await asyncio.gather(
                    *[one(client, random.Random(rng.random()), stats, bad) for _ in range(args.burst_size)]
                )

        async def sampler():
            while time.monotonic() < t_end:
                if pid is not None:
                    rss["samples"].append((round(time.monotonic() - t0, 1), rss_kib(pid)))
                    if "warm" not in rss and time.monotonic() >= t_warm:
                        rss["warm"] = rss_kib(pid)
                await asyncio.sleep(5)

        t0 = time.monotonic()
        await asyncio.gather(*[worker(i) for i in range(args.concurrency)], bursts(), sampler())
    return rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--warmup", type=float, default=120.0, help="RSS baseline taken after this many seconds")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    ap.add_argument("--burst-size", type=int, default=24, help="requests per burst (past capacity)")
    ap.add_argument("--url", default=None, help="an already running server (else one is started)")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--kv-block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    ap.add_argument("server_args", nargs="*", help="extra dspark-serve flags (after --)")
    args = ap.parse_args()
    global MODEL
    with contextlib.ExitStack() as stack:
        proc = None
        url = args.url
        if url is None:
            flags = [
                "--max-num-seqs",
                "4",
                "--max-waiting",
                "8",
                "--max-model-len",
                "1024",
                "--kv-cache-tokens",
                str(args.kv_cache_tokens),
                "--kv-block-size",
                str(args.kv_block_size),
                "--log-level",
                "warning",
                *args.server_args,
            ]
            server = stack.enter_context(running_server(18000 + os.getpid() % 1000, flags))
            proc, url = server.proc, server.url
        MODEL = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        stats = Stats()
        t_start = time.monotonic()
        rss = asyncio.run(drive(url, args, stats, proc.pid if proc else None))
        elapsed = time.monotonic() - t_start
        # idle: wait for the last requests to go, then read what is still held
        t_idle = time.monotonic()
        while time.monotonic() - t_idle < 60:
            m = httpx.get(url + "/metrics").text
            running = metric_value(m, "dspark:num_requests_running")
            if not running and not metric_value(m, "dspark:kv_cache_usage_perc"):
                break
            time.sleep(0.5)
        m = httpx.get(url + "/metrics").text
        num_blocks = args.kv_cache_tokens // args.kv_block_size
        usage = metric_value(m, "dspark:kv_cache_usage_perc") or 0.0
        final_rss = rss_kib(proc.pid) if proc else None
        warm = rss.get("warm")
        from bench.common import machine

        total = sum(sum(d.values()) for d in stats.by_kind.values())
        disc = sum(sum(d.values()) for k, d in stats.by_kind.items() if k.startswith("disconnect"))
        result = {
            "machine": machine(),
            "duration_s": round(elapsed, 1),
            "requests": total,
            "disconnect_share": round(disc / max(total, 1), 3),
            "by_kind_and_status": stats.by_kind,
            "unexpected": len(stats.unexpected),
            "unexpected_examples": stats.unexpected[:20],
            "transport_errors": stats.transport_errors,
            "http_5xx": sum(n for d in stats.by_kind.values() for s, n in d.items() if s.startswith("5")),
            "leaked_blocks_after_idle": round(usage * num_blocks),
            "running_after_idle": metric_value(m, "dspark:num_requests_running"),
            "waiting_after_idle": metric_value(m, "dspark:num_requests_waiting"),
            "rss_kib_after_warmup": warm,
            "rss_kib_final": final_rss,
            "rss_growth_pct": round(100 * (final_rss - warm) / warm, 2) if warm and final_rss else None,
            "rss_samples": rss["samples"],
            "http_429_metric": metric_value(m, 'dspark:http_errors_total{status="429"}'),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))


if __name__ == "__main__":
    main()
