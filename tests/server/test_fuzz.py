"""A schema-driven fuzz of every route (schemathesis reads /openapi.json): valid and invalid
requests alike get no server error and never a dropped connection. Served by a tiny random model
behind the embedded model's real tokenizer, with a short context, so many cases fit in about two
minutes (FUZZ_SECONDS, shared by the routes)."""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
import urllib3
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from dspark_serve.scheduler.builder import EngineBundle
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from tests.helpers import runner_for, tiny_model
from tests.server.test_e2e import LiveServer

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

FUZZ_SECONDS = 100
TINY_LEN = 96


def tiny_bundle(metrics) -> EngineBundle:
    import torch

    from dspark_serve.verifier.loader import DtypeChoice, load_target

    tok = load_target(None).tokenizer  # the embedded model's tokenizer (chat template)
    engine = Engine(
        runner_for(tiny_model("llama", vocab=len(tok)), num_blocks=512, block_size=16),
        tok,
        SchedulerConfig(max_num_seqs=8, max_waiting=64),
        max_model_len=TINY_LEN,
        metrics=metrics,
    )
    return EngineBundle(engine, tok, DtypeChoice(torch.float32, "test: tiny model"))


@pytest.fixture(scope="module")
def tiny_server():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread avoids thread-pool waits on a busy machine
    s = LiveServer(build=tiny_bundle, max_len=TINY_LEN)
    yield s
    s.close()
    torch.set_num_threads(threads)


def test_schema_fuzz_no_server_errors_no_dropped_connections(tiny_server, monkeypatch):
    url = tiny_server.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/models/{model_id}",
        "/health",
        "/metrics",
    } <= paths, paths

    connections = []
    real_new_conn = urllib3.connectionpool.HTTPConnectionPool._new_conn

    def counting_new_conn(pool):
        connections.append(time.monotonic())
        return real_new_conn(pool)

    monkeypatch.setattr(urllib3.connectionpool.HTTPConnectionPool, "_new_conn", counting_new_conn)
    session = requests.Session()
    stats = {"cases": 0, "by_status": {}, "failures": [], "errors": []}
    deadline = time.monotonic() + FUZZ_SECONDS
    samples = []
    # Time shares: routes that generate get most of it, valid requests most of that.
    shares = {
        (op.path, mode): (
            0.02 if op.method.upper() == "GET" else 0.33 if mode is GenerationMode.POSITIVE else 0.12
        )
        for op in ops
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    }
    scale = 1.0 / sum(shares.values())

    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_end = min(deadline, time.monotonic() + FUZZ_SECONDS * scale * shares[(op.path, mode)])

            @settings(
                max_examples=400,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                derandomize=True,
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                if time.monotonic() > run_end:
                    return
                stats["cases"] += 1
                t_call = time.monotonic()
                try:
                    resp = case.call(base_url=url, session=session, timeout=60)
                    stats.setdefault("call_s", {}).setdefault(f"{op.path} {mode.value}", []).append(
                        round(time.monotonic() - t_call, 2)
                    )
                except requests.RequestException as exc:
                    stats["errors"].append(f"{case.as_curl_command(base_url=url)}: {exc!r}")
                    return
                key = f"{op.method.upper()} {op.path} {mode.value} {resp.status_code}"
                if resp.status_code == 400 and mode is GenerationMode.POSITIVE and len(samples) < 30:
                    samples.append(resp.text[:200])
                stats["by_status"][key] = stats["by_status"].get(key, 0) + 1
                try:
                    case.validate_response(
                        resp, checks=[not_a_server_error, status_code_conformance, content_type_conformance]
                    )
                except Exception as exc:  # a failed check: collected, reported together
                    stats["failures"].append(f"{case.as_curl_command(base_url=url)}\n{exc}"[:2000])

            try:
                fuzz()
            except Unsatisfiable:  # nothing invalid to generate (a route without inputs)
                assert mode is GenerationMode.NEGATIVE
    print(
        f"\nfuzz: {stats['cases']} cases, {len(connections)} TCP connection(s); "
        f"by route and status: {stats['by_status']}"
    )
    print({k: (len(v), round(sum(v), 1)) for k, v in stats.get("call_s", {}).items()})
    print("some 400s of valid-by-schema requests:", *samples[:30], sep="\n  ")
    assert stats["cases"] >= 100
    assert not stats["errors"], stats["errors"][:3]
    assert not stats["failures"], "\n\n".join(stats["failures"][:3])
    assert len(connections) == 1, f"{len(connections)} connections: the server dropped keep-alive"
    statuses = {int(k.rsplit(" ", 1)[1]) for k in stats["by_status"]}
    assert 200 in statuses and 400 in statuses and max(statuses) < 500
    assert tiny_server.idle()
