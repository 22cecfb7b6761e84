from dspark_serve.scheduler.detokenizer import IncrementalDetokenizer
from tests.helpers import ByteTokenizer


def stream(text: str, stop=()):
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("prompt "), tuple(stop))
    pieces, stopped = [], False
    for t in tok.encode(text):
        stopped = d.add(t)
        pieces.append(d.flush(final=stopped))
        if stopped:
            break
    if not stopped:
        pieces.append(d.flush(final=True))
    return pieces, stopped


def test_multibyte_characters_are_never_split():
    text = "naïve café — 日本語 🎉 done"
    pieces, stopped = stream(text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)  # no half characters ever streamed
    assert any(p == "🎉" for p in pieces)  # a 4-byte char arrives whole


def test_stop_string_cut_exactly_even_across_tokens_and_chars():
    pieces, stopped = stream("alpha beta 日本 gamma", stop=("本 g",))
    assert stopped and "".join(pieces) == "alpha beta 日"


def test_possible_stop_prefix_is_held_back_until_resolved():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, [], ("STOP",))
    out = ""
    for t in tok.encode("ab ST"):
        d.add(t)
        out += d.flush(final=False)
    assert out == "ab"  # "ST" might begin "STOP": held back
    for t in tok.encode("ART"):
        d.add(t)
        out += d.flush(final=False)
    out += d.flush(final=True)
    assert out == "ab START"


def test_earliest_of_several_stop_strings_wins():
    pieces, stopped = stream("one two three", stop=("three", "two"))
    assert stopped and "".join(pieces) == "one "
