"""The replay drafter: a controlled acceptance rate, calibrated confidences, honest bookkeeping."""

import pytest
import torch

from bench.replay import ReplayDrafter
from dspark_serve.drafter.base import AcceptedContext, DraftRequest
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams

PROMPT = [5, 6, 7]
REF = list(range(20, 60))


def view(rid, out, max_draft=7):
    return DraftRequest(rid, PROMPT + out, len(PROMPT), SamplingParams(temperature=0.0), None, max_draft)


def test_registered_and_proposes_the_corrupted_reference_with_confidence_equal_to_the_rate():
    dr = build_drafter(
        "replay", references={tuple(PROMPT): REF}, vocab_size=100, block_size=7, accept_rate=0.75, seed=1
    )
    assert isinstance(dr, ReplayDrafter) and dr.tap_layers == ()
    kept = total = 0
    for _ in range(400):
        p = dr.propose([view("a", REF[:1])])[0]
        truth = torch.tensor(REF[1:8])
        assert len(p) == 7 and p.probs is None
        assert torch.equal(p.confidences, torch.full((7,), 0.75))
        assert bool(((p.tokens == truth) | (p.tokens == (truth + 1) % 100)).all())
        kept += int((p.tokens == truth).sum())
        total += 7
    assert abs(kept / total - 0.75) < 0.03


def test_proposals_respect_max_draft_and_the_end_of_the_reference():
    dr = ReplayDrafter({tuple(PROMPT): REF}, vocab_size=100, block_size=7, accept_rate=1.0)
    assert dr.propose([view("a", REF[:2], max_draft=3)])[0].tokens.tolist() == REF[2:5]
    assert dr.propose([view("a", REF[:38])])[0].tokens.tolist() == REF[38:]
    assert len(dr.propose([view("b", [1, 2], max_draft=0)])[0]) == 0


def test_realised_rate_counts_each_rounds_first_rejection():
    dr = ReplayDrafter({}, vocab_size=10)
    dr.observe_acceptance("a", proposed=5, accepted=2)  # 2 kept, then a rejection: 3 decided
    dr.observe_acceptance("a", proposed=3, accepted=3)  # all kept: 3 decided
    assert dr.stats.rate == pytest.approx(5 / 6) and dr.stats.rounds == 2
    assert dr.reset_stats().tried == 6 and dr.stats.rate is None
    with pytest.raises(ValueError, match="4 of 3"):
        dr.observe_acceptance("a", proposed=3, accepted=4)


def test_divergence_from_the_reference_is_counted():
    dr = ReplayDrafter({tuple(PROMPT): REF}, vocab_size=100, accept_rate=1.0)
    dr.propose([view("a", REF[:3])])
    assert not dr.stats.diverged
    dr.propose([view("a", REF[:3] + [0, REF[4]])])
    assert dr.stats.diverged == {"a"}


def test_context_gaps_are_errors():
    dr = ReplayDrafter({}, vocab_size=10)
    dr.observe([AcceptedContext("a", [1, 2, 3], 0, None)])
    dr.observe([AcceptedContext("a", [4], 3, None)])
    with pytest.raises(ValueError, match="starts at 5"):
        dr.observe([AcceptedContext("a", [6], 5, None)])
    dr.free("a")
    dr.observe([AcceptedContext("a", [1], 0, None)])


@pytest.mark.parametrize(
    "kw, match", [(dict(accept_rate=1.2), "1.2"), (dict(block_size=0), "0"), (dict(vocab_size=1), "1")]
)
def test_bad_arguments_are_rejected(kw, match):
    args = dict(references={}, vocab_size=10)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ReplayDrafter(**args)


def test_per_request_rates_noisy_confidences_and_the_drafter_in_the_loop():
    """Each request keeps the rate it drew from `rates` (its kept share follows it); its
    confidences scatter around a miscalibrated centre; `load` runs once a proposal."""
    calls = []
    dr = ReplayDrafter(
        {tuple(PROMPT): REF}, vocab_size=100, rates=(0.5, 0.95), confidence_noise=0.5,
        confidence_scale=0.5, seed=3, load=calls.append,
    )  # fmt: skip
    rids = [f"r{i}" for i in range(12)]
    kept = {r: 0 for r in rids}
    confs = {r: [] for r in rids}
    for _ in range(150):
        for rid, p in zip(rids, dr.propose([view(rid, REF[:1]) for rid in rids])):
            kept[rid] += int((p.tokens == torch.tensor(REF[1:8])).sum())
            confs[rid] += p.confidences.tolist()
    assert calls == [12] * 150
    drawn = {rid: dr.rate_of(rid) for rid in rids}
    assert set(drawn.values()) == {0.5, 0.95}
    for rid in rids:
        assert abs(kept[rid] / (150 * 7) - drawn[rid]) < 0.06
        c = torch.tensor(confs[rid])
        assert c.std() > 0.02  # noisy
        centre = torch.sigmoid(torch.logit(torch.tensor(drawn[rid])) * 0.5)
        assert abs(float(c.median()) - float(centre)) < 0.08  # miscalibrated towards 0.5
    dr.free("r0")
    assert "r0" not in dr._rate
    with pytest.raises(ValueError, match="rates"):
        ReplayDrafter({}, vocab_size=10, rates=(1.0,))
