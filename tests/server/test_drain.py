"""Graceful drain: SIGTERM to a real `dspark-serve` process stops it accepting (/health 503), lets
a short request finish, ends a long stream with finish_reason "abort" and an error event within
--shutdown-timeout, and the process exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_e2e import free_port

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 8.0


def events(url, body, out, key, first_event: threading.Event | None = None):
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        out[key + "_status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if first_event is not None and len(lines) >= 1:
                    first_event.set()
    out[key] = (lines, time.monotonic())


def test_sigterm_drains_then_exits():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspark_serve.server.cli",
            "--drafter",
            "none",
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--kv-cache-tokens",
            "16384",
            "--shutdown-timeout",
            str(TIMEOUT),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        out: dict = {}
        started = threading.Event()
        long = threading.Thread(
            target=events,
            args=(
                url,
                # more tokens than a CPU writes in TIMEOUT (plain bf16 decoding on a 2-core
                # Zen 5 writes 900 in ~6 s), so the drain has to cut the stream
                {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True},
                out,
                "long",
                started,
            ),
        )
        long.start()
        assert started.wait(120)
        short_started = threading.Event()
        short = threading.Thread(
            target=events,
            args=(url, {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}, out, "short", short_started),
        )
        short.start()
        assert short_started.wait(120)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503
        long.join(timeout=TIMEOUT + 30)
        short.join(timeout=TIMEOUT + 30)
        lines, t_end = out["long"]
        assert t_end - t_term < TIMEOUT + 3, t_end - t_term  # cut at the timeout, not later
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["code"] == "draining" and "shutting down" in err["message"]
        final = json.loads(lines[-3])["choices"][0]
        assert final["finish_reason"] == "abort"
        texts = [json.loads(x)["choices"][0]["text"] for x in lines[:-3]]
        assert len(texts) >= 2 and all(texts[:2])
        short_lines, _ = out["short"]  # finished on its own
        assert out["short_status"] == 200 and short_lines[-1] == "[DONE]"
        assert json.loads(short_lines[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
