"""Stage files too large for one copy to a GPU machine, in parts, and join them there.

A command sent to the GPU machine carries the working tree and a few ignored paths, 64 MiB in
all; the embedded target's GGUF (about 98 MB) and what reads it (the pure-Python `gguf` wheel)
do not fit beside the tree. Here they are cut into parts of at most --part-mib under a folder
git ignores (list it in .git/info/exclude), one part carried per command; ignored files stay on
the GPU machine between commands while it is up, so the last command joins them, checks every
SHA-256 and trains (docs/training.md has the commands).

  python bench/gpu_stage.py split --out .gpu-stage FILE...      # here
  python bench/gpu_stage.py join --stage .gpu-stage --dest DIR  # there: the files, checked
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split(files: list[Path], out: Path, part_mib: float) -> list[Path]:
    """Each file cut into numbered parts of at most part_mib under `out`, and a manifest of
    names, sizes, part lists and SHA-256 sums. -> the parts, in the order to carry them."""
    out.mkdir(parents=True, exist_ok=True)
    limit = int(part_mib * 2**20)
    manifest, parts = [], []
    for f in files:
        names = []
        with open(f, "rb") as src:
            for i, chunk in enumerate(iter(lambda: src.read(limit), b"")):
                part = out / f"{f.name}.part{i:03d}"
                part.write_bytes(chunk)
                names.append(part.name)
                parts.append(part)
        manifest.append({"name": f.name, "size": f.stat().st_size, "sha256": _sha256(f), "parts": names})
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return parts


def join(stage: Path, dest: Path) -> list[Path]:
    """The staged files rebuilt in `dest`; ValueError naming a missing part or a bad sum."""
    manifest = json.loads((stage / MANIFEST).read_text())
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for entry in manifest:
        missing = [p for p in entry["parts"] if not (stage / p).exists()]
        if missing:
            raise ValueError(f"{entry['name']}: parts not staged yet: {missing}")
        target = dest / entry["name"]
        with open(target, "wb") as out:
            for p in entry["parts"]:
                out.write((stage / p).read_bytes())
        if target.stat().st_size != entry["size"] or _sha256(target) != entry["sha256"]:
            raise ValueError(f"{entry['name']}: joined file does not match its SHA-256")
        done.append(target)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("files", nargs="+", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--part-mib", type=float, default=18.0)
    j = sub.add_parser("join")
    j.add_argument("--stage", type=Path, required=True)
    j.add_argument("--dest", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "split":
        for p in split(a.files, a.out, a.part_mib):
            print(p)
    else:
        for p in join(a.stage, a.dest):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
