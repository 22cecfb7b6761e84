import math

import pytest
import torch

from dspark_serve.ops.sampling import (
    SamplingTensors,
    probs_from_logits,
    sample,
    sample_from_uniforms,
    token_logprobs,
)
from dspark_serve.ops.sampling_params import SamplingParams


def _params(n, temperature=1.0, top_p=1.0, top_k=0):
    return (
        torch.full((n,), temperature),
        torch.full((n,), top_p),
        torch.full((n,), top_k, dtype=torch.long),
    )


def test_plain_softmax_path():
    logits = torch.randn(3, 11)
    probs = probs_from_logits(logits, *_params(3))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-6)


def test_temperature_scales_logits():
    logits = torch.randn(2, 7)
    probs = probs_from_logits(logits, *_params(2, temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1), atol=1e-6)


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0]])
    probs = probs_from_logits(
        logits, torch.tensor([0.0, 0.0]), torch.tensor([0.5, 1.0]), torch.tensor([0, 3])
    )
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_top_k_mask():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = probs_from_logits(logits, *_params(1, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert torch.equal(probs[0] > 0, torch.tensor([False, True, True, False, False]))
    assert torch.allclose(probs[0, [1, 2]], expected, atol=1e-6)


def test_top_k_larger_than_vocab_is_off():
    logits = torch.randn(1, 4)
    probs = probs_from_logits(logits, *_params(1, top_k=10))
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    # p = 0.5, 0.25, 0.125, 0.125 (unsorted positions below)
    base = torch.tensor([0.125, 0.5, 0.125, 0.25]).log()
    cases = {
        0.49: [False, True, False, False],  # 0.5 alone reaches it
        0.6: [False, True, False, True],  # needs the 0.25 too
        0.74: [False, True, False, True],
        0.8: None,  # needs one of the 0.125s; exactly 3 kept
        1.0: [True, True, True, True],
    }
    for top_p, keep in cases.items():
        probs = probs_from_logits(base.unsqueeze(0), *_params(1, top_p=top_p))[0]
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
        if keep is None:
            assert int((probs > 0).sum()) == 3 and bool(probs[1] > 0) and bool(probs[3] > 0)
        else:
            assert (probs > 0).tolist() == keep, top_p
            kept = base.exp()[torch.tensor(keep)]
            assert torch.allclose(probs[torch.tensor(keep)], kept / kept.sum(), atol=1e-6)


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[3.0, 0.0, 0.0]])
    probs = probs_from_logits(logits, *_params(1, top_p=0.01))
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def test_top_k_then_top_p_and_mixed_rows():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(3, 1)
    probs = probs_from_logits(
        logits,
        torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([1.0, 0.65, 0.65]),
        torch.tensor([0, 0, 3], dtype=torch.long),
    )
    assert torch.allclose(probs[0], torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=1e-6)
    # top-p 0.65 over (0.4, 0.3, ...): keep 0.4 + 0.3
    assert torch.allclose(probs[1], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)
    # top-k 3 renormalises to (4, 3, 2)/9; top-p 0.65 then keeps 4/9 + 3/9
    assert torch.allclose(probs[2], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)


def test_sampling_tensors_from_params():
    t = SamplingTensors.from_params([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, top_k=5)])
    assert t.temperature.tolist() == [0.0, 1.0]
    assert t.top_k.dtype == torch.long and t.top_k.tolist() == [0, 5]
    assert torch.allclose(t.top_p, torch.tensor([1.0, 0.9]))
    e = t.repeat_interleave(torch.tensor([2, 1]))
    assert e.temperature.tolist() == [0.0, 0.0, 1.0]


def test_sample_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(500, 1)
    tokens = sample(probs)
    assert set(tokens.tolist()) <= {1, 3}
    edge = sample_from_uniforms(probs[:3], torch.tensor([0.0, 0.5, 1.0 - 2**-24]))
    assert edge.tolist() == [1, 3, 3]


def test_sample_matches_distribution():
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tokens = sample(p.repeat(20000, 1))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert 0.5 * (freq - p).abs().sum() < 0.02


def test_seeded_sampling_reproducible_independent_of_batch():
    probs = torch.softmax(torch.randn(4, 50), -1)

    def run(rows, seeds):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return [sample(probs[rows], gens).tolist() for _ in range(5)]

    alone = run([2], [123])
    in_batch = run([0, 2, 3], [None, 123, 7])
    assert [r[1] for r in in_batch] == [r[0] for r in alone]
    assert run([0, 1], [1, 2]) == run([0, 1], [1, 2])
    # different seeds do give different streams
    assert run([2] * 8, [1] * 8) != run([2] * 8, [2] * 8)


def test_token_logprobs():
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    lp = token_logprobs(probs, torch.tensor([1, 1]))
    assert math.isclose(float(lp[0]), math.log(0.75), rel_tol=1e-6)
    assert lp[1] == float("-inf")


def test_bad_shape_raises():
    with pytest.raises(ValueError, match=r"\(5,\)"):
        probs_from_logits(torch.randn(5), *_params(1))


def test_keyed_uniforms_are_a_function_of_seed_and_position():
    from dspark_serve.ops.sampling import keyed_uniforms

    u = keyed_uniforms(7, range(1000))
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u[500:510], keyed_uniforms(7, range(500, 510)))  # no stream: any position alone
    assert not torch.equal(u[:10], keyed_uniforms(8, range(10)))
    assert abs(u.mean().item() - 0.5) < 0.05 and len(set(u.tolist())) == 1000
    # the whole seed range (negative and unsigned 64-bit alike)
    assert keyed_uniforms(-(2**63), [0]).shape == (1,) and keyed_uniforms(2**64 - 1, [2**40]).shape == (1,)


def _reference_probs(logits, temperature):
    """The plain path as first written: widen, divide, softmax; greedy rows one-hot."""
    x = logits.float()
    greedy = temperature < 1e-5
    scaled = x / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def _reference_draw(probs, u):
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return torch.minimum(idx, (probs > 0).long().cumsum(dim=-1).argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfiltered_probs_and_draws_keep_the_reference_bits(dtype):
    """The unfiltered softmax (widened inside it, temperature 1 not divided) and the draw (its
    end-of-vocabulary guard only where a draw can need it) give the same bits as the direct
    forms, greedy rows, zero-mass tails and uniforms next to 1 included."""
    torch.manual_seed(5)
    logits = (torch.randn(12, 3000) * 3).to(dtype)
    for temps in ([1.0] * 12, [1.0, 0.7, 0.0, 1.3] * 3):
        t = torch.tensor(temps)
        n = len(temps)
        got = probs_from_logits(logits, t, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.zeros(n))
        assert torch.equal(got, _reference_probs(logits, t))
    probs = _reference_probs(logits, torch.ones(12))
    probs[:4, 2000:] = 0.0  # a tail without mass
    probs[5, ::3] = 0.0
    u = torch.rand(12)
    u[:6] = 1.0 - 2.0**-53  # draws at the very end: the guard's case
    assert torch.equal(sample_from_uniforms(probs, u), _reference_draw(probs, u))
    u = torch.rand(12)
    assert torch.equal(sample_from_uniforms(probs, u), _reference_draw(probs, u))
