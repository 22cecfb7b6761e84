"""Reasoning split from content, whole and at every way a stream can cut the reply (a drafted
block crossing the end tag, the tag arriving in pieces)."""

from __future__ import annotations

import pytest

from dspark_serve.server.reasoning import (
    DEEPSEEK_R1,
    QWEN3,
    ReasoningParser,
    Split,
    reasoning_format,
    split_reply,
)

CASES = [
    (
        QWEN3,
        "<think>\nLet me think. 2 < 3 and </thin is no tag.\n</think>\n\nThe answer is 4.",
        "\nLet me think. 2 < 3 and </thin is no tag.\n",
        "The answer is 4.",
    ),
    (QWEN3, "The answer is 4, no thinking.", "", "The answer is 4, no thinking."),
    (QWEN3, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (QWEN3, "\n<think></think>Done.", "", "Done."),
    (DEEPSEEK_R1, "Hmm, 2 + 2.</think>It is 4.", "Hmm, 2 + 2.", "It is 4."),
    (DEEPSEEK_R1, "still thinking <", "still thinking <", ""),
]


def streamed(fmt, text: str, cuts: list[int]) -> Split:
    p = ReasoningParser(fmt)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parts = [p.feed(piece) for piece in pieces] + [p.close()]
    return Split("".join(x.reasoning for x in parts), "".join(x.content for x in parts))


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_the_split_is_the_same_whole_and_at_every_cut(fmt, text, reasoning, content):
    assert split_reply(fmt, text) == Split(reasoning, content)
    for cut in range(len(text) + 1):
        assert streamed(fmt, text, [cut]) == Split(reasoning, content), cut
    assert streamed(fmt, text, list(range(1, len(text)))) == Split(reasoning, content)


def test_no_reasoning_text_is_sent_as_content_while_a_tag_may_be_arriving():
    p = ReasoningParser(QWEN3)
    assert p.feed("<thi") == Split() and p.feed("nk>Hm") == Split(reasoning="Hm")
    assert p.feed("m. </th") == Split(reasoning="m. ") and p.feed("ink>OK") == Split(content="OK")


def test_the_format_is_picked_by_name_or_family():
    assert reasoning_format("auto", "qwen3") is QWEN3 and reasoning_format("auto", "llama") is None
    assert (
        reasoning_format("deepseek_r1", "llama") is DEEPSEEK_R1 and reasoning_format("none", "qwen3") is None
    )
