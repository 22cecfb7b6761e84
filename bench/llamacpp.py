"""This engine beside llama.cpp's, one stream at a time, on the same GGUF and the same prompts.

llama.cpp (through llama-cpp-python) runs the embedded model's GGUF as it is (Q4_1 weights);
this engine loads the same file (dequantised to its dtype) and runs plain decoding and the
default configuration (DSpark + prompt lookup, dspark policy). Greedy, the same chat-templated
prompt tokens on both sides, and the same per-user metric: completion tokens / (last token -
first token), median over requests. The three take turns for `--rounds` rounds so a slow spell
of a shared machine hits all of them.

llama-cpp-python is not a dependency of this project (it builds from source, which takes
minutes on a small machine); install it into the environment that runs this script:

    pip install llama-cpp-python
    python bench/llamacpp.py --out bench/results/llamacpp-side-by-side.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import DATA, load_prompts, machine, median, run_engine_closed_loop  # noqa: E402


def llamacpp_point(llm, prompts: list[list[int]], max_tokens: int, eos: int) -> dict:
    """Greedy decoding of each prompt alone; per-user tok/s as run_engine_closed_loop counts it."""
    per_user, ttft, total = [], [], 0
    t_all = time.perf_counter()
    for ids in prompts:
        llm.reset()
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            n += 1
            if tok == eos or n >= max_tokens:
                break
        total += n
        ttft.append((first or t0) - t0)
        if n > 1 and first is not None and last is not None:
            per_user.append(n / max(last - first, 1e-6))
    return {
        "label": "llama.cpp",
        "per_user_tps": median(per_user),
        "aggregate_tps": total / (time.perf_counter() - t_all),
        "ttft_s": median(ttft),
        "completion_tokens": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="folder of dev-*.jsonl prompt sets")
    ap.add_argument("--prompts", type=int, default=6, help="prompts (round-robin over the dev sets)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is not installed here (pip install llama-cpp-python)")

    from bench.bench_engine import chat_ids
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.verifier.loader import embedded_gguf_path

    torch.set_num_threads(args.threads)
    t_start = time.time()
    ours = LLM(drafter="dspark+ngram", max_num_seqs=4, max_model_len=2048)
    eng = ours.engine
    prompts = [chat_ids(ours.tokenizer, t, args.max_prompt) for _, t in load_prompts(args.data, args.prompts)]
    gguf = embedded_gguf_path()
    lc = Llama(model_path=str(gguf), n_ctx=2048, n_threads=args.threads, n_batch=512, verbose=False)
    eos = int(ours.tokenizer.eos_token_id)
    eng.set_policy("none")
    run_engine_closed_loop(eng, prompts[:1], 1, 4, 0.0, "warmup")
    llamacpp_point(lc, prompts[:1], 4, eos)
    rows = []
    for rnd in range(args.rounds):
        r = llamacpp_point(lc, prompts, args.max_tokens, eos)
        rows.append({**r, "round": rnd})
        print(f"round {rnd} llama.cpp per-user {r['per_user_tps']:6.1f}", flush=True)
        for policy, label in (("none", "plain"), ("dspark", "default")):
            eng.set_policy(policy)
            p = run_engine_closed_loop(eng, prompts, 1, args.max_tokens, 0.0, label)
            rows.append(
                {
                    "label": label,
                    "per_user_tps": p.per_user_tps,
                    "aggregate_tps": p.aggregate_tps,
                    "ttft_s": p.ttft_s,
                    "completion_tokens": p.completion_tokens,
                    "tau": p.tau,
                    "round": rnd,
                }
            )
            print(f"round {rnd} {label:9s} per-user {p.per_user_tps:6.1f} tau {p.tau or 0:4.2f}", flush=True)
    medians = {
        label: median(r["per_user_tps"] for r in rows if r["label"] == label)
        for label in ("llama.cpp", "plain", "default")
    }
    result = {
        "machine": machine(),
        "gguf": gguf.name,
        "dtype": str(eng.runner.dtype),
        "args": {
            k: (os.path.relpath(v, ROOT) if isinstance(v, Path) else str(v)) for k, v in vars(args).items()
        },
        "rows": rows,
        "median_per_user_tps": medians,
        "default_vs_llamacpp": medians["default"] / medians["llama.cpp"] if medians["llama.cpp"] else None,
        "plain_vs_llamacpp": medians["plain"] / medians["llama.cpp"] if medians["llama.cpp"] else None,
        "seconds": time.time() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(medians), "->", args.out)


if __name__ == "__main__":
    main()
