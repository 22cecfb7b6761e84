"""This server beside the native llama-server, over HTTP, on the same GGUF (the embedded
`SmolLM2-135M-Instruct.Q4_1.gguf`), the same threads, the same chat messages:

- llama-server (`--llama-server PATH`: the binary, built from llama.cpp, e.g. the copy vendored in
  the llama-cpp-python sdist: `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target
  llama-server`), started with `-t THREADS -np 1`;
- `dspark-serve` plain (`--drafter none`) and the default (no flags), each with `--weights` of
  each `--weights` entry (`auto`: the file's own blocks on a CPU).

Each request streams `POST /v1/chat/completions` with `ignore_eos` and `max_tokens`, so every
server writes the same number of tokens; the per-user figure is completion tokens / (last token
chunk - first token chunk), median over requests, at `--concurrency` requests in flight; the
arms take turns for `--rounds` rounds. Greedy and sampled (`--temperatures`).

  python bench/vs_llama_server.py --llama-server ~/llama.cpp/build/bin/llama-server \\
      --out bench/results/vs-llama-server-zen4.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DATA,
    load_prompts,
    median,
    running_server,
    save_result,
    stream_chat,
    wait_healthy,
)


@contextmanager
def llama_server(binary: Path, gguf: Path, port: int, threads: int) -> Iterator[str]:
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, poll=0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def one_stream(url: str, model: str, text: str, max_tokens: int, temperature: float) -> dict:
    """One streamed chat completion -> its tokens, time to first token and decode speed."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    c = stream_chat(url, body)
    return {"tokens": c.tokens, "ttft_s": c.ttft_s, "per_user_tps": c.per_user_tps}


def point(
    url: str, model: str, texts: list[str], max_tokens: int, temperature: float, concurrency: int
) -> dict:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        rs = list(pool.map(lambda t: one_stream(url, model, t, max_tokens, temperature), texts))
    wall = time.perf_counter() - t0
    return {
        "per_user_tps": median(r["per_user_tps"] for r in rs if r["per_user_tps"]),
        "aggregate_tps": sum(r["tokens"] for r in rs) / wall,
        "ttft_s": median(r["ttft_s"] for r in rs),
        "tokens": sum(r["tokens"] for r in rs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    ap.add_argument("--weights", type=lambda s: s.split(","), default=["auto"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from dspark_serve.verifier.loader import embedded_gguf_path

    texts = [t for _, t in load_prompts(args.data, args.prompts)]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    arms: dict[str, tuple[str, str]] = {}
    t_start = time.time()
    with ExitStack() as stack:
        url = stack.enter_context(
            llama_server(args.llama_server, embedded_gguf_path(), args.port, args.threads)
        )
        arms["llama-server"] = (url, "model")
        port = args.port + 1
        for w in args.weights:
            for label, flags in (("plain", ["--drafter", "none"]), ("default", [])):
                s = stack.enter_context(running_server(port, ["--weights", w, *flags]))
                arms[f"{label} ({w})"] = (s.url, s.model)
                port += 1
        for url, model in arms.values():  # warm-up: first requests, cost tables in place
            one_stream(url, model, texts[0], 8, 0.0)
        rows = []
        for rnd in range(args.rounds):
            for temp in args.temperatures:
                for name, (url, model) in arms.items():
                    p = point(url, model, texts, args.max_tokens, temp, args.concurrency)
                    rows.append({"arm": name, "temperature": temp, "round": rnd, **p})
                    print(
                        f"round {rnd} T={temp} {name:18s} per-user {p['per_user_tps']:6.1f} "
                        f"aggregate {p['aggregate_tps']:6.1f}",
                        flush=True,
                    )
    summary = {}
    for temp in args.temperatures:
        base = median(
            r["per_user_tps"] for r in rows if r["arm"] == "llama-server" and r["temperature"] == temp
        )
        for name in arms:
            v = median(r["per_user_tps"] for r in rows if r["arm"] == name and r["temperature"] == temp)
            summary[f"T={temp} {name}"] = {"per_user_tps": v, "vs_llama_server": v / base if base else None}
    save_result(args, {"rows": rows, "summary": summary, "seconds": time.time() - t_start})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
