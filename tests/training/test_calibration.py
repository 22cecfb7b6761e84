"""Sequential Temperature Scaling and the calibration metrics."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_serve.training.calibrate import (
    STSConfig,
    auc,
    cumulative_survival,
    ece,
    fit_sts,
    pooled_ece,
    position_metrics,
)


def test_ece_by_hand():
    # Bin [0.2, 0.25): preds 0.2, 0.2 vs targets 1, 0 -> |0.2 - 0.5| = 0.3 on half the mass;
    # bin [0.8, 0.85): preds 0.8, 0.8 vs targets 1, 1 -> |0.8 - 1| = 0.2 on the other half.
    pred = torch.tensor([0.2, 0.2, 0.8, 0.8])
    target = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert ece(pred, target, 20) == pytest.approx(0.5 * 0.3 + 0.5 * 0.2)


def test_auc_by_hand_and_soft_labels():
    pred = torch.tensor([0.1, 0.4, 0.35, 0.8])
    target = torch.tensor([0.0, 0.0, 1.0, 1.0])
    # Pairs (pos, neg): (0.35 > 0.1), (0.35 < 0.4), (0.8 > 0.1), (0.8 > 0.4) -> 3 / 4.
    assert auc(pred, target) == pytest.approx(0.75)
    # A soft label 0.5 is half a positive and half a negative.
    soft = auc(torch.tensor([0.2, 0.9]), torch.tensor([0.5, 1.0]))
    # positives: 0.5 at 0.2, 1 at 0.9; negatives: 0.5 at 0.2.
    # pairs: pos@0.9 vs neg@0.2 -> 1 * 0.5; pos@0.2 vs neg@0.2 tie -> 0.5 * 0.5 * 0.5.
    assert soft == pytest.approx((0.5 + 0.125) / (1.5 * 0.5))


def _synthetic(n: int, bs: int, overconfidence: float, seed: int = 0):
    """True per-step survival s_k, sampled outcomes, and logits scaled by `overconfidence`."""
    g = torch.Generator().manual_seed(seed)
    s = 0.35 + 0.6 * torch.rand(n, bs, generator=g, dtype=torch.float64)
    ok = (torch.rand(n, bs, generator=g, dtype=torch.float64) < s).double()
    prefix = ok.cumprod(-1)
    logits = overconfidence * torch.log(s / (1 - s))
    return logits, prefix, torch.ones(n, bs, dtype=torch.bool)


def test_sts_lowers_ece_of_overconfident_scores():
    logits, prefix, mask = _synthetic(20000, 5, overconfidence=3.0)
    before = position_metrics(cumulative_survival(logits), prefix, mask)
    temps = fit_sts(logits, prefix, mask, STSConfig())
    after = position_metrics(cumulative_survival(logits, torch.tensor(temps)), prefix, mask)
    assert pooled_ece(before) > 0.05
    assert pooled_ece(after) < 0.5 * pooled_ece(before)
    assert pooled_ece(after) < 0.02
    # Overconfident logits need T > 1 (about the overconfidence factor at position 1).
    assert 2.0 < temps[0] < 4.5
    # AUC is a ranking measure; a positive temperature per position barely moves it.
    assert after[0].auc == pytest.approx(before[0].auc, abs=1e-9)


def test_sts_keeps_calibrated_scores_near_one():
    logits, prefix, mask = _synthetic(20000, 3, overconfidence=1.0, seed=1)
    temps = fit_sts(logits, prefix, mask, STSConfig())
    assert all(0.6 < t < 1.6 for t in temps), temps


def test_masked_slots_are_ignored():
    logits, prefix, mask = _synthetic(4000, 3, overconfidence=3.0, seed=2)
    mask[:, 2] = False
    prefix[:, 2] = 123.0  # garbage that must not matter
    temps = fit_sts(logits, prefix, mask)
    assert temps[2] == 1.0
    metrics = position_metrics(cumulative_survival(logits), prefix, mask)
    assert metrics[2].count == 0 and math.isnan(metrics[2].ece)


def test_sts_config_rejects_bad_grid():
    with pytest.raises(ValueError, match="t_min"):
        STSConfig(t_min=2.0, t_max=1.0)
