"""No request can hurt another inside the engine: everything a request brings is checked when it
is added; a request found bad before a step changes any state is failed alone; a step that fails
later fails only its batch, cleanly (KV freed), and everyone else's output is unchanged."""

import pytest
import torch
from prometheus_client import CollectorRegistry

from dspark_serve.drafter.ngram import NgramConfig, NgramDrafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine, RequestRejected
from dspark_serve.scheduler.metrics import EngineMetrics
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, runner_for, tiny_model

GREEDY = SamplingParams(temperature=0.0)


def make_engine(model=None, metrics=None, drafter=None, draft_gate=True, draft_rule="argmax"):
    return Engine(
        runner_for(model or tiny_model("llama"), num_blocks=256),
        ByteTokenizer(),
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            verify_policy="static:3" if drafter else "none",
            draft_gate=draft_gate,
            draft_rule=draft_rule,
        ),
        max_model_len=512,
        drafter=drafter,
        metrics=metrics,
    )


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 23, 41)]


def run(engine, reqs, inject=None):
    """Add reqs, step to the end; inject(step) may tamper before a step. Returns outputs by id."""
    for r in reqs:
        engine.add_request(r)
    outs: dict[str, list] = {}
    step = 0
    while engine.has_work():
        if inject is not None:
            inject(step)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 1000
    return outs


def fresh(ps, n=16):
    return [Request(f"r{i}", list(p), GREEDY, n, ignore_eos=True) for i, p in enumerate(ps)]


def assert_all_blocks_free(engine):
    b = engine.blocks
    assert b.num_free_blocks == b.num_blocks and engine.scheduler.reserved_blocks == 0
    assert not engine.running and not engine.waiting and not engine.requests


@pytest.mark.parametrize(
    "bad,param",
    [([-1], "prompt"), ([257], "prompt"), ([1, 10**12], "prompt"), ([1, 2.0], "prompt"), ([True], "prompt")],
)
def test_add_request_rejects_out_of_range_or_odd_token_ids(bad, param):
    engine = make_engine()
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("x", bad, GREEDY, 4))
    assert e.value.status == 400 and e.value.param == param
    assert not engine.waiting and not engine.requests


def test_add_request_rejects_duplicates_and_bad_lengths():
    engine = make_engine()
    engine.add_request(Request("x", [1, 2], GREEDY, 4))
    with pytest.raises(RequestRejected):
        engine.add_request(Request("x", [1, 2], GREEDY, 4))
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("y", [1, 2], GREEDY, 0))
    assert e.value.param == "max_tokens"
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


@pytest.mark.parametrize("speculate", [False, True])
def test_a_request_gone_bad_fails_alone(speculate):
    ps = prompts()
    model = tiny_model("llama")
    alone = run(
        make_engine(model, drafter=NgramDrafter(NgramConfig(block_size=3)) if speculate else None), fresh(ps)
    )
    engine = make_engine(model, drafter=NgramDrafter(NgramConfig(block_size=3)) if speculate else None)
    evil = Request("evil", [5] * 30, GREEDY, 16, ignore_eos=True)

    def tamper(step):  # corrupt a queued prompt after admission checks: caught before the step
        if step == 0:
            evil.prompt_ids[-1] = 10**9

    outs = run(engine, fresh(ps) + [evil], tamper)
    assert outs["evil"][-1].error and outs["evil"][-1].finish_reason == "error"
    for rid, o in alone.items():
        assert [t for x in outs[rid] for t in x.token_ids] == [t for x in o for t in x.token_ids], rid
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].error is None
    assert_all_blocks_free(engine)


def test_a_failing_step_fails_its_batch_cleanly_and_the_engine_goes_on():
    ps = prompts()
    model = tiny_model("llama")
    alone = run(make_engine(model), fresh(ps[:1]))
    engine = make_engine(model)
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return real(*a, **k)

    engine.runner.forward = flaky
    outs = run(engine, fresh(ps[1:]))
    assert all(o[-1].finish_reason == "error" and o[-1].error for o in outs.values())
    assert_all_blocks_free(engine)
    after = run(engine, fresh(ps[:1]))  # the engine still serves, with identical output
    assert [t for x in after["r0"] for t in x.token_ids] == [t for x in alone["r0"] for t in x.token_ids]
    assert_all_blocks_free(engine)


def test_metrics_drop_aborted_requests_and_export_spec_counters_from_the_start():
    reg = CollectorRegistry()
    metrics = EngineMetrics(reg, "m")
    labels = {"model_name": "m"}
    assert reg.get_sample_value("dspark:spec_decode_num_drafts_total", labels) == 0.0
    assert reg.get_sample_value("dspark:spec_decode_num_accepted_tokens_total", labels) == 0.0
    engine = make_engine(metrics=metrics)
    engine.add_request(Request("a", [1, 2, 3], GREEDY, 50, ignore_eos=True))
    engine.step()
    engine.step()
    assert reg.get_sample_value("dspark:num_requests_running", labels) == 1.0
    assert reg.get_sample_value("dspark:kv_cache_usage_perc", labels) > 0
    engine.abort("a")  # the last request: no step follows
    assert reg.get_sample_value("dspark:num_requests_running", labels) == 0.0
    assert reg.get_sample_value("dspark:kv_cache_usage_perc", labels) == 0.0


class FailingConstraint:
    """A grammar that allows every token until its `where` method's `after`-th call, which
    raises (as llguidance does when a schema that compiled hits a limit inside a step);
    "shape" answers masks of the wrong shape, "dead_end" allows no token at all."""

    def __init__(self, where: str, after: int = 2) -> None:
        self.where, self.after, self.calls = where, after, 0

    def _tick(self, method: str) -> None:
        if method == self.where:
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError(f"simulated grammar failure in {method}")

    def allowed(self, drafts, vocab_size):
        self._tick("allowed")
        if self.where == "shape":
            return torch.ones(len(drafts) + 2, vocab_size, dtype=torch.bool)
        fill = self.where != "dead_end"
        return torch.full((len(drafts) + 1, vocab_size), fill, dtype=torch.bool)

    def allowed_after(self, drafts, vocab_size):
        self._tick("allowed_after")
        return torch.full((vocab_size,), self.where != "dead_end", dtype=torch.bool)

    def valid_prefix(self, drafts):
        self._tick("valid_prefix")
        return len(drafts)

    def commit(self, tokens):
        self._tick("commit")


class FailingDetokenizer:
    """Stop-string handling that raises on the request's third token."""

    def __init__(self, inner) -> None:
        self.inner, self.n = inner, 0

    def add(self, t):
        self.n += 1
        if self.n == 3:
            raise ValueError("simulated stop-string failure")
        return self.inner.add(t)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def eight_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (5 + 6 * i,), generator=g).tolist() for i in range(7)]


def drafter_of(kind, model, tmp_path):
    if kind == "ngram":
        return NgramDrafter(NgramConfig(block_size=3))
    if kind == "dspark":
        from tests.scheduler.test_penalties import dspark_drafter

        return dspark_drafter(model, tmp_path, block_size=4)
    return None


COMMON_FAULTS = ["commit", "allowed", "shape", "dead_end", "stop_strings"]
# where a drafter reads the grammar: n-gram lookup cuts its drafts to the valid prefix, DSpark
# cuts a greedy request's block there too and masks a sampled request's q with the mask after
# its drafted prefix (the request that fails is sampled for that case)
DRAFTER_FAULTS = {"none": [], "ngram": ["valid_prefix"], "dspark": ["valid_prefix", "allowed_after"]}


@pytest.mark.parametrize(
    "drafter,fault",
    [(d, f) for d, extra in DRAFTER_FAULTS.items() for f in COMMON_FAULTS + extra],
)
def test_one_request_failing_inside_a_step_fails_alone_among_eight(drafter, fault, tmp_path):
    """Seven requests run beside one whose grammar, processing or stop strings fail inside a
    step (after every admission check): the seven keep exactly their text and finish normally,
    the one ends with finish_reason "error" and a message, and every KV block comes back."""
    model = tiny_model("llama")
    ps = eight_prompts()
    gate = fault != "allowed_after"  # the gate leaves this sampled request undrafted at this load
    # the sampled request drafts from q, masked by its grammar after the drafted prefix
    rule = "sampled" if fault == "allowed_after" else "argmax"
    alone = run(
        make_engine(
            model, drafter=drafter_of(drafter, model, tmp_path / "a"), draft_gate=gate, draft_rule=rule
        ),
        fresh(ps),
    )
    engine = make_engine(
        model, drafter=drafter_of(drafter, model, tmp_path / "b"), draft_gate=gate, draft_rule=rule
    )
    sampled = SamplingParams(temperature=1.0)  # unseeded: q sampled and masked (keyed drafts are greedy)
    evil = Request("evil", [7] * 12, sampled if fault == "allowed_after" else GREEDY, 16, ignore_eos=True)
    if fault != "stop_strings":
        evil.constraint = FailingConstraint(fault)

    def tamper(step):
        if step == 0 and fault == "stop_strings":
            evil.detok = FailingDetokenizer(evil.detok)

    outs = run(engine, fresh(ps) + [evil], tamper)
    last = outs["evil"][-1]
    assert last.finish_reason == "error" and last.error, last
    # its own input failed it (400), except a stop-string bug, which is the server's (500)
    assert last.error_status == (500 if fault == "stop_strings" else 400)
    if fault in ("commit", "allowed", "allowed_after", "valid_prefix"):
        assert "simulated grammar failure" in last.error
    for rid, o in alone.items():
        assert [t for x in outs[rid] for t in x.token_ids] == [t for x in o for t in x.token_ids], rid
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].error is None
    assert_all_blocks_free(engine)


def test_a_real_grammar_that_explodes_inside_a_step_fails_alone():
    """The schema from the field: a required property referring back to its own definition.
    Built straight into a matcher (past the compile checks that now refuse it), llguidance
    fails with "Too many items" at its first token; the seven others are untouched."""
    import llguidance

    from dspark_serve.verifier.grammar import Grammar
    from dspark_serve.verifier.grammar_check import GrammarConfig
    from tests.verifier.test_grammar_check import RECURSIVE, byte_lltokenizer

    model = tiny_model("llama")
    ps = eight_prompts()
    alone = run(make_engine(model, drafter=NgramDrafter(NgramConfig(block_size=3))), fresh(ps))
    engine = make_engine(model, drafter=NgramDrafter(NgramConfig(block_size=3)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        RECURSIVE, overrides=GrammarConfig(json_whitespace="compact").json_options
    )
    evil = Request("evil", [7] * 12, GREEDY, 16, ignore_eos=True)
    evil.constraint = Grammar(
        llguidance.LLMatcher(byte_lltokenizer(), grammar, log_level=0), 257, frozenset({256})
    )
    outs = run(engine, fresh(ps) + [evil])
    last = outs["evil"][-1]
    assert last.finish_reason == "error" and "Too many items" in last.error and last.error_status == 400
    for rid, o in alone.items():
        assert [t for x in outs[rid] for t in x.token_ids] == [t for x in o for t in x.token_ids], rid
        assert outs[rid][-1].finish_reason == "length"
    assert_all_blocks_free(engine)
