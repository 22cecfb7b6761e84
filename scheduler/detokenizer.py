"""Incremental detokenization with exact stop strings.

Text is decoded from a sliding window of tokens so each step costs O(new tokens), a multi-byte
character split across tokens is held back until complete, and text that could still be the
start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    # Tokens of left context re-decoded with each step: enough for tokenizers whose spacing
    # depends on the previous token.
    CONTEXT = 4

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.emitted = 0  # characters of self.text already returned

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string completed (text is cut before it)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = max(0, len(self.ids) - self.CONTEXT)
            self.read_offset = len(self.ids)
        else:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]  # the earliest stop wins
            return True
        return False

    def flush(self, final: bool) -> str:
        """New text safe to return: everything when final, else all but a possible stop prefix."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
