"""Position-dependent logits processing: each row of a verified block sees exactly the tokens
before it (the request's output plus the block's earlier drafts)."""

from __future__ import annotations

import pytest
import torch

from dspark_serve.ops.processors import TokenContext, process_block, process_next
from dspark_serve.ops.sampling import SamplingTensors, probs_from_logits
from dspark_serve.ops.sampling_params import SamplingParams


def naive(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], history: list[int]) -> torch.Tensor:
    """One position, written out token by token (the definition the batched code must match)."""
    out = logits.clone().float()
    for t, b in sp.logit_bias:
        out[t] += b
    for t in set(prompt) | set(history):
        if sp.repetition_penalty != 1.0:
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    for t in set(history):
        out[t] -= sp.frequency_penalty * history.count(t) + sp.presence_penalty
    return out


SP = SamplingParams(
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.6,
    logit_bias=((3, 5.0), (9, -100.0)),
)


@pytest.mark.parametrize(
    "sp", [SP, SamplingParams(frequency_penalty=-1.5), SamplingParams(logit_bias=((0, 2.0),))]
)
def test_every_row_sees_the_drafts_before_it(sp):
    torch.manual_seed(0)
    vocab, prompt, output, drafts = 16, [1, 2, 2], [4, 5, 4], [4, 7, 4, 1]
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    got = process_block(logits, sp, TokenContext(prompt, output), drafts)
    for k in range(len(drafts) + 1):
        want = naive(logits[k], sp, prompt, output + drafts[:k])
        torch.testing.assert_close(got[k], want)
        # a drafter's next position after drafts[:k]: the same processing
        nxt = process_next(logits[k : k + 1], sp, TokenContext(prompt, output), drafts[:k])[0]
        torch.testing.assert_close(nxt, want)
    # penalties really changed something (the test could fail)
    assert not torch.allclose(got, logits)


def test_min_p_drops_tokens_below_the_fraction_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    st = SamplingTensors.from_params([SamplingParams(min_p=0.25)])
    p = probs_from_logits(logits, st.temperature, st.top_p, st.top_k, st.min_p)
    want = torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95  # 0.05 < 0.25 * 0.5 <= 0.15
    torch.testing.assert_close(p, want)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, 101.0),)},
    ],
)
def test_out_of_range_parameters_are_refused_with_the_value(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))).strip("()").split(",")[0] in str(e.value)


def test_a_greedy_drafters_row_under_a_grammar_has_the_masked_argmax():
    """process_next applies a greedy row's grammar only where it forbids the argmax: the argmax
    is always the fully masked row's, and the mask is computed only where it was needed."""
    import json

    from tests.verifier.test_grammar import byte_compiler

    c = byte_compiler()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0)
    masks = {"lazy": 0, "forbidden": 0}
    for trial in range(40):
        grammar = c.compile("json_schema", schema)
        drafted = list(b'{"n":1')[: trial % 7]
        row = torch.randn(1, 257, generator=g)
        row[0, int(torch.randint(0, 257, (1,), generator=g))] += 6.0
        counting = CountingConstraint(grammar)
        got = process_next(row, greedy, TokenContext((), (), counting), drafted)
        full = row.masked_fill(~grammar.allowed_after(drafted, 257), float("-inf"))
        assert int(got.argmax()) == int(full.argmax()), trial
        forbidden = not bool(grammar.allowed_after(drafted, 257)[int(row.argmax())])
        masks["forbidden"] += forbidden
        masks["lazy"] += counting.masks
        assert counting.masks == int(forbidden)  # a mask only where the argmax was forbidden
    assert 0 < masks["forbidden"] < 40  # both cases happened


class CountingConstraint:
    """A constraint that counts the vocabulary masks it was asked for."""

    def __init__(self, inner) -> None:
        self.inner, self.masks = inner, 0

    def allowed(self, drafts, vocab_size):
        self.masks += len(drafts) + 1
        return self.inner.allowed(drafts, vocab_size)

    def allowed_after(self, drafts, vocab_size):
        self.masks += 1
        return self.inner.allowed_after(drafts, vocab_size)

    def valid_prefix(self, drafts):
        return self.inner.valid_prefix(drafts)

    def commit(self, tokens):
        self.inner.commit(tokens)


def test_top_entries_of_a_wide_row_are_torchs_topk():
    """The block-maxima top-k of a vocabulary-wide row: torch's topk values in order, indices
    pointing at them (among equal values in any order), on rows with ties, -inf stretches and
    the best entries packed into one block; narrow rows go to torch itself."""
    from dspark_serve.ops.processors import TOP_BLOCK, top_entries

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        row = torch.randn(64 * TOP_BLOCK * 2, generator=g)
        if trial % 3 == 0:
            row[torch.randint(0, row.numel(), (12,), generator=g)] = 4.0  # ties at the top
        if trial % 4 == 0:
            row[: row.numel() - 100] = float("-inf")
        if trial % 5 == 0:
            row[128:134] = 9.0 + torch.arange(6.0)  # the best all in one block
        k = 1 + trial % 6
        want, got = row.topk(k), top_entries(row, k)
        assert torch.equal(got.values, want.values), trial
        assert torch.equal(row[got.indices], got.values) and len(set(got.indices.tolist())) == k, trial
    narrow = torch.randn(7696, generator=g)  # not a multiple of the block: torch's topk
    assert torch.equal(top_entries(narrow, 4).indices, narrow.topk(4).indices)


def test_history_penalties_on_the_seen_columns_equal_the_whole_vocabularys():
    """The penalties computed on the columns of the tokens seen only: the same bits as over the
    whole vocabulary (the counts, the repetition penalty's prompt, each row's drafts), for every
    mix of penalties, with repeated, out-of-range and -inf entries."""
    from dspark_serve.ops.processors import TokenContext, _ids, process_block

    def dense(logits, sp, ctx, drafts):  # the rule over every column
        n, vocab = logits.shape
        out = logits.float().clone()
        base = torch.bincount(_ids(ctx.output_ids, vocab, out.device), minlength=vocab)[:vocab].float()
        counts = base.unsqueeze(0).repeat(n, 1)
        if n > 1:
            onehot = torch.nn.functional.one_hot(_ids(drafts[: n - 1], vocab, out.device), vocab)
            counts[1:] += onehot.float().cumsum(0)
        if sp.repetition_penalty != 1.0:
            seen = counts > 0
            if len(ctx.prompt_ids):
                prompt = torch.zeros(vocab, dtype=torch.bool)
                prompt[_ids(ctx.prompt_ids, vocab, out.device)] = True
                seen = seen | prompt
            rp = sp.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
        if sp.frequency_penalty:
            out = out - sp.frequency_penalty * counts
        if sp.presence_penalty:
            out = out - sp.presence_penalty * (counts > 0).float()
        return out

    g = torch.Generator().manual_seed(0)
    mixes = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.7},
        {"presence_penalty": -0.4},
        {"repetition_penalty": 0.8, "frequency_penalty": 0.3, "presence_penalty": 0.5},
    ]
    for trial in range(24):
        vocab, n = 97, 1 + trial % 4
        sp = SamplingParams(temperature=0.0, **mixes[trial % 4])
        logits = torch.randn(n, vocab, generator=g) * 3
        logits[:, 5] = float("-inf")
        out_ids = torch.randint(0, vocab + 3, (trial % 9,), generator=g).tolist()  # some past vocab
        prompt = torch.randint(0, vocab, (trial % 5,), generator=g).tolist()
        drafts = torch.randint(0, vocab, (n - 1,), generator=g).tolist()
        ctx = TokenContext(prompt, out_ids)
        got = process_block(logits, sp, ctx, drafts)
        assert torch.equal(got, dense(logits, sp, ctx, drafts)), trial
