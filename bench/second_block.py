"""A second draft block per greedy request, measured: one stream, the embedded default.

  python bench/second_block.py --branch-rows 0,12,16 --rounds 4 --out bench/results/second-block.json

One engine with the default drafters (`dspark+ngram`) and policy (dspark). Each arm sets
`SchedulerConfig.branch_rows` (0 = one block, the baseline) and, with --primary-alternate, lets
a lookup-led step draft DSpark's block as the second one too. Every arm decodes the same prompts
at one stream per round; rounds alternate the arms' order, so a slow spell of a shared machine
hits all of them. Reported per arm: per-user tokens/s per round and its ratio to the baseline's
in the same round (the median of those ratios is the figure), tokens per round (tau), and how
many second blocks were verified and kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, load_prompts, machine, run_engine_closed_loop  # noqa: E402
from dspark_serve.scheduler.metrics_sink import NullMetrics  # noqa: E402


class _Blocks(NullMetrics):
    """Counts second blocks verified and kept."""

    def __init__(self) -> None:
        self.kept = self.dropped = 0

    def record_second_block(self, kept: bool) -> None:
        self.kept += kept
        self.dropped += not kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--branch-rows", default="0,12,16", help="arms; the first is the baseline")
    ap.add_argument("--primary-alternate", action="store_true")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from bench.bench_engine import chat_ids
    from dspark_serve.drafter.combined import CombinedDrafter
    from dspark_serve.scheduler.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(drafter="dspark+ngram", verify_policy="dspark", dtype="auto")
    eng = llm.engine
    counts = _Blocks()
    eng.metrics = counts
    if args.primary_alternate:
        assert isinstance(eng.drafter, CombinedDrafter)
        eng.drafter.config = dataclasses.replace(eng.drafter.config, primary_alternate=True)
    prompts = [chat_ids(llm.tokenizer, t, 512) for _, t in load_prompts(DATA, args.prompts)]
    run_engine_closed_loop(eng, prompts[:3], 1, 32, 0.0, "warm-up")
    base = eng.speculation.cfg
    arms = [int(x) for x in args.branch_rows.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for br in arms if rnd % 2 == 0 else arms[::-1]:
            eng.speculation.cfg = dataclasses.replace(base, branch_rows=br)
            kept, dropped = counts.kept, counts.dropped
            pr = run_engine_closed_loop(eng, prompts, 1, args.max_tokens, 0.0, f"b{br}-{rnd}")
            rows.append(
                {
                    "round": rnd,
                    "branch_rows": br,
                    "per_user_tps": pr.per_user_tps,
                    "tau": pr.tau,
                    "second_blocks": counts.kept + counts.dropped - kept - dropped,
                    "kept": counts.kept - kept,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for br in arms:
        mine = [r for r in rows if r["branch_rows"] == br]
        ratios = [
            r["per_user_tps"] / b["per_user_tps"]
            for r in mine
            for b in rows
            if b["branch_rows"] == arms[0] and b["round"] == r["round"]
        ]
        summary[str(br)] = {
            "per_user_tps": statistics.median(r["per_user_tps"] for r in mine),
            "ratio_to_baseline": statistics.median(ratios),
            "ratios": [round(x, 3) for x in ratios],
            "tau": statistics.median(r["tau"] or 0.0 for r in mine),
            "second_blocks": sum(r["second_blocks"] for r in mine),
            "kept": sum(r["kept"] for r in mine),
        }
        print(br, json.dumps(summary[str(br)]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": machine(), "args": vars(args), "rows": rows, "summary": summary}, indent=1)
    )


if __name__ == "__main__":
    main()
