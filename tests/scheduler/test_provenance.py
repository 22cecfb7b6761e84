"""Per-token provenance from the engine: accepted drafts with their position, the target's
correction at a rejection, the bonus token after a fully accepted block, plain tokens."""

from __future__ import annotations

import pytest

from bench.replay import ReplayDrafter
from dspark_serve.scheduler.client import TokenRecord, round_provenance
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model
from tests.scheduler.test_speculative import GREEDY


def test_round_provenance():
    assert round_provenance(0, 0) == [("plain", None)]
    assert round_provenance(0, 3) == [("correction", None)]
    assert round_provenance(2, 4) == [("draft", 0), ("draft", 1), ("correction", None)]
    assert round_provenance(3, 3) == [("draft", 0), ("draft", 1), ("draft", 2), ("bonus", None)]
    with pytest.raises(ValueError, match="5"):
        round_provenance(5, 4)
    with pytest.raises(ValueError, match="'guess'"):
        TokenRecord(1, "a", "guess")
    with pytest.raises(ValueError, match="draft_position"):
        TokenRecord(1, "a", "draft")


def generate(noise: float, drafter=True):
    model = tiny_model("qwen3")
    prompts = {f"r{i}": list(range(40 + i, 40 + i + n)) for i, n in enumerate((5, 17))}
    refs = {k: hf_greedy(model, p, 30) for k, p in prompts.items()}
    # the true greedy continuation, each position corrupted with probability `noise`
    dr = (
        ReplayDrafter(
            {tuple(p): refs[k] for k, p in prompts.items()},
            vocab_size=257,
            block_size=4,
            accept_rate=1.0 - noise,
        )
        if drafter
        else None
    )
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="static:4"),
        max_model_len=512,
        drafter=dr,
    )
    reqs = [Request(k, p, GREEDY, max_tokens=24, ignore_eos=True) for k, p in prompts.items()]
    for r in reqs:
        engine.add_request(r)
    records: dict[str, list[TokenRecord]] = {r.request_id: [] for r in reqs}
    texts = {r.request_id: "" for r in reqs}
    while engine.has_work():
        for out in engine.step():
            assert [t.token_id for t in out.tokens] == out.token_ids
            records[out.request_id] += out.tokens
            texts[out.request_id] += out.text
    return reqs, records, texts


def rounds_of(recs: list[TokenRecord]) -> list[list[TokenRecord]]:
    """Split a request's records into rounds: drafts at positions 0, 1, ... then one
    non-draft token (the last round may be cut short by max_tokens)."""
    out, cur = [], []
    for t in recs:
        cur.append(t)
        if t.kind == "draft":
            assert t.draft_position == len(cur) - 1, [(x.kind, x.draft_position) for x in cur]
        else:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def test_records_follow_the_verification_rounds():
    reqs, records, texts = generate(noise=0.3)
    kinds = set()
    for r in reqs:
        recs = records[r.request_id]
        assert [t.token_id for t in recs] == r.output_ids
        # the pieces add up to the returned text (no stop strings here)
        assert "".join(t.text for t in recs) == texts[r.request_id]
        assert recs[0].kind == "plain"  # the first token comes from prefill
        rounds = rounds_of(recs[1:])
        ended = [x for x in rounds if x[-1].kind != "draft"]
        assert sum(1 for x in ended if x[-1].kind in ("correction", "bonus")) <= r.spec.rounds
        drafts = sum(t.kind == "draft" for t in recs)
        assert r.spec.accepted - 4 <= drafts <= r.spec.accepted  # all but a cut last round
        for x in ended:
            if x[-1].kind == "bonus":
                assert 1 <= len(x) <= 5  # static:4: at most 4 accepted drafts, then the bonus
        kinds |= {t.kind for t in recs}
    assert kinds == {"plain", "draft", "correction", "bonus"}


def test_perfect_drafts_end_in_bonus_and_wrong_drafts_in_corrections():
    reqs, records, texts = generate(noise=0.0)
    for r in reqs:
        tail = [x[-1].kind for x in rounds_of(records[r.request_id][1:]) if x[-1].kind != "draft"]
        assert tail and set(tail) == {"bonus"}
    reqs, records, texts = generate(noise=1.0)
    for r in reqs:
        recs = records[r.request_id]
        later = {t.kind for t in recs[1:]}  # plain where no draft was verified (the last token)
        assert recs[0].kind == "plain" and "correction" in later and later <= {"correction", "plain"}


def test_without_a_drafter_every_token_is_plain():
    reqs, records, texts = generate(noise=0.0, drafter=False)
    for r in reqs:
        assert len(records[r.request_id]) == 24
        assert {t.kind for t in records[r.request_id]} == {"plain"}
