"""Acceptance length per dev set through the serving engine, and the live calibration of the
drafter's survival probabilities, at a fixed verification length (default static:7), per
sampling temperature (default greedy; sampled requests unseeded with `--unseeded`: rejection
sampling against the drafter's q, as most API requests come; seeded ones sample keyed by
position and draft greedily).

    python bench/acceptance.py --drafters dspark dflash ngram dspark+ngram --out bench/results/acceptance.json
    python bench/acceptance.py --drafters dspark+ngram --temperatures 0,0.7,1 --unseeded --out /tmp/a.json

tau = (accepted drafts + rounds) / rounds over every verification round of every request;
`rounds` says how many rounds stand behind each figure. For drafters with a confidence head
the per-position ECE of the cumulative survival probability (what the policy uses) is reported
over every verified draft of the run, with their number (`survival_ece`, `ece_samples`) and the
ECE a perfectly calibrated head would show on as many drafts (`ece_noise_floor`: each bin's
binomial noise, which shrinks as drafts accumulate, so judging a small ECE takes many more drafts
than the 1,000 minimum), and
over the calibrator's window alone (`window_ece`, what `/metrics` exports).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, DOMAINS, load_prompts, machine  # noqa: E402


def run_domain(
    llm,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    label: str,
    temperature: float,
    seed: int | None,
) -> dict:
    from bench.common import run_engine_closed_loop

    r = run_engine_closed_loop(llm.engine, prompts, concurrency, max_tokens, temperature, label, seed=seed)
    return {
        "tau": r.tau,
        "rounds": r.extra["rounds"],
        "completion_tokens": r.completion_tokens,
        "requests": r.requests,
        "per_user_tps": r.per_user_tps,
        "aggregate_tps": r.aggregate_tps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["dspark", "dflash", "ngram"])
    ap.add_argument("--policy", default="static:7")
    ap.add_argument(
        "--drafter-path",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="checkpoint for drafter NAME (repeatable; default: the embedded one)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="per dev set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--temperatures", default="0", help="comma-separated; each a run of its own")
    ap.add_argument("--unseeded", action="store_true", help="sampled requests carry no seed")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/acceptance.json")
    args = ap.parse_args()
    from bench.bench_engine import chat_ids
    from dspark_serve.drafter.online_calibration import sampling_bucket
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM

    result = {
        "machine": machine(),
        "policy": args.policy,
        "drafter_paths": args.drafter_path,
        "prompts_per_set": args.prompts,
        "max_tokens": args.max_tokens,
        "unseeded": args.unseeded,
        "drafters": {},
    }
    temperatures = [float(t) for t in args.temperatures.split(",")]
    for name, temperature in ((n, t) for n in args.drafters for t in temperatures):
        t0 = time.perf_counter()
        paths = dict(spec.split("=", 1) for spec in args.drafter_path)
        llm = LLM(
            drafter=name,
            drafter_path=paths.get(name),
            verify_policy=args.policy,
            dtype=args.dtype,
            max_num_seqs=args.concurrency,
            max_model_len=1024,
            kv_cache_tokens=65536,
        )
        rows = {}
        for d in DOMAINS:
            texts = [t for _, t in load_prompts(DATA, args.prompts, domains=(d,))]
            prompts = [chat_ids(llm.tokenizer, t, args.max_prompt) for t in texts]
            seed = None if args.unseeded else 0
            rows[d] = run_domain(
                llm, prompts, args.concurrency, args.max_tokens, f"{name}-{d}", temperature, seed
            )
        eng = llm.engine
        bucketed = getattr(eng.drafter, "calibrator", None)
        # the run's own sampling bucket (each temperature is a run of its own)
        cal = (
            None
            if bucketed is None
            else bucketed.buckets[sampling_bucket(SamplingParams(temperature=temperature))]
        )
        out = {
            "per_set": rows,
            "macro_tau": sum(r["tau"] or 1.0 for r in rows.values()) / len(rows),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if cal is not None:
            cum = cal.cumulative_ece()
            out["survival_ece"] = [c.ece for c in cum]  # every verified draft of the run
            out["ece_samples"] = [c.samples for c in cum]
            # what a perfectly calibrated head would show on as many drafts (binomial noise)
            out["ece_noise_floor"] = [c.noise_floor for c in cum]
            out["window_ece"] = cal.survival_ece()  # the last `window` ones (what /metrics shows)
            out["temperatures"] = list(cal.temperatures)
            out["biases"] = list(cal.biases)
        key = name if temperatures == [0.0] else f"{name}@T={temperature:g}"
        result["drafters"][key] = out
        print(
            key,
            json.dumps({d: round(r["tau"] or 0, 2) for d, r in rows.items()}),
            "macro",
            round(out["macro_tau"], 2),
            flush=True,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
