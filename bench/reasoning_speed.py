"""What the reasoning split costs per user: the same streamed chat requests against two servers
on the embedded model with the default drafters (speculation on in both, a fixed verification
length by default so both engines take the same steps), one with the split on and one with it
off, interleaved request by request.

    python bench/reasoning_speed.py --rounds 3 --out bench/results/reasoning-speed.json

The split on is `--reasoning-parser deepseek_r1`: its reply starts inside the reasoning (the
template is taken to have opened it), so every streamed piece of this model's reply goes through
the split and comes back as `reasoning_content` (the model never writes the end tag), the most
the split can do per token; off is `--reasoning-parser none`. Greedy and length-fixed
(ignore_eos), so both arms stream the same tokens. Per-user speed of a request: its tokens after
the first over the time from its first streamed token to its last; reported: the median over
requests of the ratio split / plain for the same prompt back to back (the engines adapt their
drafting to what they measure, so single requests vary widely), and the ratio of the arms'
median per-user speeds, per round and over all requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DATA,
    greedy_stream_body,
    load_prompts,
    machine,
    report_args,
    running_server,
    stream_chat,
)

ARMS = {"split": ["--reasoning-parser", "deepseek_r1"], "plain": ["--reasoning-parser", "none"]}


def stream_one(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed chat request -> its per-user tokens/s and the fields it streamed into."""
    c = stream_chat(url, greedy_stream_body(model, prompt, max_tokens), timeout=300)
    return {
        "tokens": c.tokens,
        "per_user_tps": c.per_user_tps or float("nan"),
        **{f"{k}_pieces": v for k, v in c.fields.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--verify-policy",
        default="static:4",
        help="both servers' policy: a fixed length by default, so the two engines take the same "
        "steps and only the split differs (the load-aware default adapts to what each measures)",
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    prompts = [text for _, text in load_prompts(a.data, a.prompts)]
    rows: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    checks = {}
    policy = ["--verify-policy", a.verify_policy]
    with (
        running_server(8311, ARMS["split"] + policy) as split,
        running_server(8312, ARMS["plain"] + policy) as plain,
    ):
        servers = {"split": split, "plain": plain}
        for arm, s in servers.items():  # warm-up: caches, allocators, the cost table
            checks[arm] = stream_one(s.url, s.model, prompts[0], 16)
        for rnd in range(a.rounds):
            for arm in rows:
                rows[arm].append([])
            for i, p in enumerate(prompts):
                order = list(servers) if (rnd + i) % 2 == 0 else list(servers)[::-1]
                for arm in order:
                    r = stream_one(servers[arm].url, servers[arm].model, p, a.max_tokens)
                    rows[arm][-1].append(r["per_user_tps"])
            print(
                f"round {rnd}: " + ", ".join(f"{arm} {statistics.median(rows[arm][-1]):.1f}" for arm in rows),
                flush=True,
            )
    per_round = [statistics.median(s) / statistics.median(p) for s, p in zip(rows["split"], rows["plain"])]
    flat = {arm: [x for rnd in v for x in rnd] for arm, v in rows.items()}
    pairs = [s / p for s, p in zip(flat["split"], flat["plain"])]  # the same prompt, back to back
    report = {
        "machine": machine(),
        "args": report_args(a),
        "split_arm_streamed": checks["split"],
        "plain_arm_streamed": checks["plain"],
        "median_per_user_tps": {arm: statistics.median(v) for arm, v in flat.items()},
        "ratio_split_over_plain": statistics.median(flat["split"]) / statistics.median(flat["plain"]),
        "median_pair_ratio": statistics.median(pairs),
        "ratio_per_round": per_round,
        "rounds": rows,
    }
    print(
        json.dumps(
            {k: report[k] for k in ("median_per_user_tps", "ratio_split_over_plain", "ratio_per_round")},
            indent=1,
        )
    )
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
