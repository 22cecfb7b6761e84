"""Speculative decoding through the engine is lossless: greedy output equals plain decoding for
every drafter and policy, and sampled output has the target's distribution (a test that a
broken sampler fails)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dspark_serve.scheduler.engine as engine_mod
import dspark_serve.verifier.verify as verify_mod
from bench.replay import ReplayDrafter
from dspark_serve.drafter.base import DraftProposal
from dspark_serve.drafter.combined import CombinedDrafter
from dspark_serve.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.metrics_sink import NullMetrics
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.rejection import greedy_verify, rejection_sample
from tests.helpers import ByteTokenizer, FakeDrafterBase, hf_greedy, runner_for, tiny_model

GREEDY = SamplingParams(temperature=0.0)


def byte_engine(model, drafter, policy: str, budget: int) -> Engine:
    """An engine over `model` with byte tokens: `policy` verifies `drafter`'s blocks, at most
    `budget` tokens a step."""
    return Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=budget),
        max_model_len=512,
        drafter=drafter,
    )


def run(engine, reqs, late=()):
    for r in reqs:
        engine.add_request(r)
    step = 0
    while engine.has_work() or late:
        if step == 2 and late:
            for r in late:
                engine.add_request(r)
            late = ()
        engine.step()
        step += 1


@pytest.mark.parametrize("policy", ["static:4", "dspark", "threshold:0.3"])
def test_greedy_oracle_drafter_equals_plain(policy):
    model = tiny_model("qwen3")
    prompts = {f"r{i}": list(range(30 + i, 30 + i + n)) for i, n in enumerate((4, 19, 33, 8))}
    refs = {k: hf_greedy(model, p, 24) for k, p in prompts.items()}
    # The true greedy continuation, each position corrupted with probability 0.3: multi-token
    # acceptance, rejection in the middle, rollback; it also checks contexts arrive gap-free.
    dr = ReplayDrafter(
        {tuple(p): refs[k] for k, p in prompts.items()}, vocab_size=257, block_size=4, accept_rate=0.7
    )
    engine = byte_engine(model, dr, policy, budget=40)
    reqs = [
        Request(k, p, GREEDY, max_tokens=17 + i, ignore_eos=True) for i, (k, p) in enumerate(prompts.items())
    ]
    run(engine, reqs[:2], late=reqs[2:])
    for r in reqs:
        assert r.output_ids == refs[r.request_id][: r.max_tokens], r.request_id
        assert len(r.output_ids) == r.max_tokens  # max_tokens exact despite blocks
    total = sum(r.spec.accepted for r in reqs)
    assert total > 0 and sum(r.spec.rounds for r in reqs) < sum(r.max_tokens for r in reqs)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def random_dspark(target, tmp_path, markov_rank=8):
    cfg = DSparkConfig.for_target(
        target.config,
        num_draft_layers=2,
        block_size=5,
        target_layer_ids=(0, 1),
        mask_token_id=255,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
    )
    torch.manual_seed(3)
    m = DSparkModel(cfg, embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    save_dspark(m, tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_greedy_dspark_drafter_equals_plain(tmp_path, name):
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path, markov_rank=8 if name == "dspark" else 0)
    dr = build_drafter(name, path=str(path), target_model=model)
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="static:5", max_num_batched_tokens=16),  # chunked prefill
        max_model_len=512,
        drafter=dr,
    )
    prompts = [list(range(40, 40 + n)) for n in (3, 25, 11)]
    reqs = [Request(f"r{i}", p, GREEDY, max_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]
    run(engine, reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(model, p, 20)
        assert r.spec.drafted > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_greedy_ngram_drafter_equals_plain_and_accepts_repeats():
    model = tiny_model("llama", seed=5)
    prompt = list(b"abcabcabcabc")
    ref = hf_greedy(model, prompt, 40)
    dr = build_drafter("ngram", block_size=4)
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="static:4"),
        max_model_len=512,
        drafter=dr,
    )
    r = Request("n", prompt, GREEDY, max_tokens=40, ignore_eos=True)
    run(engine, [r])
    assert r.output_ids == ref
    assert r.spec.drafted > 0


# -- sampling: the distribution of speculative tokens ---------------------------------------------
VOCAB = 8


class LetterTokenizer:
    eos_token_id = None

    def decode(self, ids, **_):
        return "".join(chr(97 + i) for i in ids)


class FixedQDrafter(FakeDrafterBase):
    """Drafts from a fixed distribution q that differs from the target's p."""

    name, tap_layers, block_size, calibrator = "fixed-q", (), 2, None
    online_confidence = False

    def __init__(self, q: torch.Tensor):
        super().__init__()
        self.q = q
        self.argmax_blocks = 0

    def propose(self, requests):
        out = []
        for r in requests:
            k = min(2, r.max_draft)
            if r.sampling.greedy:  # the argmax rule: q's most likely token, q one-hot on it
                self.argmax_blocks += 1
                out.append(DraftProposal(self.q.argmax().repeat(k), None, None))
                continue
            toks = torch.multinomial(self.q, k, replacement=True, generator=r.generator)
            out.append(DraftProposal(toks, self.q.expand(k, -1).clone(), None))
        return out


def exact_marginals(model, prompt):
    """P(t2) and P(t3) under plain sampling at temperature 1, by enumeration."""
    with torch.no_grad():

        def p(seq):
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

        p1 = p(prompt)
        m2, m3 = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
        for a in range(VOCAB):
            p2 = p(prompt + [a])
            m2 += p1[a] * p2
            for b in range(VOCAB):
                m3 += p1[a] * p2[b] * p(prompt + [a, b])
    return m2, m3


FULL_Q = torch.softmax(torch.linspace(2.0, -2.0, VOCAB), -1)  # far from p on purpose
# A truncated draft vocabulary: q is a distribution over 5 kept ids, zero on the other 3.
TRUNCATED_Q = torch.cat([torch.softmax(torch.linspace(2.0, -2.0, 5), -1), torch.zeros(3)])


def sampled_marginals(
    model, prompt, n, seed, q=FULL_Q, combined=False, cached=False, keyed=False, engines=None, rule="sampled"
):
    """Unseeded requests (rejection sampling, the global RNG seeded here) or, keyed, seeded ones
    (each row judged by its keyed sample); engines: a list the engine is appended to."""
    torch.manual_seed(seed)
    dr = FixedQDrafter(q)
    if combined:  # prompt lookup where it matches, the fixed-q drafter elsewhere
        dr = CombinedDrafter(dr, build_drafter("ngram", block_size=2))
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
        drafter=dr,
    )
    reqs = [
        Request(
            f"s{i}",
            prompt,
            SamplingParams(temperature=1.0, seed=seed * 100000 + i if keyed else None),
            max_tokens=4,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    if engines is not None:
        engines.append(engine)
    if cached:  # the first request runs a step alone: every later one hits its cached blocks
        engine.add_request(reqs[0])
        engine.step()
        run(engine, reqs[1:])
        hit = engine.blocks.block_size * ((len(prompt) - 1) // engine.blocks.block_size)
        assert hit > 0 and engine.blocks.stats().hits == (n - 1) * hit
    else:
        run(engine, reqs)
    c2, c3 = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
    for r in reqs:
        c2[r.output_ids[1]] += 1
        c3[r.output_ids[2]] += 1
    # the speculative path really ran (prompt lookup may propose a single token)
    assert sum(r.spec.drafted for r in reqs) >= (n if combined else 2 * n)
    if combined:
        assert dr.uses[1] > 0  # lookup drafted too
    return c2 / n, c3 / n


def broken_rejection_sample(
    target_probs, draft_tokens, draft_probs, num_draft, generators=None, draft_deterministic=None
):
    """Ignores q: pretends the draft distribution equals the target's, so every draft passes."""
    req = torch.repeat_interleave(torch.arange(len(num_draft)), num_draft.cpu())
    judged = torch.arange(draft_tokens.numel()) + req  # the verify row of each draft
    return rejection_sample(
        target_probs,
        draft_tokens,
        target_probs[judged.to(target_probs.device)].clone(),
        num_draft,
        generators,
        torch.zeros_like(num_draft, dtype=torch.bool),
    )


# the quick loop proves it once (a full-vocabulary q); the full suite in every variant
@pytest.mark.parametrize(
    "q,combined,cached,rule",
    [
        (FULL_Q, False, False, "sampled"),
        (FULL_Q, False, False, "argmax"),
        pytest.param(TRUNCATED_Q, False, False, "sampled", marks=pytest.mark.slow),
        pytest.param(FULL_Q, True, False, "sampled", marks=pytest.mark.slow),
        pytest.param(FULL_Q, False, True, "sampled", marks=pytest.mark.slow),
    ],
    ids=["full-vocab", "argmax-drafts", "truncated-vocab", "combined-drafters", "prefix-cache-hits"],
)
def test_sampled_distribution_matches_plain_and_catches_a_broken_sampler(
    monkeypatch, q, combined, cached, rule
):
    model = tiny_model("llama", vocab=VOCAB, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # p neither flat nor one-hot
    prompt = [1, 2, 3, 4, 5, 6] if cached else [1, 2, 3]
    m2, m3 = exact_marginals(model, prompt)
    n = 3000
    engines: list = []
    s2, s3 = sampled_marginals(model, prompt, n, 1, q, combined, cached, engines=engines, rule=rule)
    if not combined:  # the rule was followed
        assert (engines[0].drafter.argmax_blocks > 0) == (rule == "argmax")
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()
    # sampling noise of an 8-outcome TV at n=3000 is ~0.02; 0.05 leaves a wide margin
    assert tv(s2, m2) < 0.05 and tv(s3, m3) < 0.05, (tv(s2, m2), tv(s3, m3))
    monkeypatch.setattr(verify_mod, "rejection_sample", broken_rejection_sample)
    b2, b3 = sampled_marginals(model, prompt, n, seed=2, q=q, combined=combined, cached=cached, rule=rule)
    assert max(tv(b2, m2), tv(b3, m3)) > 0.1, (tv(b2, m2), tv(b3, m3))


def test_keyed_sampled_distribution_matches_plain_and_catches_a_broken_key(monkeypatch):
    """Seeded sampled requests: each position is sampled with the uniform keyed by (seed,
    position) and a draft is kept only where it equals that sample. The marginals are the
    target's; uniforms that do not vary with the key (every request sampling alike) are caught."""
    model = tiny_model("llama", vocab=VOCAB, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # p neither flat nor one-hot
    prompt = [1, 2, 3]
    m2, m3 = exact_marginals(model, prompt)
    n = 3000
    s2, s3 = sampled_marginals(model, prompt, n, seed=1, keyed=True)
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()
    assert tv(s2, m2) < 0.05 and tv(s3, m3) < 0.05, (tv(s2, m2), tv(s3, m3))
    monkeypatch.setattr(
        verify_mod, "keyed_uniforms", lambda seed, pos: torch.full((len(pos),), 0.5, dtype=torch.float64)
    )
    b2, b3 = sampled_marginals(model, prompt, n, seed=2, keyed=True)
    assert max(tv(b2, m2), tv(b3, m3)) > 0.1, (tv(b2, m2), tv(b3, m3))


@pytest.mark.parametrize("policy", ["static:2", "static:7", "dspark"])
def test_seeded_sampled_output_is_plain_decodings_whatever_is_drafted(tmp_path, policy):
    """The same seeds give the same sampled text with or without speculation, at any
    verification length, alone or among other requests (float32: bit-exact forwards)."""
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path)
    prompts = [list(b"abcdabcdabcd"), list(range(60, 75)), list(b"xyzxyzxyz") + list(range(90, 97))]

    def outputs(drafter, verify_policy, together):
        engine = byte_engine(model, drafter, verify_policy, budget=64)
        reqs = [
            Request(f"r{i}", p, SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i), 24, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        if together:
            run(engine, reqs)
        else:
            for r in reqs:
                run(engine, [r])
        return [r.output_ids for r in reqs], sum(r.spec.rounds for r in reqs)

    want, _ = outputs(None, "none", together=False)
    dr = build_drafter("dspark+ngram", path=str(path), target_model=model)
    for together in (False, True):
        got, rounds = outputs(dr, policy, together)
        assert got == want
        assert rounds > 0  # drafts were verified


def test_greedy_combined_drafters_equal_plain_and_both_propose(tmp_path):
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path)
    dr = build_drafter("dspark+ngram", path=str(path), target_model=model)
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark", max_num_batched_tokens=32),
        max_model_len=512,
        drafter=dr,
    )
    # repeated text: prompt lookup matches; a fresh prompt: it does not at first
    prompts = [list(b"abcdabcdabcdabcd"), list(range(60, 75)), list(b"xyzxyzxyz") + list(range(90, 97))]
    reqs = [Request(f"r{i}", p, GREEDY, max_tokens=30, ignore_eos=True) for i, p in enumerate(prompts)]
    run(engine, reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(model, p, 30)
    assert dr.uses[0] > 0 and dr.uses[1] > 0, dr.uses
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


class SecondBlocks(NullMetrics):
    def __init__(self):
        self.kept = self.dropped = 0

    def record_branch(self, kept):
        self.kept += kept
        self.dropped += not kept


@pytest.mark.parametrize("branch_rows,both_ways", [(0, False), (64, False), (64, True)])
def test_greedy_branches_equal_plain_and_the_longer_run_is_kept(tmp_path, branch_rows, both_ways):
    """With room for two blocks a request verifies prompt lookup's match beside DSpark's
    block (forking its block table from the anchor) and keeps the longer accepted run: the
    output is still plain greedy decoding's, bit for bit in float32, and no block leaks."""
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path)
    dr = build_drafter("dspark+ngram", path=str(path), target_model=model)
    assert isinstance(dr, CombinedDrafter)
    dr.config = dataclasses.replace(dr.config, primary_branch=both_ways)
    seen = SecondBlocks()
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(
            verify_policy="dspark", max_num_batched_tokens=64, branch_rows=branch_rows, draft_gate=False
        ),
        max_model_len=512,
        drafter=dr,
        metrics=seen,
    )
    forks = []
    fork = engine.blocks.fork
    bs = engine.blocks.block_size
    engine.blocks.fork = lambda *a: forks.append(a[2] % bs) or fork(*a)
    # every tap row the drafter reads back (by the request's slots, after a fork was adopted
    # too) is the one the target computed for that position
    taps, kept, reads = engine.taps, {}, []
    write, rows_of = taps.write, taps.rows_of

    def spy_write(contexts, *forward):  # forward: the step's whole rows and their slots
        for c in contexts:
            for j in range(len(c.token_ids) if c.hidden is not None else 0):
                kept[(c.request_id, c.start_pos + j)] = c.hidden[j].clone()
        return write(contexts, *forward)

    def spy_rows_of(rid, start, end):
        out = rows_of(rid, start, end)
        for j in range(start, end):
            assert torch.equal(out[j - start], kept[(rid, j)]), (rid, j)
            reads.append(j)
        return out

    taps.write, taps.rows_of = spy_write, spy_rows_of
    copies = []
    copy = taps.copy_block
    taps.copy_block = lambda *a: copies.append(a) or copy(*a)
    prompts = [list(b"abcdabcdabcdabcd"), list(range(60, 75)), list(b"xyzxyzxyz") + list(range(90, 97))]
    reqs = [Request(f"r{i}", p, GREEDY, max_tokens=40, ignore_eos=True) for i, p in enumerate(prompts)]
    run(engine, reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(model, p, 40)
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not engine.verify.open_branches
    if branch_rows == 0:
        assert seen.kept == seen.dropped == 0 and not forks
    else:  # both outcomes happened, and forks inside a block (a partial block copied) too
        assert seen.kept > 0 and seen.dropped > 0, (seen.kept, seen.dropped)
        assert any(n != 0 for n in forks), forks
        assert len(copies) == sum(1 for n in forks if n)  # tap rows beside every KV copy
    assert reads  # the drafter read stored rows back


def test_drafts_no_positions_the_policy_cannot_admit():
    """With the dspark policy a request drafts at most `draft_headroom` positions past the
    budget it got last step; output is unchanged."""
    model = tiny_model("qwen3")
    prompts = {f"r{i}": list(range(30 + i, 38 + i)) for i in range(3)}
    refs = {k: hf_greedy(model, p, 20) for k, p in prompts.items()}

    class Recording(ReplayDrafter):
        def propose(self, requests):
            for r in requests:
                self.asked.setdefault(r.request_id, []).append(r.max_draft)
            return super().propose(requests)

    dr = Recording(
        {tuple(p): refs[k] for k, p in prompts.items()}, vocab_size=257, block_size=6, accept_rate=1.0
    )
    dr.asked = {}
    # every token costs a step of its own: no draft pays, not even a whole block (the step's
    # overhead left out of the price: on this tiny model it is most of a step)
    points = (1, 2, 4, 8, 16, 32, 64)
    steep = engine_mod.CostTable(points, tuple(100.0 / b for b in points))
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark", draft_gate=False, draft_headroom=1, price_overhead=False),
        max_model_len=512,
        drafter=dr,
        cost_table=steep,
    )
    reqs = [Request(k, p, GREEDY, max_tokens=20, ignore_eos=True) for k, p in prompts.items()]
    run(engine, reqs)
    for r in reqs:
        assert r.output_ids == refs[r.request_id]
    asked = [m for ms in dr.asked.values() for m in ms[1:]]
    assert asked and max(asked) <= 2 < 6, dr.asked  # budget 0-1 here, +1 headroom


def test_engine_verifies_flat_rows_without_padding_to_the_longest_block(monkeypatch):
    """Requests verifying different numbers of drafts in one step: the sampler gets exactly
    sum(K_i + 1) target rows and sum(K_i) draft rows, never requests x (max K + 1)."""
    model = tiny_model("qwen3")
    prompts = {"a": list(range(30, 38)), "b": list(range(40, 45)), "c": list(range(50, 60))}
    refs = {k: hf_greedy(model, p, 12) for k, p in prompts.items()}
    # max_tokens differ, so near their ends the requests' blocks are cut to different lengths
    limits = {"a": 12, "b": 5, "c": 9}
    dr = ReplayDrafter(
        {tuple(p): refs[k] for k, p in prompts.items()}, vocab_size=257, block_size=6, accept_rate=1.0
    )
    seen = []

    def recording(
        target_probs, draft_tokens, draft_probs, num_draft, generators=None, draft_deterministic=None
    ):
        seen.append((tuple(target_probs.shape), tuple(draft_tokens.shape), num_draft.tolist()))
        return rejection_sample(
            target_probs, draft_tokens, draft_probs, num_draft, generators, draft_deterministic
        )

    def recording_greedy(target_argmax, draft_tokens, num_draft):  # the all-greedy path
        seen.append((tuple(target_argmax.shape) + (None,), tuple(draft_tokens.shape), num_draft.tolist()))
        return greedy_verify(target_argmax, draft_tokens, num_draft)

    monkeypatch.setattr(verify_mod, "rejection_sample", recording)
    monkeypatch.setattr(verify_mod, "greedy_verify", recording_greedy)
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="static:6"),
        max_model_len=512,
        drafter=dr,
    )
    reqs = [Request(k, p, GREEDY, max_tokens=limits[k], ignore_eos=True) for k, p in prompts.items()]
    run(engine, reqs)
    for r in reqs:
        assert r.output_ids == refs[r.request_id][: limits[r.request_id]]
    uneven = [s for s in seen if len(set(s[2])) > 1]
    assert uneven, seen
    for (rows, _vocab), (drafts,), ks in seen:
        assert rows == sum(k + 1 for k in ks) and drafts == sum(ks)
    assert any(rows < len(ks) * (max(ks) + 1) for (rows, _), _, ks in uneven)
