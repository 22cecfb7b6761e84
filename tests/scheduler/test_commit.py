"""Commit alone: stop conditions cut exactly inside a block, text pieces, provenance records."""

from types import SimpleNamespace

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.client import round_provenance
from dspark_serve.scheduler.commit import append_tokens, eos_token_ids, token_records
from dspark_serve.scheduler.detokenizer import IncrementalDetokenizer
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer

EOS = frozenset({256})


def req(max_tokens=20, stop=(), ignore_eos=False) -> Request:
    r = Request(
        "r", list(b"hi"), SamplingParams(temperature=0.0), max_tokens, stop=stop, ignore_eos=ignore_eos
    )
    r.detok = IncrementalDetokenizer(ByteTokenizer(), r.prompt_ids, r.stop)
    return r


def test_eos_inside_an_accepted_block_ends_it_and_is_not_appended():
    r = req()
    out = append_tokens(r, [ord("a"), 256, ord("b")], EOS)
    assert out.token_ids == [ord("a")] and out.finish_reason == "stop" and r.output_ids == [ord("a")]
    r2 = req(ignore_eos=True)
    out2 = append_tokens(r2, [ord("a"), 256, ord("b")], EOS)
    assert out2.token_ids == [ord("a"), 256, ord("b")] and out2.finish_reason is None


def test_stop_string_and_max_tokens_cut_exactly():
    r = req(stop=("cd",))
    out = append_tokens(r, list(b"abcdef"), EOS)
    assert out.finish_reason == "stop" and bytes(out.token_ids) == b"abcd"
    assert r.detok.text == "ab"  # the text ends before the stop string
    r = req(max_tokens=3)
    out = append_tokens(r, list(b"abcdef"), EOS)
    assert out.finish_reason == "length" and bytes(r.output_ids) == b"abc"


def test_pieces_and_records_follow_the_appended_tokens():
    r = req()
    euro = list("€".encode())  # three tokens, one character
    out = append_tokens(r, euro + [ord("x")], EOS)
    assert out.pieces == ["", "", "€", "x"]
    recs = token_records(out, round_provenance(3, 4))
    assert [(t.token_id, t.text, t.kind, t.draft_position) for t in recs] == [
        (euro[0], "", "draft", 0),
        (euro[1], "", "draft", 1),
        (euro[2], "€", "draft", 2),
        (ord("x"), "x", "correction", None),
    ]


def test_eos_ids_from_every_source():
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[5, 6]), config=SimpleNamespace(eos_token_id=7)
    )
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=None)) == {5, 6, 7}
