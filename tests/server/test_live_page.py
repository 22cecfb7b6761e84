"""The live page in a real headless Chromium (the OS package), driven over the DevTools
protocol: the page loads, a prompt streams, tokens of at least two provenance kinds appear and
the gauges update. `python -m tests.server.test_live_page OUT.png` saves a screenshot."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_e2e import MODEL, LiveServer

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser_binary() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class DevTools:
    """A headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, binary: str, profile: str) -> None:
        import websocket  # websocket-client

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                f"--user-data-dir={profile}",
                "--window-size=1280,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = None
        t0 = time.monotonic()
        while port is None and time.monotonic() - t0 < 60:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            port = m and int(m.group(1))
        assert port, "chromium did not open its DevTools port"
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self.ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True
        )
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expr: str):
        res = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expr}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait(self, expr: str, timeout: float = 120.0):
        """Poll until `expr` is truthy (errors count as not yet: the page may still be loading)."""
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < timeout:
            try:
                v = self.js(expr)
            except RuntimeError as exc:
                v, last = None, exc
            if v:
                return v
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {expr} (last error: {last})")

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def drive(url: str, profile: str, screenshot: Path | None = None) -> dict:
    """Load the page, send a seeded prompt (seeded requests always draft), wait for the
    stream to end and the gauges to refresh; returns what the page showed."""
    b = DevTools(browser_binary(), profile)
    try:
        b.call("Page.enable")
        b.call("Page.navigate", url=url)
        b.wait(
            f"document.readyState === 'complete' && document.getElementById('model').textContent.includes({json.dumps(MODEL)})"
        )
        polls0 = int(
            b.wait(
                "document.getElementById('metrics-status').dataset.polls !== '0' && document.getElementById('metrics-status').dataset.polls"
            )
        )
        b.js(
            "document.getElementById('maxtok').value = '48'; document.getElementById('seed').value = '0';"
            "document.getElementById('send').click(); true"
        )
        b.wait(
            "document.getElementById('status').textContent === 'done' || "
            "document.getElementById('status').textContent.startsWith('error')"
        )
        status = b.js("document.getElementById('status').textContent")
        polls_done = int(b.js("document.getElementById('metrics-status').dataset.polls"))
        # two more metric polls after the request ended: the gauges reflect it
        b.wait(f"Number(document.getElementById('metrics-status').dataset.polls) >= {polls_done} + 2")
        out = b.js("""({
            kinds: Array.from(document.querySelectorAll('#output .tok')).map(s => s.dataset.kind),
            positions: Array.from(document.querySelectorAll('#output .tok[data-kind=draft]')).map(s => Number(s.dataset.position)),
            text: document.getElementById('output').textContent,
            gauges: Object.fromEntries(['running', 'waiting', 'budget', 'acceptance', 'tps', 'kv']
                .map(k => [k, document.getElementById('g-' + k).textContent])),
            polls: Number(document.getElementById('metrics-status').dataset.polls),
            table: document.getElementById('cost-source').textContent,
        })""")
        out["status"], out["polls0"], out["polls_done"] = status, polls0, polls_done
        if screenshot is not None:
            png = b.call("Page.captureScreenshot", format="png")["data"]
            screenshot.write_bytes(base64.b64decode(png))
        return out
    finally:
        b.close()


@pytest.fixture(scope="module")
def server():
    s = LiveServer(drafter="ngram", verify_policy="static:4")
    yield s
    s.close()


def test_live_page_streams_provenance_and_updates_gauges(server, tmp_path):
    if browser_binary() is None:
        pytest.skip("no Chromium: install the OS package `chromium` (apt-get install chromium)")
    pytest.importorskip("websocket", reason="websocket-client is in the test extra")
    shot = tmp_path / "page.png"
    out = drive(server.url + "/", str(tmp_path / "profile"), shot)
    assert out["status"] == "done", out
    kinds = out["kinds"]
    assert len(kinds) > 5 and kinds[0] == "plain"
    assert len(set(kinds)) >= 2 and "draft" in kinds, kinds
    assert all(p >= 0 for p in out["positions"]) and 0 in out["positions"]
    assert out["text"].strip()
    g = out["gauges"]
    assert g["running"] == "0" and g["waiting"] == "0"  # idle again after the request
    assert g["acceptance"] != "-" and float(g["acceptance"]) >= 1.0
    assert g["kv"].endswith("%") and g["tps"] != "-"
    assert out["polls"] >= out["polls_done"] + 2 > out["polls0"]  # polled on after the request
    assert out["table"] == "table in force: none"  # a static policy prices nothing
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


if __name__ == "__main__":
    # python -m tests.server.test_live_page docs/live-page.png
    s = LiveServer(drafter="ngram", verify_policy="static:4")
    try:
        with tempfile.TemporaryDirectory() as d:
            print(drive(s.url + "/", d, Path(sys.argv[1])))
    finally:
        s.close()


def test_live_page_asks_for_the_api_key_and_keeps_it_in_the_tab(tmp_path):
    """Over the fake engine (no model): the page shows the key box on 401, then works with
    the key, which lives in sessionStorage, never in localStorage or a cookie."""
    if browser_binary() is None:
        pytest.skip("no Chromium: install the OS package `chromium` (apt-get install chromium)")
    pytest.importorskip("websocket", reason="websocket-client is in the test extra")
    import threading

    import uvicorn
    from prometheus_client import CollectorRegistry

    from dspark_serve.server.app import build_app
    from dspark_serve.server.config import ServerConfig
    from tests.server.test_app import FakeEngine
    from tests.server.test_e2e import free_port

    port = free_port()
    app = build_app(FakeEngine(), ServerConfig(port=port, api_key="k3y"), CollectorRegistry())
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    b = DevTools(browser_binary(), str(tmp_path / "profile"))
    try:
        b.call("Page.enable")
        b.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        b.wait(
            "getComputedStyle(document.getElementById('keybox')).display !== 'none' && "
            "document.getElementById('model').textContent === 'API key required'"
        )
        b.js(
            "document.getElementById('apikey').value = 'k3y'; document.getElementById('keysave').click(); true"
        )
        b.wait("document.getElementById('model').textContent.startsWith('fake-model')")
        assert b.js("getComputedStyle(document.getElementById('keybox')).display") == "none"
        # the fake engine's context is 64 "tokens" (one per character)
        b.js(
            "document.getElementById('prompt').value = 'hi'; document.getElementById('maxtok').value = '5';"
            "document.getElementById('send').click(); true"
        )
        b.wait(
            "document.getElementById('status').textContent !== 'streaming...' && "
            "document.getElementById('status').textContent !== ''"
        )
        assert b.js("document.getElementById('status').textContent") == "done"
        kinds = b.js("Array.from(document.querySelectorAll('#output .tok')).map(s => s.dataset.kind)")
        assert kinds == ["plain", "draft", "draft", "bonus"]
        assert b.js("document.getElementById('output').textContent") == "Hello world"
        assert b.js("sessionStorage.getItem('dspark-api-key')") == "k3y"
        assert b.js("localStorage.length") == 0 and b.js("document.cookie") == ""
    finally:
        b.close()
        srv.should_exit = True
        th.join(timeout=10)
