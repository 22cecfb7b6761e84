"""Structured output under speculation: the grammar masks the target's p at every verified
position and DSpark's q while drafting, follows accepted tokens and rolls back rejected ones.
Greedy output equals plain decoding and always validates; the sampled distribution of the
constrained output is unchanged by speculation."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import dspark_serve.verifier.verify as verify_mod
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, runner_for, tiny_model
from tests.scheduler.test_penalties import dspark_drafter
from tests.scheduler.test_speculative import broken_rejection_sample, run
from tests.verifier.test_grammar import EOS, byte_compiler

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "ok", "tag", "name"],
    "additionalProperties": False,
}


def engine_for(model, drafter=None, policy="none", **sched):
    e = Engine(
        runner_for(model, num_blocks=1024),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, draft_gate=False, **sched),
        max_model_len=256,
        drafter=drafter,
    )
    e.grammars = byte_compiler()
    return e


def constrained(engine, prompts, sp, schema, max_tokens=80):
    reqs = [Request(f"j{i}", p, sp, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for r in reqs:
        r.constraint = engine.compile_grammar("json_schema", json.dumps(schema))
    run(engine, reqs)
    return reqs


@pytest.mark.parametrize(
    "drafter,policy", [("dspark", "static:7"), ("ngram", "static:7"), ("dspark", "dspark")]
)
def test_twenty_greedy_constrained_requests_validate_and_equal_plain(tmp_path, drafter, policy):
    model = tiny_model("qwen3", seed=1)
    prompts = [list(range(33 + i, 40 + 2 * i)) for i in range(20)]
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    plain = constrained(engine_for(model), prompts, greedy, SCHEMA)
    dr = dspark_drafter(model, tmp_path) if drafter == "dspark" else build_drafter("ngram", block_size=7)
    spec = constrained(engine_for(model, dr, policy), prompts, greedy, SCHEMA)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert s.finish_reason == "stop", s.finish_reason  # the grammar closed and EOS followed
        jsonschema.validate(json.loads(bytes(s.output_ids)), SCHEMA)
    assert sum(r.spec.drafted for r in spec) > 0
    if drafter == "dspark":  # q is masked: its drafts are grammar-valid, so many are accepted
        assert sum(r.spec.accepted for r in spec) > 0


ENUM = {"enum": ["ab", "abc", "b", "ba", "c"]}


def exact_outcomes(model, prompt, compiler):
    """P(output) of plain sampling at temperature 1 under the grammar, by enumerating it."""
    g = compiler.compile("json_schema", json.dumps(ENUM))
    out: dict[bytes, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].double()
        mask = g.allowed_after(prefix, 257)
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        for t in mask.nonzero().flatten().tolist():
            if t == EOS:
                out[bytes(prefix)] = out.get(bytes(prefix), 0.0) + prob * p[t].item()
            else:
                walk(prefix + [t], prob * p[t].item())

    walk([], 1.0)
    return out


def sampled_outcomes(model, prompt, n, seed, drafter, rule="argmax"):
    """Unseeded requests, the global RNG seeded here: rejection sampling against the drafts' q
    (seeded requests are judged by keyed samples instead); rule: `SchedulerConfig.draft_rule`."""
    torch.manual_seed(seed)
    engine = engine_for(
        model,
        drafter,
        "static:3",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_waiting=n,
        draft_rule=rule,
    )
    reqs = [Request(f"s{i}", prompt, SamplingParams(temperature=1.0), max_tokens=12) for i in range(n)]
    for r in reqs:
        r.constraint = engine.compile_grammar("json_schema", json.dumps(ENUM))
    run(engine, reqs)
    assert sum(r.spec.drafted for r in reqs) >= n
    counts: dict[bytes, float] = {}
    for r in reqs:
        assert r.finish_reason == "stop"
        counts[bytes(r.output_ids)] = counts.get(bytes(r.output_ids), 0.0) + 1 / n
    return counts


# argmax drafts follow the grammar's cursor; sampled ones draw from q masked by it
@pytest.mark.parametrize("rule", ["argmax", pytest.param("sampled", marks=pytest.mark.slow)])
def test_sampled_constrained_distribution_is_unchanged_by_speculation(monkeypatch, tmp_path, rule):
    model = tiny_model("qwen3", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # p neither flat nor one-hot over the allowed bytes
    prompt = [40, 41, 42]
    exact = exact_outcomes(model, prompt, byte_compiler())
    assert len(exact) == 5 and abs(sum(exact.values()) - 1) < 1e-9
    assert {json.loads(k) for k in exact} == set(ENUM["enum"])
    tv = lambda a: (
        0.5 * sum(abs(a.get(k, 0.0) - exact[k]) for k in exact)
        + 0.5 * sum(v for k, v in a.items() if k not in exact)
    )
    n = 1500
    got = sampled_outcomes(model, prompt, n, 1, dspark_drafter(model, tmp_path, block_size=3), rule)
    # sampling noise of a 5-outcome TV at n=1500 is ~0.02
    assert tv(got) < 0.05, (tv(got), got, exact)
    monkeypatch.setattr(verify_mod, "rejection_sample", broken_rejection_sample)
    broken = sampled_outcomes(model, prompt, n, 2, dspark_drafter(model, tmp_path, block_size=3), rule)
    assert tv(broken) > 0.08, (tv(broken), broken, exact)


def test_the_grammars_end_ends_a_request_that_ignores_eos(tmp_path):
    """ignore_eos under a grammar: EOS is allowed only where the output is complete, so it ends
    the request ("stop", valid JSON) instead of the request going on past its grammar."""
    model = tiny_model("qwen3", seed=1)
    engine = engine_for(model, build_drafter("ngram", block_size=7), "static:7")
    reqs = [
        Request(f"e{i}", list(range(40 + i, 50)), SamplingParams(temperature=0.0), 200, ignore_eos=True)
        for i in range(4)
    ]
    for r in reqs:
        r.constraint = engine.compile_grammar("json_schema", json.dumps(SCHEMA))
    run(engine, reqs)
    for r in reqs:
        assert r.finish_reason == "stop", r.finish_reason
        jsonschema.validate(json.loads(bytes(r.output_ids)), SCHEMA)
    unconstrained = Request("u", list(range(40, 50)), SamplingParams(temperature=0.0), 40, ignore_eos=True)
    run(engine, [unconstrained])
    assert unconstrained.finish_reason == "length"  # without a grammar, EOS is still ignored


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_seeded_constrained_requests_equal_plain_decoding_with_the_same_seed(tmp_path, drafter):
    """Keyed sampling under a grammar: a seeded request's output is plain decoding's for that
    seed whatever was drafted (each position's uniform keyed by seed and position)."""
    model = tiny_model("qwen3", seed=1)
    prompts = [list(range(33 + i, 40 + 2 * i)) for i in range(5)]
    plain, spec = [], []
    dr = dspark_drafter(model, tmp_path) if drafter == "dspark" else build_drafter("ngram", block_size=7)
    for engine, out in ((engine_for(model), plain), (engine_for(model, dr, "static:7"), spec)):
        reqs = [
            Request(f"k{i}", p, SamplingParams(temperature=0.8, seed=100 + i), 80)
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            r.constraint = engine.compile_grammar("json_schema", json.dumps(SCHEMA))
        run(engine, reqs)
        out += reqs
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids and s.finish_reason == p.finish_reason == "stop"
        jsonschema.validate(json.loads(bytes(s.output_ids)), SCHEMA)
    assert sum(r.spec.drafted for r in spec) > 0
    assert len({bytes(r.output_ids) for r in spec}) > 1  # sampled: the seeds give different replies
