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

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dspark_serve.ops.cpu_kernels import mask_words
from dspark_serve.verifier.grammar_check import (
    GrammarConfig,
    GrammarError,
    build_matcher,
    hf_tokenizer_json,
    matcher_error,
    prepare,
    schema_text,
)
from dspark_serve.verifier.grammar_worker import CompileWorkers

if TYPE_CHECKING:
    import llguidance

__all__ = ["Grammar", "GrammarCompiler", "GrammarConfig", "GrammarError"]
log = logging.getLogger(__name__)


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
        if self.matcher.is_error():  # llguidance never raises: an error is a state
            raise RuntimeError(f"grammar failed computing a mask: {matcher_error(self.matcher)}")
        allowed = torch.frombuffer(bytearray(raw), dtype=torch.uint8) > 0
        n = allowed.numel()
        if n >= vocab:
            return allowed[:vocab]
        return torch.cat([allowed, torch.zeros(vocab - n, dtype=torch.bool)])

    def fill_mask(self, bits: torch.Tensor) -> None:  # [W] int32, contiguous, on the CPU
        """bits <- the packed mask of what may follow the matcher's state (`mask_words` words)."""
        if bits.dtype != torch.int32 or not bits.is_contiguous() or bits.device.type != "cpu":
            raise ValueError("a packed mask is a contiguous int32 CPU tensor")
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar failed computing a mask: {matcher_error(self.matcher)}")

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
                    raise RuntimeError(f"grammar refused a validated token: {matcher_error(self.matcher)}")
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
            raise RuntimeError(f"grammar refused validated tokens: {matcher_error(self.matcher)}")
        try:
            return self._mask(vocab_size)
        finally:
            if drafts:
                self.matcher.rollback(len(drafts))

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"grammar refused committed tokens: {matcher_error(self.matcher)}")

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def cursor(self) -> GrammarCursor:
        """This grammar followed along a draft (`ops.processors.ConstraintCursor`)."""
        return GrammarCursor(self)


class GrammarCursor:
    """A grammar followed along a draft as it is written: the matcher itself advanced past each
    taken token and rolled back by `close`, so each check is one token's step from the state
    before it (no prefix validated again) and a mask is filled straight into packed words."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.taken = 0

    def allows(self, token: int) -> bool:
        return self.grammar.valid_prefix([token]) == 1

    def take(self, token: int) -> bool:
        if token in self.grammar.eos_ids:  # the matcher is never advanced past EOS
            return False
        if not self.grammar.matcher.consume_token(token):
            raise RuntimeError(f"grammar refused a draft it allowed: {matcher_error(self.grammar.matcher)}")
        self.taken += 1
        return True

    def fill(self, bits: torch.Tensor) -> None:
        self.grammar.fill_mask(bits)

    def close(self) -> None:
        if self.taken:
            taken, self.taken = self.taken, 0
            self.grammar.matcher.rollback(taken)


_EXECUTOR: list[llguidance.LLExecutor] = []


def _executor() -> llguidance.LLExecutor:
    """One llguidance executor per process (its threads fill masks of several requests at once)."""
    if not _EXECUTOR:
        import llguidance

        _EXECUTOR.append(llguidance.LLExecutor(max(1, min(8, os.cpu_count() or 1))))
    return _EXECUTOR[0]


def fill_masks(
    jobs: Sequence[tuple[Grammar, Sequence[int]]], vocab_size: int
) -> list[torch.Tensor | Exception]:
    """Packed token masks of several requests' verified rows in one call: for job (grammar,
    drafts), len(drafts) + 1 rows [n, mask_words] int32, row k allowing what may follow the
    committed tokens and drafts[:k] (`Grammar.allowed`, packed: bit j of word w is token
    32 w + j). llguidance advances each matcher along its drafts and rolls it back, the
    requests on its threads; rows after an invalid draft or EOS allow everything (that draft is
    rejected; they are never used). A job whose matcher fails gets its exception instead."""
    import llguidance.torch as llt

    sizes = [len(d) + 1 for _, d in jobs]
    bits = torch.full((sum(sizes), mask_words(vocab_size)), -1, dtype=torch.int32)
    along, alone = [], []  # matchers with drafts to walk; matchers asked for one row
    start = 0
    for (g, drafts), n in zip(jobs, sizes):
        walk = _until_eos([int(t) for t in drafts], g.eos_ids)
        if walk:
            along.append((g.matcher, start, walk))
        else:
            alone.append((g.matcher, start))
        start += n
    if along:
        llt.fill_next_token_bitmask_par_with_draft_tokens(_executor(), along, bits)
    if alone:
        llt.fill_next_token_bitmask_par(_executor(), alone, bits)
    out: list[torch.Tensor | Exception] = []
    start = 0
    for (g, _), n in zip(jobs, sizes):
        if g.matcher.is_error():
            out.append(RuntimeError(f"grammar failed computing a mask: {matcher_error(g.matcher)}"))
        else:
            out.append(bits[start : start + n])
        start += n
    return out


def _until_eos(drafts: list[int], eos_ids: frozenset[int]) -> list[int]:
    """The drafts up to the first EOS: the matcher is never advanced past it."""
    for i, t in enumerate(drafts):
        if t in eos_ids:
            return drafts[:i]
    return drafts


class GrammarCompiler:
    """Turns a request's schema into a `Grammar` for one tokenizer (one per engine,
    thread-safe). A schema is checked by the compile workers first when there are any
    (`verifier/grammar_worker.py`: killed at the time limit), then built here; the built
    matcher is kept by schema text, so a repeated schema costs a copy (refusals are kept too)."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        config: GrammarConfig,
        workers: CompileWorkers | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.workers = workers
        self.eos_ids = frozenset(int(t) for t in tokenizer.eos_tokens)
        self._built: OrderedDict[str, llguidance.LLMatcher | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_hf(
        cls, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], config: GrammarConfig
    ) -> GrammarCompiler:
        """From a fast Hugging Face tokenizer (raises ValueError for a slow one)."""
        # Imported on first use, not at module import: an engine that serves no structured
        # output (the GPU suite's machine has no llguidance) must not need the package.
        import llguidance

        text = hf_tokenizer_json(hf_tokenizer)
        eos = [int(t) for t in sorted(eos_ids)]
        workers = None
        if config.compile_workers:
            workers = CompileWorkers(
                "dspark_serve.verifier.grammar_check:tokenizer_from_json", [text, eos], config
            )
        return cls(llguidance.LLTokenizer(text, eos_token=eos or None), vocab_size, config, workers)

    def compile(self, kind: str, schema: str | None) -> Grammar:
        """kind "json_object" (any JSON object) or "json_schema" (`schema`, JSON text)."""
        text = schema_text(kind, schema)
        with self._lock:
            built = self._built.get(text)
            if built is not None:
                self._built.move_to_end(text)
        if built is None:
            built = self._build(text)
            with self._lock:
                self._built[text] = built
                while len(self._built) > self.config.cache_size:
                    self._built.popitem(last=False)
        if isinstance(built, GrammarError):
            raise built
        return Grammar(built.deep_copy(), self.vocab_size, self.eos_ids)

    def _build(self, text: str) -> llguidance.LLMatcher | GrammarError:
        t0 = time.perf_counter()
        checked = False
        try:
            if self.workers is not None:
                try:
                    self.workers.check(text)
                    checked = True
                except (OSError, RuntimeError) as exc:  # no worker could start here: build alone
                    log.warning("grammar workers unavailable (%s); building in the server", exc)
                    t0 = time.perf_counter()  # the time limit is the build's
            matcher = build_matcher(self.tokenizer, prepare(text, self.config), self.eos_ids, self.config)
        except GrammarError as exc:
            return exc
        took = time.perf_counter() - t0
        limit = self.config.max_compile_seconds
        if not checked and took > limit:  # no worker to cancel it: refused afterwards
            return GrammarError(f"the JSON schema took {took:.2f}s to compile; the limit is {limit:g}s")
        return matcher

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
