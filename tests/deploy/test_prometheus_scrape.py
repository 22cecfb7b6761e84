"""A real Prometheus (the Debian `prometheus` package; `.ci/run` fetches it) scrapes a running
server after traffic, and its HTTP API returns the spec-decode series with the server's values."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_e2e import MODEL, LiveServer, free_port

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

ROOT = Path(__file__).resolve().parents[2]
# `.ci/run` unpacks the Debian package here when `prometheus` is not installed system-wide.
LOCAL = ROOT / ".ci" / "cache" / "prometheus" / "usr" / "bin" / "prometheus"


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found:
        return found
    return str(LOCAL) if LOCAL.is_file() else None


def server_value(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def query(api: str, promql: str) -> list[dict]:
    r = httpx.get(api + "/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(api: str, promql: str, want, timeout: float = 90.0) -> list[dict]:
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        try:
            last = query(api, promql)
            if last and want(last):
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{promql}: last answer {last!r} after {timeout}s")


def test_prometheus_scrapes_spec_decode_series(tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(
            "no prometheus binary: install the Debian package `prometheus` "
            "(or run .ci/run, which unpacks it into .ci/cache/prometheus)"
        )
    server = LiveServer(drafter="ngram", verify_policy="static:4")
    proc = None
    try:
        client = server.client()
        client.chat.completions.create(
            model=MODEL,
            max_tokens=40,
            temperature=0,
            seed=0,  # seeded: drafts whatever the draft gate says
            messages=[{"role": "user", "content": "Repeat this line four times: the cat sat on the mat."}],
        )
        assert server.idle()
        drafted = server_value(server.url, "dspark:spec_decode_num_draft_tokens_total")
        rounds = server_value(server.url, "dspark:spec_decode_num_drafts_total")
        assert drafted > 0 and rounds > 0, "the n-gram drafter should have drafted on a repeated line"

        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "dspark",
                            "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}],
                        }
                    ],
                }
            )
        )
        log = open(tmp_path / "prometheus.log", "w")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        api = f"http://127.0.0.1:{port}"
        wait_for(api, 'up{job="dspark"}', lambda r: r[0]["value"][1] == "1")
        lab = f'{{job="dspark",model_name="{MODEL}"}}'
        for name, value in (
            ("dspark:spec_decode_num_draft_tokens_total", drafted),
            ("dspark:spec_decode_num_drafts_total", rounds),
            ("vllm:spec_decode_num_draft_tokens_total", drafted),
            ("vllm:spec_decode_num_drafts_total", rounds),
        ):
            res = wait_for(api, name + lab, lambda r: True)
            assert float(res[0]["value"][1]) == value, (name, res)
        accepted = server_value(server.url, "dspark:spec_decode_num_accepted_tokens_total")
        per_pos = wait_for(
            api, "sum(dspark:spec_decode_num_accepted_tokens_per_pos_total" + lab + ")", lambda r: True
        )
        assert float(per_pos[0]["value"][1]) == accepted
        # a dashboard query evaluates over the scraped history
        lengths = wait_for(api, "dspark:spec_decode_acceptance_length_count" + lab, lambda r: True)
        assert float(lengths[0]["value"][1]) == rounds
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.close()
