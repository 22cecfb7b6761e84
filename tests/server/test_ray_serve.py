"""Scale-out on Ray Serve: the config, the metrics bridge, and a real local Ray cluster with two
replicas of the embedded model (requests spread over both; a killed replica's in-flight stream
ends with an error, not a hang, and the replica is replaced; stopping the application drains
each replica's engine: a long stream ends with finish_reason "abort" and an error event)."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dspark_serve.server.ray_serve import (
    RayMetricsBridge,
    RayServeConfig,
    prometheus_samples,
    ray_metric_name,
)
from tests.server.test_e2e import free_port

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it


def test_config_validates_and_builds_deployment_options():
    fixed = RayServeConfig(num_replicas=3).deployment_options(shutdown_timeout=10)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["graceful_shutdown_timeout_s"] > 10  # Ray's kill comes after the engine's own drain
    auto = RayServeConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=6).deployment_options(5)
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 6,
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
        "look_back_period_s": 30.0,
    }
    assert "num_replicas" not in auto
    for bad in (
        {"num_replicas": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"max_replicas": 0},
        {"target_ongoing_requests": 0.0},
        {"health_check_period_s": float("nan")},
        {"upscale_delay_s": -1.0},
        {"look_back_period_s": 0.0},
    ):
        with pytest.raises(ValueError, match=repr(next(iter(bad.values())))[:3]):
            RayServeConfig(**bad)


def test_metrics_bridge_tags_every_sample_with_the_replica():
    reg = CollectorRegistry()
    g = Gauge("dspark:num_requests_running", "r", ["model_name"], registry=reg)
    g.labels(model_name="m").set(3)
    c = Counter("dspark:generation_tokens", "t", ["model_name"], registry=reg)
    c.labels(model_name="m").inc(7)
    h = Histogram("dspark:e2e", "e", registry=reg, buckets=(1.0, 2.0))
    h.observe(1.5)
    Gauge("vllm:num_requests_running", "alias", registry=reg).set(3)
    names = {n for n, _, _ in prometheus_samples(reg)}
    assert "dspark:generation_tokens_total" in names and "dspark:e2e_sum" in names
    assert not any(n.startswith("vllm:") or n.endswith(("_bucket", "_created")) for n in names)

    made: dict[str, FakeGauge] = {}

    def factory(name, description, tag_keys):
        made[name] = FakeGauge(tag_keys)
        return made[name]

    bridge = RayMetricsBridge(reg, {"deployment": "D", "replica": "r1"}, 1.0, gauge_factory=factory)
    assert bridge.export_once() == len(list(prometheus_samples(reg)))
    run = made[ray_metric_name("dspark:num_requests_running")]
    assert run.values == [(3.0, {"model_name": "m", "deployment": "D", "replica": "r1"})]
    assert set(run.tag_keys) == {"model_name", "deployment", "replica"}
    assert made["dspark_generation_tokens_total"].values[-1][0] == 7.0
    c.labels(model_name="m").inc(2)
    bridge.export_once()
    assert made["dspark_generation_tokens_total"].values[-1][0] == 9.0
    assert ray_metric_name("dspark:x-y") == "dspark_x_y"


class FakeGauge:
    def __init__(self, tag_keys):
        self.tag_keys, self.values = tag_keys, []

    def set(self, value, tags):
        assert set(tags) == set(self.tag_keys)
        self.values.append((value, tags))


# -- a real local Ray cluster ---------------------------------------------------------------


def _stream(
    url: str, body: dict, out: dict, started: threading.Event, stop: threading.Event | None = None
) -> None:
    """Reads one SSE stream into out["lines"]; `stop` set: the client hangs up (a disconnect)."""
    lines: list[str] = []
    out["lines"] = lines
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get("x-dspark-replica")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
                if stop is not None and stop.is_set():
                    out["hung_up"] = True
                    break
    except httpx.HTTPError as exc:  # the connection was cut: an error, not a hang
        out["exception"] = repr(exc)
    finally:
        out["ended"] = time.monotonic()
        started.set()


def _long_stream(
    url: str, max_tokens: int = 1500, stop: threading.Event | None = None
) -> tuple[threading.Thread, dict, threading.Event]:
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(
        target=_stream,
        args=(
            url,
            {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True},
            out,
            started,
            stop,
        ),
        daemon=True,
    )
    t.start()
    assert started.wait(120)
    return t, out, started


def _running_replicas(serve, app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())


def _wait(pred, timeout: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with Serve's proxy on a free port: (serve module, url, metrics port)."""
    ray = pytest.importorskip("ray")
    from ray import serve

    http_port, metrics_port = free_port(), free_port()
    # A loaded 2-core machine starts Serve's proxy slower than Ray's 5 s default allows (the
    # controller would kill it); the cluster's processes inherit these from this one.
    slow_ok = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    saved = {k: os.environ.get(k) for k in slow_ok}
    os.environ.update(slow_ok)
    # address="local": a cluster of this test's own, never one another process started
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        logging_level="error",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield serve, f"http://127.0.0.1:{http_port}", metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def serve_cluster(ray_cluster):
    """The module's cluster, with every application this test deployed deleted afterwards."""
    yield ray_cluster
    serve = ray_cluster[0]
    for name in list(serve.status().applications):
        serve.delete(name)


def _configs():
    from dspark_serve.drafter.config import DrafterConfig
    from dspark_serve.scheduler.config import SchedulerConfig
    from dspark_serve.server.config import ServerConfig
    from dspark_serve.verifier.config import ModelConfig

    return (
        ModelConfig(max_model_len=2048, kv_cache_tokens=8192),
        DrafterConfig(drafter="none"),
        SchedulerConfig(),
        ServerConfig(shutdown_timeout=3.0, log_level="warning"),
    )


def test_two_replicas_on_a_local_ray_cluster(serve_cluster):
    import ray

    from dspark_serve.server.ray_serve import deployment

    serve, url, metrics_port = serve_cluster
    app = "dspark-test"
    model, drafter, sched, server = _configs()
    rcfg = RayServeConfig(
        num_replicas=2, num_cpus=0.5, health_check_period_s=1.0, metrics_interval_s=0.5, app_name=app
    )
    serve.run(deployment(model, drafter, sched, server, rcfg), name=app, route_prefix="/")
    assert _running_replicas(serve, app) == 2

    # Requests spread over both replicas, each answering through the same OpenAI app.
    seen = set()
    for i in range(16):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"Count {i}", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        seen.add(r.headers["x-dspark-replica"])
    assert len(seen) == 2, seen
    assert httpx.get(url + "/health", timeout=30).status_code == 200

    # Each replica's engine metrics reach Ray's metrics endpoint, tagged with the replica.
    def tagged():
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        rows = [l for l in text.splitlines() if l.startswith("ray_dspark_generation_tokens_total")]
        return {rid for rid in seen if any(f'replica="{rid}"' in l for l in rows)} == seen

    _wait(tagged, 60, "per-replica metrics on Ray's endpoint")

    # Kill the replica serving a long stream: the stream ends (error, not a hang), Ray
    # replaces the replica, and later requests succeed.
    t, out, _ = _long_stream(url)
    victim = out["replica"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(victim)]
    assert names, ray.util.list_named_actors(all_namespaces=True)
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    t.join(timeout=60)
    assert not t.is_alive(), "the stream on the killed replica hung"
    assert out["ended"] - t_kill < 30
    finished_normally = any(
        '"finish_reason": "length"' in l or '"finish_reason":"length"' in l for l in out["lines"]
    )
    assert not finished_normally and (
        "exception" in out or any("error" in l for l in out["lines"]) or out["lines"][-1:] != ["[DONE]"]
    ), out
    _wait(lambda: _running_replicas(serve, app) == 2, 180, "the killed replica's replacement")
    after = set()
    for i in range(8):  # later requests succeed, never on the killed replica
        r = httpx.post(url + "/v1/completions", json={"prompt": f"Again {i}", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        after.add(r.headers["x-dspark-replica"])
    assert victim not in after

    # Ray stopping the application drains each replica's engine like SIGTERM does.
    t, out, _ = _long_stream(url)
    t_stop = time.monotonic()
    serve.delete(app)
    t.join(timeout=60)
    assert not t.is_alive()
    assert out["ended"] - t_stop < server.shutdown_timeout + 10, out["ended"] - t_stop
    lines = out["lines"]
    assert lines[-1] == "[DONE]", lines[-3:]
    assert json.loads(lines[-2])["error"]["code"] == "draining"
    assert json.loads(lines[-3])["choices"][0]["finish_reason"] == "abort"


def test_autoscaling_on_ongoing_requests(serve_cluster):
    from dspark_serve.server.ray_serve import deployment

    serve, url, _ = serve_cluster
    app = "dspark-autoscale"
    model, drafter, sched, server = _configs()
    rcfg = RayServeConfig(
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=1,
        upscale_delay_s=1,
        downscale_delay_s=2,
        look_back_period_s=2,
        num_cpus=0.5,
        app_name=app,
    )
    serve.run(deployment(model, drafter, sched, server, rcfg), name=app, route_prefix="/")
    try:
        assert _running_replicas(serve, app) == 1
        # 3 in flight against a target of 1, long enough to outlast a second replica's start
        # (streams that end first would drop the load before it is counted); once the second
        # replica runs, the clients hang up: the disconnects end the requests and the load drops
        hang_up = threading.Event()
        streams = [_long_stream(url, stop=hang_up) for _ in range(3)]
        _wait(lambda: _running_replicas(serve, app) == 2, 180, "the scale-up to 2 replicas")
        assert _running_replicas(serve, app) <= 2  # never past max_replicas
        hang_up.set()
        for t, out, _ in streams:
            t.join(timeout=300)
            assert out.get("hung_up") or out["lines"][-1:] == ["[DONE]"], out.get("exception")
        _wait(lambda: _running_replicas(serve, app) == 1, 180, "the scale-down to 1 replica")
    finally:
        serve.delete(app)
