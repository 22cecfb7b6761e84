"""The vLLM-named aliases mirror the dspark: metrics (same values, one storage); every metric of
the table is exported under its name, type and labels."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dspark_serve.scheduler.metrics import (
    ENGINE_METRICS,
    AliasCollector,
    EngineMetrics,
    EngineSnapshot,
    QueueWait,
    SlotShares,
)

VLLM = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)

# Every dspark: metric as exported (name without a counter's _total, type, labels): a dropped,
# renamed or retyped metric breaks the dashboards and alerts that read it.
EXPORTED = (
    ("dspark:num_requests_running", "gauge", ("model_name",)),
    ("dspark:num_requests_waiting", "gauge", ("model_name",)),
    ("dspark:kv_cache_usage_perc", "gauge", ("model_name",)),
    ("dspark:kv_cache_cached_free_perc", "gauge", ("model_name",)),
    ("dspark:prefix_cache_queries", "counter", ("model_name",)),
    ("dspark:prefix_cache_hits", "counter", ("model_name",)),
    ("dspark:prefix_cache_hit_rate", "gauge", ("model_name",)),
    ("dspark:prefix_cache_blocks", "gauge", ("model_name",)),
    ("dspark:prefix_cache_evictions", "counter", ("model_name",)),
    ("dspark:num_preemptions", "counter", ("model_name",)),
    ("dspark:fair_slot_preemptions", "counter", ("model_name",)),
    ("dspark:largest_slot_share", "gauge", ("model_name",)),
    ("dspark:key_slot_share", "gauge", ("model_name", "key")),
    ("dspark:key_queue_wait_seconds", "histogram", ("model_name", "key")),
    ("dspark:prompt_tokens", "counter", ("model_name",)),
    ("dspark:generation_tokens", "counter", ("model_name",)),
    ("dspark:request_success", "counter", ("model_name", "finished_reason")),
    ("dspark:time_to_first_token_seconds", "histogram", ("model_name",)),
    ("dspark:inter_token_latency_seconds", "histogram", ("model_name",)),
    ("dspark:e2e_request_latency_seconds", "histogram", ("model_name",)),
    ("dspark:forward_batch_tokens", "histogram", ("model_name",)),
    ("dspark:forward_seconds", "histogram", ("model_name",)),
    ("dspark:spec_decode_num_drafts", "counter", ("model_name",)),
    ("dspark:spec_decode_num_draft_tokens", "counter", ("model_name",)),
    ("dspark:spec_decode_num_accepted_tokens", "counter", ("model_name",)),
    ("dspark:spec_decode_num_accepted_tokens_per_pos", "counter", ("model_name", "position")),
    ("dspark:spec_decode_branches", "counter", ("model_name", "outcome")),
    ("dspark:spec_decode_acceptance_length", "histogram", ("model_name",)),
    ("dspark:spec_decode_verify_budget", "histogram", ("model_name",)),
    ("dspark:spec_decode_verify_budget_mean", "gauge", ("model_name",)),
    ("dspark:spec_decode_step_overhead_seconds", "gauge", ("model_name",)),
    ("dspark:spec_decode_expected_tokens", "counter", ("model_name",)),
    ("dspark:spec_decode_realized_tokens", "counter", ("model_name",)),
    ("dspark:accelerator_memory_used_bytes", "gauge", ("model_name",)),
    ("dspark:spec_decode_confidence_ece", "gauge", ("model_name", "sampling", "position")),
    ("dspark:spec_decode_confidence_temperature", "gauge", ("model_name", "sampling", "position")),
    ("dspark:spec_decode_confidence_bias", "gauge", ("model_name", "sampling", "position")),
    ("dspark:spec_decode_confidence_samples", "gauge", ("model_name", "sampling", "position")),
    ("dspark:cost_table_steps_per_second", "gauge", ("model_name", "batch_tokens")),
    ("dspark:cost_table_in_force", "gauge", ("model_name", "source")),
    ("dspark:cost_table_since_seconds", "gauge", ("model_name",)),
    ("dspark:forward_seconds_predicted", "gauge", ("model_name",)),
    ("dspark:forward_seconds_measured", "gauge", ("model_name",)),
    ("dspark:cost_table_correction", "gauge", ("model_name",)),
)


def samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fake_engine(running: int, waiting: int, usage: float) -> EngineSnapshot:
    return EngineSnapshot(num_running=running, num_waiting=waiting, kv_usage=usage)


def test_vllm_aliases_mirror_dspark_metrics():
    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    assert set(m.aliases.names) == set(VLLM)
    m.record_step(fake_engine(3, 5, 0.25))
    m.record_round(drafted=4, accepted=2)
    m.record_round(drafted=3, accepted=3)
    got = samples(reg)
    lab = (("model_name", "tiny"),)
    assert got[("vllm:num_requests_running", lab)] == 3
    assert got[("vllm:num_requests_waiting", lab)] == 5
    assert got[("vllm:kv_cache_usage_perc", lab)] == 0.25
    assert got[("vllm:spec_decode_num_drafts_total", lab)] == 2
    assert got[("vllm:spec_decode_num_draft_tokens_total", lab)] == 7
    assert got[("vllm:spec_decode_num_accepted_tokens_total", lab)] == 5
    per_pos = {
        dict(k[1])["position"]: v
        for k, v in got.items()
        if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 2, "1": 2, "2": 1}
    # every alias sample equals its dspark: sample (created timestamps included)
    for (name, labels), v in got.items():
        if name.startswith("vllm:"):
            assert got[("dspark:" + name[len("vllm:") :], labels)] == v, name
    # one storage: a later update shows under both names
    m.record_step(fake_engine(1, 0, 0.5))
    got = samples(reg)
    assert got[("vllm:num_requests_waiting", lab)] == got[("dspark:num_requests_waiting", lab)] == 0
    assert got[("vllm:num_requests_running", lab)] == 1
    text = generate_latest(reg).decode()
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert "# TYPE vllm:num_requests_waiting gauge" in text


def test_prefix_cache_and_preemption_metrics_follow_the_cumulative_snapshot():
    from dspark_serve.scheduler.block_manager import PrefixCacheStats

    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    lab = (("model_name", "tiny"),)
    got = samples(reg)
    assert got[("vllm:prefix_cache_queries_total", lab)] == 0 == got[("dspark:num_preemptions_total", lab)]
    m.record_step(EngineSnapshot(2, 0, 0.25, None, 0.5, PrefixCacheStats(100, 40, 3, 9, 4), 1))
    slots = SlotShares(2, 0.5, {"alice": 0.5, "": 0.25})
    m.record_step(EngineSnapshot(2, 0, 0.25, None, 0.125, PrefixCacheStats(150, 90, 5, 7, 2), 3, slots))
    got = samples(reg)
    assert got[("vllm:prefix_cache_queries_total", lab)] == 150
    assert got[("dspark:prefix_cache_hits_total", lab)] == got[("vllm:prefix_cache_hits_total", lab)] == 90
    assert got[("dspark:prefix_cache_hit_rate", lab)] == pytest.approx(0.6)
    assert got[("dspark:prefix_cache_evictions_total", lab)] == 5
    assert got[("dspark:prefix_cache_blocks", lab)] == 7
    assert got[("dspark:kv_cache_cached_free_perc", lab)] == 0.125
    assert got[("dspark:kv_cache_usage_perc", lab)] == 0.25
    assert got[("vllm:num_preemptions_total", lab)] == 3
    assert (
        got[("dspark:fair_slot_preemptions_total", lab)] == 2
        and got[("dspark:largest_slot_share", lab)] == 0.5
    )
    assert got[("dspark:key_slot_share", (("key", "alice"), *lab))] == 0.5
    assert got[("dspark:key_slot_share", (("key", "(none)"), *lab))] == 0.25
    m.record_step(EngineSnapshot(1, 0, 0.25, None, 0.125, None, 3, SlotShares(2, 0.25, {"": 0.25})))
    assert samples(reg)[("dspark:key_slot_share", (("key", "alice"), *lab))] == 0  # nothing of alice's runs


def test_queue_waits_are_observed_per_api_key():
    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    m.record_queue_waits([QueueWait("alice", 0.02), QueueWait("alice", 3.0), QueueWait("", 0.5)])
    got = samples(reg)
    alice = (("key", "alice"), ("model_name", "tiny"))
    assert got[("dspark:key_queue_wait_seconds_count", alice)] == 2
    assert got[("dspark:key_queue_wait_seconds_sum", alice)] == pytest.approx(3.02)
    assert got[("dspark:key_queue_wait_seconds_count", (("key", "(none)"), ("model_name", "tiny")))] == 1


def test_alias_rejects_its_own_name_and_duplicates():
    reg = CollectorRegistry()
    g = Gauge("dspark:x", "x", registry=reg)
    col = AliasCollector()
    with pytest.raises(ValueError, match="dspark:x"):
        col.alias(g, "dspark:x")
    col.alias(g, "vllm:x")
    reg.register(col)
    with pytest.raises(ValueError):  # the registry sees the alias name as taken
        Gauge("vllm:x", "clash", registry=reg)


def test_null_metrics_is_the_disabled_sink_and_the_engine_uses_it():
    import inspect

    from dspark_serve.scheduler.config import SchedulerConfig
    from dspark_serve.scheduler.engine import Engine
    from dspark_serve.scheduler.metrics_sink import EngineMetricsSink, NullMetrics
    from tests.helpers import ByteTokenizer, runner_for, tiny_model

    report = {
        n for n, _ in inspect.getmembers(EngineMetricsSink, inspect.isfunction) if n.startswith("record_")
    }
    assert "record_step" in report and "record_realized" in report
    for sink in (NullMetrics, EngineMetrics):  # both implement every report, same signature
        for n in report:
            assert (
                inspect.signature(getattr(sink, n)).parameters.keys()
                == inspect.signature(getattr(EngineMetricsSink, n)).parameters.keys()
            ), (sink, n)
    engine = Engine(runner_for(tiny_model("llama")), ByteTokenizer(), SchedulerConfig(), max_model_len=64)
    assert isinstance(engine.metrics, NullMetrics)


def test_engine_snapshot_feeds_the_gauges_and_the_calibration_export():
    class Cal:
        temperatures, biases, rounds = [1.5], [0.25], 3

        def survival_ece(self):
            return [0.125]

        def samples(self, k):
            return 9

    class Idle(Cal):
        rounds = 0

    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    cal = SimpleNamespace(buckets={"greedy": Idle(), "full": Cal()})
    m.record_step(EngineSnapshot(num_running=2, num_waiting=1, kv_usage=0.5, calibrator=cal))
    got = samples(reg)
    pos = (("model_name", "tiny"), ("position", "0"), ("sampling", "full"))
    assert (("model_name", "tiny"), ("position", "0"), ("sampling", "greedy")) not in {
        labels for name, labels in got if name == "dspark:spec_decode_confidence_temperature"
    }  # a bucket without a verified round is not exported
    assert got[("dspark:num_requests_running", (("model_name", "tiny"),))] == 2
    assert got[("dspark:spec_decode_confidence_temperature", pos)] == 1.5
    assert got[("dspark:spec_decode_confidence_samples", pos)] == 9


def test_branches_are_counted_by_outcome():
    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    for kept in (True, False, False):
        m.record_branch(kept)
    got = samples(reg)
    lab = lambda outcome: (("model_name", "tiny"), ("outcome", outcome))
    assert got[("dspark:spec_decode_branches_total", lab("kept"))] == 1
    assert got[("dspark:spec_decode_branches_total", lab("dropped"))] == 2


def test_the_policy_report_exports_the_step_overhead_it_priced():
    from dspark_serve.scheduler.policy import PolicyDecision

    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny")
    key = ("dspark:spec_decode_step_overhead_seconds", (("model_name", "tiny"),))
    m.record_policy(PolicyDecision([2, 3], 4.5))
    assert key not in samples(reg)  # not measured yet: no sample
    m.record_policy(PolicyDecision([2, 3], 4.5), overhead=0.004)
    assert samples(reg)[key] == 0.004
    assert samples(reg)[("dspark:spec_decode_verify_budget_mean", (("model_name", "tiny"),))] == 2.5


def test_every_metric_is_exported_under_its_name_type_and_labels():
    reg = CollectorRegistry()
    m = EngineMetrics(reg, "tiny", max_block=4)
    text = generate_latest(reg).decode()
    types = {
        name.removesuffix("_total"): typ
        for name, typ in re.findall(r"^# TYPE (dspark:\S+) (\w+)$", text, re.M)
        if not name.endswith("_created")
    }
    assert types == {name: typ for name, typ, _ in EXPORTED}
    built = {s.name: getattr(m, s.attr) for s in ENGINE_METRICS}
    assert {name: tuple(built[name]._labelnames) for name, _, _ in EXPORTED} == {
        name: labels for name, _, labels in EXPORTED
    }
    # the block-sized histograms follow the block size: a bucket per count a block can make
    got = samples(reg)
    les = lambda metric: sorted(
        float(dict(k[1])["le"]) for k in got if k[0] == metric + "_bucket" and dict(k[1])["le"] != "+Inf"
    )
    assert les("dspark:spec_decode_acceptance_length") == [1, 2, 3, 4, 5, 6]
    assert les("dspark:spec_decode_verify_budget") == [0, 1, 2, 3, 4]


def test_each_row_of_the_table_is_a_typed_attribute():
    hints = {n: t for n, t in EngineMetrics.__annotations__.items()}
    assert {s.attr: s.kind.__name__ for s in ENGINE_METRICS} == hints
    assert len({s.name for s in ENGINE_METRICS}) == len(ENGINE_METRICS)


def test_gpu_load_is_exported_where_nvml_answers(monkeypatch):
    """A fake pynvml with two GPUs: utilisation and memory per GPU at scrape time; where NVML
    does not answer (no module here, or an init that fails) nothing is registered."""
    import sys
    import types

    class Rates:
        def __init__(self, gpu):
            self.gpu = gpu

    class Mem:
        def __init__(self, used):
            self.used = used

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: Rates([37, 91][h]),
        nvmlDeviceGetMemoryInfo=lambda h: Mem([2**30, 3 * 2**30][h]),
    )
    monkeypatch.setitem(sys.modules, "pynvml", types.ModuleType("pynvml"))
    for k, v in vars(fake).items():
        setattr(sys.modules["pynvml"], k, v)
    reg = CollectorRegistry()
    EngineMetrics(reg, "tiny")
    got = samples(reg)
    assert got[("dspark:gpu_utilization_perc", (("gpu", "1"), ("model_name", "tiny")))] == 91
    assert got[("dspark:gpu_memory_used_bytes", (("gpu", "0"), ("model_name", "tiny")))] == 2**30

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    sys.modules["pynvml"].nvmlInit = fail
    reg = CollectorRegistry()
    EngineMetrics(reg, "tiny")
    assert not any(name.startswith("dspark:gpu_") for name, _ in samples(reg))
