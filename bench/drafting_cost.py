"""What drafting costs at one stream, beside a plain decode step of the same engine.

  python bench/drafting_cost.py --rounds 6 --steps 40 --out bench/results/drafting-cost-bf16.json

One engine with the embedded default (`dspark+ngram`, the default dtype). Each round decodes one
request for --steps steps plain (policy none: the step's wall time) and then one request for as
many steps with the default policy (dspark), where the DSpark drafter's proposals, all drafting
(both drafters and the choice between them) and the target's forward are timed inside the step.
Rounds alternate the two and rotate the prompts, so a slow spell of a shared machine hits both
sides; the figures are medians over rounds, and the share is the median DSpark proposal over the
median plain step (per round too). A proposal is timed only in steps where the DSpark drafter
drafted (prompt lookup may take a step instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, load_prompts, machine  # noqa: E402


class _Timer:
    """Wraps a bound method of an object in place: total seconds and calls while `on`."""

    def __init__(self, obj: object, name: str) -> None:
        self.seconds, self.calls, self.on = 0.0, 0, False
        inner = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if self.on:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

        setattr(obj, name, timed)

    def start(self) -> None:
        self.seconds, self.calls, self.on = 0.0, 0, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per run")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from bench.bench_engine import chat_ids
    from dspark_serve.drafter.dspark import DSparkDrafter
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.scheduler.request import Request, Status

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(drafter="dspark+ngram", max_num_seqs=4, max_model_len=2048)
    eng = llm.engine
    drafters = getattr(eng.drafter, "drafters", [eng.drafter])
    dspark = next(d for d in drafters if isinstance(d, DSparkDrafter))
    timers = {
        "dspark_proposal": _Timer(dspark, "propose"),
        "drafting": _Timer(eng.speculation, "_draft"),
        "forward": _Timer(eng.runner, "forward"),
    }
    prompts = [chat_ids(llm.tokenizer, t, args.max_prompt) for _, t in load_prompts(DATA, 12)]
    rows = []
    for rnd in range(args.rounds):
        for policy in ("none", "dspark"):
            eng.set_policy(policy)
            greedy = SamplingParams(temperature=0.0)
            r = Request(f"{rnd}-{policy}", prompts[rnd % len(prompts)], greedy, 1024, ignore_eos=True)
            eng.add_request(r)
            while r.status is not Status.DECODE:
                eng.step()
            for _ in range(3):  # past the first drafting step (the prompt's context absorbed)
                eng.step()
            for t in timers.values():
                t.start()
            made, t0 = len(r.output_ids), time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            wall = time.perf_counter() - t0
            row = {
                "round": rnd,
                "policy": policy,
                "step_ms": wall / args.steps * 1e3,
                "tokens_per_step": (len(r.output_ids) - made) / args.steps,
                "forward_ms": timers["forward"].seconds / args.steps * 1e3,
            }
            if policy != "none":
                p = timers["dspark_proposal"]
                row["dspark_proposal_ms"] = p.seconds / p.calls * 1e3 if p.calls else None
                row["dspark_steps"] = p.calls
                row["drafting_ms_per_step"] = timers["drafting"].seconds / args.steps * 1e3
            eng.abort(r.request_id)
            rows.append(row)
            print(json.dumps(row), flush=True)
    plain = [x["step_ms"] for x in rows if x["policy"] == "none"]
    prop = [x["dspark_proposal_ms"] for x in rows if x.get("dspark_proposal_ms")]
    draft = [x["drafting_ms_per_step"] for x in rows if x["policy"] != "none"]
    spec = [x for x in rows if x["policy"] != "none"]
    per_round = [
        s["dspark_proposal_ms"] / p["step_ms"]
        for p, s in zip([x for x in rows if x["policy"] == "none"], spec)
        if s.get("dspark_proposal_ms")
    ]
    summary = {
        "plain_step_ms": statistics.median(plain),
        "dspark_proposal_ms": statistics.median(prop) if prop else None,
        "drafting_ms_per_step": statistics.median(draft),
        "speculative_step_ms": statistics.median(x["step_ms"] for x in spec),
        "tokens_per_speculative_step": statistics.median(x["tokens_per_step"] for x in spec),
        "proposal_share_of_plain_step": statistics.median(prop) / statistics.median(plain) if prop else None,
        "proposal_share_per_round": per_round,
        "fastest_proposal_over_fastest_plain_step": min(prop) / min(plain) if prop else None,
    }
    print(json.dumps(summary, indent=1))
    cfg = {k: str(v) for k, v in vars(args).items()}
    out = {"machine": machine(), "args": cfg, "rows": rows, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
