"""Engine tokens/s on a GPU with torch's cuDNN SDPA backend allowed vs left out.

  python bench/sdpa_backends.py --out bench/results/gpu/sdpa-backends.json   # on the GPU machine

The engine leaves cuDNN out on CUDA (`ModelRunner.attention_backends`: cuDNN plans per input
shape, and serving shapes change every step). This measures that choice: the GPU suite's
Qwen3-shaped random target, plain decoding and static:7 with the replay drafter (acceptance
0.8), 64 tokens per request, concurrency 1 and 8, three interleaved rounds of each variant;
medians of tokens/s. Needs only torch and transformers, like the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout, whatever is installed


import bench.replay  # noqa: E402, F401  (registers the "replay" drafter)
from bench.common import machine, run_engine_closed_loop  # noqa: E402
from bench.gpu_suite import Suite, SuiteConfig, _sync  # noqa: E402
from dspark_serve.drafter.registry import build_drafter  # noqa: E402


def run(device: str, shape: str, concurrency: list[int], tokens: int, rounds: int, scratch: Path) -> dict:
    cfg = SuiteConfig(device=device, dtype="bfloat16", shapes=(shape,), concurrency=(1, 8), max_tokens=tokens)
    suite = Suite(cfg, scratch)  # the suite's own report of the build lands in scratch
    suite.build({})
    m = suite.models[0]
    replay = build_drafter(
        "replay", references={}, vocab_size=m.shape.vocab_size, block_size=7, accept_rate=0.8, seed=0
    )
    leave_out = m.runner.attention_backends
    variants = {"no-cudnn": leave_out, "cudnn": contextlib.nullcontext}
    res: dict = {"shape": shape, "device": suite._device_name(), "machine": machine(), "tokens": tokens}
    for conc in concurrency:
        prompts = suite.prompts(m.shape, conc, salt=100 + conc)
        rows: dict[str, list[float]] = {}
        for rnd in range(rounds):
            for variant, backends in variants.items():
                m.runner.attention_backends = backends  # type: ignore[method-assign]
                for policy in ("none", "static:7"):
                    if policy == "none":  # the continuation the replay drafter replays
                        eng = suite.engine(m, replay)
                        done: list = []
                        label = f"ref{rnd}{variant}"
                        run_engine_closed_loop(
                            eng, prompts, conc, tokens, 0.0, label, ignore_eos=True, finished=done
                        )
                        replay.references.update({tuple(r.prompt_ids): r.output_ids for r in done})
                    eng = suite.engine(m, replay)
                    eng.set_policy(policy)
                    _sync(suite.dev)
                    t0 = time.perf_counter()
                    run_engine_closed_loop(
                        eng, prompts, conc, tokens, 0.0, f"{rnd}{variant}{policy}", ignore_eos=True
                    )
                    _sync(suite.dev)
                    rows.setdefault(f"{variant}/{policy}", []).append(
                        round(conc * tokens / (time.perf_counter() - t0), 1)
                    )
        m.runner.attention_backends = leave_out  # type: ignore[method-assign]
        res[f"c{conc}_tokens_per_s"] = {
            k: {"rounds": v, "median": statistics.median(v)} for k, v in rows.items()
        }
        print(conc, json.dumps(res[f"c{conc}_tokens_per_s"]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-0.6b-like")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        res = run(
            a.device, a.shape, [int(c) for c in a.concurrency.split(",")], a.tokens, a.rounds, Path(scratch)
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
