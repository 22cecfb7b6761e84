"""Engine metrics in Prometheus form. Names follow vLLM's (`vllm:` becomes `dspark:`) where the
meaning is the same, so existing dashboards carry over. The gauges and spec-decode counters that
routers and autoscalers read are also exported under vLLM's own names (always on): each alias is
declared in the metric's row of `ENGINE_METRICS` and re-exposes that metric's samples at scrape
time, so the value is stored and updated once."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.metrics_sink import (  # noqa: F401
    EngineMetricsSink,
    EngineSnapshot,
    NullMetrics,
    QueueWait,
    SlotShares,
)
from dspark_serve.scheduler.nvml import NvmlCollector

if TYPE_CHECKING:
    from dspark_serve.drafter.online_calibration import BucketedCalibrator
    from dspark_serve.scheduler.policy import CostTable, PolicyDecision

# Steps between exports of the online calibration state (its ECE scans a few thousand
# outcomes per position: too much work for every step).
CALIBRATION_EVERY = 32
NO_KEY = "(none)"  # the `key` label of requests without an API key (no key's name can be this)
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
FORWARD_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Every series carries the served model's name.
MODEL_LABEL = "model_name"
# The finish reasons exported at zero from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")
# where the cost table in force came from (`scheduler/builder.py`)
COST_TABLE_SOURCES = ("cached", "measured", "provisional")

Kind = type[Counter] | type[Gauge] | type[Histogram]


@dataclass(frozen=True)
class BlockBuckets:
    """Histogram buckets that follow the drafter's block size: first .. max_block + beyond,
    one per count a block can produce."""

    first: int
    beyond: int

    def values(self, max_block: int) -> tuple[int, ...]:
        return tuple(range(self.first, max_block + self.beyond + 1))


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    attr: the `EngineMetrics` attribute that holds it.
    name / kind / help: as exported.
    labels: its labels besides the model name.
    buckets: a histogram's buckets (fixed, or following the block size).
    vllm: the vLLM name it is also exported under, or None.
    unmeasured: no sample until first recorded (a gauge with no meaningful zero); otherwise a
                 metric without further labels is exported at zero from the start, so a dashboard sees
                 it before the first event.
    preset: values of its one further label exported at zero from the start.
    """

    attr: str
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | BlockBuckets | None = None
    vllm: str | None = None
    unmeasured: bool = False
    preset: tuple[str, ...] = ()

    def build(self, registry: CollectorRegistry, max_block: int) -> Counter | Gauge | Histogram:
        labels = (MODEL_LABEL, *self.labels)
        if self.kind is Histogram:
            b = self.buckets
            buckets = b.values(max_block) if isinstance(b, BlockBuckets) else b
            assert buckets is not None, f"histogram {self.name} needs buckets"
            return Histogram(self.name, self.help, labels, buckets=buckets, registry=registry)
        return self.kind(self.name, self.help, labels, registry=registry)


# Every metric the engine exports, in export order (one row each; `MetricSpec`).
# fmt: off
ENGINE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("running", "dspark:num_requests_running", Gauge, "Requests decoding or prefilling.",
               vllm="vllm:num_requests_running"),
    MetricSpec("waiting", "dspark:num_requests_waiting", Gauge, "Requests queued for admission.",
               vllm="vllm:num_requests_waiting"),
    MetricSpec("kv_usage", "dspark:kv_cache_usage_perc", Gauge, "Fraction of KV cache blocks in use (0-1).",
               vllm="vllm:kv_cache_usage_perc"),
    MetricSpec("kv_cached_free", "dspark:kv_cache_cached_free_perc", Gauge,
               "Fraction of KV cache blocks holding cached prefixes no request holds (0-1); they count "
               "as free, so they are not in kv_cache_usage_perc."),
    MetricSpec("prefix_queries", "dspark:prefix_cache_queries", Counter,
               "Prompt tokens looked up in the prefix cache at admission.", vllm="vllm:prefix_cache_queries"),
    MetricSpec("prefix_hits", "dspark:prefix_cache_hits", Counter,
               "Prompt tokens found in the prefix cache (their prefill skipped).",
               vllm="vllm:prefix_cache_hits"),
    MetricSpec("prefix_hit_rate", "dspark:prefix_cache_hit_rate", Gauge,
               "Prefix cache hits / queries in tokens, since start (0-1)."),
    MetricSpec("prefix_blocks", "dspark:prefix_cache_blocks", Gauge,
               "KV blocks holding cached content (held by requests or not)."),
    MetricSpec("prefix_evictions", "dspark:prefix_cache_evictions", Counter,
               "Cached KV blocks evicted to make room."),
    MetricSpec("preemptions", "dspark:num_preemptions", Counter,
               "Requests preempted (KV freed; they resume by recomputing).", vllm="vllm:num_preemptions"),
    MetricSpec("fair_preemptions", "dspark:fair_slot_preemptions", Counter,
               "Slots given back by the largest owner to a waiting one (fair slots)."),
    MetricSpec("largest_share", "dspark:largest_slot_share", Gauge,
               "Running slots the largest owner (a request with its n choices) holds, over max_num_seqs."),
    MetricSpec("key_share", "dspark:key_slot_share", Gauge,
               f"Running slots the requests of each API key hold, over max_num_seqs (key {NO_KEY!r}: "
               "requests without one).", labels=("key",)),
    MetricSpec("key_wait", "dspark:key_queue_wait_seconds", Histogram,
               "Seconds a request waited in the queue before admission (from arrival, or from a "
               f"preemption), by API key (key {NO_KEY!r}: requests without one).", labels=("key",),
               buckets=LATENCY_BUCKETS),
    MetricSpec("prompt_tokens", "dspark:prompt_tokens", Counter, "Prefilled prompt tokens."),
    MetricSpec("gen_tokens", "dspark:generation_tokens", Counter, "Generated tokens returned."),
    MetricSpec("finished", "dspark:request_success", Counter, "Finished requests.",
               labels=("finished_reason",), preset=FINISH_REASONS),
    MetricSpec("ttft", "dspark:time_to_first_token_seconds", Histogram, "Time to first token.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("itl", "dspark:inter_token_latency_seconds", Histogram,
               "Time between tokens (a step yielding n tokens counts n times its time / n).",
               buckets=LATENCY_BUCKETS),
    MetricSpec("e2e", "dspark:e2e_request_latency_seconds", Histogram, "Arrival to finish.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("forward_tokens", "dspark:forward_batch_tokens", Histogram, "Tokens per target forward.",
               buckets=FORWARD_TOKEN_BUCKETS),
    MetricSpec("forward_seconds", "dspark:forward_seconds", Histogram, "Duration of a target forward.",
               buckets=LATENCY_BUCKETS),
    # speculative decoding
    MetricSpec("drafts", "dspark:spec_decode_num_drafts", Counter,
               "Verification rounds with at least one draft.",
               vllm="vllm:spec_decode_num_drafts"),
    MetricSpec("draft_tokens", "dspark:spec_decode_num_draft_tokens", Counter, "Draft tokens verified.",
               vllm="vllm:spec_decode_num_draft_tokens"),
    MetricSpec("accepted", "dspark:spec_decode_num_accepted_tokens", Counter, "Draft tokens accepted.",
               vllm="vllm:spec_decode_num_accepted_tokens"),
    MetricSpec("accepted_pos", "dspark:spec_decode_num_accepted_tokens_per_pos", Counter,
               "Accepted draft tokens by position (0-based).", labels=("position",),
               vllm="vllm:spec_decode_num_accepted_tokens_per_pos"),
    MetricSpec("branches", "dspark:spec_decode_branches", Counter,
               "Branches (second draft blocks from the same anchor) verified beside a request's "
               "first (greedy, low load), by whether "
               "their accepted run was the longer one and kept.", labels=("outcome",)),
    MetricSpec("accept_len", "dspark:spec_decode_acceptance_length", Histogram,
               "Tokens per round, the target's own token included.", buckets=BlockBuckets(1, 2)),
    MetricSpec("budget", "dspark:spec_decode_verify_budget", Histogram,
               "Draft tokens admitted for verification per request per step.", buckets=BlockBuckets(0, 0)),
    MetricSpec("budget_mean", "dspark:spec_decode_verify_budget_mean", Gauge,
               "Mean verification budget per request in the last step."),
    MetricSpec("step_overhead", "dspark:spec_decode_step_overhead_seconds", Gauge,
               "Seconds a drafting step spends besides the target forward at the last step's load "
               "(drafting, sampling, bookkeeping), as the verification policy prices it.", unmeasured=True),
    MetricSpec("expected", "dspark:spec_decode_expected_tokens", Counter,
               "Tokens per step the policy expected (tau), summed over steps."),
    MetricSpec("realized", "dspark:spec_decode_realized_tokens", Counter,
               "Tokens per step actually produced by decode requests, summed."),
    MetricSpec("accel_mem", "dspark:accelerator_memory_used_bytes", Gauge,
               "Accelerator memory allocated by the engine (CUDA only).", unmeasured=True),
    MetricSpec("conf_ece", "dspark:spec_decode_confidence_ece", Gauge,
               "Live expected calibration error of the survival probability the policy used, by "
               "sampling bucket (greedy, sharpened, full) and draft position (0-based), over the "
               "recent window.", labels=("sampling", "position")),
    MetricSpec("conf_temp", "dspark:spec_decode_confidence_temperature", Gauge,
               "Online-calibrated confidence temperature T_k by sampling bucket and draft position.",
               labels=("sampling", "position")),
    MetricSpec("conf_bias", "dspark:spec_decode_confidence_bias", Gauge,
               "Online-calibrated confidence bias b_k by sampling bucket and draft position.",
               labels=("sampling", "position")),
    MetricSpec("conf_samples", "dspark:spec_decode_confidence_samples", Gauge,
               "Verified drafts behind the live ECE, by sampling bucket and draft position.",
               labels=("sampling", "position")),
    MetricSpec("cost", "dspark:cost_table_steps_per_second", Gauge,
               "Profiled target steps per second at a batch of B tokens.", labels=("batch_tokens",)),
    MetricSpec("cost_source", "dspark:cost_table_in_force", Gauge,
               "1 for where the cost table in force came from, else 0: cached, measured (before "
               "serving or in the engine's idle gaps) or provisional (a short probe, served on "
               "while the full table is measured).", labels=("source",), preset=COST_TABLE_SOURCES),
    MetricSpec("cost_since", "dspark:cost_table_since_seconds", Gauge,
               "Unix time the cost table in force took over.", unmeasured=True),
    MetricSpec("fwd_predicted", "dspark:forward_seconds_predicted", Gauge,
               "The profiled cost table's time for the last decode step's forward.", unmeasured=True),
    MetricSpec("fwd_measured", "dspark:forward_seconds_measured", Gauge,
               "The last decode step's forward time as measured.", unmeasured=True),
    MetricSpec("cost_correction", "dspark:cost_table_correction", Gauge,
               "Measured over profiled forward time where the last decode step fell, as the "
               "verification policy applies it (1: the profile holds).", unmeasured=True),
)
# fmt: on


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
    """The engine's reports (`EngineMetricsSink`) as Prometheus metrics in `registry`, one
    attribute per row of `ENGINE_METRICS`."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    kv_cached_free: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    prefix_hit_rate: Gauge
    prefix_blocks: Gauge
    prefix_evictions: Counter
    preemptions: Counter
    fair_preemptions: Counter
    largest_share: Gauge
    key_share: Gauge
    key_wait: Histogram
    prompt_tokens: Counter
    gen_tokens: Counter
    finished: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    forward_tokens: Histogram
    forward_seconds: Histogram
    drafts: Counter
    draft_tokens: Counter
    accepted: Counter
    accepted_pos: Counter
    branches: Counter
    accept_len: Histogram
    budget: Histogram
    budget_mean: Gauge
    step_overhead: Gauge
    expected: Counter
    realized: Counter
    accel_mem: Gauge
    conf_ece: Gauge
    conf_temp: Gauge
    conf_bias: Gauge
    conf_samples: Gauge
    cost: Gauge
    cost_source: Gauge
    cost_since: Gauge
    fwd_predicted: Gauge
    fwd_measured: Gauge
    cost_correction: Gauge

    def __init__(self, registry: CollectorRegistry, model_name: str, max_block: int = 16) -> None:
        self.labels = {MODEL_LABEL: model_name}
        self.aliases = AliasCollector()
        for spec in ENGINE_METRICS:
            metric = spec.build(registry, max_block)
            setattr(self, spec.attr, metric)
            if spec.vllm is not None:
                self.aliases.alias(metric, spec.vllm)
        registry.register(self.aliases)
        nvml = NvmlCollector.create(model_name)  # GPU utilisation and memory, where NVML answers
        if nvml is not None:
            registry.register(nvml)
        for spec in ENGINE_METRICS:
            self._export_zero(spec)
        self._last_prefix = (0, 0, 0)
        self._last_preemptions = 0
        self._last_fair = 0
        self._keys_seen: set[str] = set()
        self._steps = 0

    def _export_zero(self, spec: MetricSpec) -> None:
        """Create the series a dashboard should see before the first event (`MetricSpec`)."""
        metric: Counter | Gauge | Histogram = getattr(self, spec.attr)
        if not spec.labels and not spec.unmeasured:
            metric.labels(**self.labels)
        for value in spec.preset:
            metric.labels(**self.labels, **{spec.labels[0]: value})

    def set_cost_table(self, table: CostTable, source: str) -> None:
        for b, s in zip(table.batch_sizes, table.steps_per_second):
            self.cost.labels(**self.labels, batch_tokens=str(b)).set(s)
        for name in COST_TABLE_SOURCES:
            self.cost_source.labels(**self.labels, source=name).set(1.0 if name == source else 0.0)
        self.cost_since.labels(**self.labels).set(time.time())

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

    def record_cost(self, predicted: float, measured: float, correction: float) -> None:
        self.fwd_predicted.labels(**self.labels).set(predicted)
        self.fwd_measured.labels(**self.labels).set(measured)
        self.cost_correction.labels(**self.labels).set(correction)

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

    def record_branch(self, kept: bool) -> None:
        """A branch (a second draft block from the same anchor) was verified; kept: its run was
        the longer and replaced the first block's."""
        self.branches.labels(**self.labels, outcome="kept" if kept else "dropped").inc()

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
        self.record_slots(snap.slots)
        self._steps += 1
        cal = snap.calibrator
        if cal is not None and self._steps % CALIBRATION_EVERY == 1:
            self.record_calibration(cal)

    def record_slots(self, slots: SlotShares) -> None:
        self.fair_preemptions.labels(**self.labels).inc(max(slots.fair_preemptions - self._last_fair, 0))
        self._last_fair = slots.fair_preemptions
        self.largest_share.labels(**self.labels).set(slots.largest_share)
        self._keys_seen.update(slots.by_key)
        for key in self._keys_seen:  # a key with nothing running now reads 0
            self.key_share.labels(**self.labels, key=key or NO_KEY).set(slots.by_key.get(key, 0.0))

    def record_queue_waits(self, waits: Sequence[QueueWait]) -> None:
        for w in waits:
            self.key_wait.labels(**self.labels, key=w.key_name or NO_KEY).observe(w.seconds)

    def record_calibration(self, cal: BucketedCalibrator) -> None:
        """Export the online calibration's state per sampling bucket and position
        (drafter/online_calibration.py); a bucket with no verified round yet is left out."""
        for bucket, c in cal.buckets.items():
            if not c.rounds:
                continue
            for k, (ece, t, b) in enumerate(zip(c.survival_ece(), c.temperatures, c.biases)):
                pos = {**self.labels, "sampling": bucket, "position": str(k)}
                self.conf_ece.labels(**pos).set(ece)
                self.conf_temp.labels(**pos).set(t)
                self.conf_bias.labels(**pos).set(b)
                self.conf_samples.labels(**pos).set(c.samples(k))
