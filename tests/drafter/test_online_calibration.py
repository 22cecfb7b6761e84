"""Online recalibration from verification outcomes: it repairs confidences that are off, stays
bounded, and never changes what greedy decoding outputs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from dspark_serve.drafter.online_calibration import (
    BucketedCalibrator,
    OnlineCalibrationConfig,
    OnlineCalibrator,
    expected_calibration_error,
    fit_platt,
    sampling_bucket,
)
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.metrics import EngineMetrics
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model
from tests.scheduler.test_speculative import random_dspark, run


def overconfident_rounds(n, seed):
    """Rounds whose true conditional survival s_k is known; the raw logit claims far more."""
    rng = random.Random(seed)
    for _ in range(n):
        s = [rng.uniform(0.1, 0.9) for _ in range(3)]
        raw = [3.0 * math.log(p / (1 - p)) + 2.0 for p in s]  # overconfident on purpose
        accepted = 0
        while accepted < 3 and rng.random() < s[accepted]:
            accepted += 1
        yield raw, accepted


def test_recalibration_lowers_the_ece_of_an_overconfident_head():
    cal = OnlineCalibrator(3, config=OnlineCalibrationConfig(window=2048, refit_every=64, min_samples=128))
    for raw, acc in overconfident_rounds(3000, seed=0):
        cal.record(raw, cal.calibrate(raw), 3, acc)
    # fresh rounds: ECE of the raw head vs the recalibrated confidences, position 1
    raw_c, fit_c, out = [], [], []
    for raw, acc in overconfident_rounds(4000, seed=1):
        raw_c.append(1 / (1 + math.exp(-raw[0])))
        fit_c.append(cal.calibrate(raw)[0])
        out.append(1.0 if acc > 0 else 0.0)
    before = expected_calibration_error(np.array(raw_c), np.array(out), 10)
    after = expected_calibration_error(np.array(fit_c), np.array(out), 10)
    assert before > 0.1 and after < 0.03, (before, after)
    assert 2.0 < cal.temperatures[0] < 4.5  # the 3x over-scaling was found
    # the live ECE that /metrics reports fell as the fit took over
    assert cal.survival_ece()[0] < before


def test_cumulative_ece_covers_every_round_while_the_window_keeps_the_last():
    cal = OnlineCalibrator(3, config=OnlineCalibrationConfig(window=256, refit_every=64, min_samples=128))
    used_all: list[list[float]] = [[], [], []]
    out_all: list[list[float]] = [[], [], []]
    for raw, acc in overconfident_rounds(1500, seed=2):
        used = cal.calibrate(raw)
        cal.record(raw, used, 3, acc)
        a = 1.0
        for k in range(3):
            a *= used[k]
            used_all[k].append(a)
            out_all[k].append(1.0 if k < acc else 0.0)
    cum = cal.cumulative_ece()
    for k in range(3):
        want = expected_calibration_error(np.array(used_all[k]), np.array(out_all[k]), 10)
        assert cum[k].samples == 1500 and cum[k].ece == pytest.approx(want, abs=1e-9)
        last = expected_calibration_error(np.array(used_all[k][-256:]), np.array(out_all[k][-256:]), 10)
        assert cal.samples(k) == 256 and cal.survival_ece()[k] == pytest.approx(last, abs=1e-9)


def test_the_noise_floor_is_what_a_calibrated_head_shows_and_a_biased_one_exceeds():
    """Outcomes drawn with exactly the probabilities used: the ECE lands on the noise floor
    (averaged over runs), and shrinks with samples; a head 8 points overconfident stays above."""
    rng = np.random.default_rng(0)

    def run(n, shift):
        cal = OnlineCalibrator(
            1, config=OnlineCalibrationConfig(window=64, refit_every=10**9, min_samples=64)
        )
        for p in rng.uniform(0.05, 0.95, n):
            cal.record([0.0], [float(p)], 1, int(rng.random() < p - shift))
        return cal.cumulative_ece()[0]

    small = [run(1000, 0.0) for _ in range(40)]
    mean_ece = float(np.mean([c.ece for c in small]))
    mean_floor = float(np.mean([c.noise_floor for c in small]))
    assert 0.02 < mean_floor < 0.04  # ~1 / sqrt(1000) scale
    assert mean_ece == pytest.approx(mean_floor, rel=0.15)
    large = run(16000, 0.0)
    assert large.noise_floor < mean_floor / 3 and large.ece < 3 * large.noise_floor
    biased = run(16000, 0.08)
    assert biased.ece > 0.07 and biased.noise_floor < 0.01


def test_fit_is_bounded_and_config_validated():
    cfg = OnlineCalibrationConfig()
    z = np.linspace(-3, 3, 200)
    t, b = fit_platt(z, np.ones_like(z), 1.0, 0.0, cfg)  # all accepted: push to the bounds
    assert cfg.min_temperature <= t <= cfg.max_temperature and abs(b) <= cfg.max_bias
    with pytest.raises(ValueError, match="window"):
        OnlineCalibrationConfig(window=0)
    with pytest.raises(ValueError, match="3"):
        OnlineCalibrator(3).record([0.0, 0.0, 0.0], [0.5, 0.5, 0.5], 2, 3)


def test_engine_recalibrates_an_overconfident_drafter_and_greedy_is_unchanged(tmp_path):
    target = tiny_model("qwen3")
    path = random_dspark(target, tmp_path)
    dr = build_drafter("dspark", path=str(path), target_model=target)
    with torch.no_grad():
        dr.model.confidence_head.proj.bias.fill_(4.0)  # claims ~0.98; random drafts fail
    for c in dr.calibrator.buckets.values():
        c.config = OnlineCalibrationConfig(window=512, refit_every=16, min_samples=32)
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    engine = Engine(
        runner_for(target),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="static:5"),
        max_model_len=512,
        drafter=dr,
        metrics=EngineMetrics(reg, "tiny"),
    )
    prompts = [list(range(40 + i, 52 + i)) for i in range(4)]
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    run(engine, reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(target, p, 40)
    cal = dr.calibrator.buckets["greedy"]  # greedy traffic trains the greedy fit alone
    assert cal.rounds > 64 and dr.calibrator.rounds == cal.rounds
    z = np.array(list(cal._z[0]))
    y = np.array(list(cal._y[0]))
    offline = expected_calibration_error(1 / (1 + np.exp(-z)), y, 10)
    online = expected_calibration_error(np.array([cal.calibrate([v])[0] for v in z]), y, 10)
    assert offline > 0.5 and online < offline / 2, (offline, online)
    engine.metrics.record_calibration(dr.calibrator)
    text = __import__("prometheus_client").generate_latest(reg).decode()
    assert (
        'dspark:spec_decode_confidence_temperature{model_name="tiny",position="0",sampling="greedy"}' in text
    )
    assert 'sampling="full"' not in text  # no sampled round: nothing to say about that bucket
    assert "dspark:spec_decode_confidence_ece" in text


def test_sampling_buckets_and_their_separate_fits():
    assert sampling_bucket(SamplingParams(temperature=0.0)) == "greedy"
    assert sampling_bucket(SamplingParams(temperature=1.0)) == "full"
    assert sampling_bucket(SamplingParams(temperature=0.95)) == "full"
    assert sampling_bucket(SamplingParams(temperature=0.7)) == "sharpened"
    assert sampling_bucket(SamplingParams(temperature=1.0, top_p=0.9)) == "sharpened"
    assert sampling_bucket(SamplingParams(temperature=1.0, min_p=0.05)) == "sharpened"
    cal = BucketedCalibrator(2, None, OnlineCalibrationConfig(window=256, refit_every=16, min_samples=32))
    rng = random.Random(0)
    for _ in range(200):
        z = [rng.uniform(-1, 1), rng.uniform(-1, 1)]
        cal.record(z, cal.calibrate(z, "greedy"), 2, 2, "greedy")  # greedy drafts survive
        cal.record(z, cal.calibrate(z, "full"), 2, 0, "full")  # T=1 drafts die
    g, f = cal.calibrate([0.0, 0.0], "greedy"), cal.calibrate([0.0, 0.0], "full")
    assert g[0] > 0.9 and f[0] < 0.1, (g, f)
    assert cal.buckets["sharpened"].rounds == 0 and cal.rounds == 400


def test_a_mixed_batch_gives_greedy_and_sampled_requests_their_own_budgets(tmp_path):
    """One step, one greedy and one temperature-1 request, the same drafter: the greedy bucket
    has learned that drafts survive, the full bucket that they die, so the load-aware policy
    verifies a long block for the one and little or nothing for the other."""
    target = tiny_model("qwen3")
    path = random_dspark(target, tmp_path)
    dr = build_drafter("dspark", path=str(path), target_model=target)
    dr.calibrator.buckets["greedy"].biases = [4.0] * dr.block_size  # c_k ~ 0.98
    dr.calibrator.buckets["full"].biases = [-4.0] * dr.block_size  # c_k ~ 0.02
    from dspark_serve.scheduler.policy import CostTable

    engine = Engine(
        runner_for(target),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark", draft_gate=False, draft_headroom=0),
        max_model_len=512,
        drafter=dr,
        cost_table=CostTable((1, 8, 16, 64), (100.0, 95.0, 90.0, 40.0)),  # drafts nearly free
    )
    greedy = Request(
        "g", list(range(40, 52)), SamplingParams(temperature=0.0), max_tokens=16, ignore_eos=True
    )
    sampled = Request(
        "s", list(range(60, 72)), SamplingParams(temperature=1.0), max_tokens=2, ignore_eos=True
    )
    for r in (greedy, sampled):
        engine.add_request(r)
    engine.step()  # the prefills
    engine.step()  # one decode step of both, drafts verified
    assert greedy.spec.steps == sampled.spec.steps == 1
    assert greedy.spec.drafted >= 1 and greedy.spec.drafted > sampled.spec.drafted, (
        greedy.spec.drafted,
        sampled.spec.drafted,
    )
