"""The paged attention kernel alone at verify shapes: G requests of `context` keys, each with t
query tokens (an anchor and t - 1 drafts), the embedded model's geometry (9 query heads, 3 kv
heads, head_dim 64, bf16, 16-token blocks scattered over a large pool). The build as it is
against one without AMX (-mno-amx-*: the AVX512 paths), same process, same inputs; per shape
the median of --repeats calls, times the model's 30 layers.

  python bench/attention_rows.py --out bench/results/attention-rows-amx-bf16.json

On a CPU without AMX tiles both builds run the same code (the comparison says so: `tiles` 0).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import save_result, timing_args  # noqa: E402

NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
H, HKV, D, BLOCK, LAYERS = 9, 3, 64, 16, 30


def libraries() -> dict[str, object]:
    """{"native": the build as the server loads it, "no-amx": the same sources without AMX}."""
    import dspark_serve.ops.cpu_kernels as ck

    native = ck.load_kernels()
    flags = ck.CFLAGS
    try:
        ck.CFLAGS = flags + NO_AMX  # a different key: built and cached beside the native one
        ck._library_key.cache_clear()  # the key is read once per process
        plain = ck.load_kernels()
    finally:
        ck.CFLAGS = flags
        ck._library_key.cache_clear()
    if native is None or plain is None:
        raise SystemExit("the C kernels cannot be built here")
    if plain.paged_attention_tiles():  # type: ignore[attr-defined]
        raise SystemExit("the build without AMX still reports the tiles")
    return {"native": native, "no-amx": plain}


def time_shape(kern, kc, vc, G: int, t: int, context: int, repeats: int, rng: random.Random) -> float:
    num_blocks = kc.shape[1] // BLOCK
    nb = (context + t + BLOCK - 1) // BLOCK
    table = torch.tensor(rng.sample(range(num_blocks), G * nb), dtype=torch.int32).view(G, nb)
    q = torch.randn(G * t, H, D).bfloat16()
    out = torch.empty_like(q)
    row0 = torch.arange(G, dtype=torch.int32) * t
    n = torch.full((G,), t, dtype=torch.int32)
    start = torch.full((G,), context, dtype=torch.int32)
    kern(q, kc, vc, out, row0, n, start, table, 0.125)  # warm-up
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kern(q, kc, vc, out, row0, n, start, table, 0.125)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[320, 1024])
    args = timing_args(ap, repeats=30)
    from dspark_serve.ops.cpu_kernels import PagedAttention

    libs = libraries()
    kernels = {name: PagedAttention(lib, H, HKV, D, BLOCK) for name, lib in libs.items()}
    pool = 6000 * BLOCK
    kc = torch.randn(HKV, pool, D).bfloat16()
    vc = torch.randn(HKV, pool, D).bfloat16()
    rows = []
    for context in args.contexts:
        for G in args.requests:
            for t in args.tokens:
                row = {"context": context, "requests": G, "tokens_each": t}
                for name, kern in kernels.items():  # the same tables for both: one seed per shape
                    s = time_shape(kern, kc, vc, G, t, context, args.repeats, random.Random(G * 1000 + t))
                    row[f"{name}_ms_per_forward"] = s * LAYERS * 1e3
                row["no_amx_over_native"] = row["no-amx_ms_per_forward"] / row["native_ms_per_forward"]
                rows.append(row)
                print(
                    f"context {context:5d}  {G:3d} requests x {t} tokens: native "
                    f"{row['native_ms_per_forward']:7.2f} ms  no-AMX {row['no-amx_ms_per_forward']:7.2f} ms "
                    f"({row['no_amx_over_native']:.2f}x)",
                    flush=True,
                )
    tiles = {name: int(lib.paged_attention_tiles()) for name, lib in libs.items()}  # type: ignore[attr-defined]
    geometry = {"heads": H, "kv_heads": HKV, "head_dim": D, "block": BLOCK, "layers": LAYERS}
    save_result(args, {"rows": rows, "tiles": tiles, "geometry": geometry})


if __name__ == "__main__":
    main()
