"""Logits processing that depends on the tokens before a position: logit_bias, repetition /
frequency / presence penalties and a grammar constraint (`TokenConstraint`).

Under speculation one verified block holds several positions of one request; position k sees
the request's tokens so far plus the block's drafts 0..k-1, exactly the tokens that precede it
if those drafts are accepted. Rows after a rejected draft are never used, so every token the
request keeps was drawn from the distribution plain decoding would have used at its position:
rejection sampling stays lossless with respect to the processed distribution. The drafter
shapes its q with the same functions (its drafted prefix standing in for the drafts).

Semantics follow vLLM and the OpenAI API: logit_bias is added to the raw logits; repetition
penalty (HF style: positive logits divided, negative multiplied) covers prompt and output
tokens; frequency (times the count) and presence (once) penalties cover output tokens only;
then temperature, min_p, top-k, top-p (ops/sampling.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark_serve.ops.cpu_kernels import argmax_allowed, argmax_rows, mask_rows_bits, mask_words
from dspark_serve.ops.sampling_params import SamplingParams


class TokenConstraint(Protocol):
    """A per-request constraint on the next tokens (a grammar): which tokens may follow.

    `allowed(drafts)` answers for len(drafts) + 1 positions at once: row k allows the tokens
    that may follow the committed tokens and drafts[:k]; drafts that are themselves not allowed
    make every later row all-False (those rows can never be used). It never changes the
    constraint's committed state."""

    def allowed(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [len+1, V] bool
        ...

    def allowed_after(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [V] bool
        """The last row of `allowed(drafts)` alone (what a drafter masks its next token with)."""
        ...

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint accepts, in order."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the committed state past tokens the request kept (EOS never comes here)."""
        ...


class ConstraintCursor(Protocol):
    """A constraint followed along a draft as a drafter writes it, one token at a time (a
    constraint may offer one: `cursor()`). Each token is checked against the state after the
    tokens taken before it, so a check costs one token's step, not the whole prefix's; `close`
    undoes every `take`, leaving the committed state as it was."""

    def allows(self, token: int) -> bool:
        """Whether token may follow the tokens taken so far."""
        ...

    def take(self, token: int) -> bool:
        """Advance past an allowed token; False: nothing after it is ever verified (EOS), the
        cursor follows no further."""
        ...

    def fill(self, bits: torch.Tensor) -> None:
        """bits [W] int32 <- what may follow the tokens taken so far, as a packed token mask
        (bit j of word w allows token 32 w + j, `mask_rows_bits`' layout)."""
        ...

    def close(self) -> None:
        """Undo every take."""
        ...


class DraftCursor:
    """A greedy, unpenalized draft row's constraint followed along its block (`pick` at each
    position, `close` at the end): the pick is the row's argmax where the constraint allows
    it, else the argmax over the allowed tokens, read from the packed mask in one pass
    (`argmax_allowed`), the same token `process_next` and an argmax would give (a mask only
    removes tokens). Where nothing in the row is allowed, or after EOS or a failure (recorded by
    the guard: the request fails alone when the step settles), the row keeps its argmax and is
    followed no further, as a row past an invalid draft is left unprocessed (the verifier
    rejects that draft; nothing after it is read)."""

    def __init__(self, guard: GuardedConstraint, inner: ConstraintCursor, vocab_size: int) -> None:
        self.guard, self.inner = guard, inner
        self.bits = torch.empty(mask_words(vocab_size), dtype=torch.int32)
        self.live = True

    def pick(
        self, row: torch.Tensor, top: int, d2t: torch.Tensor | None, targets: Sequence[int] | None
    ) -> int:
        """row: [V'] the position's logits; top: their argmax; d2t / targets: the target token of
        each entry (a tensor and the same as a list; None: entry j is token j) -> the entry
        drafted."""
        if not self.live:
            return top
        try:
            token = top if targets is None else targets[top]
            if not self.inner.allows(token):
                self.inner.fill(self.bits)
                found = argmax_allowed(row, self.bits, d2t)
                if found < 0:
                    self.live = False
                    return top
                top = found
                token = top if targets is None else targets[top]
            self.live = self.inner.take(token)
        except Exception as exc:
            self.guard.fail(exc)
            self.live = False
        return top

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as exc:
            self.guard.fail(exc)


class GuardedConstraint:
    """A request's constraint whose failures stay that request's.

    A grammar can fail in the middle of a step (llguidance hits a resource limit on a schema
    that compiled; a bug): the drafter masks q with it inside a batched proposal, verification
    masks p, the commit advances it. Raising there would fail every request in the step. The
    guard records the first failure in `error` and from then on answers as if unconstrained
    (all tokens allowed, no draft valid, commits ignored); the engine fails the request alone
    when the step settles, discarding what it drew under the broken constraint."""

    def __init__(self, inner: TokenConstraint) -> None:
        self.inner = inner
        self.error: str | None = None

    def fail(self, exc: Exception) -> None:
        """Record a failure met outside the guard (a batched mask computation)."""
        if self.error is None:
            self.error = str(exc) or type(exc).__name__

    def allowed(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [len+1, V] bool
        if self.error is None:
            try:
                rows = self.inner.allowed(drafts, vocab_size)
                if rows.shape == (len(drafts) + 1, vocab_size):
                    return rows
                raise ValueError(f"constraint rows of shape {tuple(rows.shape)} for {len(drafts)} drafts")
            except Exception as exc:
                self.fail(exc)
        return torch.ones(len(drafts) + 1, vocab_size, dtype=torch.bool)

    def allowed_after(self, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:  # [V] bool
        if self.error is None:
            try:
                row = self.inner.allowed_after(drafts, vocab_size)
                if row.shape == (vocab_size,):
                    return row
                raise ValueError(f"a constraint row of shape {tuple(row.shape)}")
            except Exception as exc:
                self.fail(exc)
        return torch.ones(vocab_size, dtype=torch.bool)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        if self.error is None:
            try:
                return max(0, min(int(self.inner.valid_prefix(drafts)), len(drafts)))
            except Exception as exc:
                self.fail(exc)
        return 0

    def commit(self, tokens: Sequence[int]) -> None:
        if self.error is None:
            try:
                self.inner.commit(tokens)
            except Exception as exc:
                self.fail(exc)

    def draft_cursor(self, vocab_size: int) -> DraftCursor | None:
        """The constraint followed along a greedy draft (`DraftCursor`), where the inner one offers
        a cursor (`cursor()`) and has not failed; None: the drafter asks `allowed_after`."""
        open_cursor = getattr(self.inner, "cursor", None)
        if self.error is not None or open_cursor is None:
            return None
        try:
            return DraftCursor(self, open_cursor(), vocab_size)
        except Exception as exc:
            self.fail(exc)
            return None


@dataclass(frozen=True)
class TokenContext:
    """What position-dependent processing of one request reads.

    prompt_ids: the prompt (repetition penalty covers it).
    output_ids: the tokens generated so far (all penalties cover them).
    constraint: the request's grammar, or None.
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    constraint: TokenConstraint | None = None


def needs_processing(sp: SamplingParams, ctx: TokenContext | None) -> bool:
    """True when the request's logits change with its tokens (penalties, bias, grammar)."""
    return sp.penalized or (ctx is not None and ctx.constraint is not None)


def process_block(
    logits: torch.Tensor,  # [n, V] float: one request's consecutive positions
    sp: SamplingParams,
    ctx: TokenContext,
    drafts: Sequence[int],  # the tokens between the positions: row k follows drafts[:k]
    packed: torch.Tensor | None = None,  # [n, W] int32: the grammar's rows, computed already
) -> torch.Tensor:  # [n, V] float32
    """logit_bias, penalties and the grammar mask for one request's n positions (n - 1 <= len(drafts)).
    `packed`: the constraint's rows as packed masks (`mask_rows_bits`), computed with other
    requests' in one batch; None: asked of the constraint here."""
    n, vocab = logits.shape
    if len(drafts) < n - 1:
        raise ValueError(f"{n} positions need {n - 1} drafts before them, got {len(drafts)}")
    drafts = list(drafts[: n - 1])
    out = logits.float().clone()
    device = out.device
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.long, device=device)
        vals = torch.tensor([b for _, b in sp.logit_bias], dtype=torch.float32, device=device)
        keep = ids < vocab
        out[:, ids[keep]] += vals[keep]
    if sp.penalized_by_history:
        _penalize(out, sp, ctx, drafts)
    if packed is not None:
        mask_rows_bits(out, packed)
    elif ctx.constraint is not None:
        allowed = ctx.constraint.allowed(drafts, vocab).to(device)
        out = out.masked_fill(~allowed, float("-inf"))
    return out


def process_next(
    logits: torch.Tensor,  # [m, V] float: rows of requests at the position after their drafts
    sp: SamplingParams,
    ctx: TokenContext,
    drafted: Sequence[int],  # the tokens drafted before this position
) -> torch.Tensor:  # [m, V] float32
    """The processing of the one position that follows `drafted` (a drafter's next token):
    the same result as the last row of `process_block`, without computing the earlier rows.
    A greedy row's grammar is applied only where it forbids the row's argmax: elsewhere the
    masked argmax is that argmax (a mask only removes tokens), which is all a greedy drafter
    reads, and checking one token costs far less than a vocabulary's mask."""
    history = TokenContext(ctx.prompt_ids, list(ctx.output_ids) + list(drafted), None)
    out = process_block(logits, sp, history, []) if sp.penalized else logits.float()
    if ctx.constraint is not None and sp.greedy and out.shape[0] == 1:
        top = int(argmax_rows(out)[0])
        if ctx.constraint.valid_prefix([*drafted, top]) == len(drafted) + 1:
            return out
    if ctx.constraint is not None:
        allowed = ctx.constraint.allowed_after(list(drafted), logits.shape[-1]).to(out.device)
        out = out.masked_fill(~allowed, float("-inf"))
    return out


NEXT_BEST = 3
"""A greedy row whose argmax its grammar forbids tries this many next best tokens, one check
each, before the grammar is asked for a mask (`next_best_allowed`)."""


def next_best_allowed(row: torch.Tensor, allows: Callable[[int], bool]) -> tuple[int, torch.Tensor] | None:
    """row: [V] logits whose argmax the grammar forbids; allows(index): whether the grammar
    allows that entry next -> (the best allowed of the next `NEXT_BEST` entries, the indices
    ranked above it), or None: a mask decides (none of them allowed). A check of one token
    costs far less than a mask (a constraint without a cursor answers masks as bool rows)."""
    k = min(NEXT_BEST + 1, row.shape[-1])
    best = top_entries(row.float(), k)
    values, ids = best.values.tolist(), best.indices.tolist()
    for j in range(1, k):
        if values[j] == float("-inf"):
            return None
        if allows(ids[j]):
            return int(ids[j]), best.indices[:j]
    return None


TOP_BLOCK = 64
"""`top_entries` reads a wide row's maxima over blocks of this many entries."""


def top_entries(row: torch.Tensor, k: int) -> torch.return_types.topk:
    """row.topk(k) of a 1-D row (the same values in order; among equal values the indices may
    come in another order). A row as wide as a vocabulary goes through the maxima of its
    TOP_BLOCK-wide blocks: its k largest entries lie in the k blocks with the largest maxima,
    so one pass of max and a top-k over k blocks replace a top-k over the whole row (which is
    many times slower on CPUs)."""
    n = row.shape[-1]
    if row.dim() != 1 or n % TOP_BLOCK or n < 64 * TOP_BLOCK or k > TOP_BLOCK:
        return row.topk(k)
    blocks = row.view(-1, TOP_BLOCK)
    chosen = blocks.amax(1).topk(k).indices  # [k]
    best = blocks.index_select(0, chosen).reshape(-1).topk(k)  # over k * TOP_BLOCK candidates
    at = chosen[best.indices // TOP_BLOCK] * TOP_BLOCK + best.indices % TOP_BLOCK
    return torch.return_types.topk((best.values, at))


def _ids(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device).clamp(0, vocab - 1)


def _penalize(out: torch.Tensor, sp: SamplingParams, ctx: TokenContext, drafts: Sequence[int]) -> None:
    """The history penalties of `process_block` on out [n, V] float32, in place: row k counts
    the output so far and drafts[:k] (the repetition penalty the prompt too). Only the columns
    of tokens seen anywhere change, so the work is done on those columns alone ([n, M], M the
    distinct tokens seen), in the same order and arithmetic as over the whole vocabulary (a
    column no row has seen would only lose 0)."""
    n, vocab = out.shape
    device = out.device
    hist, drafted = _ids(ctx.output_ids, vocab, device), _ids(drafts[: n - 1], vocab, device)
    parts = [hist, drafted]
    rp = sp.repetition_penalty
    with_prompt = rp != 1.0 and len(ctx.prompt_ids) > 0  # the repetition penalty covers it
    if with_prompt:
        parts.append(_ids(ctx.prompt_ids, vocab, device))
    cols, where_in = torch.unique(torch.cat(parts), return_inverse=True)  # [M], [sum of parts]
    if cols.numel() == 0:
        return
    m, h, d = cols.numel(), hist.numel(), drafted.numel()
    counts = torch.zeros(m, dtype=torch.float32, device=device).index_add_(
        0, where_in[:h], torch.ones(h, dtype=torch.float32, device=device)
    )
    counts = counts.unsqueeze(0).repeat(n, 1)  # [n, M]: row k also counts drafts[:k]
    if n > 1 and d:
        counts[1:] += torch.nn.functional.one_hot(where_in[h : h + d], m).float().cumsum(0)
    x = out[:, cols]
    if rp != 1.0:
        seen = counts > 0
        if with_prompt:
            prompt = torch.zeros(m, dtype=torch.bool, device=device)
            prompt[where_in[h + d :]] = True
            seen = seen | prompt
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if sp.frequency_penalty:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty:
        x = x - sp.presence_penalty * (counts > 0).float()
    out[:, cols] = x
