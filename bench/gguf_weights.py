"""The embedded model served from its GGUF blocks (`--weights gguf`, the CPU default) beside the
same model in dense floats (`--weights bf16` or `fp32`: what `--dtype auto` served before), in one
process, taking turns for --rounds rounds so a slow spell of a shared machine hits all of them:

- the target's forward alone, per step of 1, 2, 4, 8 and 16 tokens of one sequence (a decode step
  and verification blocks), median of --reps;
- plain decoding and the default (DSpark + prompt lookup, load-aware policy) per user at
  --concurrency requests, greedy and sampled (--temperatures), the dev prompts chat-templated,
  the same per-user metric as bench/llamacpp.py (tokens / (last token - first token), median);
- greedy texts of blocks vs dense float32 (`--compare-prompts`, 0 to skip): how many are equal,
  and where they differ, the first differing position.

  python bench/gguf_weights.py --dense bf16 --out bench/results/gguf-weights-zen4.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import chat_ids  # noqa: E402
from bench.common import DATA, load_prompts, median, run_engine_closed_loop, save_result  # noqa: E402


def forward_ms(engine, rows: int, reps: int) -> float:
    """Median ms of the target's forward over `rows` new tokens of one sequence at position 64.
    Run before the engine serves anything: it writes the KV of the cache's first blocks, which
    hold nothing yet (the prefix cache is empty), and the engine's own requests write theirs
    before they read them."""
    from dspark_serve.verifier.forward import Segment

    runner = engine.runner
    table = list(range(-(-(64 + rows) // runner.block_size)))
    seg = Segment("bench", list(range(1, rows + 1)), 64, 0, table)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward([seg])
        times.append(time.perf_counter() - t0)
    return 1000 * median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--dense", default="fp32", choices=("fp32", "bf16"), help="the dense weights beside")
    ap.add_argument(
        "--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7, 1.0]
    )
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="forward timings per row count")
    ap.add_argument("--compare-prompts", type=int, default=48)
    ap.add_argument("--compare-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from dspark_serve.ops.quant_kernels import quant_path
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM

    t_start = time.time()
    opts = {"drafter": "dspark+ngram", "max_num_seqs": max(4, args.concurrency), "max_model_len": 2048}
    engines = {"gguf": LLM(weights="gguf", **opts), args.dense: LLM(weights=args.dense, **opts)}
    tok = engines["gguf"].tokenizer
    texts = load_prompts(args.data, max(args.prompts, args.compare_prompts))
    prompts = [chat_ids(tok, t, args.max_prompt) for _, t in texts]
    rows: list[dict] = []
    for rnd in range(args.rounds):  # before anything is served (see forward_ms)
        for name, llm in engines.items():
            steps = {n: forward_ms(llm.engine, n, args.reps) for n in (1, 2, 4, 8, 16)}
            rows.append(
                {"weights": name, "kind": "forward_ms", "round": rnd, **{str(k): v for k, v in steps.items()}}
            )
            print(
                f"round {rnd} {name:5s} forward ms " + " ".join(f"{k}:{v:.2f}" for k, v in steps.items()),
                flush=True,
            )
    for llm in engines.values():  # warm-up
        llm.engine.set_policy("none")
        run_engine_closed_loop(llm.engine, prompts[:1], 1, 4, 0.0, "warmup")
    for rnd in range(args.rounds):
        for temp in args.temperatures:
            for name, llm in engines.items():
                eng = llm.engine
                for policy, label in (("none", "plain"), ("dspark", "default")):
                    eng.set_policy(policy)
                    p = run_engine_closed_loop(
                        eng,
                        prompts[: args.prompts],
                        args.concurrency,
                        args.max_tokens,
                        temp,
                        label,
                        seed=None,
                    )
                    rows.append(
                        {
                            "weights": name,
                            "kind": label,
                            "temperature": temp,
                            "round": rnd,
                            "per_user_tps": p.per_user_tps,
                            "aggregate_tps": p.aggregate_tps,
                            "tau": p.tau,
                        }
                    )
                    print(
                        f"round {rnd} T={temp} {name:5s} {label:8s} per-user {p.per_user_tps:6.1f} "
                        f"tau {p.tau or 0:4.2f}",
                        flush=True,
                    )
    summary: dict = {}
    for name in engines:
        fw = [r for r in rows if r["weights"] == name and r["kind"] == "forward_ms"]
        summary[f"{name} forward_ms"] = {k: median(r[k] for r in fw) for k in ("1", "2", "4", "8", "16")}
        for temp in args.temperatures:
            for label in ("plain", "default"):
                sel = [
                    r
                    for r in rows
                    if r["weights"] == name and r["kind"] == label and r["temperature"] == temp
                ]
                summary[f"{name} {label} T={temp}"] = median(r["per_user_tps"] for r in sel)
    for temp in args.temperatures:
        for label in ("plain", "default"):
            summary[f"gguf/{args.dense} {label} T={temp}"] = (
                summary[f"gguf {label} T={temp}"] / summary[f"{args.dense} {label} T={temp}"]
            )
    compare = None
    if args.compare_prompts:
        ref = (
            LLM(weights="fp32", drafter="none", max_num_seqs=8, max_model_len=2048)
            if args.dense != "fp32"
            else None
        )
        dense_llm = ref or engines["fp32"]
        greedy = SamplingParams(temperature=0.0)
        ids = prompts[: args.compare_prompts]
        engines["gguf"].engine.set_policy("none")
        dense_llm.engine.set_policy("none")
        a = engines["gguf"].generate(ids, greedy, args.compare_tokens)
        b = dense_llm.generate(ids, greedy, args.compare_tokens)
        differ = [
            next((i for i, (x, y) in enumerate(zip(p.token_ids, q.token_ids)) if x != y), None)
            for p, q in zip(a, b)
        ]
        compare = {
            "prompts": len(ids),
            "tokens": args.compare_tokens,
            "equal": sum(d is None for d in differ),
            "first_difference": [d for d in differ if d is not None],
        }
        print("greedy blocks vs float32:", compare, flush=True)
    result = {
        "quant_path": quant_path(),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "summary": summary,
        "greedy_blocks_vs_float32": compare,
        "seconds": time.time() - t_start,
    }
    save_result(args, result)
    for k, v in summary.items():
        print(k, v)


if __name__ == "__main__":
    main()
