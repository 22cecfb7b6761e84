"""Every Triton kernel launch the engine can make for the served model shapes, compiled with
Triton's own compiler for sm_80 and sm_90 (no GPU needed), as a markdown table: registers a
thread, spilled bytes and shared memory a block. tests/ops/test_triton_compile.py holds the same
list to 0 spills and the targets' shared-memory limits; docs/benchmarks.md has the table.

    python bench/triton_compile.py > /tmp/table.md

Run it without TRITON_INTERPRET set: under the interpreter `triton.jit` makes functions the
compiler does not take.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_serve.ops.triton_launch import (  # noqa: E402
    SHARED_LIMIT,
    KernelLaunch,
    ModelShape,
    compile_launch,
    engine_launches,
)
from dspark_serve.scheduler.config import SchedulerConfig  # noqa: E402
from dspark_serve.verifier.config import ModelConfig  # noqa: E402

# The shapes the engine serves with Triton (their config.json values): the Qwen3 targets of
# the public DSpark drafters (the drafters' layers share their target's heads) and the
# embedded model.
SERVED_SHAPES = (
    ModelShape("Qwen3-4B", 32, 8, 128, 2560, 9728),
    ModelShape("Qwen3-8B", 32, 8, 128, 4096, 12288),
    ModelShape("Qwen3-14B", 40, 8, 128, 5120, 17408),
    ModelShape("SmolLM2-135M", 9, 3, 64, 576, 1536),
)
DTYPES = (torch.bfloat16, torch.float16)
ARCHES = tuple(SHARED_LIMIT)


def all_launches() -> list[tuple[str, KernelLaunch]]:
    """(the shapes that use it, launch) for every distinct launch of every served shape."""
    block, tokens = ModelConfig().kv_block_size, SchedulerConfig().max_num_batched_tokens
    seen: dict[tuple, tuple[list[str], KernelLaunch]] = {}
    for shape in SERVED_SHAPES:
        for dtype in DTYPES:
            for launch in engine_launches(shape, dtype, block, tokens):
                seen.setdefault(launch.key, ([], launch))[0].append(shape.name)
    return [(", ".join(dict.fromkeys(names)), launch) for names, launch in seen.values()]


def describe(launch: KernelLaunch) -> str:
    dtype = next(t for t in launch.signature.values() if t.startswith("*") and t[1:] in ("bf16", "fp16"))[1:]
    keys = (
        "GROUP",
        "HEAD_DIM",
        "BLOCK_M",
        "BLOCK_Q",
        "CAUSAL",
        "HAS_DELTA",
        "HAS_BIAS",
        "BLOCK",
        "NUM_HEADS",
    )
    fixed = " ".join(f"{k}={launch.constexprs[k]}" for k in keys if k in launch.constexprs)
    fixed += f" warps={launch.num_warps}"
    out = launch.signature.get("y_ptr")
    return f"{dtype} {fixed}" + (" fp32 out" if out == "*fp32" else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON record a launch and target, not the table")
    args = ap.parse_args()
    if not args.json:
        print("| kernel | launch | shapes | sm_80 regs / spilled / shared | sm_90 regs / spilled / shared |")
        print("|---|---|---|---|---|")
    for names, launch in all_launches():
        compiled = [compile_launch(launch, arch) for arch in ARCHES]
        if args.json:
            for c in compiled:
                record = {"kernel": launch.kernel, "options": dict(launch.options), "shapes": names}
                print(json.dumps({**record, "arch": c.arch, "registers": c.registers, "spilled": c.spilled,
                                  "shared": c.shared}), flush=True)  # fmt: skip
            continue
        cells = " | ".join(f"{c.registers} / {c.spilled} / {c.shared}" for c in compiled)
        print(f"| {launch.kernel} | {describe(launch)} | {names} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
