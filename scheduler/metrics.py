"""Engine metrics in Prometheus form. Names follow vLLM's (`vllm:` becomes `dspark:`) where the
meaning is the same, so existing dashboards carry over. The gauges and spec-decode counters that
routers and autoscalers read are also exported under vLLM's own names (always on): each alias is
declared where its `dspark:` metric is defined and re-exposes that metric's samples at scrape
time, so the value is stored and updated once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink, EngineSnapshot, NullMetrics  # noqa: F401

if TYPE_CHECKING:
    from dspark_serve.drafter.online_calibration import OnlineCalibrator
    from dspark_serve.scheduler.policy import CostTable, PolicyDecision

# Steps between exports of the online calibration state (its ECE scans a few thousand
# outcomes per position: too much work for every step).
CALIBRATION_EVERY = 32
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class AliasCollector:
    """Re-exports registered metrics under a second name (e.g. `vllm:num_requests_waiting` for
    `dspark:num_requests_waiting`): same type, help, labels and values, read at collect time."""

    def __init__(self) -> None:
        self._aliases: list[tuple[Any, str, str]] = []  # (metric, its name, alias name)

    def alias(self, metric: Any, name: str) -> Any:
        """Expose `metric` under `name` as well; returns `metric` so it wraps a definition."""
        own = metric._name  # prometheus_client strips a counter's `_total` here
        if name.endswith("_total") and metric._type == "counter":
            name = name[: -len("_total")]
        if not name or name == own:
            raise ValueError(f"alias {name!r} must differ from the metric name {own!r}")
        self._aliases.append((metric, own, name))
        return metric

    @property
    def names(self) -> dict[str, str]:
        """Alias name -> the metric name it mirrors."""
        return {alias: own for _, own, alias in self._aliases}

    def _renamed(self, families: Iterable[Metric]) -> Iterator[Metric]:
        for fam in families:
            for _metric, own, alias in self._aliases:
                if fam.name == own:
                    out = Metric(alias, fam.documentation, fam.type, fam.unit)
                    out.samples = [s._replace(name=alias + s.name[len(own) :]) for s in fam.samples]
                    yield out

    def collect(self) -> Iterator[Metric]:
        for metric, _, _ in self._aliases:
            yield from self._renamed(metric.collect())

    def describe(self) -> Iterator[Metric]:
        for metric, _, _ in self._aliases:
            yield from self._renamed(metric.describe())


class EngineMetrics:
    """The engine's reports (`EngineMetricsSink`) as Prometheus metrics in `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_block: int = 16) -> None:
        L = ["model_name"]
        self.labels = {"model_name": model_name}
        r = registry
        self.aliases = AliasCollector()
        vllm = self.aliases.alias
        self.running = vllm(
            Gauge("dspark:num_requests_running", "Requests decoding or prefilling.", L, registry=r),
            "vllm:num_requests_running",
        )
        self.waiting = vllm(
            Gauge("dspark:num_requests_waiting", "Requests queued for admission.", L, registry=r),
            "vllm:num_requests_waiting",
        )
        self.kv_usage = vllm(
            Gauge("dspark:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", L, registry=r),
            "vllm:kv_cache_usage_perc",
        )
        self.kv_cached_free = Gauge(
            "dspark:kv_cache_cached_free_perc",
            "Fraction of KV cache blocks holding cached prefixes no request "
            "holds (0-1); they count as free, so they are not in kv_cache_usage_perc.",
            L,
            registry=r,
        )
        self.prefix_queries = vllm(
            Counter(
                "dspark:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache at admission.",
                L,
                registry=r,
            ),
            "vllm:prefix_cache_queries",
        )
        self.prefix_hits = vllm(
            Counter(
                "dspark:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (their prefill skipped).",
                L,
                registry=r,
            ),
            "vllm:prefix_cache_hits",
        )
        self.prefix_hit_rate = Gauge(
            "dspark:prefix_cache_hit_rate",
            "Prefix cache hits / queries in tokens, since start (0-1).",
            L,
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "dspark:prefix_cache_blocks",
            "KV blocks holding cached content (held by requests or not).",
            L,
            registry=r,
        )
        self.prefix_evictions = Counter(
            "dspark:prefix_cache_evictions", "Cached KV blocks evicted to make room.", L, registry=r
        )
        self.preemptions = vllm(
            Counter(
                "dspark:num_preemptions",
                "Requests preempted (KV freed; they resume by recomputing).",
                L,
                registry=r,
            ),
            "vllm:num_preemptions",
        )
        self._last_prefix = (0, 0, 0)
        self._last_preemptions = 0
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prefilled prompt tokens.", L, registry=r)
        self.gen_tokens = Counter("dspark:generation_tokens", "Generated tokens returned.", L, registry=r)
        self.finished = Counter(
            "dspark:request_success", "Finished requests.", L + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "dspark:time_to_first_token_seconds",
            "Time to first token.",
            L,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dspark:inter_token_latency_seconds",
            "Time between tokens (a step yielding n tokens counts n times its time / n).",
            L,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dspark:e2e_request_latency_seconds", "Arrival to finish.", L, buckets=LATENCY_BUCKETS, registry=r
        )
        self.forward_tokens = Histogram(
            "dspark:forward_batch_tokens",
            "Tokens per target forward.",
            L,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
            registry=r,
        )
        self.forward_seconds = Histogram(
            "dspark:forward_seconds", "Duration of a target forward.", L, buckets=LATENCY_BUCKETS, registry=r
        )
        # speculative decoding
        self.drafts = vllm(
            Counter(
                "dspark:spec_decode_num_drafts", "Verification rounds with at least one draft.", L, registry=r
            ),
            "vllm:spec_decode_num_drafts",
        )
        self.draft_tokens = vllm(
            Counter("dspark:spec_decode_num_draft_tokens", "Draft tokens verified.", L, registry=r),
            "vllm:spec_decode_num_draft_tokens",
        )
        self.accepted = vllm(
            Counter("dspark:spec_decode_num_accepted_tokens", "Draft tokens accepted.", L, registry=r),
            "vllm:spec_decode_num_accepted_tokens",
        )
        self.accepted_pos = vllm(
            Counter(
                "dspark:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position (0-based).",
                L + ["position"],
                registry=r,
            ),
            "vllm:spec_decode_num_accepted_tokens_per_pos",
        )
        self.second_blocks = Counter(
            "dspark:spec_decode_second_blocks",
            "Second draft blocks verified beside a request's first (greedy, low load), by "
            "whether their accepted run was the longer one and kept.",
            L + ["outcome"],
            registry=r,
        )
        self.accept_len = Histogram(
            "dspark:spec_decode_acceptance_length",
            "Tokens per round, the target's own token included.",
            L,
            buckets=tuple(range(1, max_block + 3)),
            registry=r,
        )
        self.budget = Histogram(
            "dspark:spec_decode_verify_budget",
            "Draft tokens admitted for verification per request per step.",
            L,
            buckets=tuple(range(max_block + 1)),
            registry=r,
        )
        self.budget_mean = Gauge(
            "dspark:spec_decode_verify_budget_mean",
            "Mean verification budget per request in the last step.",
            L,
            registry=r,
        )
        self.step_overhead = Gauge(
            "dspark:spec_decode_step_overhead_seconds",
            "Seconds a drafting step spends besides the target forward at the last step's load "
            "(drafting, sampling, bookkeeping), as the verification policy prices it.",
            L,
            registry=r,
        )
        self.expected = Counter(
            "dspark:spec_decode_expected_tokens",
            "Tokens per step the policy expected (tau), summed over steps.",
            L,
            registry=r,
        )
        self.realized = Counter(
            "dspark:spec_decode_realized_tokens",
            "Tokens per step actually produced by decode requests, summed.",
            L,
            registry=r,
        )
        self.accel_mem = Gauge(
            "dspark:accelerator_memory_used_bytes",
            "Accelerator memory allocated by the engine (CUDA only).",
            L,
            registry=r,
        )
        self.conf_ece = Gauge(
            "dspark:spec_decode_confidence_ece",
            "Live expected calibration error of the survival probability the "
            "policy used, by draft position (0-based), over the recent window.",
            L + ["position"],
            registry=r,
        )
        self.conf_temp = Gauge(
            "dspark:spec_decode_confidence_temperature",
            "Online-calibrated confidence temperature T_k by draft position.",
            L + ["position"],
            registry=r,
        )
        self.conf_bias = Gauge(
            "dspark:spec_decode_confidence_bias",
            "Online-calibrated confidence bias b_k by draft position.",
            L + ["position"],
            registry=r,
        )
        self.conf_samples = Gauge(
            "dspark:spec_decode_confidence_samples",
            "Verified drafts behind the live ECE, by draft position.",
            L + ["position"],
            registry=r,
        )
        self._steps = 0
        self.cost = Gauge(
            "dspark:cost_table_steps_per_second",
            "Profiled target steps per second at a batch of B tokens.",
            L + ["batch_tokens"],
            registry=r,
        )
        registry.register(self.aliases)

        # Export every series at zero from the start (spec-decode counters included), so a
        # dashboard sees them before the first draft round.
        for m in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.kv_cached_free,
            self.prefix_queries,
            self.prefix_hits,
            self.prefix_hit_rate,
            self.prefix_blocks,
            self.prefix_evictions,
            self.preemptions,
            self.prompt_tokens,
            self.gen_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.forward_tokens,
            self.forward_seconds,
            self.drafts,
            self.draft_tokens,
            self.accepted,
            self.accept_len,
            self.budget,
            self.budget_mean,
            self.expected,
            self.realized,
        ):
            m.labels(**self.labels)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(**self.labels, finished_reason=reason)

    def set_cost_table(self, table: CostTable) -> None:
        for b, s in zip(table.batch_sizes, table.steps_per_second):
            self.cost.labels(**self.labels, batch_tokens=str(b)).set(s)

    def record_forward(self, tokens: int, seconds: float) -> None:
        self.forward_tokens.labels(**self.labels).observe(tokens)
        self.forward_seconds.labels(**self.labels).observe(seconds)

    def record_policy(
        self, decision: PolicyDecision, load: LoadState | None = None, overhead: float | None = None
    ) -> None:
        if overhead is not None:
            self.step_overhead.labels(**self.labels).set(overhead)
        if load is not None and load.accel_mem_used is not None:
            self.accel_mem.labels(**self.labels).set(load.accel_mem_used)
        ls = list(decision.lengths)
        for l in ls:
            self.budget.labels(**self.labels).observe(l)
        if ls:
            self.budget_mean.labels(**self.labels).set(sum(ls) / len(ls))
        self.expected.labels(**self.labels).inc(decision.expected_tokens)

    def record_round(self, drafted: int, accepted: int) -> None:
        lab = self.labels
        self.drafts.labels(**lab).inc()
        self.draft_tokens.labels(**lab).inc(drafted)
        self.accepted.labels(**lab).inc(accepted)
        for k in range(accepted):
            self.accepted_pos.labels(**lab, position=str(k)).inc()
        self.accept_len.labels(**lab).observe(accepted + 1)

    def record_first_token(self, seconds: float, prompt_tokens: int) -> None:
        """seconds: arrival to first token; prompt_tokens: the request's prompt length."""
        self.ttft.labels(**self.labels).observe(seconds)
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)

    def record_inter_token(self, seconds: float, n: int) -> None:
        for _ in range(max(n, 0)):
            self.itl.labels(**self.labels).observe(seconds / max(n, 1))

    def record_tokens(self, n: int) -> None:
        self.gen_tokens.labels(**self.labels).inc(n)

    def record_second_block(self, kept: bool) -> None:
        """A second block was verified; kept: its run was the longer and replaced the first's."""
        self.second_blocks.labels(**self.labels, outcome="kept" if kept else "dropped").inc()

    def record_realized(self, n: int) -> None:
        """Tokens a decoding request produced this step (before stop conditions cut them)."""
        self.realized.labels(**self.labels).inc(n)

    def record_finished(self, reason: str | None, seconds: float) -> None:
        """reason: the finish reason; seconds: arrival to finish."""
        self.finished.labels(**self.labels, finished_reason=reason or "unknown").inc()
        self.e2e.labels(**self.labels).observe(seconds)

    def record_step(self, snap: EngineSnapshot) -> None:
        self.running.labels(**self.labels).set(snap.num_running)
        self.waiting.labels(**self.labels).set(snap.num_waiting)
        self.kv_usage.labels(**self.labels).set(snap.kv_usage)
        self.kv_cached_free.labels(**self.labels).set(snap.kv_cached_free)
        pc = snap.prefix_cache
        if pc is not None:  # cumulative in the snapshot; the counters take the increase
            q0, h0, e0 = self._last_prefix
            self.prefix_queries.labels(**self.labels).inc(max(pc.queries - q0, 0))
            self.prefix_hits.labels(**self.labels).inc(max(pc.hits - h0, 0))
            self.prefix_evictions.labels(**self.labels).inc(max(pc.evictions - e0, 0))
            self._last_prefix = (pc.queries, pc.hits, pc.evictions)
            if pc.queries:
                self.prefix_hit_rate.labels(**self.labels).set(pc.hits / pc.queries)
            self.prefix_blocks.labels(**self.labels).set(pc.cached_blocks)
        self.preemptions.labels(**self.labels).inc(max(snap.preemptions - self._last_preemptions, 0))
        self._last_preemptions = snap.preemptions
        self._steps += 1
        cal = snap.calibrator
        if cal is not None and self._steps % CALIBRATION_EVERY == 1:
            self.record_calibration(cal)

    def record_calibration(self, cal: OnlineCalibrator) -> None:
        """Export an online calibrator's state (drafter/online_calibration.py)."""
        for k, (ece, t, b) in enumerate(zip(cal.survival_ece(), cal.temperatures, cal.biases)):
            pos = {**self.labels, "position": str(k)}
            self.conf_ece.labels(**pos).set(ece)
            self.conf_temp.labels(**pos).set(t)
            self.conf_bias.labels(**pos).set(b)
            self.conf_samples.labels(**pos).set(cal.samples(k))
