"""A truncated draft vocabulary (d2t map): the draft head and Markov head cover only the kept
target ids, q is a proper distribution over them, and verification stays lossless."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_serve.drafter.base import DraftRequest
from dspark_serve.drafter.dspark_model import DSparkConfig, load_dspark, save_dspark
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.training.cache import CachedSequence
from dspark_serve.training.loss import LossConfig, dspark_loss
from dspark_serve.training.train import build_draft_model, draft_vocabulary, vocabulary_coverage
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model
from tests.kv_tables import Tables
from tests.scheduler.test_speculative import run

KEPT = torch.tensor(sorted({*range(30, 120), 255, 7, 200}))


def truncated_dspark(target, path, markov_rank=8):
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
    cfg = cfg.replace(draft_vocab_size=KEPT.numel())
    torch.manual_seed(3)
    m = build_draft_model(cfg, target, init_from_target=True, d2t=KEPT)
    with torch.no_grad():
        if m.markov_head is not None:
            m.markov_head.markov_w2.weight.normal_(0, 0.5)
    save_dspark(m, str(path))
    return m


def test_checkpoint_round_trip_keeps_the_map_and_cuts_the_shared_head(tmp_path):
    target = tiny_model("qwen3")
    truncated_dspark(target, tmp_path)
    m = load_dspark(str(tmp_path), target.get_input_embeddings(), target.get_output_embeddings())
    assert m.config.draft_vocab_size == KEPT.numel() and torch.equal(m.d2t, KEPT)
    assert torch.equal(m.lm_head.weight, target.lm_head.weight[KEPT])
    assert m.markov_head.markov_w2.weight.shape == (KEPT.numel(), 8)
    # a config that claims a truncated vocabulary without the map is refused
    cfg = m.config.to_json_dict()
    import json

    from safetensors.torch import load_file, save_file

    state = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items() if k != "d2t"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_dspark(str(tmp_path), target.get_input_embeddings(), target.get_output_embeddings())
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == KEPT.numel()
    assert cfg["draft_vocab_size"] == KEPT.numel()


def test_sampled_drafts_lie_in_the_kept_ids_and_q_is_a_distribution_over_them(tmp_path):
    target = tiny_model("qwen3")
    truncated_dspark(target, tmp_path)
    dr = build_drafter("dspark", path=str(tmp_path), target_model=target)
    from dspark_serve.drafter.base import AcceptedContext

    runner = runner_for(target)
    prompt = list(range(40, 52))
    Tables.of(runner).blocks.append("a", len(prompt))
    fwd = runner.forward([Tables.of(runner).segment("a", prompt, 0, len(prompt) - 1)], dr.tap_layers)
    dr.observe([AcceptedContext("a", prompt[:-1], 0, fwd.hidden[:-1])])
    gen = torch.Generator().manual_seed(0)
    req = DraftRequest("a", prompt, 0, SamplingParams(temperature=1.0), gen, 5)
    kept = set(KEPT.tolist())
    for _ in range(20):
        p = dr.propose([req])[0]
        assert set(p.tokens.tolist()) <= kept
        assert p.probs.shape == (5, target.config.vocab_size)
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(5))
        off = torch.ones(target.config.vocab_size, dtype=torch.bool)
        off[KEPT] = False
        assert float(p.probs[:, off].abs().max()) == 0.0
        assert bool((p.probs[torch.arange(5), p.tokens] > 0).all())


@pytest.mark.parametrize("policy", ["static:5", "dspark"])
def test_greedy_with_truncated_vocabulary_equals_plain(tmp_path, policy):
    target = tiny_model("qwen3")
    truncated_dspark(target, tmp_path)
    dr = build_drafter("dspark", path=str(tmp_path), target_model=target)
    engine = Engine(
        runner_for(target),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=16),
        max_model_len=512,
        drafter=dr,
    )
    prompts = [list(range(40, 40 + n)) for n in (3, 25, 11)]
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=20, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    run(engine, reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(target, p, 20)
    assert sum(r.spec.drafted for r in reqs) > 0


def test_loss_over_kept_ids_equals_full_vocabulary_loss_with_zero_mass_elsewhere():
    torch.manual_seed(0)
    V, kept = 12, torch.tensor([1, 4, 5, 9])
    draft = torch.randn(2, 3, 4, kept.numel())
    target = torch.randn(2, 3, 4, V)
    labels = torch.tensor([1, 4, 2, 9]).repeat(2, 3, 1)  # label 2 lies outside the kept ids
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    conf = torch.randn(2, 3, 4)
    got = dspark_loss(draft, target, labels, mask, conf, LossConfig(ce_alpha=0.0), d2t=kept)
    full = torch.full((2, 3, 4, V), -math.inf)
    full[..., kept] = draft
    ref = dspark_loss(full, target, labels, mask, conf, LossConfig(ce_alpha=0.0))
    torch.testing.assert_close(got.l1, ref.l1)
    torch.testing.assert_close(got.confidence, ref.confidence)
    torch.testing.assert_close(got.accept_rate, ref.accept_rate)
    # CE: only labels with a draft id count (position 3, label 2, is left out)
    ce = dspark_loss(draft, target, labels, mask, conf, LossConfig(), d2t=kept).ce
    logq = draft.log_softmax(-1)
    cols = torch.tensor([0, 1, 3])  # draft ids of labels 1, 4, 9
    w = torch.exp(-torch.tensor([0.0, 1.0, 3.0]) / 4)
    expect = -(logq[..., [0, 1, 3], cols] * w).sum() / (w.sum() * 6)
    torch.testing.assert_close(ce, expect)


def test_draft_vocabulary_keeps_the_most_written_ids():
    seqs = [
        CachedSequence(torch.tensor([99, 99, 5, 5, 5, 6, 7, 7]), 2, torch.zeros(7, 1), torch.zeros(7, 1)),
        CachedSequence(torch.tensor([1, 7, 8, 5]), 1, torch.zeros(3, 1), torch.zeros(3, 1)),
    ]
    d2t = draft_vocabulary(seqs, 3, always=[42])
    assert d2t.tolist() == [5, 7, 42]  # 5 (x4) and 7 (x3) are written most; 99 is prompt
    assert vocabulary_coverage(seqs, d2t) == pytest.approx(7 / 9)


def test_a_greedy_row_under_a_grammar_is_masked_in_the_draft_vocabulary(tmp_path):
    """A truncated drafter's greedy, constrained row (`sample_block`'s shape) has the argmax of
    widening it to the target's vocabulary, `process_next` there and gathering back (the
    general path): unchanged where the grammar allows its argmax, the forbidden best tokens
    dropped where one of the next few is allowed, else masked through d2t (the only case that
    asks the grammar for a mask); a grammar allowing no kept id leaves the row as it was."""
    import json

    from dspark_serve.ops.processors import TokenContext, process_next
    from tests.ops.test_processors import CountingConstraint
    from tests.verifier.test_grammar import byte_compiler

    m = truncated_dspark(tiny_model("qwen3"), tmp_path)
    c = byte_compiler()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = torch.Generator().manual_seed(0)
    asked = forbidden = 0
    for trial in range(30):
        grammar = CountingConstraint(c.compile("json_schema", json.dumps(schema)))
        drafted = [ord(ch) for ch in '{"a": 1'[: trial % 7]]
        row = torch.randn(KEPT.numel(), generator=g) * 3
        got = m._greedy_under(grammar, row, drafted)
        asked += grammar.masks  # before the general path below asks for its own
        greedy = SamplingParams(temperature=0.0)
        wide = m.to_target_logits(row).unsqueeze(0)
        full = process_next(wide, greedy, TokenContext((), (), grammar), drafted)[0]
        want = full[KEPT]
        want = want if bool(torch.isfinite(want).any()) else row
        assert int(got.argmax()) == int(want.argmax()), trial
        assert torch.isfinite(got).sum() >= torch.isfinite(want).sum()  # at most a few dropped
        forbidden += int(not torch.equal(got, row))
    assert 0 < forbidden < 30 and asked > 0
    # after '{"a":' a digit or '-' comes: a forbidden best token with an allowed second best
    # costs no mask
    drafted = list(b'{"a":')
    row = torch.zeros(KEPT.numel())
    at = {t: i for i, t in enumerate(KEPT.tolist())}
    row[at[ord("q")]], row[at[ord("7")]], row[at[ord("3")]] = 5.0, 4.0, 3.0
    grammar = CountingConstraint(c.compile("json_schema", json.dumps(schema)))
    got = m._greedy_under(grammar, row, drafted)
    assert int(KEPT[got.argmax()]) == ord("7") and grammar.masks == 0
    assert torch.isfinite(got).sum() == KEPT.numel() - 1  # only the forbidden best dropped

    class OnlyUnkept:  # a grammar allowing one id the draft vocabulary dropped
        def valid_prefix(self, drafts):
            return 0

        def allowed_after(self, drafts, vocab_size):
            return torch.arange(vocab_size) == 250

    row = torch.randn(KEPT.numel(), generator=g)
    assert 250 not in KEPT.tolist() and torch.equal(m._greedy_under(OnlyUnkept(), row, []), row)


def test_a_greedy_row_under_a_grammar_follows_it_along_the_draft(tmp_path):
    """Greedy, unpenalized rows whose grammar offers a cursor (llguidance's) take each position's
    token from the grammar's state after the row's own drafts (a one-token check, and where it
    refuses, the argmax over the mask's allowed entries read through d2t): the same blocks as
    the path that asks the grammar for masks over the whole drafted prefix (`_greedy_under`),
    in a batch with a sampled constrained row and an unconstrained one; every grammar's
    committed state is as before. A grammar failing inside the walk fails its own request only
    (its guard records it); the other rows draft as before."""
    import json

    from dspark_serve.ops.processors import GuardedConstraint, TokenContext
    from tests.ops.test_processors import CountingConstraint
    from tests.verifier.test_grammar import byte_compiler

    m = truncated_dspark(tiny_model("qwen3"), tmp_path)
    c = byte_compiler()
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}},
            "required": ["a", "b"],
            "additionalProperties": False,
        }
    )
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)
    sampling = [greedy, greedy, hot, greedy, greedy]
    gen = torch.Generator().manual_seed(1)
    json_ids = torch.tensor([KEPT.tolist().index(ord(ch)) for ch in '":,ab0123456789 '])

    def grammars(prefix: str) -> list:
        out = []
        for _ in range(4):
            g = c.compile("json_schema", schema)
            g.commit(list(prefix.encode()))
            out.append(g)
        return out

    def contexts(gs: list, wrap) -> list:
        ctx = [TokenContext((), (), GuardedConstraint(wrap(g))) for g in gs]
        return [ctx[0], ctx[1], ctx[2], None, ctx[3]]  # row 3 unconstrained

    refused = 0
    for trial in range(16):
        prefix = '{"a":12,"b":"x'[: trial % 14]
        base = torch.randn(5, 5, KEPT.numel(), generator=gen)
        base[..., json_ids] += 2.0  # JSON's characters likely, others often best anyway
        anchors = torch.tensor([ord("{")] * 5)
        followed, asked = grammars(prefix), grammars(prefix)
        want = m.sample_block(
            base,
            anchors,
            sampling,
            [None, None, torch.Generator().manual_seed(trial), None, None],
            contexts=contexts(asked, CountingConstraint),
        )
        got = m.sample_block(
            base,
            anchors,
            sampling,
            [None, None, torch.Generator().manual_seed(trial), None, None],
            contexts=contexts(followed, lambda g: g),
        )
        assert torch.equal(got.tokens, want.tokens), trial
        assert torch.equal(got.prev_tokens, want.prev_tokens) and torch.equal(got.probs, want.probs)
        free = m.sample_block(base, anchors, [greedy] * 5, [None] * 5)
        refused += int((free.tokens[[0, 1, 4]] != want.tokens[[0, 1, 4]]).any())
        for g, fresh in zip(followed, grammars(prefix)):  # the committed state as before
            assert torch.equal(g.allowed_after([], 257), fresh.allowed_after([], 257))
    assert refused > 4  # the grammar changed greedy rows' drafts in many trials

    class Exploding:  # a grammar whose mask fails inside the walk
        def __init__(self, g) -> None:
            self.g = g

        def __getattr__(self, name):
            return getattr(self.g, name)

        def cursor(self):
            cursor = self.g.cursor()

            def boom(bits):
                raise RuntimeError("out of fuel")

            cursor.fill = boom
            return cursor

    base = torch.randn(5, 5, KEPT.numel(), generator=gen)
    base[0, :, KEPT.tolist().index(ord("q"))] = 50.0  # row 0's best is always forbidden
    gs, ref = grammars('{"a":'), grammars('{"a":')
    ctx = contexts(gs, lambda g: g)
    ctx[0] = TokenContext((), (), GuardedConstraint(Exploding(gs[0])))
    gens = [None, None, torch.Generator().manual_seed(9), None, None]
    got = m.sample_block(base, anchors, sampling, gens, contexts=ctx)
    want = m.sample_block(
        base,
        anchors,
        sampling,
        [None, None, torch.Generator().manual_seed(9), None, None],
        contexts=contexts(ref, lambda g: g),
    )
    assert ctx[0].constraint.error == "out of fuel" and ctx[1].constraint.error is None
    assert torch.equal(got.tokens[1:], want.tokens[1:])
    assert got.tokens[0, 0] == ord("q")  # the failed row keeps its argmax
    assert torch.equal(gs[0].allowed_after([], 257), ref[0].allowed_after([], 257))  # rolled back
