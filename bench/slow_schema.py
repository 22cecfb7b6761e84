"""What a schema that is slow to compile costs everyone else: normal streams against a real
`dspark-serve`, alone and with clients that keep sending such a schema the whole time (each
answered 400 once its compile worker is killed at the limit). The arms alternate (their order too)
for several rounds; per-user speed is each stream's tokens after its first over the time they took.

    python -m bench.slow_schema --rounds 3 --out bench/results/slow-schema.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import greedy_stream_body, machine, running_server  # noqa: E402
from bench.soak import PROMPTS  # noqa: E402

SLOW = {"type": "string", "pattern": "^(x{1000}){1000}$"}


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> float:
    """One greedy stream; its per-user speed (tokens after the first per second)."""
    body = greedy_stream_body(model, prompt, max_tokens)
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            elif any(c["delta"].get("content") for c in ev.get("choices", [])):
                last = time.monotonic()
                first = first or last
    assert first is not None and last is not None and last > first, "a stream produced too little"
    return (tokens - 1) / (last - first)


async def slow_sender(client: httpx.AsyncClient, url: str, model: str, stop: asyncio.Event) -> list[int]:
    """Sends the slow schema again as soon as it is answered, until stop; the statuses."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say x."}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW}},
    }
    codes = []
    while not stop.is_set():  # a new schema text each time: the server keeps refusals by text
        schema = {**SLOW, "description": f"attempt {uuid.uuid4().hex}"}
        rf = {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}
        r = await client.post(url + "/v1/chat/completions", json={**body, "response_format": rf})
        codes.append(r.status_code)
    return codes


async def arm(url: str, model: str, streams: int, senders: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        stop = asyncio.Event()
        bad = [asyncio.create_task(slow_sender(client, url, model, stop)) for _ in range(senders)]
        speeds = await asyncio.gather(
            *(stream(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(streams))
        )
        stop.set()
        codes = [c for t in await asyncio.gather(*bad) for c in t]
    return {
        "per_user_tps": statistics.median(speeds),
        "slow_schema_statuses": sorted(set(codes)),
        "sent": len(codes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--senders", type=int, default=6, help="clients sending the slow schema at once")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "slow-schema.json"))
    ap.add_argument("server_args", nargs="*", help="extra dspark-serve flags (after --)")
    args = ap.parse_args()
    rows = []
    flags = ["--log-level", "warning", *args.server_args]
    with running_server(19500 + os.getpid() % 400, flags) as server:
        url, model = server.url, server.model
        asyncio.run(arm(url, model, args.streams, 1, 16))  # warm-up: workers started, caches filled
        for k in range(args.rounds):  # the arms' order alternates: a warmer second arm cancels out
            order = (0, args.senders) if k % 2 == 0 else (args.senders, 0)
            for senders in order:
                row = asyncio.run(arm(url, model, args.streams, senders, args.max_tokens))
                rows.append({"round": k + 1, "senders": senders, **row})
                print(json.dumps(rows[-1]), flush=True)
    alone = statistics.median(r["per_user_tps"] for r in rows if r["senders"] == 0)
    loaded = statistics.median(r["per_user_tps"] for r in rows if r["senders"])
    by_round = {(r["round"], bool(r["senders"])): r["per_user_tps"] for r in rows}
    ratios = [by_round[(k + 1, True)] / by_round[(k + 1, False)] for k in range(args.rounds)]
    result = {
        "machine": machine(),
        "command": " ".join(["python -m bench.slow_schema", *sys.argv[1:]]),
        "streams": args.streams,
        "senders": args.senders,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "per_user_tps_alone": round(alone, 2),
        "per_user_tps_with_slow_schemas": round(loaded, 2),
        "ratio_of_medians": round(loaded / alone, 3),
        "median_per_round_ratio": round(statistics.median(ratios), 3),
        "per_round_ratios": [round(r, 3) for r in ratios],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
