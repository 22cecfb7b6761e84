"""The per-request choice between DSpark and prompt lookup (and none), from past rounds only."""

import pytest
import torch

from dspark_serve.drafter.base import DraftProposal, DraftRequest
from dspark_serve.drafter.combined import CombinedConfig, CombinedDrafter, expected_accepted
from dspark_serve.ops.sampling_params import SamplingParams
from tests.helpers import FakeDrafterBase


class Fake(FakeDrafterBase):
    tap_layers, calibrator, online_confidence = (), None, False

    def __init__(self, name, block=4, hit=True):
        super().__init__()
        self.name, self.block_size, self.hit = name, block, hit
        self.asked = 0

    def propose(self, requests):
        self.asked += len(requests)
        n = self.block_size if self.hit else 0
        return [DraftProposal(torch.arange(n)) for _ in requests]


def req(rid="a"):
    return DraftRequest(rid, [1, 2, 3], 2, SamplingParams(temperature=0.0), None, 4)


def test_a_primary_that_does_not_pay_stops_drafting_but_is_retried():
    primary, lookup = Fake("dspark"), Fake("ngram", hit=False)
    comb = CombinedDrafter(primary, lookup, CombinedConfig(explore_every=4, primary_floor=0.5, decay=1.0))
    assert len(comb.propose([req()])[0]) == 4  # the prior (1.0) says it pays: it drafts
    comb.observe_acceptance("a", 4, 0)  # nothing accepted: its score drops to 0
    sizes = [len(comb.propose([req()])[0]) for _ in range(7)]
    # plain steps (no draft), but every 4th step of the request tries the primary again
    assert sizes == [0, 0, 4, 0, 0, 0, 4], sizes
    comb.observe_acceptance("a", 4, 3)  # it did well on that retry: drafting resumes
    assert len(comb.propose([req()])[0]) == 4
    assert comb.uses[0] == 4 and comb.uses[1] == 0 and primary.asked == 4


def test_lookup_match_wins_when_its_rounds_are_better_or_the_primary_does_not_pay():
    primary, lookup = Fake("dspark"), Fake("ngram", hit=True, block=3)
    comb = CombinedDrafter(primary, lookup, CombinedConfig(explore_every=100, primary_floor=0.5, decay=1.0))
    comb.propose([req()])  # tie at the prior: lookup (it is free)
    assert comb._state["a"].last == 1
    comb.observe_acceptance("a", 3, 0)  # lookup's round failed
    comb.propose([req()])
    assert comb._state["a"].last == 0  # primary's prior 1.0 beats 0
    comb.observe_acceptance("a", 4, 0)  # primary failed too: below the floor
    comb.propose([req()])
    assert comb._state["a"].last == 1  # a lookup match is taken while the primary does not pay


def test_floor_zero_always_drafts_with_the_primary_and_bad_values_are_rejected():
    comb = CombinedDrafter(
        Fake("dspark"), Fake("ngram", hit=False), CombinedConfig(primary_floor=0.0, decay=1.0)
    )
    comb.propose([req()])
    comb.observe_acceptance("a", 4, 0)
    assert all(len(comb.propose([req()])[0]) == 4 for _ in range(5))
    with pytest.raises(ValueError, match="-0.1"):
        CombinedConfig(primary_floor=-0.1)


def test_lookup_wins_a_close_call_by_what_the_primary_costs():
    """With a lookup match, the primary must make more tokens per unit of time, its proposal's
    cost counted: a lookup accepting a little less per round is taken at cost 0.2, not at 0."""

    def chosen(cost):
        comb = CombinedDrafter(
            Fake("dspark"),
            Fake("ngram", hit=True, block=3),
            CombinedConfig(explore_every=100, primary_floor=0.5, decay=1.0, primary_cost=cost),
        )
        st = comb._choice("a")
        st.score = [1.6, 1.3]  # accepted tokens per round: (1 + 1.3) * 1.2 = 2.76 >= 2.6
        comb.propose([req()])
        return st.last

    assert chosen(0.0) == 0 and chosen(0.2) == 1
    with pytest.raises(ValueError, match="-0.5"):
        CombinedConfig(primary_cost=-0.5)


def test_a_branch_rides_along_only_where_the_request_allows_one():
    """With a branch asked: a primary-led step sends lookup's match as the branch; a
    lookup-led one sends the primary's block only with `primary_branch`."""

    def ask(comb, branch):
        r = req()
        r.branch = branch
        return comb.propose([r])[0]

    primary, lookup = Fake("dspark", block=4), Fake("ngram", hit=True, block=3)
    comb = CombinedDrafter(primary, lookup, CombinedConfig(explore_every=100, primary_cost=0.0, decay=1.0))
    p = ask(comb, False)
    assert comb._state["a"].last == 1 and p.branch is None  # a tie at the prior: lookup leads
    comb.observe_acceptance("a", 3, 0)  # and fails: the primary leads next
    p = ask(comb, True)
    assert comb._state["a"].last == 0 and len(p) == 4 and p.branch.tolist() == [0, 1, 2]
    comb.observe_branch("a", 3, 3)  # the lookup block did well: it leads next
    assert comb._state["a"].score == [1.0, 3.0]
    asked = primary.asked
    p = ask(comb, True)
    assert comb._state["a"].last == 1 and len(p) == 3 and p.branch is None
    assert primary.asked == asked  # no primary block drafted for a lookup-led step
    comb.config = CombinedConfig(explore_every=100, primary_cost=0.0, decay=1.0, primary_branch=True)
    p = ask(comb, True)
    assert len(p) == 3 and p.branch.tolist() == [0, 1, 2, 3] and primary.asked == asked + 1
    assert ask(comb, False).branch is None


class Confident(Fake):
    """A lookup whose blocks come with confidences (prompt lookup's follow the match length)."""

    def __init__(self, conf):
        super().__init__("ngram", block=3)
        self.conf = conf

    def propose(self, requests):
        self.asked += len(requests)
        return [DraftProposal(torch.arange(3), confidences=torch.tensor(self.conf)) for _ in requests]


def test_a_lookup_block_is_judged_by_the_acceptance_its_confidences_expect():
    assert expected_accepted(torch.tensor([0.5, 0.5, 1.0])) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted(torch.empty(0)) == 0.0
    cfg = CombinedConfig(explore_every=100, primary_cost=0.0, decay=1.0)
    primary = Fake("dspark")
    strong = CombinedDrafter(primary, Confident([0.9, 0.9, 0.9]), cfg)  # expects 2.44 accepted
    weak = CombinedDrafter(primary, Confident([0.2, 0.2, 0.2]), cfg)  # expects 0.25
    for comb in (strong, weak):
        comb.propose([req()])
        comb.observe_acceptance("a", 4, 1)  # whoever drafted: one accepted
        comb._state["a"].score = [1.5, 0.0]  # the primary averages 1.5; lookup's rounds failed
        comb.propose([req()])
    # the request's own lookup score (0) is not what decides where the block carries confidences
    assert strong._state["a"].last == 1 and weak._state["a"].last == 0
