"""Prefill chunks: the paged attention kernel (every chunk reads the cache in place) against
the block-gathering attention (SDPA over each chunk's gathered blocks), same process, same model.

  python bench/prefill.py --dtype bfloat16 --out bench/results/prefill-paged-vs-gather.json

For each context length, one request's prompt goes through the target in chunks of --chunk
tokens (the first chunk at position 0 attends to its own keys, every later one to the cache
before it as well, as chunked prefill and a prefix-cache hit do); per chunk the fastest of
--repeats forwards, both attention kinds timed in alternation so a slow spell hits both. The
speculative and decode paths are not here: bench/step_breakdown.py and bench_engine.py cover them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.common import save_result, timing_args  # noqa: E402


def chunk_times(runner, context: int, chunk: int) -> list[float]:
    """Seconds of each chunk's forward for one prompt of `context` tokens."""
    from dspark_serve.scheduler.block_manager import BlockManager

    kv = BlockManager(runner.kv.num_blocks, runner.kv.block_size)

    rid = "prefill-bench"
    ids = [(37 * i) % 30000 + 100 for i in range(context)]
    out = []
    for a in range(0, context, chunk):
        n = min(chunk, context - a)
        kv.append(rid, n)
        t0 = time.perf_counter()
        runner.forward([kv.segment(rid, ids[a : a + n], a, n - 1)])
        out.append(time.perf_counter() - t0)
    kv.free(rid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048])
    ap.add_argument("--chunk", type=int, default=512)
    args = timing_args(ap)
    from dspark_serve.scheduler.llm import LLM

    kinds = ("paged", "sdpa")
    runners = {}
    for kind in kinds:
        llm = LLM(drafter="none", dtype=args.dtype, attention=kind, max_model_len=4096, kv_cache_tokens=8192)
        runners[kind] = llm.engine.runner
        assert runners[kind].attention == kind, f"attention {kind} is not available here"
    for kind in kinds:  # warm-up: kernel builds, allocator
        chunk_times(runners[kind], args.chunk * 2, args.chunk)
    rows = []
    for context in args.contexts:
        times: dict[str, list[list[float]]] = {k: [] for k in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(chunk_times(runners[kind], context, args.chunk))
        row: dict = {"context": context, "chunk": args.chunk}
        for kind in kinds:
            per_chunk = [min(r[i] for r in times[kind]) for i in range(len(times[kind][0]))]
            row[kind] = {
                "chunk_s": per_chunk,
                "total_s": sum(per_chunk),
                "median_total_s": statistics.median(sum(r) for r in times[kind]),
            }
        row["sdpa_over_paged"] = row["sdpa"]["total_s"] / row["paged"]["total_s"]
        print(
            f"context {context:5d}: paged {row['paged']['total_s'] * 1e3:8.1f} ms "
            f"(last chunk {row['paged']['chunk_s'][-1] * 1e3:6.1f}), gathered sdpa "
            f"{row['sdpa']['total_s'] * 1e3:8.1f} ms (last chunk {row['sdpa']['chunk_s'][-1] * 1e3:6.1f}): "
            f"{row['sdpa_over_paged']:.2f}x",
            flush=True,
        )
        rows.append(row)
    save_result(args, {"rows": rows, "dtype": args.dtype})


if __name__ == "__main__":
    main()
