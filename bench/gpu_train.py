"""The drafter's training run on a GPU machine, from a plain checkout (nothing installed there).

Joins the staged target and `gguf` wheel (bench/gpu_stage.py), puts the wheel on the import
path, and runs `dspark-train train-online` on the checkout's token shards; everything the run
writes (log, report, curves' data, both exports split to 16 MiB files) goes under --out.

  python bench/gpu_train.py --stage .gpu-stage --out "$OUT" --minutes 6.5   # on the GPU machine
  python bench/gpu_train.py --tiny --out /tmp/gpu-train                      # CPU, tiny (a test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout, whatever is installed

import bench  # noqa: E402, F401  (dspark_serve.* from this checkout)
from bench.gpu_stage import join  # noqa: E402

# The passes over prompts made here (data/prompts/train-made.jsonl.gz, `dspark-train
# make-prompts`), which copy no benchmark or dev prompt; the older passes answer prompts taken
# from benchmark test splits and stay only as the record of the CPU-trained drafter.
DATA = sorted((ROOT / "data" / "generated").glob("smollm2-135m-made*/data"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stage", type=Path, default=None, help="the staged parts (bench/gpu_stage.py split)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--minutes", type=float, default=6.5)
    ap.add_argument("--data", type=Path, nargs="+", default=DATA, help="folders of token shards")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("extra", nargs="*", help="more train-online arguments (after --)")
    a = ap.parse_args(argv)
    import torch

    from dspark_serve.training.cli import main as train_main

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = [
        "train-online",
        "--out",
        str(a.out),
        "--work",
        str(a.out / "work"),
        "--dest",
        str(a.out / "export"),
    ]
    args += ["--device", device, "--minutes", str(a.minutes)]
    if a.tiny:
        args += ["--tiny", "--steps", "12", "--batch-seqs", "4", "--num-anchors", "8", "--block-size", "4"]
        args += ["--markov-rank", "8", "--checkpoint-every", "6", "--threads", "1"]
    else:
        if a.stage is None:
            raise SystemExit("--stage is needed without --tiny: the target comes staged")
        files = join(a.stage, a.out / "staged")
        wheels = [str(f) for f in files if f.suffix == ".whl"]
        sys.path[:0] = wheels  # pure-Python wheels import from the zip
        model = next(str(f) for f in files if f.suffix == ".gguf")
        args += ["--model", model, "--data", *map(str, a.data)]
    return train_main(args + a.extra)


if __name__ == "__main__":
    sys.exit(main())
