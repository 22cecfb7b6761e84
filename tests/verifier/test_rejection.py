"""Rejection sampling: exact on greedy cases, distribution-preserving on sampled ones.

The statistical harness runs speculative rounds over a tiny Markov "model" (target and
draft both condition on the previous token) and compares the joint distribution of the
first two generated tokens with the target's. The same harness must flag samplers with
classic bugs, which shows its threshold can fail.
"""

import pytest
import torch

from dspark_serve.ops.sampling import probs_from_logits, sample
from dspark_serve.verifier.rejection import greedy_verify, rejection_sample, verify_offsets
from tests.verifier._padded import padded_rejection_sample

V = 5  # vocabulary
K = 3  # drafts per round
T = 6  # positions the Markov chain is defined for
N = 20000  # trials
TV_FIRST = 0.02  # expected TV of a correct sampler ~0.006 at N=20000 (5 cells)
TV_JOINT = 0.035  # expected TV ~0.014 (25 cells)


def _dirichlet(shape, g):
    x = -torch.rand(*shape, generator=g).log()  # Exp(1) -> Dirichlet(1, ..., 1)
    return x / x.sum(-1, keepdim=True)


def _chain(seed):
    """Target P[t, prev, next] and draft Q[t, prev, next]; at t = 0 prev is ignored."""
    g = torch.Generator().manual_seed(seed)
    p, q = _dirichlet((T, V, V), g), _dirichlet((T, V, V), g)
    p[0] = p[0, 0]
    q[0] = q[0, 0]
    return p, q


def _round(p, q, start, prev, num_draft, sampler, deterministic_drafts):
    """One speculative round for every row: draft K tokens from q, verify with `sampler`."""
    n = prev.shape[0]
    rows = torch.arange(n)
    drafts, draft_probs, target_probs = [], [], []
    cur = prev
    for k in range(K + 1):
        t = start + k
        target_probs.append(p[t, cur])
        if k == K:
            break
        qk = q[t, cur]
        if deterministic_drafts:
            x = qk.argmax(-1)
            qk = torch.zeros_like(qk).scatter_(1, x.unsqueeze(1), 1.0)
        else:
            x = sample(qk)
        drafts.append(x)
        draft_probs.append(qk)
        cur = x
    res = sampler(
        torch.stack(target_probs, 1),
        torch.stack(drafts, 1),
        None if deterministic_drafts else torch.stack(draft_probs, 1),
        num_draft,
        None,
    )
    assert torch.equal(res.num_output, res.num_accepted + 1)
    assert bool((res.output_tokens[rows, res.num_accepted] >= 0).all())
    return res


def _first_two_tokens(sampler, seed, deterministic_drafts=False):
    """Empirical joint of the first two generated tokens and the exact target joint."""
    torch.manual_seed(seed)
    p, q = _chain(seed)
    prev0 = torch.zeros(N, dtype=torch.long)
    res = _round(p, q, 0, prev0, torch.randint(0, K + 1, (N,)), sampler, deterministic_drafts)
    tok1 = res.output_tokens[:, 0]
    tok2 = res.output_tokens[:, 1].clone()
    short = res.num_output < 2
    if bool(short.any()):  # second token comes from the next round
        m = int(short.sum())
        res2 = _round(p, q, 1, tok1[short], torch.randint(0, K + 1, (m,)), sampler, deterministic_drafts)
        tok2[short] = res2.output_tokens[:, 0]
    emp = torch.bincount(tok1 * V + tok2, minlength=V * V).float().view(V, V) / N
    exact = p[0, 0].unsqueeze(1) * p[1]  # P(x1) * P(x2 | x1)
    return emp, exact


def _tv(a, b):
    return 0.5 * float((a - b).abs().sum())


def _errors(sampler, seed=0, deterministic_drafts=False):
    emp, exact = _first_two_tokens(sampler, seed, deterministic_drafts)
    return _tv(emp.sum(1), exact.sum(1)), _tv(emp, exact)


def _accepts_ignoring_q(tp, dt, dp, nd, gens):
    """Bug: accepts with min(1, p(x)) as if q(x) were 1, but keeps the residual max(0, p - q).

    (Treating q as one-hot in both places would be lossless, only slower.)
    """
    dp = dp.scatter(2, dt.unsqueeze(2), 1.0)
    return padded_rejection_sample(tp, dt, dp, nd, gens)


def _resamples_from_p(tp, dt, dp, nd, gens):
    """Bug: after a rejection, samples from p instead of the residual max(0, p - q)."""
    res = padded_rejection_sample(tp, dt, dp, nd, gens)
    rows = (res.num_accepted < nd).nonzero(as_tuple=True)[0]
    pos = res.num_accepted[rows]
    res.output_tokens[rows, pos] = sample(tp[rows, pos])
    return res


@pytest.fixture(params=["torch", "kernel"])
def draws(request, monkeypatch):
    """Every draw through torch's cumulative sum, or through the C kernel (`sample_rows`)."""
    import dspark_serve.ops.sampling as sampling_mod
    from dspark_serve.ops.cpu_kernels import load_kernels

    if request.param == "torch":
        monkeypatch.setattr(sampling_mod, "sample_rows", lambda probs, u: None)
    elif load_kernels() is None:
        pytest.skip("the CPU kernels need a C compiler")
    return request.param


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_output_matches_target(seed, draws):
    first, joint = _errors(padded_rejection_sample, seed)
    assert first < TV_FIRST and joint < TV_JOINT, (first, joint)


def test_the_final_draw_in_one_pass_is_the_residual_distributions_draw():
    """`_DraftQ.final_draws` on a CPU (the C kernel: p and q read where they lie, the residual
    computed as it is read) draws the token that `final_distribution` and the cumulative-sum
    draw give: rejected requests from max(0, p - q) with q a draft row, one-hot on the draft
    token (deterministic requests, or no draft probabilities), a residual without mass from p,
    accepted requests from p; every uniform at 0, in between and just below 1."""
    from dspark_serve.ops.cpu_kernels import load_kernels
    from dspark_serve.verifier.rejection import RESIDUAL_EPS, _DraftQ

    if load_kernels() is None:
        pytest.skip("the CPU kernels need a C compiler")
    g = torch.Generator().manual_seed(3)
    vocab, b = 700, 6

    def reference(dist, u):
        cdf = torch.cumsum(dist, dim=-1, dtype=torch.float64)
        total = cdf[:, -1]
        x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1).clamp_(max=dist.shape[1] - 1)

    checked = 0
    for trial in range(60):
        target = torch.softmax(torch.randn(b * 3, vocab + 4, generator=g) * 3, -1)[:, :vocab]  # strided rows
        draft = torch.softmax(torch.randn(b * 2, vocab, generator=g) * 3, -1)
        tokens = torch.randint(0, vocab, (b * 2,), generator=g)
        final_rows = torch.arange(b) * 3 + torch.randint(0, 3, (b,), generator=g)
        rejected = torch.rand(b, generator=g) < 0.7
        draft[final_rows[2] - 2] = target[final_rows[2]]  # request 2's q == p: a residual without mass
        draft[final_rows[3] - 3] = target[final_rows[3]]  # request 3's: a residual of 5e-7 on token 9
        draft[final_rows[3] - 3, 9] -= 5e-7
        rejected[2:4] = True
        det = torch.rand(b, generator=g) < 0.3 if trial % 3 else None
        probs = None if trial % 5 == 0 else draft
        q = _DraftQ(probs, det, tokens)
        u = torch.rand(b, generator=g, dtype=torch.float64)
        if trial < 2:
            u[:] = [0.0, 1.0 - 2.0**-53][trial]
        got = q.final_draws(target, final_rows, rejected, u)
        want = reference(q.final_distribution(target[final_rows].float(), final_rows, rejected), u)
        assert torch.equal(got, want), trial
        checked += int(rejected.sum())
    assert checked > 100 and RESIDUAL_EPS > 0


def test_deterministic_drafts_match_target():
    first, joint = _errors(padded_rejection_sample, 2, deterministic_drafts=True)
    assert first < TV_FIRST and joint < TV_JOINT, (first, joint)


@pytest.mark.parametrize("broken", [_accepts_ignoring_q, _resamples_from_p])
def test_harness_detects_broken_samplers(broken):
    first, joint = _errors(broken, 0)
    assert first > 2 * TV_FIRST and joint > 2 * TV_JOINT, (first, joint)


def test_greedy_hand_made():
    # Target argmax per position: [2, 0, 1, 3]; four requests verify 3, 3, 3 and 0 drafts.
    argmax = torch.tensor([2, 0, 1, 3])
    num_draft = torch.tensor([3, 3, 3, 0])
    offsets = verify_offsets(num_draft)
    assert offsets.tolist() == [0, 4, 8, 12, 13]
    rows = torch.cat([argmax[: n + 1] for n in num_draft.tolist()])  # [13] argmax per verify row
    target = torch.zeros(13, 4).scatter_(1, rows.unsqueeze(1), 1.0)
    drafts = torch.tensor([2, 0, 1, 2, 3, 1, 1, 0, 1])  # [9] = sum(num_draft)
    res = rejection_sample(target, drafts, None, num_draft, None)
    assert res.output_tokens.tolist() == [
        2,
        0,
        1,
        3,  # all accepted + bonus
        2,
        0,
        -1,
        -1,  # rejected at 1, recovered = argmax
        2,
        -1,
        -1,
        -1,  # rejected at 0
        2,  # nothing to verify: plain decoding
    ]
    assert [res.tokens(b) for b in range(4)] == [[2, 0, 1, 3], [2, 0], [2], [2]]
    assert res.num_accepted.tolist() == [3, 1, 0, 0]
    assert res.num_output.tolist() == [4, 2, 1, 1]


def test_flat_rows_follow_each_request_length_without_padding():
    # Requests with 5, 0 and 2 drafts: 6 + 1 + 3 verify rows, 7 draft rows, never 3 x 6.
    num_draft = torch.tensor([5, 0, 2])
    target = torch.full((10, 3), 1.0 / 3)
    res = rejection_sample(
        target, torch.zeros(7, dtype=torch.long), torch.full((7, 3), 1.0 / 3), num_draft, None
    )
    assert res.output_tokens.shape == (10,) and res.offsets.tolist() == [0, 6, 7, 10]
    assert res.num_accepted.tolist() == [5, 0, 2]  # q == p: every draft passes
    assert [len(res.tokens(b)) for b in range(3)] == [6, 1, 3]
    with pytest.raises(ValueError, match=r"sum\(num_draft \+ 1\)"):
        rejection_sample(
            torch.full((3 * 6, 3), 1.0 / 3), torch.zeros(7, dtype=torch.long), None, num_draft, None
        )


def test_greedy_equals_argmax_decoding_with_stochastic_draft_probs():
    torch.manual_seed(3)
    b, vocab = 64, 6
    logits = torch.randn(b * (K + 1), vocab)
    n = b * (K + 1)
    target = probs_from_logits(logits, torch.zeros(n), torch.ones(n), torch.zeros(n, dtype=torch.long)).view(
        b, K + 1, vocab
    )
    argmax = logits.view(b, K + 1, vocab).argmax(-1)
    draft_probs = torch.softmax(torch.randn(b, K, vocab), -1)
    # Drafts agree with the argmax often, so every acceptance length occurs.
    drafts = torch.where(torch.rand(b, K) < 0.7, argmax[:, :K], torch.randint(0, vocab, (b, K)))
    num_draft = torch.randint(0, K + 1, (b,))
    res = padded_rejection_sample(target, drafts, draft_probs, num_draft, [torch.Generator()] * b)
    for r in range(b):
        expected = []
        for k in range(int(num_draft[r])):
            if drafts[r, k] != argmax[r, k]:
                break
            expected.append(int(drafts[r, k]))
        expected.append(int(argmax[r, len(expected)]))
        got = [t for t in res.output_tokens[r].tolist() if t >= 0]
        assert got == expected, r
    assert len(set(res.num_accepted.tolist())) == K + 1


def test_greedy_verify_equals_rejection_sampling_on_one_hot_targets():
    """The all-greedy fast path returns exactly what the general sampler returns for one-hot p
    (flat layout, uneven blocks, empty blocks, every acceptance length)."""
    torch.manual_seed(5)
    b, vocab = 48, 7
    num_draft = torch.randint(0, K + 1, (b,))
    t = int(num_draft.sum()) + b
    logits = torch.randn(t, vocab)
    argmax = logits.argmax(-1)
    offsets = verify_offsets(num_draft)
    vrows = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1]) - 1) for i in range(b)])
    drafts = torch.where(torch.rand(len(vrows)) < 0.7, argmax[vrows], torch.randint(0, vocab, (len(vrows),)))
    target = probs_from_logits(logits, torch.zeros(t), torch.ones(t), torch.zeros(t, dtype=torch.long))
    q = torch.softmax(torch.randn(len(vrows), vocab), -1)
    ref = rejection_sample(target, drafts, q, num_draft)
    got = greedy_verify(argmax, drafts, num_draft)
    assert torch.equal(got.output_tokens, ref.output_tokens)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(got.offsets, ref.offsets)
    assert len(set(got.num_accepted.tolist())) == K + 1
    # A broken fast path (accepting one draft too many) would differ.
    broken = greedy_verify(argmax, torch.where(drafts == argmax[vrows], drafts, argmax[vrows]), num_draft)
    assert not torch.equal(broken.num_accepted, ref.num_accepted)


def test_deterministic_flag_per_row():
    # q = p at the draft position, so an honest stochastic row always accepts; a row flagged
    # deterministic uses a one-hot q instead: accept with p(x) = 0.6, else emit the other token.
    m = 4000
    target = torch.tensor([[0.6, 0.4], [0.5, 0.5]]).expand(m, 2, 2).contiguous()
    draft_probs = torch.tensor([[0.6, 0.4]]).expand(m, 1, 2).contiguous()
    flagged = torch.arange(m) % 2 == 0
    torch.manual_seed(0)
    res = padded_rejection_sample(
        target,
        torch.zeros(m, 1, dtype=torch.long),
        draft_probs,
        torch.ones(m, dtype=torch.long),
        None,
        flagged,
    )
    assert bool((res.num_accepted[~flagged] == 1).all())
    rejected = flagged & (res.num_accepted == 0)
    assert abs(float(rejected.sum()) / float(flagged.sum()) - 0.4) < 0.04
    assert bool((res.output_tokens[rejected, 0] == 1).all())


def test_residual_without_mass_falls_back_to_p():
    # q slightly above p everywhere (unnormalised draft probs): residual is all zero.
    p = torch.tensor([0.0, 0.3, 0.7])
    m = 4000
    target = torch.stack([p, p]).expand(m, 2, 3).contiguous()
    drafts = torch.full((m, 1), 2)
    draft_probs = (p * 1.05).expand(m, 1, 3).contiguous()
    torch.manual_seed(0)
    res = padded_rejection_sample(target, drafts, draft_probs, torch.ones(m, dtype=torch.long), None)
    rejected = res.num_accepted == 0
    assert int(rejected.sum()) > 50  # accept prob 1/1.05
    recovered = res.output_tokens[rejected, 0]
    assert bool((recovered != 0).all())  # token 0 has no target mass


def test_seeded_rows_reproducible_independent_of_batch():
    torch.manual_seed(5)
    vocab = 7
    target = torch.softmax(torch.randn(3, K + 1, vocab), -1)
    draft_probs = torch.softmax(torch.randn(3, K, vocab), -1)
    drafts = torch.randint(0, vocab, (3, K))

    def run_alone():
        g = torch.Generator().manual_seed(11)
        return (
            padded_rejection_sample(
                target[1:2, :3], drafts[1:2, :2], draft_probs[1:2, :2], torch.tensor([2]), [g]
            )
            .output_tokens[0, :3]
            .tolist()
        )

    def run_batched():
        # Row 1 inside a wider (K = 3) batch with neighbours using other generators.
        gens = [None, torch.Generator().manual_seed(11), torch.Generator().manual_seed(99)]
        return (
            padded_rejection_sample(target, drafts, draft_probs, torch.tensor([3, 2, 1]), gens)
            .output_tokens[1, :3]
            .tolist()
        )

    alone = [run_alone() for _ in range(20)]
    assert alone == [run_batched() for _ in range(20)]
    assert alone == [run_alone() for _ in range(20)]


def test_zero_drafts_is_plain_sampling():
    target = torch.tensor([[[0.25, 0.75]]]).repeat(8000, 1, 1)
    torch.manual_seed(1)
    res = padded_rejection_sample(
        target, torch.zeros(8000, 0, dtype=torch.long), None, torch.zeros(8000, dtype=torch.long)
    )
    assert res.output_tokens.shape == (8000, 1)
    assert abs(float(res.output_tokens.float().mean()) - 0.75) < 0.02


def test_bad_inputs_raise():
    target = torch.full((5, 4), 0.25)  # two requests verifying 1 and 2 drafts
    drafts = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[6\] rows"):
        rejection_sample(target, drafts, None, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(target, drafts[:1], None, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(target, drafts, torch.full((3, 5), 0.2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=">= 0"):
        rejection_sample(target, drafts, None, torch.tensor([4, -1]))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        rejection_sample(target.view(5, 2, 2), drafts, None, torch.tensor([1, 2]))
