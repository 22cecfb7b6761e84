"""Schemathesis against a real `dspark-serve` (the embedded default, with an API key): every
operation of /openapi.json with generated valid and invalid requests, checked for no server
error (no 5xx); the summary goes to a JSON file. The context is 256 tokens unless the flags say
otherwise (generated requests ask for as many tokens as the context allows, one at a time). The
suite's `tests/server/test_fuzz.py` runs the same fuzz in-process against a fake engine; this
one goes through the real engine over HTTP.

    python bench/schema_fuzz.py --max-examples 30 --out bench/results/schema-fuzz-zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, running_server  # noqa: E402

KEY = "schema-fuzz-key"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8441)
    ap.add_argument("--max-examples", type=int, default=30, help="generated cases per operation and phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("server_flags", nargs=argparse.REMAINDER, help="-- then flags for dspark-serve")
    args = ap.parse_args()
    flags = args.server_flags[1:] if args.server_flags[:1] == ["--"] else args.server_flags
    if "--max-model-len" not in flags:  # generated max_tokens run up to the context: keep it short
        flags = [*flags, "--max-model-len", "256"]
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY)
    schemathesis = Path(sys.executable).parent / "schemathesis"
    try:
        with running_server(args.port, [*flags, "--api-key-file", f.name], api_key=KEY) as srv:
            t0 = time.monotonic()
            run = subprocess.run(
                [
                    str(schemathesis),
                    "run",
                    f"{srv.url}/openapi.json",
                    "--header",
                    f"Authorization: Bearer {KEY}",
                    "--checks",
                    "not_a_server_error",
                    "--max-examples",
                    str(args.max_examples),
                    "--seed",
                    str(args.seed),
                    "--request-timeout",
                    "120",
                    "--workers",
                    "1",
                ],
                capture_output=True,
                text=True,
                cwd=tempfile.gettempdir(),  # its cache of examples stays out of the checkout
            )
            seconds = time.monotonic() - t0
            alive = srv.proc.poll() is None
    finally:
        os.unlink(f.name)
    out = run.stdout + run.stderr
    print(out[-4000:])
    cases = re.search(r"(\d+) generated", out)
    result = {
        "machine": machine(),
        "server_flags": flags,
        "max_examples": args.max_examples,
        "seed": args.seed,
        "exit_code": run.returncode,
        "generated_cases": int(cases.group(1)) if cases else None,
        "server_errors_found": "not_a_server_error" in out and run.returncode != 0,
        "server_alive_after": alive,
        "seconds": seconds,
        "summary_tail": out[-1500:],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
