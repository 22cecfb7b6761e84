"""Two priority classes at saturation, with and without scheduling by priority.

  python bench/priorities.py --out bench/results/priorities.json

One engine (the embedded model, the default drafters and policy) takes a burst of requests at
once, half "interactive" (priority 0) and half "batch" (priority 1), more than it runs at a time
(--max-num-seqs), so they queue. Per class: median time to first token, end-to-end latency and
per-user tokens/s, under scheduling_policy fcfs and priority, the two interleaved over --rounds
rounds (medians). Compare within one run: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, load_prompts, machine, report_args  # noqa: E402


def burst(engine, prompts: list[list[int]], max_tokens: int, label: str) -> dict[str, dict[str, float]]:
    """Every prompt at once, even ones interactive (priority 0), odd ones batch (1) -> per class
    medians of TTFT, e2e latency and per-user tokens/s."""
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.request import Request

    reqs = [
        Request(
            f"{label}-{i}", ids, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True, priority=i % 2
        )
        for i, ids in enumerate(prompts)
    ]
    t0 = time.monotonic()
    for r in reqs:
        r.arrival_time = t0
        engine.add_request(r)
    done: dict[str, float] = {}
    while engine.has_work():
        engine.step()
        for r in reqs:
            if r.finished and r.request_id not in done:
                done[r.request_id] = time.monotonic()
    out = {}
    for cls, name in ((0, "interactive"), (1, "batch")):
        mine = [r for r in reqs if r.priority == cls]
        out[name] = {
            "ttft_s": statistics.median((r.first_token_time or t0) - t0 for r in mine),
            "e2e_s": statistics.median(done[r.request_id] - t0 for r in mine),
            "per_user_tps": statistics.median(
                len(r.output_ids) / max(done[r.request_id] - (r.first_token_time or t0), 1e-6) for r in mine
            ),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from bench.bench_engine import chat_ids
    from dspark_serve.scheduler.llm import LLM

    llm = LLM(drafter="dspark+ngram", max_num_seqs=a.max_num_seqs, scheduling_policy="fcfs")
    engine = llm.engine
    tok = llm.tokenizer
    prompts = [chat_ids(tok, text, 256) for _, text in load_prompts(a.data, a.requests)]
    burst(engine, prompts[:4], 8, "warm")
    rows: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for rnd in range(a.rounds):
        for policy in rows:
            cfg = dataclasses.replace(engine.scheduler.cfg, scheduling_policy=policy)
            engine.scheduler.cfg = engine.speculation.cfg = cfg
            rows[policy].append(burst(engine, prompts, a.max_tokens, f"{policy}{rnd}"))
            print(policy, rnd, json.dumps(rows[policy][-1]), flush=True)
    medians = {
        policy: {
            cls: {k: statistics.median(r[cls][k] for r in runs) for k in runs[0][cls]} for cls in runs[0]
        }
        for policy, runs in rows.items()
    }
    report = {
        "machine": machine(),
        "args": report_args(a),
        "medians": medians,
        "rounds": rows,
    }
    print(json.dumps(medians, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
