"""A schema is checked before it is admitted: a finite value must exist, the first mask and a
short probe walk must pass, and the worker that builds it first is killed at the time limit.
Built grammars are kept by schema text (refusals too)."""

from __future__ import annotations

import json
import time

import pytest
from llguidance import LLTokenizer
from llguidance._tokenizer import TokenizerWrapper

from dspark_serve.verifier.grammar import GrammarCompiler
from dspark_serve.verifier.grammar_check import GrammarConfig, GrammarError, no_finite_value
from dspark_serve.verifier.grammar_worker import CompileWorkers
from tests.verifier.test_grammar import SCHEMA, _Bytes, byte_compiler

RECURSIVE = {
    "$ref": "#/$defs/a",
    "$defs": {
        "a": {
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
            "required": ["x"],
            "additionalProperties": False,
        }
    },
}
SLOW = {"type": "string", "pattern": "^(x{1000}){1000}$"}  # ~1 s of lexer building, then a limit


def byte_lltokenizer() -> LLTokenizer:
    """The byte-level test tokenizer, built in a worker process by name."""
    return LLTokenizer(TokenizerWrapper(_Bytes()))


@pytest.mark.parametrize(
    "schema,finite",
    [
        (RECURSIVE, False),
        ({**RECURSIVE, "$defs": {"a": {**RECURSIVE["$defs"]["a"], "required": []}}}, True),
        ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, False),
        (
            {
                "$ref": "#/$defs/n",
                "$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}},
            },
            False,
        ),
        ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}, True),
        (  # a tree: children are an array, which may be empty
            {
                "$ref": "#/$defs/n",
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                        "required": ["kids"],
                    }
                },
            },
            True,
        ),
        (  # a way out through anyOf
            {
                "$ref": "#/$defs/n",
                "$defs": {
                    "n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/m"}]},
                    "m": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]},
                },
            },
            True,
        ),
        ({"type": ["object", "string"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),
        ({"type": "object"}, True),
        ({"$ref": "#/$defs/missing"}, True),  # not this check's to refuse: llguidance says why
    ],
)
def test_no_finite_value_finds_self_requiring_definitions(schema, finite):
    problem = no_finite_value(schema)
    assert (problem is None) == finite, problem


def test_a_self_requiring_schema_is_refused_naming_the_definition():
    with pytest.raises(GrammarError, match=r"no finite value.*#/\$defs/a"):
        byte_compiler().compile("json_schema", json.dumps(RECURSIVE))


def test_the_probe_walk_refuses_a_schema_whose_lexer_explodes():
    """The pattern compiles, then llguidance's lexer limit trips on the first tokens: refused
    at compile time, without the grammar and parser state in the message."""
    with pytest.raises(GrammarError, match="cannot be used: lexer error") as e:
        byte_compiler().compile("json_schema", json.dumps(SLOW))
    assert "<state>" not in str(e.value) and "<grammar>" not in str(e.value)


def workers(limit: float, n: int = 1) -> CompileWorkers:
    cfg = GrammarConfig(max_compile_seconds=limit, compile_workers=n)
    return CompileWorkers("tests.verifier.test_grammar_check:byte_lltokenizer", [], cfg)


def test_the_worker_is_killed_at_the_time_limit_and_replaced():
    pool = workers(0.05)
    try:
        pool.check(SCHEMA)  # starts the worker (outside the limit), then passes
        t0 = time.perf_counter()
        with pytest.raises(GrammarError, match=r"longer than 0.05s to compile \(cancelled at the limit\)"):
            pool.check(json.dumps(SLOW))
        assert time.perf_counter() - t0 < 0.5  # answered at the limit, not when the build ends
        assert pool.killed == 1
        pool.check(SCHEMA)  # a fresh worker takes the next schema
        with pytest.raises(GrammarError, match="not valid JSON"):
            pool.check("{")
    finally:
        pool.close()


def test_the_compiler_builds_in_process_only_what_a_worker_passed_and_keeps_it():
    pool = workers(0.05)
    calls: list[str] = []
    real = pool.check
    pool.check = lambda text: (calls.append(text), real(text))[1]  # type: ignore[method-assign]
    compiler = GrammarCompiler(byte_lltokenizer(), 257, pool.config, pool)
    try:
        a = compiler.compile("json_schema", SCHEMA)
        b = compiler.compile("json_schema", SCHEMA)
        assert calls == [SCHEMA]  # the second is a copy of the first build
        a.commit(list(b'{"a":1'))  # each request's state is its own
        assert b.valid_prefix(list(b'{"a":2')) == 6 and a.valid_prefix(list(b',"b":true}')) == 10
        for _ in range(2):  # a refusal is kept too: the slow schema reaches a worker once
            with pytest.raises(GrammarError, match="longer than"):
                compiler.compile("json_schema", json.dumps(SLOW))
        assert calls.count(json.dumps(SLOW)) == 1 and pool.killed == 1
    finally:
        compiler.close()


def test_config_rejects_bad_values():
    for bad in (
        {"max_compile_seconds": 0},
        {"probe_tokens": -1},
        {"compile_workers": -1},
        {"cache_size": -1},
        {"max_schema_bytes": 0},
    ):
        with pytest.raises(ValueError, match=repr(next(iter(bad.values())))):
            GrammarConfig(**bad)


def test_checks_waiting_for_a_killed_worker_are_not_stranded():
    """One worker, three slow schemas and a good one at once: each slow one kills the worker it
    got, and every waiting check still gets a fresh one (none waits forever)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = workers(0.05, n=1)

    def check(text: str) -> str:
        try:
            pool.check(text)
            return "ok"
        except GrammarError as exc:
            return "late" if "longer than" in str(exc) else str(exc)

    slow = [json.dumps({**SLOW, "description": str(i)}) for i in range(3)]
    try:
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(check, [*slow, SCHEMA]))
    finally:
        pool.close()
    assert results == ["late"] * 3 + ["ok"] and pool.killed == 3


def test_without_a_worker_the_server_builds_alone_and_checks_the_time_afterwards():
    pool = workers(2.0)
    pool._hello = "not json"  # every worker fails to start
    compiler = GrammarCompiler(byte_lltokenizer(), 257, GrammarConfig(max_compile_seconds=0.05), pool)
    g = compiler.compile("json_schema", SCHEMA)  # built in the server
    assert g.valid_prefix(list(b'{"a":1')) == 6
    heavy = {"type": "string", "pattern": "^(x{400}){400}$"}  # builds, in ~0.15 s
    with pytest.raises(GrammarError, match="to compile; the limit is 0.05s"):
        compiler.compile("json_schema", json.dumps(heavy))  # in the server: refused afterwards
