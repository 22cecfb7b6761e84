"""The llguidance constraint: masks for a verified block follow its drafts and leave the
committed state as it was (rollback); commits advance it; schemas are bounded."""

from __future__ import annotations

import json

import pytest
import torch
from llguidance import LLTokenizer
from llguidance._tokenizer import TokenizerWrapper

from dspark_serve.verifier.grammar import GrammarCompiler, GrammarConfig, GrammarError

EOS = 256


class _Bytes:
    """The byte-level test tokenizer (tests.helpers.ByteTokenizer) as llguidance sees it."""

    eos_token_id, bos_token_id = EOS, None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, s: bytes | str) -> list[int]:
        return list(s) if isinstance(s, bytes) else list(s.encode())


def byte_compiler(config: GrammarConfig | None = None) -> GrammarCompiler:
    """A compiler over byte tokens; compact JSON unless `config` says otherwise (tiny random
    models would otherwise spend their tokens on blanks; the default layout has its own test)."""
    config = config or GrammarConfig(json_whitespace="compact")
    return GrammarCompiler(LLTokenizer(TokenizerWrapper(_Bytes())), 257, config)


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
)


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


def test_block_masks_follow_the_drafts_and_roll_back():
    g = byte_compiler().compile("json_schema", SCHEMA)
    drafts = list(b'{"a":7')
    rows = g.allowed(drafts, 257)
    assert rows.shape == (len(drafts) + 1, 257)
    for k in range(len(drafts) + 1):
        assert torch.equal(rows[k], g.allowed_after(drafts[:k], 257))
        if k < len(drafts):
            assert rows[k, drafts[k]]  # each draft is allowed where it stands
    assert allowed_ids(rows[0]) == {ord("{")}
    assert ord(",") in allowed_ids(rows[-1]) and ord("}") not in allowed_ids(rows[-1])  # b is required
    # nothing was committed: the same block validates again from the start
    assert g.valid_prefix(drafts) == len(drafts)
    # a forbidden draft: its own row forbids it, later rows are never used (all allowed)
    bad = list(b'{"z')
    rows = g.allowed(bad, 257)
    assert g.valid_prefix(bad) == 2 and not rows[2, ord("z")] and bool(rows[3].all())
    g.commit(list(b'{"a":12,"b":'))
    assert allowed_ids(g.allowed_after([], 257)) == {ord("t"), ord("f")}
    g.commit(list(b"true}"))
    assert allowed_ids(g.allowed_after([], 257)) == {EOS} and g.accepting


def test_the_default_layout_takes_the_models_own_blanks_and_bounds_them():
    """json_whitespace "bounded" (the default): compact, spaced and indented JSON all validate;
    a gap of more than a line break and 20 blanks does not, nor two line breaks in one gap."""
    g = byte_compiler(GrammarConfig()).compile("json_schema", SCHEMA)
    for text in [
        '{"a":1,"b":true}',
        '{"a": 1, "b": true}',
        '{\n  "a": 1,\n  "b": true\n}',
        '{\n\t"a":1,"b":false}',
    ]:
        assert g.valid_prefix(list(text.encode())) == len(text), text
    wide = '{"a":1,\n' + " " * 21
    assert g.valid_prefix(list(wide.encode())) == len(wide) - 1
    assert g.valid_prefix(list(b'{"a":1,\n\n')) == 8
    assert g.valid_prefix(list(b'{"a":1,  ')) == 8  # one space, not two
    compact = byte_compiler().compile("json_schema", SCHEMA)
    assert compact.valid_prefix(list(b'{"a": 1')) == 5
    with pytest.raises(ValueError, match="'tabs'"):
        GrammarConfig(json_whitespace="tabs")


def test_json_object_allows_any_object_only():
    g = byte_compiler().compile("json_object", None)
    assert g.valid_prefix(list(b'{"x":[1,{"y":null}]}')) == 20
    assert g.valid_prefix(list(b"[1]")) == 0


def test_schema_size_compile_time_and_validity_are_bounded():
    with pytest.raises(GrammarError, match="limit is 100"):
        byte_compiler(GrammarConfig(max_schema_bytes=100)).compile(
            "json_schema", json.dumps({"enum": ["x" * 200]})
        )
    with pytest.raises(GrammarError, match="to compile"):
        byte_compiler(GrammarConfig(max_compile_seconds=1e-9)).compile("json_schema", SCHEMA)
    with pytest.raises(GrammarError):
        byte_compiler().compile("json_schema", "{not json")
    with pytest.raises(GrammarError):
        byte_compiler().compile("json_schema", json.dumps({"type": "frobnicate"}))
    with pytest.raises(ValueError, match="0"):
        GrammarConfig(max_schema_bytes=0)


def test_batched_packed_masks_equal_the_row_by_row_masks():
    """fill_masks computes several requests' rows in one llguidance call; unpacked, each
    request's rows are exactly `Grammar.allowed`'s (valid drafts, an invalid draft midway, EOS
    after a complete value, no drafts), and every matcher is back where it was."""
    from dspark_serve.ops.cpu_kernels import unpack_bits
    from dspark_serve.verifier.grammar import fill_masks

    c = byte_compiler()
    obj = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    enum = json.dumps({"enum": ["red", "green"]})
    jobs = [
        (c.compile("json_schema", obj), list(b'{"a":12')),
        (c.compile("json_schema", obj), list(b'{"b"') + [ord("x")] * 3),  # invalid from the 2nd byte
        (c.compile("json_schema", enum), [*b'"red"', EOS, ord("x")]),  # EOS, then a byte after it
        (c.compile("json_object", None), []),
        (c.compile("json_schema", enum), list(b'"gr')),
    ]
    jobs[4][0].commit(list(b'"gr'))  # a matcher that has committed tokens already
    jobs[4] = (jobs[4][0], list(b"een"))
    filled = fill_masks(jobs, 257)
    for (g, drafts), packed in zip(jobs, filled):
        assert isinstance(packed, torch.Tensor) and packed.shape == (len(drafts) + 1, 9)
        assert torch.equal(unpack_bits(packed, 257), g.allowed(drafts, 257)), bytes(drafts)
    assert allowed_ids(unpack_bits(filled[2], 257)[5]) == {EOS}  # after "red": only the end
    assert jobs[4][0].valid_prefix(list(b'een"')) == 4  # rolled back: still after '"gr'
