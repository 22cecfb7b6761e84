"""Logprobs under speculation: every returned token's logprob (and its top alternatives) is
the target's raw log-softmax at its position, the same whether the token was an accepted
draft, a correction or a bonus token, equal to plain decoding's and to a direct forward."""

from __future__ import annotations

import pytest
import torch

from bench.replay import ReplayDrafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model

TOL = 2e-4  # float32, different batch shapes (flat verify rows vs one row)


def records(model, prompts, sp, drafter=None, policy="none", top=3, max_tokens=20):
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=64, draft_gate=False),
        max_model_len=256,
        drafter=drafter,
    )
    reqs = [
        Request(f"r{i}", p, sp, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.add_request(r)
    out = {r.request_id: [] for r in reqs}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.tokens
    return reqs, out


def direct(model, ids, n_prompt):
    """log_softmax of one forward over the whole sequence: row j predicts token n_prompt + j."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[n_prompt - 1 : len(ids) - 1]


@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_logprobs_equal_plain_decoding_and_a_direct_forward_for_every_provenance(policy):
    model = tiny_model("qwen3")
    prompts = [list(range(30, 40)), list(range(50, 53))]
    refs = {f"r{i}": hf_greedy(model, p, 20) for i, p in enumerate(prompts)}
    greedy = SamplingParams(temperature=0.0)
    _, plain = records(model, prompts, greedy)
    dr = ReplayDrafter(
        {tuple(p): refs[f"r{i}"] for i, p in enumerate(prompts)},
        vocab_size=257,
        block_size=7,
        accept_rate=0.7,
    )
    reqs, spec = records(model, prompts, greedy, dr, policy)
    kinds = {t.kind for recs in spec.values() for t in recs}
    assert {"draft", "correction", "bonus"} <= kinds, kinds
    for r, p in zip(reqs, prompts):
        got, want = spec[r.request_id], plain[r.request_id]
        assert [t.token_id for t in got] == [t.token_id for t in want] == r.output_ids
        ref = direct(model, p + r.output_ids, len(p))
        for j, (g, w) in enumerate(zip(got, want)):
            assert abs(g.logprob.logprob - w.logprob.logprob) < TOL, (j, g.kind)
            assert abs(g.logprob.logprob - ref[j, g.token_id].item()) < TOL, (j, g.kind)
            assert [a.token_id for a in g.logprob.top] == ref[j].topk(3).indices.tolist()
            for a in g.logprob.top:
                assert abs(a.logprob - ref[j, a.token_id].item()) < TOL
            # greedy: the chosen token is the most likely one
            assert g.logprob.top[0].token_id == g.token_id


def test_sampled_logprobs_are_the_raw_distribution_not_the_processed_one():
    """temperature / top-k / penalties shape the sampling, never the reported logprobs."""
    model = tiny_model("qwen3")
    prompt = list(range(30, 40))
    sp = SamplingParams(temperature=0.5, top_k=3, seed=4, presence_penalty=1.0)
    dr = ReplayDrafter(
        {tuple(prompt): hf_greedy(model, prompt, 20)}, vocab_size=257, block_size=4, accept_rate=0.9
    )
    reqs, spec = records(model, [prompt], sp, dr, "static:4", top=0)
    r = reqs[0]
    ref = direct(model, prompt + r.output_ids, len(prompt))
    got = spec[r.request_id]
    assert r.spec.drafted > 0  # the speculative path ran
    for j, t in enumerate(got):
        assert abs(t.logprob.logprob - ref[j, t.token_id].item()) < TOL
        assert t.logprob.top == ()
    # the processed distribution would differ (temperature 0.5 sharpens it)
    assert any(
        abs(2 * ref[j, t.token_id].item() - ref[j, t.token_id].item()) > 1e-3 for j, t in enumerate(got)
    )
