"""The verification assembly: flat rows (sum of K_i + 1), per-request offsets, no padding."""

import pytest
import torch

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.verifier.verify import VerifyRequest, build_verify_inputs, verify

GREEDY = SamplingParams(temperature=0.0)
V = 11


def _request(k: int, probs: bool, seed: int | None = None) -> VerifyRequest:
    q = torch.softmax(torch.randn(k, V), -1) if probs else None
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return VerifyRequest(SamplingParams(temperature=1.0, seed=seed), g, torch.randint(0, V, (k,)), q)


@pytest.mark.parametrize("ks", [[7, 0, 2, 1], [0], [3], [1, 6, 0, 0, 5]])
def test_inputs_hold_exactly_sum_of_k_plus_one_rows(ks):
    torch.manual_seed(0)
    reqs = [_request(k, probs=i % 2 == 0) for i, k in enumerate(ks)]
    rows = sum(k + 1 for k in ks)
    inp = build_verify_inputs(torch.randn(rows, V), reqs)
    assert inp.target_probs.shape == (rows, V)  # not len(ks) * (max(ks) + 1)
    assert inp.draft_tokens.shape == (sum(ks),)
    assert inp.draft_probs is None or inp.draft_probs.shape == (sum(ks), V)
    assert inp.num_draft.tolist() == ks
    expect = [0]
    for k in ks:
        expect.append(expect[-1] + k + 1)
    assert inp.offsets.tolist() == expect
    # drafts concatenated in request order, each request's q in its own rows
    assert inp.draft_tokens.tolist() == [t for r in reqs for t in r.draft_tokens.tolist()]
    off = 0
    for r in reqs:
        if r.draft_probs is not None and inp.draft_probs is not None:
            assert torch.equal(inp.draft_probs[off : off + r.num_draft], r.draft_probs)
        off += r.num_draft
    # a request is deterministic (one-hot q) exactly when it brings no q
    assert inp.draft_deterministic.tolist() == [r.draft_probs is None or r.num_draft == 0 for r in reqs]
    res = verify(torch.randn(rows, V), reqs)
    assert res.output_tokens.shape == (rows,) and res.offsets.tolist() == expect


def test_rows_are_processed_with_their_own_request_parameters():
    logits = torch.randn(5, V)
    greedy = VerifyRequest(GREEDY, None, torch.tensor([3, 4]))  # rows 0..2
    hot = VerifyRequest(SamplingParams(temperature=2.0), None, torch.tensor([1]))  # rows 3..4
    inp = build_verify_inputs(logits, [greedy, hot])
    onehot = torch.zeros(3, V).scatter_(1, logits[:3].argmax(-1, keepdim=True), 1.0)
    assert torch.equal(inp.target_probs[:3], onehot)
    assert torch.allclose(inp.target_probs[3:], torch.softmax(logits[3:] / 2.0, -1), atol=1e-6)


def test_greedy_verdict_per_request():
    logits = torch.full((6, V), -5.0)
    argmax = [4, 5, 6, 7, 8, 9]
    logits[torch.arange(6), torch.tensor(argmax)] = 5.0
    reqs = [
        VerifyRequest(GREEDY, None, torch.tensor([4, 5, 0])),  # rows 0..3: two accepted
        VerifyRequest(GREEDY, None, torch.empty(0, dtype=torch.long)),  # row 4: plain
        VerifyRequest(GREEDY, None, torch.empty(0, dtype=torch.long)),
    ]  # row 5: plain
    res = verify(logits, reqs)
    assert [res.tokens(b) for b in range(3)] == [[4, 5, 6], [8], [9]]
    assert res.num_accepted.tolist() == [2, 0, 0]


def test_seeded_request_does_not_depend_on_its_neighbours():
    torch.manual_seed(1)
    mine = dict(k=3, probs=True)
    a = _request(**mine, seed=5)
    logits_a = torch.randn(4, V)

    def alone():
        r = VerifyRequest(a.sampling, torch.Generator().manual_seed(5), a.draft_tokens, a.draft_probs)
        return verify(logits_a, [r]).tokens(0)

    def among_others():
        r = VerifyRequest(a.sampling, torch.Generator().manual_seed(5), a.draft_tokens, a.draft_probs)
        others = [_request(6, probs=False), _request(0, probs=True, seed=9)]
        logits = torch.cat([torch.randn(7, V), logits_a, torch.randn(1, V)])
        return verify(logits, [others[0], r, others[1]]).tokens(1)

    assert [alone() for _ in range(10)] == [among_others() for _ in range(10)]


@pytest.mark.parametrize("kind", ["greedy", "greedy-processed", "sampled"])
def test_bf16_logits_give_the_verdict_of_their_float32_widening(kind):
    """The fast CPU forward leaves logits in bf16: greedy rows are judged by their argmax
    (ties included: bf16 rows tie often), processed and sampled rows are widened first."""
    torch.manual_seed(3)
    vocab = 50
    # few distinct values, so rows tie at the maximum and the first index must win
    logits = (torch.randint(0, 6, (9, vocab)).float() / 4).bfloat16()
    drafts = [torch.randint(0, vocab, (k,)) for k in (4, 0, 2)]
    params = {
        "greedy": GREEDY,
        "greedy-processed": SamplingParams(temperature=0.0, logit_bias=((7, 3.0), (11, -2.0))),
        "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=4),
    }[kind]

    def run(x: torch.Tensor) -> list[list[int]]:
        reqs = [VerifyRequest(params, torch.Generator().manual_seed(4 + i), d) for i, d in enumerate(drafts)]
        res = verify(x, reqs)
        return [res.tokens(b) for b in range(len(reqs))]

    assert run(logits) == run(logits.float())
    if kind == "greedy":  # the first of tied maxima, as torch's argmax of the widened rows
        first = run(logits)[1]  # the plain request: its one row is row 5
        assert first == [int(logits[5].float().argmax())]


def test_keyed_rows_emit_plain_samplings_tokens_whatever_was_drafted():
    """A keyed request's tokens are the keyed samples of its rows (plain decoding's, position
    by position) up to and including the first draft that differs, whatever its drafts, their q
    or its neighbours; the same key gives the same tokens, another key others."""
    from dspark_serve.ops.sampling import keyed_uniforms, sample_from_uniforms

    torch.manual_seed(0)
    sp = SamplingParams(temperature=1.0, seed=123)
    logits = torch.randn(5, V)
    p = torch.softmax(logits, -1)
    plain = sample_from_uniforms(p, keyed_uniforms(123, range(7, 12))).tolist()  # positions 7..11

    def tokens(drafts, q=None, neighbours=False):
        me = VerifyRequest(sp, None, torch.tensor(drafts[:4]), q, position=7)
        reqs, rows = [me], logits[: len(drafts[:4]) + 1]
        if neighbours:
            other = _request(2, probs=True)
            reqs, rows = [other, me], torch.cat([torch.randn(3, V), rows])
        return verify(rows, reqs).tokens(len(reqs) - 1)

    assert tokens(plain) == plain  # every draft equals its row's sample: all kept, then the bonus
    wrong = [(plain[0] + 1) % V] + plain[1:]
    assert tokens(wrong) == plain[:1]  # the first differs: the row's own sample, and stop
    assert tokens(plain[:2] + [(plain[2] + 1) % V, 0]) == plain[:3]
    q = torch.softmax(torch.randn(4, V), -1)
    assert tokens(plain, q) == plain and tokens(wrong, q, neighbours=True) == plain[:1]
    assert tokens([]) == plain[:1]  # a plain step samples the same token
    other = VerifyRequest(
        SamplingParams(temperature=1.0, seed=124), None, torch.empty(0, dtype=torch.long), position=7
    )
    firsts = {verify(logits[i : i + 1], [other]).tokens(0)[0] for i in range(5)}
    assert len(firsts) > 1 or firsts != {plain[0]}


def test_logits_rows_must_match_the_blocks():
    reqs = [VerifyRequest(GREEDY, None, torch.tensor([1, 2]))]
    with pytest.raises(ValueError, match=r"sum\(K_i \+ 1\) = 3"):
        build_verify_inputs(torch.randn(4, V), reqs)


def test_greedy_rows_under_a_grammar_verify_as_with_every_row_masked():
    """Greedy verification applies a grammar only where the argmax needs it (`grammar_argmax`):
    the verdicts equal those of masking every row first, over logits that often prefer tokens
    the grammar forbids (drafts valid, invalid, with EOS; grammars committed or not)."""
    import json

    from dspark_serve.ops.cpu_kernels import argmax_rows
    from dspark_serve.ops.processors import GuardedConstraint, TokenContext
    from dspark_serve.verifier.rejection import greedy_verify
    from dspark_serve.verifier.verify import _draft_counts, _flat_drafts, process_rows
    from tests.verifier.test_grammar import EOS, byte_compiler

    c = byte_compiler()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    texts = [b'{"n":1', b'{"n"', b"{", b'{"n":42}', b'{"x', b"", b'{"n":7}']
    for trial in range(30):
        reqs = []
        for i in range(4):
            grammar = c.compile("json_schema", schema)
            committed = texts[(trial + i) % len(texts)][: (trial % 3)]
            grammar.commit(list(committed))
            k = (trial + i) % 5
            drafts = list(texts[(trial * 3 + i) % len(texts)])[:k]
            if trial % 7 == 0 and drafts:
                drafts[-1] = EOS
            ctx = TokenContext((), list(committed), GuardedConstraint(grammar))
            reqs.append(VerifyRequest(greedy, None, torch.tensor(drafts, dtype=torch.long), context=ctx))
        rows = sum(r.num_draft + 1 for r in reqs)
        logits = torch.randn(rows, 257, generator=g)
        favourite = torch.randint(0, 257, (rows,), generator=g)
        logits[torch.arange(rows), favourite] += 8.0  # a clear argmax, often one the grammar forbids
        got = verify(logits, reqs)
        eager = process_rows(logits, reqs)  # every row masked
        want = greedy_verify(
            argmax_rows(eager.logits), _flat_drafts(reqs), torch.tensor(_draft_counts(logits, reqs))
        )
        assert torch.equal(got.num_accepted, want.num_accepted), trial
        assert torch.equal(got.output_tokens, want.output_tokens), trial
        assert not got.faults and not eager.faults
        for r in reqs:  # every matcher is back where it was
            assert r.context.constraint.error is None


def test_a_forbidden_argmax_is_the_argmax_over_what_the_grammar_allows():
    """`_allowed_argmax`: where the grammar forbids a verified row's argmax, the answer is the
    argmax over the tokens it allows, first index on ties (the masked argmax's rule, as plain
    decoding applies it), for float32 and bf16 rows; a row whose allowed entries are all -inf,
    or whose allowed maximum is NaN, fails (its request fails alone); the grammar's committed
    state is unchanged."""
    import json

    import pytest

    from dspark_serve.verifier.verify import _allowed_argmax
    from tests.verifier.test_grammar import byte_compiler

    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    grammar = byte_compiler().compile("json_schema", schema)
    grammar.commit(list(b'{"n":'))  # a digit or '-' comes next
    before = grammar.allowed_after([], 257)
    for dtype in (torch.float32, torch.bfloat16):
        row = torch.zeros(257)
        row[ord("x")], row[ord("7")], row[ord("3")] = 9.0, 8.0, 7.0
        assert _allowed_argmax(row.to(dtype), grammar) == ord("7")
        row[ord("3")] = 8.0  # tied with '7': the first index
        assert _allowed_argmax(row.to(dtype), grammar) == ord("3")
        row[ord("-")] = 8.5  # '-' may start a number too
        assert _allowed_argmax(row.to(dtype), grammar) == ord("-")
    row = torch.full((257,), float("-inf"))
    row[ord("x")] = 1.0
    with pytest.raises(RuntimeError, match="no token is allowed"):
        _allowed_argmax(row, grammar)
    row[ord("5")] = float("nan")
    with pytest.raises(RuntimeError, match="no token is allowed"):
        _allowed_argmax(row, grammar)
    assert torch.equal(grammar.allowed_after([], 257), before)


def test_unusable_rows_are_named_as_by_scanning_every_entry():
    """A request's processed rows are refused for a NaN anywhere or a first row with no finite
    entry, read from the rows' maxima: the same verdicts as scanning every entry (NaN in a
    later row, a first row all -inf, +inf beside finite entries, +inf beside -inf only)."""
    from dspark_serve.verifier.verify import _unusable

    def scanned(rows):
        if torch.isnan(rows).any():
            return "processing the logits produced NaN"
        if not torch.isfinite(rows[0]).any():
            return "no token is allowed at the next position"
        return None

    inf = float("inf")
    cases = []
    for edit in range(6):
        rows = torch.randn(3, 300)
        if edit == 1:
            rows[2, 17] = float("nan")
        elif edit == 2:
            rows[0] = -inf
        elif edit == 3:
            rows[0, :5] = inf
        elif edit == 4:
            rows[0] = -inf
            rows[0, 9] = inf
        elif edit == 5:
            rows[0] = -inf
            rows[1, 3] = float("nan")
        cases.append(rows)
    verdicts = [_unusable(r) for r in cases]
    assert verdicts == [scanned(r) for r in cases]
    assert verdicts[0] is None and verdicts[3] is None and verdicts[2] == verdicts[4] != None  # noqa: E711
    assert "NaN" in verdicts[1] and "NaN" in verdicts[5]
