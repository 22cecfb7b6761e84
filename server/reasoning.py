"""Reasoning split out of a reply: models that think inside `<think>...</think>` before they
answer (Qwen3, DeepSeek-R1) get the thinking returned as `reasoning_content` (vLLM's field),
the answer as `content`. One `ReasoningFormat` per family, picked by name from one registry
(`--reasoning-parser`, vLLM's names) or by the model family.

The split follows the text of the tokens a request keeps (the detokenizer's output), so a drafted
block that crosses the end tag, or an end tag written as several tokens, splits exactly where
the committed text does, whatever the block boundaries. Streamed, a piece of text that may be the
start of a tag is held back until the next piece shows what it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dspark_serve.scheduler.client import GrammarSpec
from dspark_serve.verifier.grammar_check import LARK_PREFIX, schema_text


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its reasoning.

    name: the `--reasoning-parser` name.
    start / end: the tags around the reasoning.
    opens_in_prompt: the chat template writes the start tag at the end of the prompt (DeepSeek-R1),
        so the reply begins inside the reasoning; otherwise it begins with the start tag when it
        thinks at all (Qwen3), and a reply without it is all content.
    families: model types (config.model_type) that reason in this format.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_in_prompt: bool = False
    families: tuple[str, ...] = ()


QWEN3 = ReasoningFormat("qwen3", families=("qwen3", "qwen3_moe"))
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", opens_in_prompt=True, families=("deepseek_v3",))
REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (QWEN3, DEEPSEEK_R1)}
REASONING_PARSER_NAMES = ("auto", "none", *REASONING_FORMATS)


def reasoning_format(name: str, model_type: str | None) -> ReasoningFormat | None:
    """The format `--reasoning-parser name` names: "auto" by the model family, "none" off."""
    if name == "none":
        return None
    if name == "auto":
        return next((f for f in REASONING_FORMATS.values() if model_type in f.families), None)
    return REASONING_FORMATS[name]


@dataclass(frozen=True)
class Split:
    """A piece of a reply, split: its reasoning and its content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one reply's text as it streams (`feed`), then `close` at its end."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        # start | reasoning | after (the end tag seen) | content
        self.state = "reasoning" if fmt.opens_in_prompt else "start"
        self.held = ""  # text that may begin a tag

    def feed(self, text: str) -> Split:
        buf = self.held + text
        self.held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if self.fmt.start.startswith(stripped) and len(stripped) < len(self.fmt.start):
                    self.held = buf  # maybe the start tag, not complete yet
                    break
                if stripped.startswith(self.fmt.start):
                    buf = stripped[len(self.fmt.start) :]
                    self.state = "reasoning"
                else:
                    self.state = "content"
                continue
            if self.state == "reasoning":
                at = buf.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf = buf[at + len(self.fmt.end) :]
                    self.state = "after"
                    continue
                hold = _partial_suffix(buf, self.fmt.end)
                reasoning.append(buf[: len(buf) - hold])
                self.held = buf[len(buf) - hold :]
                break
            if self.state == "after":  # blanks between the end tag and the answer are dropped
                buf = buf.lstrip()
                if not buf:
                    break
                self.state = "content"
            content.append(buf)
            break
        return Split("".join(reasoning), "".join(content))

    def close(self) -> Split:
        """The end of the reply: text held back goes where it stands."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return Split(reasoning=held)
        return Split(content=held)


def split_reply(fmt: ReasoningFormat, text: str) -> Split:
    """A whole reply's reasoning and content."""
    parser = ReasoningParser(fmt)
    a, b = parser.feed(text), parser.close()
    return Split(a.reasoning + b.reasoning, a.content + b.content)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def after_reasoning(spec: GrammarSpec, fmt: ReasoningFormat, marker_ids: Mapping[str, int]) -> GrammarSpec:
    """The grammar that lets the reasoning run free and applies `spec` to what follows the end
    tag (a reply that thinks first; Qwen3's may also answer at once). The tags must be tokens of
    the vocabulary (as in the models that use them): the reasoning is then any text, which no
    special token is part of, so only the end tag's token ends it. Where they are not, `spec`
    applies from the reply's first token, as it did without reasoning."""
    start, end = marker_ids.get(fmt.start), marker_ids.get(fmt.end)
    if start is None or end is None:
        return spec
    text = schema_text(spec.kind, spec.schema)
    if spec.kind == "lark":
        body = re.sub(r"^start:", "body:", text.removeprefix(LARK_PREFIX), count=1, flags=re.M)
    else:
        body = f"body: %json {text}\n"
    think = f"<[{start}]> /(?s:.*)/ <[{end}]> /[ \\t\\r\\n]{{0,8}}/"
    if fmt.opens_in_prompt:
        think = f"/(?s:.*)/ <[{end}]> /[ \\t\\r\\n]{{0,8}}/"
        top = "start: think body"
    else:
        top = "start: think body | body"
    return GrammarSpec("lark", f"{LARK_PREFIX}{top}\nthink: {think}\n{body}", spec.param)
