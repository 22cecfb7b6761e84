"""The target's linear layers at a few row counts: the C `gemm` kernel against oneDNN's
prepacked kernel (bf16: the fallback above SMALL_GEMM_ROWS; float32: what `--linear mkldnn`
runs), same weights, same process.

  python bench/gemm_rows.py --out bench/results/gemm-rows.json
  python bench/gemm_rows.py --dtype float32 --out bench/results/gemm-rows-float32.json

Rows are the tokens of one forward: 1 for a lone decode, B for B decoding requests, B x (1 + k)
for a verify step. Per row count, the fastest of --repeats passes over every decoder-layer
linear (the LM head is left out: its cost follows the logit rows, not the step's tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import machine, timing_args  # noqa: E402


def best_pass(linears, xs, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for lin, x in zip(linears, xs):
            lin(x)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96],
    )
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = timing_args(ap)
    from dspark_serve.ops.linear import make_linear
    from dspark_serve.scheduler.llm import LLM

    dtype = getattr(torch, args.dtype)
    runner = LLM(
        drafter="none", dtype=args.dtype, linear="gemm", max_model_len=512, kv_cache_tokens=1024
    ).engine.runner
    gemm = runner.forward_impl.weights.products()
    for lin in gemm:
        lin.max_rows = max(args.rows)  # the kernel at every row count asked for
    if dtype == torch.bfloat16:
        onednn = [lin.fallback for lin in gemm]
    else:  # the float32 kernel has no row limit: oneDNN's prepacked kernel over weights of the same shapes
        onednn = [make_linear(torch.randn(lin.N, lin.K) * 0.02, None, "mkldnn", "none") for lin in gemm]
    weight_mb = sum(lin.N * lin.K for lin in gemm) * dtype.itemsize / 1e6
    rows = []
    for m in args.rows:
        xs = [torch.randn(m, lin.K, dtype=dtype) for lin in gemm]
        g = best_pass(gemm, xs, args.repeats)
        o = best_pass(onednn, xs, args.repeats)
        rows.append({"rows": m, "gemm_s": g, "onednn_s": o, "onednn_over_gemm": o / g})
        print(f"{m:3d} rows: gemm {g * 1e3:6.2f} ms  oneDNN {o * 1e3:6.2f} ms  ({o / g:.2f}x)", flush=True)
    result = {
        "rows": rows,
        "weight_mb": weight_mb,
        "linears": len(gemm),
        "dtype": args.dtype,
        "machine": machine(),
        "args": vars(args) | {"out": str(args.out), "rows": args.rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
