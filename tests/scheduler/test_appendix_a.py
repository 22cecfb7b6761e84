"""The DSpark paper's Appendix A, run as a simulation.

Vocabulary {A, B}; target p = (0.7, 0.3) and draft q = (0.5, 0.5) at the first position.
The confidence of the second position depends on the first draft token: 0.9 after A, 0
after B. Cost table SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45. A global search over all
prefixes verifies two drafts after A and none after B, so it keeps A more often than the
target would: the first output token follows (0.85, 0.15). The causal early stop decides
before looking at anything computed from x1 and keeps the target's (0.7, 0.3).
"""

import pytest
import torch

from dspark_serve.scheduler.policy import CostTable, DSparkPolicy, LoadState, PolicyInput, parse_policy
from tests.verifier._padded import padded_rejection_sample

A, B = 0, 1
P = torch.tensor([0.7, 0.3])  # target at every position
Q = torch.tensor([0.5, 0.5])  # draft at every position
TABLE = CostTable((1, 2, 3), (1.0, 0.5, 0.45))
LOAD = LoadState(num_running=1, num_waiting=0, prefill_tokens=0, kv_usage=0.0)
ROUNDS = 20000


def first_token_distribution(policy_name, first_confidence, table=TABLE, seed=0):
    """Simulate ROUNDS independent rounds; returns (P(first output = A), lengths used).
    policy_name: a spec, or a policy object."""
    torch.manual_seed(seed)
    policy = parse_policy(policy_name) if isinstance(policy_name, str) else policy_name
    drafts = torch.multinomial(Q, ROUNDS * 2, replacement=True).view(ROUNDS, 2)
    lengths = []
    for x1 in drafts[:, 0].tolist():
        c2 = 0.9 if x1 == A else 0.0  # the Markov confidence head sees x1
        inp = PolicyInput(confidences=[[first_confidence, c2]], max_lengths=[2])
        lengths.append(policy(inp, table, LOAD).lengths[0])
    num_draft = torch.tensor(lengths)
    res = padded_rejection_sample(
        P.expand(ROUNDS, 3, 2).contiguous(),
        drafts,
        Q.expand(ROUNDS, 2, 2).contiguous(),
        num_draft,
        None,
    )
    share_a = float((res.output_tokens[:, 0] == A).float().mean())
    return share_a, drafts[:, 0], num_draft


# 0.8 is the paper's a1 (= sum min(p, q)); 1.0 makes Theta_1 tie Theta_0 (no strict gain).
@pytest.mark.parametrize("first_confidence", [0.8, 1.0])
def test_global_search_is_biased(first_confidence):
    share_a, x1, num_draft = first_token_distribution("dspark_global", first_confidence)
    # The bias mechanism: it verifies after A, never after B.
    assert bool((num_draft[x1 == A] == 2).all()) and bool((num_draft[x1 == B] == 0).all())
    assert abs(share_a - 0.85) < 0.015, share_a  # 0.85 - 0.7 is ~30 standard errors


@pytest.mark.parametrize("first_confidence", [0.8, 1.0])
def test_early_stop_is_lossless(first_confidence):
    # on the table alone (the paper's SPS): Theta_1 <= Theta_0, it stops before seeing c2
    share_a, _, num_draft = first_token_distribution(DSparkPolicy(convex=False), first_confidence)
    assert bool((num_draft == 0).all())
    assert abs(share_a - 0.7) < 0.015, share_a


@pytest.mark.parametrize("first_confidence", [0.8, 1.0])
def test_the_envelope_after_a_refused_first_draft_stays_lossless(first_confidence):
    """The served policy: the first draft does not pay on the table, which depends on c1
    alone, so it admits again on the envelope: x1 is always verified (decided from c1), x2
    only where c2 (computed from x1) says so, and the first token keeps the target's law."""
    share_a, x1, num_draft = first_token_distribution("dspark", first_confidence)
    assert bool((num_draft >= 1).all())
    assert bool((num_draft[x1 == A] == 2).all()) and bool((num_draft[x1 == B] == 1).all())
    assert abs(share_a - 0.7) < 0.015, share_a


def test_early_stop_lossless_when_it_does_verify():
    # A flatter profile makes the first draft worth verifying (Theta_1 = 1.62 > 1); the
    # second is then rejected by the early stop whatever x1 was, and the output keeps p.
    flatter = CostTable((1, 2, 3), (1.0, 0.9, 0.45))
    share_a, _, num_draft = first_token_distribution("dspark", 0.8, table=flatter, seed=1)
    assert bool((num_draft == 1).all())
    assert abs(share_a - 0.7) < 0.015, share_a
