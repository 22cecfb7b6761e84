"""Run a command as a narrower CPU than this one: `python bench/as_cpu.py avx2 -- python
bench/bench_engine.py sweep ...` runs the sweep with the AVX512 and AMX flags hidden from the
server's dispatch (so `--dtype auto` is float32), the C kernels built without them (a library
of their own in the kernel cache), and numpy's OpenBLAS, torch, oneDNN and MKL held to AVX2
(`ops/platform.py`, `CPU_LEVELS`). The results' machine line says "run as avx2". It measures
the narrower paths' code on this CPU's cores, caches and memory: a figure for the AVX2 code, not
for an AVX2 machine."""

from __future__ import annotations

import argparse
import os
import sys

from dspark_serve.ops.platform import CPU_LEVELS, emulation_env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("level", choices=list(CPU_LEVELS))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    os.execvpe(command[0], command, {**os.environ, **emulation_env(args.level)})


if __name__ == "__main__":
    main(sys.argv[1:])
