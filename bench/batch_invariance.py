"""The batch-invariant forward against today's default, in bf16 on the embedded model: how often
greedy (and seeded) texts change with speculation and batching, and what the mode costs.

For each mode (default, --batch-invariant), on the same held-out prompts, greedy:
  - plain decoding alone is the reference;
  - plain decoding with every prompt in one batch;
  - speculative decoding (the default server's drafter and policy) alone, and in one batch;
  - seeded sampling (temperature 0.8) without and with speculation, alone and in one batch.
Then speed, the modes interleaved round by round: per-user tokens/s of speculative decoding at
one request (the prompts one after another) and at all of them together (--batch requests).

    python bench/batch_invariance.py --out bench/results/batch-invariance.json
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

from bench.common import DATA, load_prompts, machine, report_args  # noqa: E402
from bench.dtype_divergence import compare  # noqa: E402

MODES = {"default": False, "batch_invariant": True}


def generate(llm, prompts, sampling, max_tokens: int, together: bool) -> tuple[list[list[int]], float]:
    """-> (each prompt's output ids, per-user tokens/s: the median over requests of tokens / wall
    time of the call that produced them)."""
    calls = [prompts] if together else [[p] for p in prompts]
    outs, rates = [], []
    for batch in calls:
        t0 = time.perf_counter()
        got = llm.generate(batch, sampling, max_tokens, ignore_eos=True)
        dt = time.perf_counter() - t0
        outs += [o.token_ids for o in got]
        rates += [len(o.token_ids) / dt for o in got]
    return outs, statistics.median(rates)


def divergence(llms: dict, prompts, max_tokens: int) -> dict:
    from dspark_serve.ops.sampling_params import SamplingParams

    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1234)
    plain, spec = llms["plain"], llms["spec"]
    alone = generate(plain, prompts, greedy, max_tokens, together=False)[0]
    sampled = generate(plain, prompts, seeded, max_tokens, together=False)[0]
    return {
        "plain_batched_vs_alone": compare(alone, generate(plain, prompts, greedy, max_tokens, True)[0]),
        "spec_alone_vs_plain": compare(alone, generate(spec, prompts, greedy, max_tokens, False)[0]),
        "spec_batched_vs_plain": compare(alone, generate(spec, prompts, greedy, max_tokens, True)[0]),
        "seeded_spec_alone_vs_plain": compare(sampled, generate(spec, prompts, seeded, max_tokens, False)[0]),
        "seeded_spec_batched_vs_plain": compare(
            sampled, generate(spec, prompts, seeded, max_tokens, True)[0]
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", default="humaneval", help="dev set the prompts come from")
    ap.add_argument("--prompts", type=int, default=16, help="prompts (the batch is all of them)")
    ap.add_argument("--speed-prompts", type=int, default=6, help="prompts of the one-request speed runs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds, the modes interleaved")
    ap.add_argument("--drafter", default="dspark+ngram")
    ap.add_argument("--verify-policy", default="auto")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/batch-invariance.json")
    args = ap.parse_args()
    from bench.bench_engine import chat_ids
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM

    texts = [t for _, t in load_prompts(DATA, args.prompts, domains=(args.domain,))]
    common = dict(dtype="bfloat16", max_num_seqs=len(texts), max_model_len=1024, kv_cache_tokens=32768)
    llms = {}
    for mode, invariant in MODES.items():
        llms[mode] = {
            "plain": LLM(batch_invariant=invariant, **common),
            "spec": LLM(
                batch_invariant=invariant, drafter=args.drafter, verify_policy=args.verify_policy, **common
            ),
        }
    tok = llms["default"]["plain"].tokenizer
    prompts = [chat_ids(tok, t, args.max_prompt) for t in texts]
    result: dict = {
        "machine": machine(),
        "args": report_args(args),
        "forward": {m: llms[m]["spec"].engine.runner.describe() for m in MODES},
        "divergence": {},
        "speed": {},
    }
    for mode in MODES:
        t0 = time.perf_counter()
        result["divergence"][mode] = divergence(llms[mode], prompts, args.max_tokens)
        print(mode, json.dumps(result["divergence"][mode]), f"{time.perf_counter() - t0:.0f} s", flush=True)
    greedy = SamplingParams(temperature=0.0)
    rates: dict[str, dict[str, list[float]]] = {m: {"c1": [], f"c{len(prompts)}": []} for m in MODES}
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else reversed(list(MODES)):
            spec = llms[mode]["spec"]
            rates[mode]["c1"].append(
                generate(spec, prompts[: args.speed_prompts], greedy, args.max_tokens, False)[1]
            )
            rates[mode][f"c{len(prompts)}"].append(generate(spec, prompts, greedy, args.max_tokens, True)[1])
        print("round", rnd, json.dumps(rates), flush=True)
    for mode in MODES:
        result["speed"][mode] = {
            k: {"per_user_tok_s_median": round(statistics.median(v), 1), "rounds": v}
            for k, v in rates[mode].items()
        }
    result["speed"]["invariant_over_default"] = {
        k: round(statistics.median(rates["batch_invariant"][k]) / statistics.median(rates["default"][k]), 3)
        for k in rates["default"]
    }
    print(json.dumps(result["speed"]["invariant_over_default"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
