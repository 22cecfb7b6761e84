"""A second draft block per greedy request, measured: one stream, the embedded default.

  python bench/branches.py --branch-rows 0,12,16 --rounds 4 --out bench/results/second-block.json

One engine with the default drafters (`dspark+ngram`) and policy (dspark). Each arm sets
`SchedulerConfig.branch_rows` (0 = one block, the baseline) and, with --primary-branch, lets
a lookup-led step draft DSpark's block as the second one too. Every arm decodes the same prompts
at one stream per round; rounds alternate the arms' order, so a slow spell of a shared machine
hits all of them. Reported per arm: per-user tokens/s per round and its ratio to the baseline's
in the same round (the median of those ratios is the figure), tokens per round (tau), and how
many branches were verified and kept.

  python bench/branches.py --potential --prompts 36 --out bench/results/second-block-potential.json

--potential measures what a branch could gain, before any arm runs: one pass of the
default (one block), where every step also drafts both drafters' blocks on the side; greedy
output is the target's argmax chain, so each block's accepted run is read off the final text.
Reported per dev set: the mean accepted drafts of DSpark's block, of lookup's, of the block the
combined drafter chose (0 where it drafted nothing), and of the longer of the two, and lookup's
mean by the length of the suffix it matched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, load_prompts, machine, run_engine_closed_loop  # noqa: E402
from dspark_serve.scheduler.metrics_sink import NullMetrics  # noqa: E402


class _Blocks(NullMetrics):
    """Counts branches verified and kept."""

    def __init__(self) -> None:
        self.kept = self.dropped = 0

    def record_branch(self, kept: bool) -> None:
        self.kept += kept
        self.dropped += not kept


def _run(block: list[int], ref: list[int]) -> int:
    """Drafts of `block` the target accepts greedily: the common prefix with its own text."""
    n = 0
    for a, b in zip(block, ref):
        if a != b:
            break
        n += 1
    return n


def potential(args: argparse.Namespace) -> None:
    from bench.bench_engine import chat_ids
    from dspark_serve.drafter.combined import CombinedDrafter
    from dspark_serve.drafter.ngram import NgramDrafter, lookup_match
    from dspark_serve.scheduler.llm import LLM

    llm = LLM(drafter="dspark+ngram", verify_policy="dspark", dtype="auto")
    eng = llm.engine
    comb = eng.drafter
    assert isinstance(comb, CombinedDrafter)
    primary, lookup = comb.drafters
    assert isinstance(lookup, NgramDrafter)
    steps: list[tuple[str, int, list[int], list[int], int, int]] = []
    chosen = comb.propose

    def propose(requests):  # the default's own choice, then both blocks on the side
        out = chosen(requests)
        found = lookup.propose(requests)
        drafted = primary.propose(requests)
        for r, d, f in zip(requests, drafted, found):
            cfg = lookup.config
            matched = lookup_match(np.asarray(r.token_ids), cfg.max_ngram, cfg.min_ngram, len(f))[1]
            last = comb._state[r.request_id].last
            n = len(r.token_ids)
            steps.append((r.request_id, n, d.tokens.tolist(), f.tokens.tolist(), last, matched))
        return out

    comb.propose = propose  # type: ignore[method-assign]
    data = load_prompts(DATA, args.prompts)
    prompts = [chat_ids(llm.tokenizer, t, 512) for _, t in data]
    done: list = []
    run_engine_closed_loop(eng, prompts, 1, args.max_tokens, 0.0, "p", finished=done)
    text = {r.request_id: list(r.token_ids) for r in done}
    domain = {f"p-{i}": d for i, (d, _) in enumerate(data)}
    per: dict[str, list[tuple[int, int, int, int]]] = {}
    by_match: dict[int, list[int]] = {}
    for rid, n, d, f, last, matched in steps:
        ref = text[rid][n : n + max(len(d), len(f))]
        a_d, a_f = _run(d, ref), _run(f, ref)
        a_c = a_d if last == 0 else a_f if last == 1 else 0
        for key in (domain[rid], "all"):
            per.setdefault(key, []).append((a_d, a_f, a_c, max(a_d, a_f)))
        if f:
            by_match.setdefault(matched, []).append(a_f)
    mean = statistics.fmean
    summary = {
        k: {
            "steps": len(v),
            "dspark": mean(x[0] for x in v),
            "lookup": mean(x[1] for x in v),
            "chosen": mean(x[2] for x in v),
            "longer": mean(x[3] for x in v),
            "tokens_per_step_longer_over_chosen": (1 + mean(x[3] for x in v)) / (1 + mean(x[2] for x in v)),
        }
        for k, v in per.items()
    }
    lookup_by_match = {str(k): {"blocks": len(v), "accepted": mean(v)} for k, v in sorted(by_match.items())}
    for k, v in summary.items():
        print(k, json.dumps({kk: round(x, 3) for kk, x in v.items()}))
    print("lookup by match length", json.dumps(lookup_by_match))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"machine": machine(), "args": vars(args), "summary": summary, "by_match": lookup_by_match},
            indent=1,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--branch-rows", default="0,12,16", help="arms; the first is the baseline")
    ap.add_argument("--primary-branch", action="store_true")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--potential", action="store_true", help="the per-step potential (see above)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from bench.bench_engine import chat_ids
    from dspark_serve.drafter.combined import CombinedDrafter
    from dspark_serve.scheduler.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.potential:
        potential(args)
        return
    llm = LLM(drafter="dspark+ngram", verify_policy="dspark", dtype="auto")
    eng = llm.engine
    counts = _Blocks()
    eng.metrics = counts
    if args.primary_branch:
        assert isinstance(eng.drafter, CombinedDrafter)
        eng.drafter.config = dataclasses.replace(eng.drafter.config, primary_branch=True)
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
                    "branches": counts.kept + counts.dropped - kept - dropped,
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
            "branches": sum(r["branches"] for r in mine),
            "kept": sum(r["kept"] for r in mine),
        }
        print(br, json.dumps(summary[str(br)]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": machine(), "args": vars(args), "rows": rows, "summary": summary}, indent=1)
    )


if __name__ == "__main__":
    main()
