from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_serve.drafter.base import DraftRequest
from dspark_serve.drafter.ngram import NgramConfig, lookup_continuation, lookup_match
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams


def req(tokens, max_draft=100, rid="r"):
    return DraftRequest(rid, list(tokens), 2, SamplingParams(temperature=0.0), None, max_draft)


def test_proposes_continuation_of_repeated_pattern():
    d = build_drafter("ngram", block_size=4, max_ngram=3, min_ngram=1)
    assert d.tap_layers == () and d.name == "ngram"
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 8]
    (p,) = d.propose([req(tokens)])
    # Suffix [6, 7, 8] matched at 1..3; what followed it: 9, 1, 5, 6.
    assert p.tokens.tolist() == [9, 1, 5, 6] and p.probs is None and p.tokens.dtype == torch.int64
    (p,) = d.propose([req(tokens, max_draft=2)])
    assert p.tokens.tolist() == [9, 1]
    (p,) = d.propose([req([1, 2, 3, 4])])
    assert len(p) == 0 and p.confidences.shape == (0,)


def test_longest_then_most_recent_match():
    # Suffix (3 4) occurs twice earlier: most recent wins; the 2-gram beats the 1-gram match of 4.
    tokens = np.array([3, 4, 10, 11, 4, 99, 3, 4, 20, 21, 3, 4])
    assert lookup_continuation(tokens, 2, 1, 2).tolist() == [20, 21]
    # Only a 1-gram match exists for suffix (7, 4): the last earlier 4.
    tokens = np.array([4, 1, 4, 2, 7, 4])
    assert lookup_continuation(tokens, 3, 1, 3).tolist() == [2, 7, 4]
    assert lookup_continuation(tokens, 3, 2, 3).tolist() == []  # min_ngram 2: no match
    # A self-overlapping run keeps predicting the run.
    assert lookup_continuation(np.array([1, 2, 1, 2, 1, 2]), 2, 1, 4).tolist() == [1, 2]


def _windowed_lookup(tokens, max_ngram, min_ngram, k):
    """The definition, one sliding window per suffix length, longest first."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            return tokens[int(hits[-1]) + n :][:k]
    return tokens[:0]


def test_lookup_equals_the_windowed_definition_on_random_contexts():
    rng = np.random.default_rng(3)
    for trial in range(400):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, 1 + trial % 6, n)  # small alphabets: many partial matches
        max_ngram, min_ngram, k = int(rng.integers(1, 6)), int(rng.integers(1, 3)), int(rng.integers(0, 8))
        if max_ngram < min_ngram:
            continue
        want = _windowed_lookup(tokens, max_ngram, min_ngram, k)
        assert lookup_continuation(tokens, max_ngram, min_ngram, k).tolist() == want.tolist()


def test_confidences_follow_acceptance_feedback():
    d = build_drafter("ngram", block_size=3)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    start = d.propose([req(tokens)])[0].confidences
    torch.testing.assert_close(start, torch.full((3,), 0.75))  # Beta(3, 1) prior: optimistic
    for _ in range(8):
        d.observe_acceptance("r", proposed=3, accepted=1)  # pos 0 accepted, pos 1 rejected
    c = d.propose([req(tokens, rid="other")])[0].confidences  # global across requests
    torch.testing.assert_close(c, torch.tensor([11 / 12, 3 / 12, 0.75]))  # pos 2 never tested
    d.observe_acceptance("r", proposed=2, accepted=2)
    c2 = d.propose([req(tokens)])[0].confidences
    assert c2[0] > c[0] and c2[1] > c[1] and c2[2] == c[2]
    with pytest.raises(ValueError, match="5"):
        d.observe_acceptance("r", proposed=3, accepted=5)


def test_confidences_are_kept_apart_by_the_length_of_the_suffix_matched():
    """A one-token match is a weaker sign than a four-token one: each block's confidences come
    from the outcomes of blocks found by matches of its own length."""
    d = build_drafter("ngram", block_size=3, max_ngram=4)
    long_match = [1, 2, 3, 4, 9, 1, 2, 3, 4]  # suffix [1, 2, 3, 4] seen before: 4 tokens
    short_match = [5, 6, 7, 8, 6]  # only [6] seen before: 1 token
    assert lookup_match(np.array(long_match), 4, 1, 3)[1] == 4
    assert lookup_match(np.array(short_match), 4, 1, 3)[1] == 1
    assert lookup_match(np.array([1, 2, 3]), 4, 1, 3)[1] == 0
    d.propose([req(short_match, rid="s"), req(long_match, rid="l")])
    for _ in range(6):
        d.observe_acceptance("s", proposed=3, accepted=0)  # one-token matches fail
        d.observe_acceptance("l", proposed=3, accepted=3)  # four-token ones succeed
    s, l = d.propose([req(short_match, rid="x"), req(long_match, rid="y")])
    torch.testing.assert_close(s.confidences, torch.tensor([3 / 10, 0.75, 0.75]))
    torch.testing.assert_close(l.confidences, torch.full((3,), 9 / 10))
    d.propose([req([1, 2, 3], rid="s")])  # no match: its next feedback teaches nothing
    d.observe_acceptance("s", proposed=3, accepted=0)
    assert d.trials.sum() == 6 * 1 + 6 * 3
    d.free("s")
    assert "s" not in d._matched


def test_config_validation():
    with pytest.raises(ValueError, match="0"):
        NgramConfig(block_size=0)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramConfig(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="no weights"):
        build_drafter("ngram", path="somewhere")
    assert build_drafter("ngram", block_size=None).block_size == NgramConfig().block_size
