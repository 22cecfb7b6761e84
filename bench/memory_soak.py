"""Memory under repetition: identical rounds of concurrent requests against a real
`dspark-serve`, the server's RSS read after each round once it is idle. Memory that only
warms up (allocator pools, the prefix cache, compiled kernels) levels off after a few rounds;
a leak keeps growing by the same step every round.

Reports (JSON, and a PNG beside it): RSS after every round, and the growth from round 3 to the
last as a share of the process's size (the aim: under 1%).

    python -m bench.memory_soak --rounds 10 --requests 64 --out bench/results/memory-soak.json
    python -m bench.memory_soak -- --drafter ngram        # flags after -- go to the server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, metric_value, running_server  # noqa: E402
from bench.soak import PROMPTS, rss_kib  # noqa: E402


async def one_round(url: str, model: str, n: int, max_tokens: int, schema_every: int) -> dict[str, int]:
    """n requests at once: the same bodies every round (greedy, some streamed, every
    schema_every-th one with a JSON schema). Returns the count of each status."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 40}},
        "required": ["answer"],
        "additionalProperties": False,
    }

    async def go(client: httpx.AsyncClient, i: int) -> int:
        body: dict = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if schema_every and i % schema_every == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        if i % 2:
            async with client.stream(
                "POST", url + "/v1/chat/completions", json={**body, "stream": True}
            ) as r:
                async for _ in r.aiter_lines():
                    pass
                return r.status_code
        return (await client.post(url + "/v1/chat/completions", json=body)).status_code

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        codes = await asyncio.gather(*(go(client, i) for i in range(n)))
    out: dict[str, int] = {}
    for c in codes:
        out[str(c)] = out.get(str(c), 0) + 1
    return out


def wait_idle(url: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = httpx.get(url + "/metrics", timeout=10).text
        if not metric_value(text, "dspark:num_requests_running") and not metric_value(
            text, "dspark:num_requests_waiting"
        ):
            return
        time.sleep(0.2)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = [r["rss_kib"] / 1024 for r in result["rounds"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(mib) + 1), mib, marker="o")
    ax.set_xlabel(f"round ({result['requests_per_round']} requests each)")
    ax.set_ylabel("server RSS after the round (MiB)")
    ax.set_title(f"growth after round 3: {result['growth_after_round_3_pct']}%")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=64, help="requests per round, all at once")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--schema-every", type=int, default=8, help="every n-th request has a JSON schema (0: none)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory-soak.json"))
    ap.add_argument("server_args", nargs="*", help="extra dspark-serve flags (after --)")
    args = ap.parse_args()
    rounds = []
    flags = ["--log-level", "warning", *args.server_args]
    with running_server(19000 + os.getpid() % 1000, flags) as server:
        for k in range(args.rounds):
            t = time.monotonic()
            codes = asyncio.run(
                one_round(server.url, server.model, args.requests, args.max_tokens, args.schema_every)
            )
            wait_idle(server.url)
            time.sleep(1.0)
            rounds.append({"round": k + 1, "seconds": round(time.monotonic() - t, 1), "statuses": codes})
            rounds[-1]["rss_kib"] = rss_kib(server.proc.pid)
            print(json.dumps(rounds[-1]), flush=True)
    base = rounds[min(2, len(rounds) - 1)]["rss_kib"]
    last = rounds[-1]["rss_kib"]
    result = {
        "machine": machine(),
        "command": " ".join(["python -m bench.memory_soak", *sys.argv[1:]]),
        "server_args": args.server_args,
        "requests_per_round": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "growth_after_round_3_kib": last - base,
        "growth_after_round_3_pct": round(100 * (last - base) / base, 2),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
