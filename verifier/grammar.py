"""Structured output: a request's JSON schema (or "any JSON object") as a token constraint,
through llguidance.

Why llguidance (over xgrammar and outlines-core): it computes each mask lazily from an Earley
parser over the tokenizer's trie, so a schema needs no ahead-of-time compilation over the
vocabulary (xgrammar precompiles per schema; outlines-core builds an automaton over the whole
vocabulary, which is slow for large schemas), it rolls back consumed tokens (exactly what
rejected drafts need), it validates a whole draft block in one call (`validate_tokens`), it
is maintained, and its CPU wheel depends on nothing else.

`Grammar` implements `verifier.processors.TokenConstraint`: its committed state follows the
tokens the request kept; masks for a verified block are computed by consuming the block's
drafts and rolling them back, so a rejected draft never reaches the committed state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions


class GrammarError(ValueError):
    """A schema this server refuses (invalid, too large, too slow to compile)."""


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds on structured output.

    max_schema_bytes: the largest JSON schema accepted (its compact JSON text, in bytes).
    max_compile_seconds: the longest a schema may take to compile and give its first mask.
    """

    max_schema_bytes: int = 32 * 1024
    max_compile_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.max_schema_bytes <= 0:
            raise ValueError(f"max_schema_bytes must be > 0, got {self.max_schema_bytes!r}")
        if not (self.max_compile_seconds > 0):
            raise ValueError(f"max_compile_seconds must be > 0, got {self.max_compile_seconds!r}")


# Compact JSON (no optional whitespace): a model cannot loop on blanks between tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class Grammar:
    """One request's grammar state (llguidance `LLMatcher`); see the module docstring."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        # EOS ends the request: a draft block is never consumed past it (consuming EOS stops
        # the matcher, and positions after it are never used).
        self.eos_ids = eos_ids

    def _mask(self, vocab: int) -> torch.Tensor:  # [V] bool
        raw = self.matcher.compute_logit_bias()
        allowed = torch.frombuffer(bytearray(raw), dtype=torch.uint8) > 0
        n = allowed.numel()
        if n >= vocab:
            return allowed[:vocab]
        return torch.cat([allowed, torch.zeros(vocab - n, dtype=torch.bool)])

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        drafts = [int(t) for t in drafts]
        return int(self.matcher.validate_tokens(drafts)) if drafts else 0

    def allowed(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [len+1, V] bool
        drafts = [int(t) for t in drafts]
        n = self.valid_prefix(drafts)
        rows = torch.ones(len(drafts) + 1, vocab_size, dtype=torch.bool)
        consumed = 0
        for k in range(n + 1):
            rows[k] = self._mask(vocab_size)
            if k < n:
                if drafts[k] in self.eos_ids:
                    break
                if not self.matcher.consume_token(drafts[k]):
                    raise RuntimeError(f"grammar refused a validated token: {self.matcher.get_error()}")
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        # rows after an invalid draft stay all-True: that draft is rejected, they are never used
        return rows

    def allowed_after(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [V] bool
        drafts = [int(t) for t in drafts]
        if self.valid_prefix(drafts) < len(drafts) or any(t in self.eos_ids for t in drafts):
            return torch.ones(vocab_size, dtype=torch.bool)
        if drafts and not self.matcher.consume_tokens(drafts):
            raise RuntimeError(f"grammar refused validated tokens: {self.matcher.get_error()}")
        try:
            return self._mask(vocab_size)
        finally:
            if drafts:
                self.matcher.rollback(len(drafts))

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"grammar refused committed tokens: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


class GrammarCompiler:
    """Turns a request's schema into a `Grammar` for one tokenizer (built once per engine)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int, config: GrammarConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config

    @classmethod
    def for_hf(
        cls, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], config: GrammarConfig
    ) -> GrammarCompiler:
        """From a fast Hugging Face tokenizer (raises ValueError for a slow one)."""
        # Imported on first use, not at module import: an engine that serves no structured
        # output (the GPU suite's machine has no llguidance) must not need the package.
        import llguidance.hf

        eos = sorted(eos_ids) or None
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos), vocab_size, config)

    def compile(self, kind: str, schema: str | None) -> Grammar:
        """kind "json_object" (any JSON object) or "json_schema" (`schema`, JSON text)."""
        if kind == "json_object":
            text = '{"type": "object"}'
        elif kind == "json_schema" and schema is not None:
            text = schema
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        size = len(text.encode("utf-8"))
        if size > self.config.max_schema_bytes:
            raise GrammarError(
                f"the JSON schema is {size} bytes; the limit is {self.config.max_schema_bytes}"
            )
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise GrammarError("the JSON schema must be an object")
        import llguidance

        t0 = time.perf_counter()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(parsed, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        g = Grammar(matcher, self.vocab_size, frozenset(int(t) for t in self.tokenizer.eos_tokens))
        g._mask(self.vocab_size)  # the first mask is part of the cost
        took = time.perf_counter() - t0
        if took > self.config.max_compile_seconds:
            limit = self.config.max_compile_seconds
            raise GrammarError(f"the JSON schema took {took:.2f}s to compile; the limit is {limit}s")
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be used: {matcher.get_error()}")
        return g
