"""Penalties, logit bias and min_p under speculation: applied position by position inside a
verified block, so greedy output equals plain decoding and sampled output has the processed
target distribution, with every drafter and policy."""

from __future__ import annotations

import pytest
import torch

import dspark_serve.verifier.verify as verify_mod
from dspark_serve.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.processors import TokenContext, process_block
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, runner_for, tiny_model
from tests.scheduler.test_speculative import (
    FULL_Q,
    VOCAB,
    FixedQDrafter,
    LetterTokenizer,
    broken_rejection_sample,
    run,
)

PENALISED = dict(
    presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias=((65, 4.0), (66, -3.0))
)


def dspark_drafter(target, tmp_path, block_size=7, mask=255):
    cfg = DSparkConfig.for_target(
        target.config,
        num_draft_layers=1,
        block_size=block_size,
        target_layer_ids=(0, 1),
        mask_token_id=mask,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    torch.manual_seed(3)
    m = DSparkModel(cfg, embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    save_dspark(m, tmp_path)
    return build_drafter("dspark", path=str(tmp_path), target_model=target)


def generate(model, sp, prompts, drafter=None, policy="none", max_tokens=24):
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        # no draft gate: whether drafting pays follows timings, and this test needs drafts
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=64, draft_gate=False),
        max_model_len=512,
        drafter=drafter,
    )
    reqs = [Request(f"r{i}", p, sp, max_tokens=max_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    run(engine, reqs)
    return [r.output_ids for r in reqs], sum(r.spec.drafted for r in reqs), sum(r.spec.accepted for r in reqs)


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_greedy_penalties_equal_plain_decoding_under_speculation(tmp_path, drafter, policy):
    model = tiny_model("qwen3")
    prompts = [list(b"abcabcabcabc"), list(range(40, 60)), list(b"xyzxyz") + [65, 66, 65]]
    sp = SamplingParams(temperature=0.0, **PENALISED)
    plain, _, _ = generate(model, sp, prompts)
    unpenalised, _, _ = generate(model, SamplingParams(temperature=0.0), prompts)
    assert plain != unpenalised  # the penalties change the output here
    dr = dspark_drafter(model, tmp_path) if drafter == "dspark" else build_drafter("ngram", block_size=7)
    spec, drafted, accepted = generate(model, sp, prompts, dr, policy)
    assert spec == plain
    assert drafted > 0


def exact_penalised_marginals(model, prompt, sp):
    """P(t2), P(t3) of plain sampling at temperature 1 under the penalties, by enumeration."""
    with torch.no_grad():

        def p(out):
            logits = model(torch.tensor([prompt + out])).logits[0, -1:].double()
            processed = process_block(logits, sp, TokenContext(prompt, out), [])
            return torch.softmax(processed[0].double(), -1)

        p1 = p([])
        m2, m3 = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
        for a in range(VOCAB):
            p2 = p([a])
            m2 += p1[a] * p2
            for b in range(VOCAB):
                m3 += p1[a] * p2[b] * p([a, b])
    return m2, m3


def sampled(model, prompt, sp, n, seed, drafter, rule="argmax"):
    """Unseeded requests, the global RNG seeded here: rejection sampling against the drafts' q
    (seeded requests are judged by keyed samples instead); rule: `SchedulerConfig.draft_rule`."""
    torch.manual_seed(seed)
    engine = Engine(
        runner_for(model, num_blocks=2048),
        LetterTokenizer(),
        SchedulerConfig(
            verify_policy="static:2",
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_waiting=n,
            draft_rule=rule,
        ),
        max_model_len=64,
        drafter=drafter,
    )
    params = {
        k: getattr(sp, k)
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    }
    reqs = [
        Request(
            f"s{i}",
            prompt,
            SamplingParams(temperature=1.0, **params),
            4,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    run(engine, reqs)
    assert sum(r.spec.drafted for r in reqs) >= n
    c2, c3 = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
    for r in reqs:
        c2[r.output_ids[1]] += 1
        c3[r.output_ids[2]] += 1
    return c2 / n, c3 / n


# the quick loop proves it once (dspark); the full suite with a fixed q too
@pytest.mark.parametrize(
    "which",
    [
        pytest.param("fixed-q", marks=pytest.mark.slow),
        "dspark",
        pytest.param("dspark-sampled", marks=pytest.mark.slow),
    ],
)
def test_sampled_penalised_distribution_matches_plain_and_catches_a_broken_sampler(
    monkeypatch, tmp_path, which
):
    model = tiny_model("qwen3", vocab=VOCAB, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = [1, 2, 3]
    sp = SamplingParams(
        presence_penalty=0.9, frequency_penalty=0.7, repetition_penalty=1.5, logit_bias=((5, 1.0),)
    )
    m2, m3 = exact_penalised_marginals(model, prompt, sp)
    plain2, _ = exact_penalised_marginals(model, prompt, SamplingParams())
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()
    assert tv(m2, plain2) > 0.1  # the penalties matter at this position

    def drafter():
        if which == "fixed-q":  # drafts from a q that knows nothing of the penalties
            return FixedQDrafter(FULL_Q)
        return dspark_drafter(model, tmp_path, block_size=2, mask=VOCAB - 1)

    n = 3000
    rule = "argmax" if which == "dspark" else "sampled"  # the greedy walk, or drafts from q
    s2, s3 = sampled(model, prompt, sp, n, 1, drafter(), rule)
    # sampling noise of an 8-outcome TV at n=3000 is ~0.02; 0.05 leaves a wide margin
    assert tv(s2, m2) < 0.05 and tv(s3, m3) < 0.05, (tv(s2, m2), tv(s3, m3))
    monkeypatch.setattr(verify_mod, "rejection_sample", broken_rejection_sample)
    b2, b3 = sampled(model, prompt, sp, n, 2, drafter(), rule)
    assert max(tv(b2, m2), tv(b3, m3)) > 0.1, (tv(b2, m2), tv(b3, m3))
