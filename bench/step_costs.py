"""Steady-state engine steps by policy and concurrency: C requests decoding (prefill done, a few
warm-up steps), then --steps steps timed, split into the step's parts (drafting, the policy, the
verify forward, verification's sampling and the commit). Each policy in its own engine (the
draft gate off, so a static length drafts at every load); the DSpark + n-gram drafter; greedy
requests, or each --sampling in turn (greedy, a presence penalty, sampled, sampled with a seed).

  python bench/step_costs.py --policies none,static:1,static:3 --concurrency 4,8,16,32 \\
      --out bench/results/step-costs-amx-bf16.json

Decode tokens per second here leave out prefill and ramp-up, which a sweep's one-wave runs
include: what drafting can gain or lose at a load in the long run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_engine import chat_ids  # noqa: E402
from bench.common import (  # noqa: E402
    DATA,
    StepParts,
    load_prompts,
    save_result,
    start_decoding,
    timed_steps,
    timing_args,
)

# the requests' sampling, by name (--sampling)
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "penalty": {"temperature": 0.0, "presence_penalty": 0.5},
    "sampled": {"temperature": 0.8},
    "seeded": {"temperature": 0.8, "seed": 1},
}


def measure(
    policy: str,
    concurrency: list[int],
    steps: int,
    drafter: str,
    mode: str = "default",
    samplings: tuple[str, ...] = ("greedy",),
) -> list[dict]:
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.scheduler.request import Request

    llm = LLM(
        drafter=drafter,
        verify_policy=policy,
        draft_gate=False,
        max_num_seqs=max(concurrency),
        batch_invariant=mode == "batch_invariant",
    )
    eng = llm.engine
    spent = StepParts(eng).spent
    prompts = [chat_ids(llm.tokenizer, t, 320) for _, t in load_prompts(DATA, max(concurrency))]
    rows = []
    for name, c in [(n, c) for n in samplings for c in concurrency]:
        sp = SamplingParams(**SAMPLING[name])
        reqs = [Request(f"{policy}-{name}-{c}-{i}", prompts[i], sp, 1024, ignore_eos=True) for i in range(c)]
        start_decoding(eng, reqs)
        spent.clear()
        walls, made = timed_steps(eng, reqs, steps)
        row = {
            "policy": policy,
            "mode": mode,
            "sampling": name,
            "concurrency": c,
            "step_ms_median": statistics.median(walls) * 1e3,
            "tokens_per_step": made / steps,
            "decode_tps": made / sum(walls),
            "context_mean": statistics.mean(len(r.prompt_ids) + len(r.output_ids) for r in reqs),
        }
        row |= {f"{k.strip('_')}_ms": v / steps * 1e3 for k, v in spent.items()}
        rows.append(row)
        print(
            f"{policy:10s} {mode[:7]} {name:7s} C={c:3d} step {row['step_ms_median']:6.1f} ms  "
            f"{row['tokens_per_step']:5.1f} tok/step  {row['decode_tps']:6.1f} tok/s | "
            + " ".join(f"{k} {v:5.1f}" for k, v in row.items() if k.endswith("_ms")),
            flush=True,
        )
        for r in reqs:
            eng.abort(r.request_id)
        for _ in range(2):
            eng.step()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", type=lambda s: s.split(","), default=["none", "static:1", "static:3"])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the policies (medians kept)")
    ap.add_argument("--drafter", default="dspark+ngram")
    ap.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["default"],
        help="forwards to compare: default, batch_invariant (ModelConfig.batch_invariant)",
    )
    ap.add_argument(
        "--sampling",
        type=lambda s: tuple(s.split(",")),
        default=("greedy",),
        help="the requests' sampling: " + ", ".join(SAMPLING),
    )
    args = timing_args(ap)
    for name in args.sampling:
        if name not in SAMPLING:
            ap.error(f"--sampling: unknown {name!r}; known: {', '.join(SAMPLING)}")
    rows = []
    arms = [(m, p) for m in args.modes for p in args.policies]
    for rnd in range(args.rounds):
        for m, p in arms if rnd % 2 == 0 else arms[::-1]:
            measured = measure(p, args.concurrency, args.steps, args.drafter, m, args.sampling)
            rows += [dict(r, round=rnd) for r in measured]
    medians = []
    for (m, p), name, c in [(a, n, c) for a in arms for n in args.sampling for c in args.concurrency]:
        rs = [
            r
            for r in rows
            if r["policy"] == p and r["mode"] == m and r["sampling"] == name and r["concurrency"] == c
        ]
        medians.append(
            {
                "policy": p,
                "mode": m,
                "sampling": name,
                "concurrency": c,
                "decode_tps": statistics.median(r["decode_tps"] for r in rs),
                "step_ms": statistics.median(r["step_ms_median"] for r in rs),
                "forward_ms": statistics.median(r.get("forward_ms", 0.0) for r in rs),
                "verify_ms": statistics.median(r.get("verify_ms", 0.0) for r in rs),
            }
        )

    def key(m: dict) -> tuple:
        return m["mode"], m["sampling"], m["concurrency"]

    plain = {key(m): m["decode_tps"] for m in medians if m["policy"] == "none"}
    for m in medians:
        if key(m) in plain:
            m["over_plain"] = m["decode_tps"] / plain[key(m)]
    save_result(args, {"rows": rows, "medians": medians})


if __name__ == "__main__":
    main()
