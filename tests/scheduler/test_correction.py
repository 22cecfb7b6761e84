"""Online correction of the cost table from measured forwards: a table twice wrong is corrected,
regions are learned apart, outliers are clipped, a choice the measurements contradict is dropped,
and the engine feeds it and exports predicted and measured times."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.correction import CostCorrection
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.metrics import EngineMetrics
from dspark_serve.scheduler.policy import CostTable, DSparkPolicy, PolicyInput
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, runner_for, tiny_model
from tests.scheduler.test_metrics import samples

FLAT = CostTable((1, 8, 64, 512), (100.0, 100.0, 100.0, 100.0))  # verifying looks free


def test_a_table_twice_wrong_is_corrected_within_a_few_steps():
    c = CostCorrection()
    predicted = 1.0 / FLAT.profiled_sps(8, 4)
    assert c.factor(8, 4) == 1.0  # nothing measured: the profile holds
    for _ in range(15):
        c.record(8, 4, predicted, 2.0 * predicted)
    assert c.factor(8, 4) == pytest.approx(2.0, rel=0.02)
    corrected = CostTable(FLAT.batch_sizes, FLAT.steps_per_second, correction=c.factor)
    assert corrected.sps(8, 4) == pytest.approx(50.0, rel=0.02)  # the measured speed
    assert corrected.profiled_sps(8, 4) == 100.0 and corrected == FLAT  # the profile itself kept
    # and it follows a change back within about ten steps
    for _ in range(12):
        c.record(8, 4, predicted, predicted)
    assert c.factor(8, 4) == pytest.approx(1.0, rel=0.1)


def test_regions_are_learned_apart_and_outliers_clipped():
    c = CostCorrection()
    for _ in range(20):
        c.record(4, 4, 0.01, 0.01)  # plain decoding of 4 requests: as profiled
        c.record(32, 4, 0.01, 0.03)  # verifying 7 drafts each: three times dearer
    assert c.factor(4, 4) == pytest.approx(1.0) and c.factor(32, 4) == pytest.approx(3.0, rel=0.02)
    assert c.factor(30, 5) == pytest.approx(3.0, rel=0.02)  # the same region
    assert c.factor(64, 4) == pytest.approx(3.0, rel=0.02)  # unmeasured: the nearest region's
    c.record(4, 4, 0.01, 10.0)  # a pause of the process
    assert c.factor(4, 4) < 1.35  # counted as at most `clip` times the estimate, weighted by alpha
    with pytest.raises(ValueError, match="alpha"):
        CostCorrection(alpha=0.0)


def test_a_choice_the_measurements_contradict_is_dropped():
    """A flat table says verifying is free, so the policy verifies every draft; measured, a
    verify step costs as much as its tokens: corrected, the policy verifies only the drafts
    that pay."""
    policy = DSparkPolicy()
    inp = PolicyInput(confidences=[torch.full((7,), 0.6)] * 4, max_lengths=[7] * 4)
    before = policy(inp, FLAT, LoadState(4))
    assert list(before.lengths) == [7, 7, 7, 7]
    c = CostCorrection()
    for _ in range(20):
        for per_request in (1, 2, 4, 8):
            tokens = 4 * per_request
            c.record(tokens, 4, 1 / 100.0, per_request / 100.0)  # forward time grows with the tokens
    after = policy(inp, CostTable(FLAT.batch_sizes, FLAT.steps_per_second, correction=c.factor), LoadState(4))
    assert sum(after.lengths) < sum(before.lengths) and max(after.lengths) <= 2


def test_the_engine_feeds_the_correction_and_exports_predicted_and_measured_times():
    reg = CollectorRegistry()
    engine = Engine(
        runner_for(tiny_model("llama")),
        ByteTokenizer(),
        SchedulerConfig(),
        max_model_len=256,
        metrics=EngineMetrics(reg, "tiny"),
    )
    engine.add_request(
        Request("a", [5, 6, 7], SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True)
    )
    while engine.has_work():
        engine.step()
    c = engine.speculation.correction
    assert c.last_measured > 0 and c.last_predicted > 0
    got = samples(reg)
    lab = (("model_name", "tiny"),)
    assert got[("dspark:forward_seconds_measured", lab)] == c.last_measured
    assert got[("dspark:forward_seconds_predicted", lab)] == c.last_predicted
    assert got[("dspark:cost_table_correction", lab)] == pytest.approx(c.factor(1, 1))
