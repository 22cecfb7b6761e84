"""The draft gate: learns per load level whether drafting pays, from past steps only."""

import copy
import time

import pytest
import torch

from dspark_serve.drafter.base import DraftProposal
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.gate import DraftGate, GateConfig, load_level
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, FakeDrafterBase, hf_greedy, runner_for, tiny_model


def _warm(g, level_decodes, on_rate, off_rate):
    """Run a level's warm-up: alternate until both modes have `warmup` steps measured."""
    seen = []
    while g.estimate.verdict(load_level(level_decodes)) is None:
        d = g.should_draft(level_decodes)
        seen.append(d)
        g.record(level_decodes, d, decode_tokens=on_rate if d else off_rate, seconds=1.0)
    return seen


def test_gate_alternates_then_picks_the_faster_mode_and_explores():
    g = DraftGate(GateConfig(warmup=2, explore_every=5))
    seen = _warm(g, 1, on_rate=3, off_rate=1)
    # warm-up alternates in bursts of 3; the first step after the switch is not measured
    assert seen == [True, True, True, False, False, False]
    assert g.estimate.verdict(0) == (True, pytest.approx(3.0))
    picks = [g.should_draft(1) for _ in range(512)]
    # drafting is 3x faster: a burst of 3 plain steps costs 6 steps' worth, so with 1% regret
    # it would run every 600 steps; the longest interval, 512, bounds it
    assert g.interval(3.0) == 512 and picks.count(False) == 3
    first = picks.index(False)
    assert picks[first : first + 3] == [False] * 3  # one burst, not three scattered steps
    assert load_level(1) != load_level(16) and g.rate(16, True) == 0.0  # levels are learned apart


def test_modes_measured_at_different_request_counts_in_one_level_compare_at_plain_pace():
    """A level spans a factor of two in requests. Here plain steps ran at 16 requests and
    drafting ones at 31 (as when the load falls and explorations land at other counts), where
    drafting makes 5% fewer tokens than a plain step would in its time: in raw tokens per second
    drafting looks 30% faster; measured against the cost curve's plain pace at each step's
    count, the gate sees it 5% slower and runs plain."""
    price = lambda rows, requests: 0.010 + 0.0005 * rows  # seconds a forward
    g = DraftGate(GateConfig(warmup=3, price=price))
    for _ in range(5):
        g.record(16, False, decode_tokens=16, seconds=price(16, 16))
    for _ in range(5):  # the first is the switch, not measured
        g.record(31, True, decode_tokens=31, seconds=price(31, 31) / 0.95)
    assert load_level(16) == load_level(31)
    raw_on, raw_off = 31 / (price(31, 31) / 0.95), 16 / price(16, 16)
    assert raw_on > 1.25 * raw_off  # what a comparison of raw rates would pick: drafting
    v = g.estimate.verdict(load_level(16))
    assert v is not None and v.drafting is False and v.ratio == pytest.approx(1 / 0.95)
    # the rates read at a count are plain's pace there times the measured share
    assert g.rate(16, False) == pytest.approx(raw_off) and g.rate(31, True) == pytest.approx(raw_on)


def test_switch_steps_are_not_measured():
    """The first step of a mode after the other one pays the switch (a drafter catching up on
    context the plain steps kept): recording it would make drafting look slower than it is."""
    g = DraftGate(GateConfig(warmup=2, explore_every=8))
    for _ in range(3):
        g.record(1, False, decode_tokens=10, seconds=1.0)
    g.record(1, True, decode_tokens=1, seconds=10.0)  # the switch step: slow, not measured
    for _ in range(3):
        g.record(1, True, decode_tokens=30, seconds=1.0)
    assert g.rate(1, True) == pytest.approx(30.0) and g.estimate.verdict(0) == (True, pytest.approx(3.0))
    g.record(1, False, decode_tokens=0, seconds=5.0)  # switching back: not measured either
    assert g.rate(1, False) == pytest.approx(10.0)


def test_explorations_that_pay_a_dear_switch_run_more_rarely():
    """The gap between the modes alone would explore every 30 steps; each exploration here also
    pays a 10 s switch into plain steps and a 5 s switch back (a drafter absorbing what the plain
    steps kept), so the interval grows until that measured loss fits the regret too."""
    g = DraftGate(GateConfig(warmup=2, explore_every=4, regret=0.1))
    _warm(g, 1, on_rate=100, off_rate=50)  # drafting 2x faster; the warm-up ends on plain steps
    assert g.interval(2.0, 0) == 30
    g.record(1, True, decode_tokens=100, seconds=1.0)  # a cheap switch back: nothing lost
    g.record(1, True, decode_tokens=100, seconds=1.0)
    assert g.interval(2.0, 0) == 30
    g.record(1, False, decode_tokens=50, seconds=10.0)  # switch: 9.5 s lost
    g.record(1, False, decode_tokens=50, seconds=1.0)  # 0.5 s lost each
    g.record(1, False, decode_tokens=50, seconds=1.0)
    g.record(1, True, decode_tokens=100, seconds=5.0)  # switching back: 4 s lost
    assert g.interval(2.0, 0) == 30  # the exploration is not over yet
    g.record(1, True, decode_tokens=100, seconds=1.0)
    # its 14.5 s averaged with the first one's 0: 7.25 s lost per exploration, against 1 s
    # steps and 10% regret -> one every 73 steps
    assert g.interval(2.0, 0) == 73
    assert g.rate(1, True) == pytest.approx(100.0) and g.rate(1, False) == pytest.approx(50.0)


def test_exploration_interval_follows_the_gap_within_bounds():
    g = DraftGate(GateConfig(explore_every=16, max_explore_every=256, regret=0.02))
    assert g.interval(1.05) == 16  # a small gap: explore at the shortest interval
    assert g.interval(1.9) == 135  # ceil(3 steps x 0.9 / 0.02)
    assert g.interval(50.0) == 256 and g.interval(float("inf")) == 256
    close = DraftGate(GateConfig(warmup=2, explore_every=4, regret=0.02))
    _warm(close, 1, on_rate=105, off_rate=100)
    assert close.interval(1.05) == 8
    picks = [close.should_draft(1) for _ in range(40)]
    assert picks.count(False) == 15  # a burst of 3 in every 8 steps


def test_unmeasured_level_borrows_a_neighbours_verdict():
    g = DraftGate(GateConfig(warmup=2, explore_every=4, regret=0.1))
    _warm(g, 2, on_rate=50, off_rate=100)  # drafting loses 2x at 2 decodes (level 1)
    # 16 decodes (level 4): no alternation, it starts plain and explores in a burst every 30 steps
    picks = [g.should_draft(16) for _ in range(30)]
    assert picks[0] is False and picks.count(True) == 3 and picks[-3:] == [True] * 3
    # ...and a lower level does not borrow a loss (drafting may still win with less load)
    assert g.estimate.borrowed(0) is None and g.should_draft(1) is True
    h = DraftGate(GateConfig(warmup=2))
    _warm(h, 8, on_rate=200, off_rate=100)  # drafting wins at 8 decodes (level 3)
    assert h.estimate.borrowed(1) == (True, pytest.approx(2.0)) and h.should_draft(2) is True
    assert h.estimate.borrowed(5) is None  # a clear win at lower load says nothing about higher load
    m = DraftGate(GateConfig(warmup=2, explore_every=16, regret=0.1))
    _warm(m, 4, on_rate=110, off_rate=100)  # drafting wins by 10% at 4 decodes (level 2)
    assert m.estimate.borrowed(4) == (False, pytest.approx(1.1))  # 16 decodes: a thin win does not carry up
    picks = [m.should_draft(16) for _ in range(16)]
    assert picks[0] is False and picks.count(True) == 3  # plain, one exploration burst (interval 16)


def _warm_rows(g, decodes, tokens_per_request, rows_per_request, on_seconds, off_seconds):
    """A level's warm-up with whole steps: `decodes` requests, drafting steps that verify
    `rows_per_request` rows and keep `tokens_per_request` tokens per request."""
    while g.estimate.verdict(load_level(decodes)) is None:
        if g.should_draft(decodes):
            g.record(decodes, True, decodes * tokens_per_request, on_seconds, decodes * rows_per_request)
        else:
            g.record(decodes, False, decodes, off_seconds, decodes)


def test_unmeasured_level_predicts_from_the_cost_curve():
    """At one request drafting wins 2x (3 tokens a step from 5 verified rows, 60 ms against a
    40 ms plain step). On a machine whose forward is compute-bound past 4 tokens, the same rows
    at 16 requests cost 5 plain steps: the gate predicts a loss there and starts plain, where
    borrowing the verdict alone (no cost curve) would alternate; on a machine whose forward
    costs the same for any batch it predicts the win and keeps drafting."""

    def compute_bound(tokens, requests):
        return 0.01 * max(4.0, tokens)

    def flat(tokens, requests):
        return 0.04

    g = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1, price=compute_bound))
    _warm_rows(g, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    assert g.estimate.verdict(0) == (True, pytest.approx(2.0))
    # rest of a drafting step beyond the verify: 3 / 2 - 0.05 / 0.04 = 0.25 plain steps;
    # at 16 requests: 3 / (0.80 / 0.16 + 0.25) = 0.571, plain 1.75x faster
    assert g.estimate.predicted(16) == (False, pytest.approx(1.75))
    assert g.interval(1.75) == 23  # ceil(3 steps x 0.75 / 0.1)
    picks = [g.should_draft(16) for _ in range(23)]
    # plain from the first step; the first burst comes once an interval has passed since the
    # (notional) last one
    assert picks[:20] == [False] * 20 and picks[20:] == [True] * 3
    blind = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1))
    _warm_rows(blind, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    assert (
        blind.estimate.prior(16) is None
        and [blind.should_draft(16) for _ in range(6)] == [True] * 3 + [False] * 3
    )
    free = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1, price=flat))
    _warm_rows(free, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    assert free.estimate.predicted(16) == (True, pytest.approx(2.0))
    assert [free.should_draft(16) for _ in range(8)] == [True] * 8
    # once the level is measured, its own verdict rules whatever the prediction said
    _warm_rows(g, 16, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    assert g.estimate.verdict(4) == (True, pytest.approx(2.0)) and g.should_draft(16) is True


def test_with_only_drafting_measured_plain_is_priced_from_the_cost_curve():
    """One request drafts at every step where the drafter decides per request, so a server that
    has seen only light traffic knows drafting's rate alone (3 tokens a step from 5 rows in
    60 ms). Plain's rate at one request is then the curve's forward time (40 ms): the same
    prediction as with plain measured at 40 ms, without `carry` (the estimate already leaves a
    plain step's own overhead out). Compute-bound past 4 tokens: plain at 16 requests, drafting
    at 2; a flat curve: drafting at 16; no curve: nothing to go on, the level alternates."""

    def compute_bound(tokens, requests):
        return 0.01 * max(4.0, tokens)

    def flat(tokens, requests):
        return 0.04

    def drafted_only(price, climb=0.05):
        g = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1, price=price, climb=climb))
        for _ in range(4):
            g.record(1, True, 3, 0.06, 5)
        assert g.estimate.verdict(0) is None  # plain never ran at one request
        return g

    g = drafted_only(compute_bound)
    assert g.estimate.predicted(16) == (False, pytest.approx(1.75))  # 3 / (5 + 0.25), as when measured
    assert [g.should_draft(16) for _ in range(8)] == [False] * 8
    # at 2 requests: 3 / (0.10 / 0.04 + 0.25) = 1.09, a win under carry (1.5) that still drafts
    # one level up (it clears 1 + climb = 1.05); with a steeper climb it starts plain
    assert g.estimate.predicted(2) == (True, pytest.approx(3 / 2.75))
    steep = drafted_only(compute_bound, climb=0.1)
    assert steep.estimate.predicted(2) == (False, 1.0)
    assert drafted_only(flat).estimate.predicted(16) == (True, pytest.approx(2.0))
    blind = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1))
    for _ in range(4):
        blind.record(1, True, 3, 0.06, 5)
    assert (
        blind.estimate.prior(16) is None
        and [blind.should_draft(16) for _ in range(6)] == [True] * 3 + [False] * 3
    )
    # a level with both modes measured speaks before the estimate, even from farther away:
    # at 16 requests drafting kept 1 token a request from 2 rows and lost 2x (rest 2 - 2 = 0),
    # so at 2 requests 1 / (0.04 / 0.04 + 0) = 1.0, where the estimate from one request said 1.09
    _warm_rows(g, 16, tokens_per_request=1, rows_per_request=2, on_seconds=0.08, off_seconds=0.04)
    assert g.estimate.verdict(4) == (False, pytest.approx(2.0))
    assert g.estimate.predicted(2) == (True, pytest.approx(1.0))


def test_a_thin_win_predicted_at_a_busier_level_starts_it_plain():
    """Carried up along the cost curve the prediction runs optimistic (fewer drafts verified at
    higher load, a drafter whose cost grows faster than a plain step's): a predicted win by
    less than `carry` starts the busier level plain, exploring at the shortest interval."""

    def mild(tokens, requests):
        return 0.04 * (1.0 + 0.03 * tokens)

    def gate(carry):
        g = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.1, price=mild, carry=carry))
        _warm_rows(g, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
        return g

    g = gate(carry=1.25)
    # rest = 3 / 2 - 1.15 / 1.03; at 4 requests 3 / (1.6 / 1.12 + rest) = 1.66: carried up
    assert g.estimate.predicted(4) == (True, pytest.approx(1.6555, abs=1e-3))
    # at 16: 3 / (3.4 / 1.48 + rest) = 1.12, under carry: plain, the gap unknown
    assert g.estimate.predicted(16) == (False, 1.0) and g.interval(1.0) == 8
    assert [g.should_draft(16) for _ in range(16)] == ([False] * 5 + [True] * 3) * 2
    assert gate(carry=1.0).estimate.predicted(16) == (True, pytest.approx(1.1190, abs=1e-3))


def test_a_levels_own_verdict_must_clear_a_prior_it_contradicts():
    """A level's verdict rests on the few steps its modes were explored in. Where it
    contradicts the prior (here the cost curve's predicted 1.75x loss at 16 requests) by less
    than `z` standard errors of the steps' log rates, the prior keeps ruling and exploration
    runs at the shortest interval until the level's own steps settle it."""

    def compute_bound(tokens, requests):
        return 0.01 * max(4.0, tokens)

    def gate(z, warmup=2):
        g = DraftGate(
            GateConfig(warmup=warmup, explore_every=8, regret=0.1, price=compute_bound, z=z, alpha=1e-9)
        )
        _warm_rows(g, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
        assert g.estimate.prior(16) == (False, pytest.approx(1.75))
        return g

    def level16(g, drafting_steps):
        for _ in range(4):
            g.record(16, False, 16, 0.06)  # plain: 267 tok/s
        for tokens in drafting_steps:  # the first pays the switch and is not measured
            g.record(16, True, tokens, 0.1)

    noisy = [16, 16, 48, 16, 48]  # 160 or 480 tok/s a step: 320 by the ratio of sums
    g = gate(z=1.0)
    level16(g, noisy)
    assert g.estimate.verdict(4) == (
        True,
        pytest.approx(1.2),
    )  # the recorded rates put drafting ahead by 1.2 ...
    assert g.favoured(16) == (False, pytest.approx(1.75)) and g.estimate.contested(16)  # ...not enough
    picks = [g.should_draft(16) for _ in range(16)]
    assert picks == ([False] * 5 + [True] * 3) * 2  # a burst every 8 steps, not every 23
    trusting = gate(z=0.0)
    level16(trusting, noisy)
    assert trusting.favoured(16) == (True, pytest.approx(1.2)) and not trusting.estimate.contested(16)
    clear = gate(z=1.0)
    level16(clear, [32, 32, 32, 32, 32])  # a steady 320 tok/s: the level's own verdict rules
    assert clear.favoured(16) == (True, pytest.approx(1.2)) and not clear.estimate.contested(16)
    assert [clear.should_draft(16) for _ in range(5)] == [True] * 5
    agree = gate(z=1.0)
    level16(agree, [16, 8, 24, 8, 24])  # drafting loses, as predicted, by its own measure
    assert agree.favoured(16) == agree.estimate.verdict(4) and agree.favoured(16)[0] is False
    # one burst (two measured steps) that agrees with the prior sizes the gap: the prior's
    # 1.75x would explore every 23 steps, the measured 3.3x every 69
    early = gate(z=1.0, warmup=6)
    level16(early, [16, 8, 8])
    assert early.estimate.verdict(4) is None and early.favoured(16) == (False, pytest.approx(10 / 3))
    assert not early.estimate.contested(16) and early.interval(10 / 3, 4, False) == 70
    picks = [early.should_draft(16) for _ in range(70)]
    assert picks[:67] == [False] * 67 and picks[67:] == [True] * 3
    # ...while one that contradicts it is not trusted yet
    rash = gate(z=1.0, warmup=6)
    level16(rash, [16, 48, 16])
    assert rash.favoured(16) == (False, pytest.approx(1.75)) and rash.estimate.contested(16)
    # a prior alone claiming a wide gap (225 steps at 1% regret) still lets the level measure
    # itself within probe_every steps
    slow = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.01, price=compute_bound, probe_every=32))
    _warm_rows(slow, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    assert slow.interval(1.75) == 225
    assert [slow.should_draft(16) for _ in range(32)] == [False] * 29 + [True] * 3


def test_an_exploration_of_drafting_waits_until_its_catch_up_fits_the_regret():
    """Where plain steps win, exploring drafting first pays the drafter's catch-up on the
    context the plain steps kept: the gate explores only once as many steps are behind it as
    keep that within `regret` of their time. Where drafting wins, explorations are plain steps
    and the catch-up changes nothing."""
    g = DraftGate(GateConfig(warmup=2, explore_every=4, regret=0.5))
    _warm(g, 1, on_rate=1, off_rate=2)
    assert g.favoured(1) == (False, pytest.approx(2.0)) and g.interval(2.0, 0, False) == 6
    assert g.catch_up_interval(0, 5.0) == 10  # 5 s within 50% of 1 s steps
    assert g.catch_up_interval(0, 1e9) == g.config.max_explore_every and g.catch_up_interval(3, 5.0) == 0
    cheap, dear = copy.deepcopy(g), copy.deepcopy(g)
    assert [cheap.should_draft(1, catch_up=0.5) for _ in range(12)] == ([False] * 3 + [True] * 3) * 2
    assert [g.should_draft(1) for _ in range(12)] == ([False] * 3 + [True] * 3) * 2  # unknown: as before
    assert [dear.should_draft(1, catch_up=5.0) for _ in range(20)] == ([False] * 7 + [True] * 3) * 2
    wins = DraftGate(GateConfig(warmup=2, explore_every=4, regret=0.5))
    _warm(wins, 1, on_rate=2, off_rate=1)
    twin = copy.deepcopy(wins)
    same = [twin.should_draft(1) for _ in range(12)]
    assert [wins.should_draft(1, catch_up=5.0) for _ in range(12)] == same
    # a prior alone would probe within probe_every steps; a dear catch-up defers that probe too
    price = lambda tokens, requests: 0.01 * max(4.0, tokens)
    probe = DraftGate(GateConfig(warmup=2, explore_every=8, regret=0.01, price=price, probe_every=32))
    _warm_rows(probe, 1, tokens_per_request=3, rows_per_request=5, on_seconds=0.06, off_seconds=0.04)
    probe.record(16, False, 16, 0.05)
    probe.record(16, False, 16, 0.05)
    picks = [probe.should_draft(16, catch_up=0.4) for _ in range(800)]
    assert (
        picks.index(True) == probe.config.max_explore_every - 3
    )  # the test's own inputs: a catch-up of 0.4 over regret 0.01 of its 0.05 steps


def test_gate_config_rejects_bad_values():
    bads = (
        dict(warmup=0),
        dict(explore_every=0),
        dict(explore_every=600),
        dict(regret=0.0),
        dict(alpha=2.0),
        dict(margin=1.5),
        dict(burst=1),
        dict(carry=0.5),
        dict(climb=-0.1),
        dict(climb=1.0),
        dict(z=-1.0),
        dict(probe_every=4),
        dict(z=float("nan")),
    )
    for bad in bads:
        with pytest.raises(ValueError, match=repr(next(iter(bad.values())))):
            GateConfig(**bad)


class SlowWrongDrafter(FakeDrafterBase):
    """Drafts a constant token (almost always rejected) and takes 30 ms: drafting loses."""

    name, tap_layers, block_size, calibrator = "slow-wrong", (), 4, None
    online_confidence = False

    def propose(self, requests):
        time.sleep(0.03)
        return [
            DraftProposal(
                torch.full((min(4, r.max_draft),), 44, dtype=torch.long),
                None,
                torch.full((min(4, r.max_draft),), 0.95),
            )
            for r in requests
        ]


def gated_engine(model, drafter) -> Engine:
    return Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark"),
        max_model_len=256,
        drafter=drafter,
    )


def test_engine_stops_drafting_when_it_does_not_pay_and_stays_lossless():
    model = tiny_model("llama")
    prompt = list(b"gate test")
    engine = gated_engine(model, SlowWrongDrafter())
    assert engine.speculation.gate is not None
    r = Request("g", prompt, SamplingParams(temperature=0), 80, ignore_eos=True)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert r.output_ids == hf_greedy(model, prompt, 80)
    drafted_steps = r.spec.rounds
    assert drafted_steps < 0.35 * r.spec.steps, (drafted_steps, r.spec.steps)
    assert engine.speculation.gate.rate(1, False) > engine.speculation.gate.rate(1, True)


class SlowWrongChooser(SlowWrongDrafter):
    """The same drafter, declaring that it decides per request whether to draft."""

    decides_per_request = True


def test_one_request_is_left_to_a_drafter_that_decides_per_request():
    """At one decoding request the step is that request's: a drafter with its own per-request
    choice (the combined drafter) is not overruled by the load-level gate; with two requests
    the gate decides again."""
    model = tiny_model("llama")
    engine = gated_engine(model, SlowWrongChooser())
    prompt = list(b"gate test")
    r = Request("one", prompt, SamplingParams(temperature=0), 40, ignore_eos=True)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert r.output_ids == hf_greedy(model, prompt, 40)
    assert r.spec.rounds >= r.spec.steps - 1  # drafted every step however slow
    for i in range(2):
        engine.add_request(Request(f"two{i}", prompt, SamplingParams(temperature=0), 80, ignore_eos=True))
    pair = [engine.requests["two0"], engine.requests["two1"]]
    while engine.has_work():
        engine.step()
    assert all(p.output_ids == hf_greedy(model, prompt, 80) for p in pair)
    assert sum(p.spec.rounds for p in pair) < 0.5 * sum(p.spec.steps for p in pair)


def test_seeded_requests_follow_the_gate_and_keep_plain_decodings_output():
    """A seeded sampled request drafts where the gate lets it (its rows are judged by keyed
    samples), and whatever the gate learned first, its output is plain decoding's for the
    seed."""
    model = tiny_model("llama")
    sp = SamplingParams(temperature=1.0, seed=11)

    def run(engine: Engine, taught: int = 0) -> tuple[list[int], int]:
        for i in range(taught):  # teach the gate different things first
            engine.speculation.gate.record(1, i % 2 == 0, decode_tokens=1 + (i % 3), seconds=0.01)
        r = Request("s", list(b"seeded"), sp, 20, ignore_eos=True)
        engine.add_request(r)
        while engine.has_work():
            engine.step()
        return r.output_ids, r.spec.rounds

    plain = Engine(runner_for(model), ByteTokenizer(), SchedulerConfig(), max_model_len=256)
    want, _ = run(plain)
    runs = [run(gated_engine(model, SlowWrongDrafter()), taught) for taught in (0, 7)]
    assert all(out == want for out, _ in runs)
    steps = len(want) - 1
    assert all(0 < rounds < steps for _, rounds in runs), runs  # the gate turned drafting off


def test_rates_are_ratios_of_sums_and_near_ties_keep_drafting():
    g = DraftGate(GateConfig(warmup=2, alpha=1e-9))  # (almost) no decay: plain sums
    # drafting steps keep 1 token in 30 ms or 7 in 50 ms; plain steps 1 token in 27 ms
    for toks, sec in ((1, 0.03), (7, 0.05), (1, 0.03), (7, 0.05)):
        g.record(1, True, decode_tokens=toks, seconds=sec)
    for _ in range(4):
        g.record(1, False, decode_tokens=1, seconds=0.027)
    # tokens / seconds over the steps (16 / 0.16 = 100 tok/s), not the mean of the per-step
    # rates (86.7 tok/s)
    assert abs(g.rate(1, True) - 100.0) < 1e-6 and g.estimate.verdict(0)[0] is True
    tie = DraftGate(GateConfig(warmup=2, margin=0.03))
    _warm(tie, 1, on_rate=98, off_rate=100)  # plain 2% faster: within the margin
    assert tie.estimate.verdict(0)[0] is True
    _warm(tie, 2, on_rate=90, off_rate=100)  # plain 11% faster: drafting goes off
    assert tie.estimate.verdict(1)[0] is False


def test_steps_that_prefill_follow_the_favoured_mode_and_never_explore():
    """A step with a prefill chunk is not measured and would make the drafter catch up on every
    request's kept context: it takes the level's verdict and leaves the exploration schedule
    alone, so the decode steps' explorations come exactly where they would without it."""
    g = DraftGate(GateConfig(warmup=2, explore_every=5))
    _warm(g, 4, on_rate=1, off_rate=3)  # plain is 3x faster at this level
    twin = DraftGate(GateConfig(warmup=2, explore_every=5))
    _warm(twin, 4, on_rate=1, off_rate=3)
    with_prefills, plain_only = [], []
    for _ in range(600):
        assert g.should_draft(4, explore=False) is False  # never an exploration, whenever it comes
        with_prefills.append(g.should_draft(4))
        plain_only.append(twin.should_draft(4))
    assert with_prefills == plain_only and with_prefills.count(True) >= 3  # explorations still run
    # a level nothing is known of: plain, without advancing the alternation
    fresh = DraftGate(GateConfig(warmup=2))
    assert [fresh.should_draft(1, explore=False) for _ in range(5)] == [False] * 5
    assert [fresh.should_draft(1) for _ in range(4)] == [True, True, True, False]
    assert fresh.should_draft(1, explore=False) is False
    # ...while a prior carries over: drafting won at a higher load, so it drafts here too
    _warm(fresh, 8, on_rate=200, off_rate=100)
    assert fresh.should_draft(1, explore=False) is True
