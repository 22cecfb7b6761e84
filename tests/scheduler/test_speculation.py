"""The speculation component alone: drafter, gate and policy behind one `propose` call, with
the seeded-request, token-room, headroom and exploration rules."""

import pytest
import torch

from dspark_serve.drafter.base import DraftProposal
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.request import Request, Status
from dspark_serve.scheduler.speculation import Speculation
from tests.helpers import FakeDrafterBase


class FakeDrafter(FakeDrafterBase):
    name, tap_layers, calibrator = "fake", (), None

    def __init__(self, block_size=4, confidence=0.9, online=False):
        self.block_size, self.confidence, self.online_confidence = block_size, confidence, online
        super().__init__()
        self.asked = []

    def propose(self, requests):
        self.asked.append({r.request_id: r.max_draft for r in requests})
        return [
            DraftProposal(
                torch.full((min(self.block_size, r.max_draft),), 7, dtype=torch.long),
                None,
                torch.full((min(self.block_size, r.max_draft),), self.confidence),
            )
            for r in requests
        ]


class ClosedGate:
    def __init__(self):
        self.asked = []

    def should_draft(self, n, explore=True, catch_up=None):
        self.asked.append((n, explore, catch_up))
        return False

    def record(self, *a):
        pass

    def favoured(self, n):
        return False, 2.0


def propose(spec, decodes, room, load):
    """One step's speculation as the engine runs it: draft, then choose lengths."""
    return spec.choose_lengths(decodes, spec.draft(decodes, load), room, load)


def decoding(rid: str, seed=None) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(temperature=1.0 if seed is not None else 0.0, seed=seed), 50)
    r.status, r.output_ids, r.num_computed = Status.DECODE, [4], 3
    return r


LOAD = LoadState(num_running=2)


def test_without_a_drafter_nothing_is_drafted():
    spec = Speculation(None, SchedulerConfig(), max_model_len=512)
    assert spec.policy.name == "none" and not spec.speculating and spec.draft_reserve([]) == 0
    p = propose(spec, [decoding("a"), decoding("b")], room=100, load=LOAD)
    assert p.lengths == [0, 0] and [len(x) for x in p.proposals] == [0, 0]
    assert p.decision is not None and p.decision.lengths == [0, 0]


def test_seeded_requests_follow_the_gate_and_draft_greedily():
    """A seeded sampled request's output no longer depends on what is drafted (its rows are
    judged by keyed samples): the gate decides for it as for any request, and it drafts the
    drafter's most likely tokens."""
    dr = FakeDrafter()
    seen = []
    dr.propose = lambda reqs: seen.extend(reqs) or FakeDrafter.propose(dr, reqs)
    spec = Speculation(dr, SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    spec.gate = ClosedGate()
    reqs = [decoding("plain"), decoding("seeded", seed=3)]
    p = propose(spec, reqs, room=100, load=LOAD)
    assert not p.drafting and [len(x) for x in p.proposals] == [0, 0] and not dr.asked
    assert spec.draft_reserve(reqs) == 0  # the closed gate's level reserves nothing, seeded or not
    spec.gate = None  # drafting on: the seeded request's view is greedy, its processing kept
    propose(spec, reqs, room=100, load=LOAD)
    views = {v.request_id: v.sampling for v in seen}
    assert views["seeded"].greedy and views["seeded"].seed == 3
    assert reqs[1].sampling.temperature == 1.0  # the request itself still samples


def test_the_token_room_caps_lengths_before_the_policy():
    dr = FakeDrafter(block_size=4)
    spec = Speculation(dr, SchedulerConfig(verify_policy="static:4"), max_model_len=512)
    reqs = [decoding(f"r{i}") for i in range(3)]
    p = propose(spec, reqs, room=5, load=LOAD)
    assert p.lengths == [2, 2, 1] and [len(x) for x in p.proposals] == [4, 4, 4]
    assert [len(p.drafts(i)) for i in range(3)] == [2, 2, 1]
    assert [r.last_budget for r in reqs] == [2, 2, 1]


def test_headroom_limits_what_is_drafted_past_last_budget():
    dr = FakeDrafter(block_size=6)
    spec = Speculation(
        dr, SchedulerConfig(verify_policy="dspark", draft_gate=False, draft_headroom=1), max_model_len=512
    )
    r = decoding("a")
    r.last_budget = 0
    propose(spec, [r], room=100, load=LoadState(num_running=1))
    assert dr.asked[-1] == {"a": 1}
    r.last_budget, r.max_tokens = None, 3  # no budget yet: the remaining max_tokens caps it
    propose(spec, [r], room=100, load=LoadState(num_running=1))
    assert dr.asked[-1] == {"a": 1}  # 3 - 1 output - 1 for the target's own token


def test_a_static_policy_asks_for_no_more_drafts_than_it_verifies():
    dr = FakeDrafter(block_size=6)
    spec = Speculation(dr, SchedulerConfig(verify_policy="static:2"), max_model_len=512)
    r = decoding("a")
    assert spec.lookahead(r) == 2
    out = propose(spec, [r], room=100, load=LoadState(num_running=1))
    assert dr.asked[-1] == {"a": 2} and out.lengths == [2]
    spec.use_policy("dspark")  # load-aware: up to the block (no budget of its own yet)
    r.last_budget = None
    assert spec.lookahead(r) == 6
    spec.use_policy("none")
    assert spec.lookahead(r) == 0


def test_online_confidence_drafters_explore_on_a_fixed_schedule():
    dr = FakeDrafter(confidence=0.0, online=True)
    spec = Speculation(
        dr, SchedulerConfig(verify_policy="dspark", draft_gate=False, explore_every=4), max_model_len=512
    )
    r = decoding("a")
    lengths = []
    for step in range(8):
        r.spec.steps = step
        lengths.append(propose(spec, [r], room=100, load=LoadState(num_running=1)).lengths[0])
    assert lengths == [1, 0, 0, 0, 1, 0, 0, 0]
    assert r.last_budget == 0  # the policy's own answer is what is remembered


def test_settle_books_rounds_and_feeds_the_drafter():
    dr = FakeDrafter()
    spec = Speculation(dr, SchedulerConfig(verify_policy="static:4"), max_model_len=512)
    r = decoding("a")
    assert spec.settle(r, verified=3, accepted=2)
    assert not spec.settle(r, verified=0, accepted=0)
    assert (r.spec.steps, r.spec.rounds, r.spec.drafted, r.spec.accepted) == (2, 1, 3, 2)
    assert dr.feedback == [("a", 3, 2)]


def test_pure_decode_steps_teach_the_gate():
    spec = Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    assert spec.gate is not None
    p = propose(spec, [decoding("a")], room=100, load=LoadState(num_running=1))
    spec.record_step(p, num_decodes=1, has_prefills=True, decode_tokens=5, seconds=0.1, forward_seconds=0.05)
    assert spec.gate.rate(1, p.drafting) == 0.0  # a prefill chunk was in the step
    spec.record_step(p, num_decodes=1, has_prefills=False, decode_tokens=5, seconds=0.1, forward_seconds=0.05)
    assert abs(spec.gate.rate(1, p.drafting) - 50.0) < 1e-9


def test_the_gate_prices_verification_with_the_cost_table_and_learns_rows():
    from dspark_serve.scheduler.policy import CostTable

    table = CostTable(batch_sizes=(1, 8, 64), steps_per_second=(40.0, 20.0, 4.0))
    spec = Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), 512, cost_table=table)
    assert spec.gate is not None and spec.gate.config.price is not None
    assert (
        abs(spec.gate.config.price(8, 8) - 1 / 20.0) < 1e-12
        and abs(spec.gate.config.price(64, 8) - 1 / 4.0) < 1e-12
    )
    p = propose(spec, [decoding("a"), decoding("b")], room=100, load=LOAD)
    assert p.drafting and sum(p.lengths) > 0
    spec.record_step(p, num_decodes=2, has_prefills=False, decode_tokens=5, seconds=0.1, forward_seconds=0.05)
    rate = spec.gate.estimate.rates[(1, True)]
    assert (rate.requests, rate.rows) == (2, 2 + sum(p.lengths))  # anchors + verified drafts
    assert Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), 512).gate.config.price is None


def test_the_gate_keeps_what_it_learned_across_policy_switches():
    spec = Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    gate = spec.gate
    assert gate is not None
    p = propose(spec, [decoding("a")], room=100, load=LoadState(num_running=1))
    spec.record_step(p, num_decodes=1, has_prefills=False, decode_tokens=5, seconds=0.1, forward_seconds=0.05)
    spec.use_policy("none")
    assert spec.gate is None  # plain decoding has no gate
    spec.use_policy("static:2")
    assert spec.gate is None  # a static length is not load-aware
    spec.use_policy("dspark")
    assert spec.gate is gate and abs(gate.rate(1, p.drafting) - 50.0) < 1e-9


def test_a_step_that_prefills_asks_the_gate_for_no_exploration():
    class Gate:
        def __init__(self):
            self.asked = []

        def should_draft(self, n, explore=True, catch_up=None):
            self.asked.append((n, explore))
            return explore  # an exploration is due: drafting, unless it may not explore

    dr = FakeDrafter()
    spec = Speculation(dr, SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    spec.gate = gate = Gate()
    reqs = [decoding("a"), decoding("b")]
    load = LoadState(num_running=2, num_waiting=3, prefill_tokens=300, num_prefilling=5)
    p = propose(spec, reqs, room=100, load=load)
    assert not p.drafting and [len(x) for x in p.proposals] == [0, 0] and dr.asked == []
    p = propose(spec, reqs, room=100, load=LoadState(num_running=2, num_waiting=3, num_prefilling=5))
    # the prefilling step is judged at the load it heads for (2 decoding + 5 prefilling + 3
    # queued); a pure decode step at its own (requests prefilling there carry no chunk in
    # this step, and the queued ones may wait for KV room)
    assert p.drafting and gate.asked == [(10, False), (2, True)]


def test_the_draft_reserve_follows_the_gates_mode_at_the_level_the_step_drafts_at():
    spec = Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    gate = spec.gate
    assert gate is not None
    running = [decoding("a"), decoding("b")]
    assert spec.draft_reserve(running) == 0  # nothing known: a step that prefills runs plain

    def teach(draft_tokens: int, plain_tokens: int) -> None:
        for drafting, tokens in ((True, draft_tokens), (False, plain_tokens)):
            for _ in range(8):  # the first step after a switch is not measured
                gate.record(2, drafting, tokens, 0.1)

    teach(draft_tokens=8, plain_tokens=2)
    assert gate.favoured(2) == (True, 4.0) and spec.draft_reserve(running) == 2
    # the level a step that admits or prefills drafts at (`draft`) counts those requests: here
    # plain, where drafting is measured to lose, so nothing is kept from their prefill
    for drafting, tokens in ((True, 2), (False, 8)):
        for _ in range(8):
            gate.record(4, drafting, tokens, 0.1)
    assert gate.favoured(2)[0] and not gate.favoured(4)[0]
    assert spec.draft_reserve(running, waiting=2) == 0 and spec.draft_reserve(running, waiting=0) == 2
    prefilling = decoding("c")
    prefilling.status = Status.PREFILL
    assert spec.draft_reserve([*running, prefilling, decoding("d")]) == 0
    assert spec.draft_reserve(running, waiting=1) == 2  # 3 requests: level 1, drafting
    spec2 = Speculation(FakeDrafter(), SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    gate = spec2.gate
    assert gate is not None
    teach(draft_tokens=2, plain_tokens=8)
    assert gate.favoured(2) is not None and not gate.favoured(2)[0]
    assert spec2.draft_reserve(running) == 0
    assert spec2.draft_reserve(running + [decoding("s", seed=1)]) == 0  # seeded requests too
    spec2.use_policy("static:3")  # no gate: always the reserve
    assert spec2.draft_reserve(running) == 2


def test_the_gate_hears_what_the_drafters_catch_up_would_cost():
    """A pure decode step tells the gate the drafter's catch-up price for the requests that
    would draft (exploring drafting at a load where plain wins pays it); a step that prefills
    explores nothing, so it is not asked."""

    class Pricing(FakeDrafter):
        def catch_up_seconds(self, rids):
            self.priced = list(rids)
            return 0.25

    dr = Pricing()
    spec = Speculation(dr, SchedulerConfig(verify_policy="dspark"), max_model_len=512)
    spec.gate = gate = ClosedGate()
    propose(spec, [decoding("a"), decoding("b")], room=100, load=LOAD)
    assert gate.asked == [(2, True, 0.25)] and dr.priced == ["a", "b"]
    propose(
        spec, [decoding("a")], room=100, load=LoadState(num_running=2, prefill_tokens=8, num_prefilling=1)
    )
    assert gate.asked[1] == (2, False, None)


def test_the_measured_overhead_moves_the_policys_lengths():
    """Drafting steps that follow drafting steps teach the overhead estimate (the first one
    after a plain step does not: it also absorbs the context plain steps kept), and the policy
    prices it: on a forward whose time grows with every token, a large overhead admits more
    drafts; with `price_overhead` off the lengths stay the forward's choice. A seeded request
    in the step changes nothing (its output does not depend on the lengths)."""
    from dspark_serve.scheduler.policy import CostTable

    table = CostTable(tuple(2**i for i in range(9)), tuple(1.0 / (0.002 + 0.001 * 2**i) for i in range(9)))

    def lengths(price):
        dr = FakeDrafter(block_size=6, confidence=0.8)
        cfg = SchedulerConfig(
            verify_policy="dspark", draft_gate=False, draft_headroom=0, price_overhead=price
        )
        spec = Speculation(dr, cfg, max_model_len=512, cost_table=table)
        reqs = [decoding(f"r{i}") for i in range(4)]
        first = propose(spec, reqs, room=100, load=LoadState(num_running=4))
        spec.record_step(first, 4, False, 8, seconds=0.5, forward_seconds=0.01)  # after no step: ignored
        assert spec.overhead.seconds(4) is None
        for _ in range(3):
            p = propose(spec, reqs, room=100, load=LoadState(num_running=4))
            spec.record_step(p, 4, False, 8, seconds=0.06, forward_seconds=0.01)
        assert spec.overhead.seconds(4) == pytest.approx(0.05)
        then = propose(spec, reqs, room=100, load=LoadState(num_running=4)).lengths
        assert spec.priced_overhead == (pytest.approx(0.05) if price else None)
        # a seeded request's keyed output does not depend on timings: its step is priced alike
        seeded = propose(spec, [*reqs[:3], decoding("s", seed=1)], room=100, load=LoadState(num_running=4))
        assert spec.priced_overhead == (pytest.approx(0.05) if price else None)
        return first.lengths, then, seeded.lengths

    before, after, seeded = lengths(True)
    assert sum(after) > sum(before), (before, after)
    assert seeded == after
    assert lengths(False) == (before, before, before)


def test_the_gate_prices_verification_as_the_policy_does_corrected_by_measured_forwards():
    """The gate's cost curve (its predictions for a load level it has not measured) is the
    policy's: the profiled table corrected by the forwards the engine measured."""
    from dspark_serve.scheduler.policy import CostTable

    table = CostTable((1, 8, 64, 512), (100.0, 90.0, 50.0, 10.0))
    spec = Speculation(
        FakeDrafter(), SchedulerConfig(verify_policy="dspark"), max_model_len=512, cost_table=table
    )
    assert spec.gate is not None and spec.gate.config.price is not None
    price = spec.gate.config.price
    assert price(32, 4) == pytest.approx(1.0 / table.profiled_sps(32, 4))
    for _ in range(30):  # verify steps of 4 requests x 8 tokens measured at half the table's time
        spec.correction.record(32, 4, 1.0 / table.profiled_sps(32, 4), 0.5 / table.profiled_sps(32, 4))
        spec.correction.record(4, 4, 1.0 / table.profiled_sps(4, 4), 1.0 / table.profiled_sps(4, 4))
    assert price(32, 4) == pytest.approx(0.5 / table.profiled_sps(32, 4), rel=0.02)
    assert price(4, 4) == pytest.approx(1.0 / table.profiled_sps(4, 4), rel=0.02)
    assert price(32, 4) == pytest.approx(1.0 / spec.priced_table.sps(32, 4))
