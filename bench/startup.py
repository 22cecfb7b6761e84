"""How long `dspark-serve` takes to start and what it holds once started, cold (an empty cache
directory: the first start on a machine) and warm (the cache the cold start left), for each
`--weights` given:

- launch to healthy (`GET /health` 200) and launch to the first streamed token of a chat;
- the first request's decode speed against the steady speed (the same request again, twice),
  and plain decoding's steady speed (a warm start with `--verify-policy none`);
- launch to the load-aware speed in force: the measured cost table (a first start serves on a
  provisional one and measures the full table in its idle gaps; `dspark:cost_table_in_force`);
- the server's resident memory after the first request (VmRSS) and its peak (VmHWM);
- the start-up log's timed stages, as logged.

  python bench/startup.py --weights auto,gguf --out bench/results/startup-zen4.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import median, save_result, stream_chat, wait_healthy  # noqa: E402

CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def chat_once(url: str, max_tokens: int) -> tuple[float, float]:
    """-> (seconds to the first token, decode tokens per second after it)."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    c = stream_chat(url, body | {"stream": True, "stream_options": {"include_usage": True}})
    assert c.per_user_tps is not None, "no tokens streamed"
    return c.ttft_s, c.per_user_tps


# what the start-up log's timed lines say
STAGE_WORDS = ("loading:", "compiled", "converted", "read the weights", "cost table", "ready:")


def table_in_force(url: str, launched: float, timeout: float) -> float | None:
    """Seconds from launch (`launched`, Unix time) until the measured or cached cost table took
    over (`dspark:cost_table_since_seconds`, polled on /metrics until a table other than the
    provisional one is in force; None: not within `timeout` seconds)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        values = {}
        for line in httpx.get(url + "/metrics").text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(("dspark:cost_table_in_force", "dspark:cost_table_since_seconds")):
                values[name] = float(value)
        final = [v for k, v in values.items() if "in_force" in k and "provisional" not in k]
        since = [v for k, v in values.items() if "since_seconds" in k]
        if any(v == 1.0 for v in final) and since:
            return since[0] - launched
        time.sleep(0.2)
    return None


def one_start(flags: list[str], cache: Path, port: int, max_tokens: int, table: bool = True) -> dict:
    """table: wait for the measured cost table (False: plain decoding has none)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "dspark_serve.server.cli", "--port", str(port), *flags]
    log = tempfile.TemporaryFile()
    t0, launched = time.perf_counter(), time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 900, poll=0.05)
        healthy = time.perf_counter() - t0
        ttft, first_tps = chat_once(url, max_tokens)
        first_token = healthy + ttft
        steady = median(chat_once(url, max_tokens)[1] for _ in range(2))
        rss, peak = status_mib(proc.pid, "VmRSS"), status_mib(proc.pid, "VmHWM")
        in_force = table_in_force(url, launched, 600) if table else None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines()
    return {
        "healthy_s": healthy,
        "first_token_s": first_token,
        "first_request_tps": first_tps,
        "steady_tps": steady,
        "load_aware_s": in_force,
        "rss_mib": rss,
        "peak_rss_mib": peak,
        "log": [ln for ln in lines if any(w in ln for w in STAGE_WORDS)][:40],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=lambda s: s.split(","), default=["auto"])
    ap.add_argument("--flags", default="", help="more server flags, space-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8290)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for w in args.weights:
        with tempfile.TemporaryDirectory() as cache:
            flags = ["--weights", w, *args.flags.split()]
            for kind, more in (("cold", []), ("warm", []), ("plain", ["--verify-policy", "none"])):
                r = one_start(flags + more, Path(cache), args.port, args.max_tokens, table=not more)
                rows.append({"weights": w, "start": kind, **r})
                aware = r["load_aware_s"]
                print(
                    f"{w:5s} {kind}: healthy {r['healthy_s']:.1f}s first token {r['first_token_s']:.1f}s "
                    f"first {r['first_request_tps']:.0f} tok/s steady {r['steady_tps']:.0f} tok/s "
                    f"table in force {'-' if aware is None else f'{aware:.1f}s'} "
                    f"RSS {r['rss_mib']:.0f} MiB peak {r['peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
    save_result(args, {"rows": rows})


if __name__ == "__main__":
    main()
