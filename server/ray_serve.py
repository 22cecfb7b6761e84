"""`dspark-serve-ray`: N replicas of the unchanged engine behind one OpenAI endpoint, on Ray Serve.

    dspark-serve-ray --num-replicas 2                        # fixed
    dspark-serve-ray --min-replicas 1 --max-replicas 4       # autoscaled on ongoing requests

Every `dspark-serve` flag applies to each replica (model, drafter, policy, KV size, ...). Each
replica runs the same FastAPI app as `dspark-serve` as its Ray Serve ingress, with its own engine
thread; Ray's proxy spreads requests over the replicas and the autoscaler adds or removes them
by ongoing requests. A replica reports healthy only while its engine thread is alive and its
model loaded (Ray replaces one that is not), and it joins the pool only once its engine is
ready. When Ray stops a replica (scale-down, redeploy, `serve shutdown`, Ctrl-C here), the
engine drains exactly as under SIGTERM: no new requests, those in flight may finish for up to
`--shutdown-timeout` seconds, the rest end with finish_reason "abort" and an error event.
Each replica's engine metrics also go to Ray's metrics endpoint, tagged with the replica.
Ray is imported only here and only when used; no torch in this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from dspark_serve.drafter.config import DrafterConfig
    from dspark_serve.scheduler.config import SchedulerConfig
    from dspark_serve.server.config import ServerConfig
    from dspark_serve.verifier.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayServeConfig:
    """How the replicas are deployed on Ray Serve.

    num_replicas: replicas when not autoscaling (min_replicas/max_replicas unset).
    min_replicas / max_replicas: autoscaling bounds; giving either turns autoscaling on.
    target_ongoing_requests: the autoscaler aims at this many requests in flight per replica.
    upscale_delay_s / downscale_delay_s: how long the autoscaler must see a need before it adds
        / removes a replica.
    look_back_period_s: the window the autoscaler averages the ongoing requests over.
    num_cpus: CPUs Ray reserves for each replica.
    num_gpus: GPUs Ray reserves for each replica (0: none; 1 places each replica on a GPU of its
        own, which `--device auto` then uses; a fraction shares one between replicas).
    health_check_period_s / health_check_timeout_s: how often Ray asks a replica whether its
        engine is alive, and how long an answer may take.
    address: Ray cluster to join ("auto" = the one running on this machine, "local" = always a
        new one here); None = Ray's default (a running local cluster if any, else a new one).
    app_name: the Ray Serve application's name.
    metrics_interval_s: seconds between copies of a replica's engine metrics to Ray's.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    address: str | None = None
    app_name: str = "dspark"
    metrics_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas!r}")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0:
            raise ValueError(f"min_replicas must be >= 0, got {lo!r}")
        if hi is not None and hi < 1:
            raise ValueError(f"max_replicas must be >= 1, got {hi!r}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_replicas {lo!r} exceeds max_replicas {hi!r}")
        if not (math.isfinite(self.num_gpus) and self.num_gpus >= 0):
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in (
            "target_ongoing_requests",
            "look_back_period_s",
            "num_cpus",
            "health_check_period_s",
            "health_check_timeout_s",
            "metrics_interval_s",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def deployment_options(self, shutdown_timeout: float) -> dict[str, Any]:
        """Keyword arguments of `serve.deployment(...).options(...)`."""
        opts: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus}
            | ({"num_gpus": self.num_gpus} if self.num_gpus else {}),
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            # Ray force-kills a stopping replica after this; the engine's own drain ends its
            # requests cleanly at shutdown_timeout, well before.
            "graceful_shutdown_timeout_s": shutdown_timeout + 15.0,
            "graceful_shutdown_wait_loop_s": 0.5,
        }
        if self.autoscaling:
            lo = self.min_replicas if self.min_replicas is not None else 1
            hi = self.max_replicas if self.max_replicas is not None else max(lo, 1)
            opts["autoscaling_config"] = {
                "min_replicas": lo,
                "max_replicas": hi,
                "initial_replicas": max(lo, 1),
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


# -- metrics: a replica's registry copied into Ray's, tagged with the replica -----------------


def prometheus_samples(registry: CollectorRegistry) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample a Ray gauge can carry: gauges, counter totals and
    histogram/summary sums and counts (buckets stay on the replica's own /metrics). vLLM-style
    aliases are skipped: they repeat the dspark: metrics."""
    for family in registry.collect():
        if family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")) or not math.isfinite(s.value):
                continue
            yield s.name, dict(s.labels), float(s.value)


def ray_metric_name(name: str) -> str:
    """Ray metric names allow [A-Za-z0-9_]: `dspark:num_requests_running` -> `dspark_num_requests_running`."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


class RayMetricsBridge:
    """Copies a prometheus_client registry into `ray.util.metrics` gauges every `interval`
    seconds, each tagged with `tags` (deployment, replica) on top of its own labels. Counters
    arrive as gauges holding the running total (Prometheus `rate()` works on them all the same)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        tags: dict[str, str],
        interval: float,
        gauge_factory: Callable[..., Any] | None = None,
    ) -> None:
        if gauge_factory is None:
            from ray.util.metrics import Gauge

            gauge_factory = Gauge
        self.registry, self.tags, self.interval = registry, dict(tags), interval
        self._factory = gauge_factory
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def export_once(self) -> int:
        n = 0
        for name, labels, value in prometheus_samples(self.registry):
            keys = tuple(sorted(labels)) + tuple(sorted(self.tags))
            key = (ray_metric_name(name), keys)
            gauge = self._gauges.get(key)
            if gauge is None:
                gauge = self._factory(key[0], description=f"{name} (per replica)", tag_keys=keys)
                self._gauges[key] = gauge
            gauge.set(value, tags={**labels, **self.tags})
            n += 1
        return n

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.export_once()
            except Exception:  # metrics must never take the replica down
                log.exception("copying engine metrics to Ray failed")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ray-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


# -- noticing that Ray began stopping this replica ------------------------------------------


def ray_stop_signal() -> Callable[[], bool] | None:
    """A function telling whether Ray Serve has begun stopping the replica this code runs in.

    Ray waits for a stopping replica's in-flight requests before it calls the user's `__del__`,
    and kills the replica when that takes too long, which would cut long streams without a
    word. Seeing the stop at once lets the engine drain on its own schedule. Ray has no public
    hook for it, so this reads the replica's own "shutting down" flag; None where that is not
    found (then the drain runs from `__del__`)."""
    try:
        import ray._private.worker as worker
    except ImportError:
        return None
    for actor in list(getattr(worker.global_worker, "actors", {}).values()):
        impl = getattr(actor, "_replica_impl", None)
        if impl is not None and hasattr(impl, "_shutting_down"):
            return lambda: bool(impl._shutting_down)
    return None


# -- the replica ----------------------------------------------------------------------------


class EngineReplica:
    """One replica: an engine thread plus the same FastAPI app `dspark-serve` serves."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        drafter_cfg: DrafterConfig,
        sched_cfg: SchedulerConfig,
        server_cfg: ServerConfig,
        ray_cfg: RayServeConfig,
        ready_timeout: float = 900.0,
    ) -> None:
        from ray import serve

        from dspark_serve.server.cli import start_engine

        logging.basicConfig(level=server_cfg.log_level.upper())
        self.server_cfg, self.ray_cfg = server_cfg, ray_cfg
        self.engine, self.registry = start_engine(model_cfg, drafter_cfg, sched_cfg, server_cfg)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        # Join the pool only with a loaded model: Ray routes to a replica once __init__ returns.
        if not self.engine.wait_ready(ready_timeout):
            raise RuntimeError(f"engine not ready after {ready_timeout}s: {self.engine.load_error}")
        self.bridge = RayMetricsBridge(
            self.registry,
            {"deployment": ctx.deployment, "replica": self.replica_id},
            ray_cfg.metrics_interval_s,
        )
        self.bridge.start()
        self._drained = threading.Event()
        stopping = ray_stop_signal()
        if stopping is not None:
            threading.Thread(
                target=self._watch_stop, args=(stopping,), name="ray-stop-watch", daemon=True
            ).start()

    def __serve_build_asgi_app__(self) -> Any:
        from dspark_serve.server.app import build_app

        app = build_app(self.engine, self.server_cfg, self.registry)

        @app.middleware("http")
        async def tag_replica(request: Any, call_next: Callable[[Any], Any]) -> Any:
            response = await call_next(request)
            response.headers["x-dspark-replica"] = self.replica_id
            return response

        return app

    def check_health(self) -> None:
        """Ray's health check: raising marks this replica unhealthy and Ray replaces it."""
        if self.engine.load_error is not None:
            raise RuntimeError(f"engine failed: {self.engine.load_error}")
        if not self.engine.alive:
            raise RuntimeError("engine thread is not running")

    def _watch_stop(self, stopping: Callable[[], bool]) -> None:
        while not self._drained.is_set():
            if stopping():
                self._drain()
                return
            time.sleep(0.1)

    def _drain(self) -> None:
        if self._drained.is_set():
            return
        self._drained.set()
        import asyncio

        report = asyncio.run(self.engine.drain(self.server_cfg.shutdown_timeout))
        log.info("replica %s drained: %s", self.replica_id, report)

    async def __del__(self) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self._drain)
        self.bridge.stop()
        self.engine.stop()


def deployment(
    model_cfg: ModelConfig,
    drafter_cfg: DrafterConfig,
    sched_cfg: SchedulerConfig,
    server_cfg: ServerConfig,
    ray_cfg: RayServeConfig,
) -> Any:
    """The bound Ray Serve application (pass to `serve.run`)."""
    from ray import serve

    cls = serve.ingress()(EngineReplica)
    dep = serve.deployment(cls, name="DSparkEngine").options(  # type: ignore[attr-defined]
        **ray_cfg.deployment_options(server_cfg.shutdown_timeout)
    )
    return dep.bind(model_cfg, drafter_cfg, sched_cfg, server_cfg, ray_cfg)


# -- the command ----------------------------------------------------------------------------


def _ray_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-serve-ray", add_help=False)
    for f in dataclasses.fields(RayServeConfig):
        default = f.default
        t = float if isinstance(default, float) else int if f.name.endswith("replicas") else str
        p.add_argument("--" + f.name.replace("_", "-"), type=t, default=default)
    return p


def resolve(
    argv: list[str] | None = None,
) -> tuple[ModelConfig, DrafterConfig, SchedulerConfig, ServerConfig, RayServeConfig]:
    """(ModelConfig, DrafterConfig, SchedulerConfig, ServerConfig, RayServeConfig) from flags:
    the RayServeConfig fields here, everything else as `dspark-serve` reads it."""
    from dspark_serve.server import cli

    args, rest = _ray_parser().parse_known_args(argv)
    ray_cfg = RayServeConfig(**vars(args))
    model_cfg, drafter_cfg, sched_cfg, server_cfg = cli.resolve(rest)
    return model_cfg, drafter_cfg, sched_cfg, cli.resolve_api_key(server_cfg, os.environ), ray_cfg


def main(argv: list[str] | None = None) -> None:
    if argv is None and any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        _ray_parser().print_help()
        print("\nand every dspark-serve flag (dspark-serve --help)")
        return
    try:
        model_cfg, drafter_cfg, sched_cfg, server_cfg, ray_cfg = resolve(argv)
    except ValueError as exc:
        print(f"dspark-serve-ray: error: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import ray
    from ray import serve

    ray.init(address=ray_cfg.address, logging_level=getattr(logging, server_cfg.log_level.upper()))
    serve.start(http_options={"host": server_cfg.host, "port": server_cfg.port})
    serve.run(
        deployment(model_cfg, drafter_cfg, sched_cfg, server_cfg, ray_cfg),
        name=ray_cfg.app_name,
        route_prefix="/",
    )
    log.info("serving %s on http://%s:%d with Ray Serve", ray_cfg.app_name, server_cfg.host, server_cfg.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping: replicas drain (up to %.0fs)", server_cfg.shutdown_timeout)
    serve.delete(ray_cfg.app_name)  # each replica drains its engine as it stops
    serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()


if __name__ == "__main__":
    main()
