"""What each dtype guarantees: how often greedy texts change with how tokens share a forward.

On the same prompts, greedy, at each dtype:
  - alone vs batched: every prompt decoded on its own vs all of them in one continuous batch
    (plain decoding both times: the only difference is how many tokens share each forward);
  - plain vs speculative: plain decoding alone vs each drafter (static full blocks) alone.
In float32 every text must be identical (the losslessness proof). In bfloat16 a token's logits
depend on the forward's shape, so batching alone changes some texts; speculation must not
change them more often than batching does.

    python bench/dtype_divergence.py --out bench/results/dtype_divergence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, load_prompts, machine  # noqa: E402


def generate(llm, prompts: list[list[int]], max_tokens: int, together: bool) -> list[list[int]]:
    from dspark_serve.ops.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    if together:
        return [o.token_ids for o in llm.generate(prompts, greedy, max_tokens)]
    return [llm.generate([p], greedy, max_tokens)[0].token_ids for p in prompts]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref: list[list[int]], other: list[list[int]]) -> dict:
    div = [first_divergence(a, b) for a, b in zip(ref, other)]
    return {
        "identical": sum(d is None for d in div),
        "of": len(ref),
        "first_divergence": [d for d in div if d is not None],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--drafters", nargs="+", default=["ngram", "dspark"])
    ap.add_argument("--domain", default="humaneval", help="dev set the prompts come from")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/dtype_divergence.json")
    args = ap.parse_args()
    from bench.bench_engine import chat_ids
    from dspark_serve.scheduler.llm import LLM

    texts = [t for _, t in load_prompts(DATA, args.prompts, domains=(args.domain,))]
    result = {
        "machine": machine(),
        "domain": args.domain,
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        "dtypes": {},
    }
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        plain = LLM(dtype=dtype, max_num_seqs=len(texts), max_model_len=1024, kv_cache_tokens=32768)
        prompts = [chat_ids(plain.tokenizer, t, args.max_prompt) for t in texts]
        alone = generate(plain, prompts, args.max_tokens, together=False)
        row = {"batched_vs_alone": compare(alone, generate(plain, prompts, args.max_tokens, True))}
        for name in args.drafters:
            spec = LLM(
                dtype=dtype,
                drafter=name,
                verify_policy="static:7" if name != "ngram" else "static:4",
                max_num_seqs=len(texts),
                max_model_len=1024,
                kv_cache_tokens=32768,
            )
            row[f"{name}_vs_plain"] = compare(alone, generate(spec, prompts, args.max_tokens, False))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        result["dtypes"][dtype] = row
        print(dtype, json.dumps(row))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
