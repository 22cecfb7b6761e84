"""Verification assembly: one step's target logits and draft blocks -> the flat inputs of
`rejection_sample` -> the verdict.

Rows are verified tokens: request after request, its drafts' positions then its bonus
position, exactly the rows the target's flat forward returned logits for. Request b owns
rows offsets[b] .. offsets[b+1] - 1 (cu_seqlens style, `verify_offsets`); nothing is padded
to the longest block, so the buffers hold sum(K_i + 1) rows of the vocabulary, not R x (K+1).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from dspark_serve.ops.cpu_kernels import argmax_allowed, argmax_rows, mask_words
from dspark_serve.ops.processors import (
    GuardedConstraint,
    TokenContext,
    needs_processing,
    process_block,
)
from dspark_serve.ops.sampling import (
    SamplingTensors,
    keyed_uniforms,
    probs_from_logits,
    sample_from_uniforms,
)
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.verifier.grammar import Grammar, fill_masks
from dspark_serve.verifier.rejection import RejectionResult, greedy_verify, rejection_sample, verify_offsets

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyRequest:
    """One request's part of a verification step.

    sampling: the request's sampling parameters (shape the target distribution p).
    generator: its torch.Generator (seeded requests) or None (global RNG).
    draft_tokens: [K] int64, the drafts it verifies (K may be 0: plain decoding / first token).
    draft_probs: [K, V] float, the draft q each was sampled from, or None (one-hot q).
    context: the tokens (and grammar) its penalties / logit bias / constraint read, or None
        when it has none (`ops/processors.py`; row k sees drafts 0..k-1 too).
    position: for a seeded sampled request, the output position its first row samples: row k
        samples position + k with the uniform keyed by (seed, position + k)
        (`keyed_uniforms`), and a draft is kept only where it equals that sample, so the
        output is plain decoding's with the same seed whatever was drafted. None: the rows
        are judged by rejection sampling with uniforms from `generator`.
    """

    sampling: SamplingParams
    generator: torch.Generator | None
    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    context: TokenContext | None = None
    position: int | None = None

    @property
    def keyed(self) -> bool:
        return self.position is not None and self.sampling.seed is not None and not self.sampling.greedy

    @property
    def num_draft(self) -> int:
        return int(self.draft_tokens.numel())


@dataclass
class VerifyInputs:
    """The flat arguments of `rejection_sample` for one step (B requests, D = sum K_i drafts).

    target_probs: [T, V] float32, T = sum(K_i + 1): processed target p per verify row.
    draft_tokens: [D] int64, the drafts, request after request.
    draft_probs: [D, V] float or None (every request one-hot).
    num_draft: [B] int64, K_i.
    generators: B entries.
    draft_deterministic: [B] bool, requests whose q is one-hot on the draft.
    faults: request index -> why its processing failed (`ProcessedRows`).
    """

    target_probs: torch.Tensor
    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    num_draft: torch.Tensor
    generators: list[torch.Generator | None]
    draft_deterministic: torch.Tensor
    faults: dict[int, str] = field(default_factory=dict)

    @property
    def offsets(self) -> torch.Tensor:  # [B+1] int64
        return verify_offsets(self.num_draft)


def build_verify_inputs(
    logits: torch.Tensor,  # [T, V] float, the target's logits at the verify rows, requests in order
    requests: Sequence[VerifyRequest],  # B entries, in row order
) -> VerifyInputs:
    """Target p for every verify row at once (each request's parameters repeated over its
    K_i + 1 rows) and the drafts concatenated in the same order."""
    counts = _draft_counts(logits, requests)
    device, vocab = logits.device, logits.shape[1]
    num_draft = torch.tensor(counts, dtype=torch.long)
    st = SamplingTensors.from_params([r.sampling for r in requests], device)
    e = st.repeat_interleave(torch.tensor([n + 1 for n in counts], device=device))
    processed = process_rows(logits, requests)
    target = probs_from_logits(processed.logits, e.temperature, e.top_p, e.top_k, e.min_p)
    _key_rows(target, requests, counts)
    drafted = [r for r in requests if r.num_draft > 0]
    tokens = _flat_drafts(requests)
    deterministic = torch.tensor(
        [r.draft_probs is None or r.num_draft == 0 for r in requests], dtype=torch.bool
    )
    draft_probs = None
    if any(r.draft_probs is not None for r in drafted):
        draft_probs = torch.cat(
            [
                r.draft_probs[: r.num_draft].to(device=device, dtype=target.dtype)
                if r.draft_probs is not None
                else target.new_zeros(r.num_draft, vocab)
                for r in drafted
            ]
        )
    return VerifyInputs(
        target,
        tokens,
        draft_probs,
        num_draft,
        [r.generator for r in requests],
        deterministic,
        processed.faults,
    )


def _key_rows(target: torch.Tensor, requests: Sequence[VerifyRequest], counts: list[int]) -> None:
    """A keyed request's rows become one-hot on the token its keyed uniforms sample from them.
    Rejection sampling then keeps a draft exactly where it equals that token and emits the
    token at the first one that does not (or as the bonus): plain decoding's sample, whatever
    q the drafts came from (p one-hot: p(x) / q(x) is 0 or >= 1, the residual is p)."""
    rows: list[int] = []
    uniforms: list[torch.Tensor] = []
    start = 0
    for r, k in zip(requests, counts):
        if r.keyed:
            assert r.position is not None and r.sampling.seed is not None
            rows += range(start, start + k + 1)
            uniforms.append(keyed_uniforms(r.sampling.seed, range(r.position, r.position + k + 1)))
        start += k + 1
    if not rows:
        return
    idx = torch.tensor(rows, device=target.device)  # one draw for every keyed row of the step
    tok = sample_from_uniforms(target.index_select(0, idx), torch.cat(uniforms))
    target.index_fill_(0, idx, 0.0)
    target[idx, tok.to(target.device)] = 1.0


def _draft_counts(logits: torch.Tensor, requests: Sequence[VerifyRequest]) -> list[int]:
    """K_i per request, after checking the logits hold exactly sum(K_i + 1) rows."""
    counts = [r.num_draft for r in requests]
    rows = sum(counts) + len(counts)
    if logits.dim() != 2 or logits.shape[0] != rows:
        raise ValueError(f"logits must be [sum(K_i + 1) = {rows}, V], got shape {tuple(logits.shape)}")
    return counts


def _flat_drafts(requests: Sequence[VerifyRequest]) -> torch.Tensor:  # [D] int64, on the host
    """Every request's drafts, request after request."""
    drafts = [r.draft_tokens.reshape(-1).to(torch.long).cpu() for r in requests if r.num_draft]
    return torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class ProcessedRows:
    """Every verify row after its request's processing.

    logits: [T, V] float; the input tensor itself when nobody needed processing.
    faults: request index -> why its processing failed (its rows are left as they came; its
        verdict must be discarded and the request failed alone).
    """

    logits: torch.Tensor
    faults: dict[int, str]
    deferred: dict[int, Grammar] = field(default_factory=dict)


def process_rows(
    logits: torch.Tensor,  # [T, V] float, T = sum(K_i + 1), requests in order
    requests: Sequence[VerifyRequest],
    defer_greedy_grammars: bool = False,
) -> ProcessedRows:
    """Penalties, logit bias and grammar masks, position by position: request b's row k sees
    its tokens so far plus its drafts 0..k-1 (`process_block`). One request's failure (its
    grammar, its processors, a first row that allows no token or holds NaN) is that request's
    fault alone: the others' rows are processed as usual. defer_greedy_grammars: a greedy
    request's llguidance grammar is left out and named in `deferred` (`grammar_argmax` applies
    it where the argmax needs it)."""
    deferred = _deferred(requests) if defer_greedy_grammars else {}
    # a request with nothing but a deferred grammar keeps its rows as they are
    todo = {
        b
        for b, r in enumerate(requests)
        if needs_processing(r.sampling, r.context) and not _grammar_only(r, b, deferred)
    }
    if not todo:
        return ProcessedRows(logits, {}, deferred)
    out = logits.float().clone()
    faults: dict[int, str] = {}
    masks = grammar_masks(requests, logits.shape[-1], skip=deferred)
    start = 0
    for b, r in enumerate(requests):
        n = r.num_draft + 1
        if b in todo:
            ctx = r.context if r.context is not None else TokenContext((), ())
            if b in deferred:
                ctx = TokenContext(ctx.prompt_ids, ctx.output_ids, None)
            try:
                drafts = r.draft_tokens.reshape(-1).tolist()
                rows = process_block(logits[start : start + n], r.sampling, ctx, drafts, masks.get(b))
                problem = _unusable(rows)
            except Exception as exc:
                rows, problem = out[start : start + n], f"{type(exc).__name__}: {exc}"
            if problem is None:
                out[start : start + n] = rows
            else:
                faults[b] = problem
        start += n
    return ProcessedRows(out, faults, {b: g for b, g in deferred.items() if b not in faults})


def _grammar_only(r: VerifyRequest, b: int, deferred: Collection[int]) -> bool:
    """The request's only processing is its grammar, and that is deferred."""
    return b in deferred and not r.sampling.penalized


def _deferred(requests: Sequence[VerifyRequest]) -> dict[int, Grammar]:
    """Greedy requests whose constraint is a working llguidance grammar."""
    return {b: g for b, (_, g) in _grammars(requests).items() if requests[b].sampling.greedy}


def _grammars(requests: Sequence[VerifyRequest]) -> dict[int, tuple[GuardedConstraint, Grammar]]:
    """Request index -> its guard and the working llguidance grammar inside it (requests whose
    constraint is none, failed, or not llguidance's are left out)."""
    out = {}
    for b, r in enumerate(requests):
        c = r.context.constraint if r.context is not None else None
        if isinstance(c, GuardedConstraint) and c.error is None and isinstance(c.inner, Grammar):
            out[b] = (c, c.inner)
    return out


def grammar_argmax(
    processed: ProcessedRows,
    argmax: torch.Tensor,  # [T] int64: the argmax of processed.logits (deferred grammars unapplied)
    requests: Sequence[VerifyRequest],
) -> torch.Tensor:  # [T] int64
    """The argmax each deferred grammar allows, computed only where greedy verification reads
    it: walking a request's rows, a row's argmax the grammar allows is the masked argmax too (a
    mask only removes tokens); where it forbids it, that row alone is masked. The walk stops at
    the first row whose argmax differs from its draft (later rows are never read). A grammar
    failing here fails its request alone (its guard records it)."""
    if not processed.deferred:
        return argmax
    argmax = argmax.cpu().clone()  # read row by row: on the host
    starts = _row_starts(requests)
    for b, g in processed.deferred.items():
        r, start = requests[b], starts[b]
        drafts = r.draft_tokens.reshape(-1).tolist()
        consumed = 0
        try:
            for k in range(len(drafts) + 1):
                token = int(argmax[start + k])
                if g.valid_prefix([token]) != 1:
                    token = _allowed_argmax(processed.logits[start + k], g)
                    argmax[start + k] = token
                if k == len(drafts) or token != drafts[k] or drafts[k] in g.eos_ids:
                    break
                if not g.matcher.consume_token(drafts[k]):
                    raise RuntimeError("grammar refused a draft it allowed")
                consumed += 1
        except Exception as exc:
            processed.faults[b] = f"{type(exc).__name__}: {exc}"
        finally:
            if consumed:
                g.matcher.rollback(consumed)
    return argmax


def _allowed_argmax(row: torch.Tensor, g: Grammar) -> int:
    """row: [V] logits whose argmax g forbids next -> the argmax over the tokens g allows (the
    masked row's, first index on ties), read from g's packed mask in one pass
    (`argmax_allowed`)."""
    bits = torch.empty(mask_words(row.shape[-1]), dtype=torch.int32)
    g.fill_mask(bits)
    row = row if row.device.type == "cpu" else row.cpu()
    top = argmax_allowed(row.contiguous(), bits)
    if top < 0 or not bool(row[top] > float("-inf")):  # nothing allowed, all -inf, or a NaN
        raise RuntimeError("no token is allowed at the next position")
    return top


def _row_starts(requests: Sequence[VerifyRequest]) -> list[int]:
    starts, at = [], 0
    for r in requests:
        starts.append(at)
        at += r.num_draft + 1
    return starts


def grammar_masks(
    requests: Sequence[VerifyRequest], vocab: int, skip: Collection[int] = ()
) -> dict[int, torch.Tensor]:
    """The packed grammar masks of every request whose constraint is a working llguidance
    grammar, all computed in one batch (`fill_masks`): request index -> [K + 1, W] int32. A
    grammar that fails here is recorded by its guard (the request then fails alone); other
    constraints answer row by row in `process_block`."""
    jobs = [
        (b, guard, g, requests[b].draft_tokens.reshape(-1).tolist())
        for b, (guard, g) in _grammars(requests).items()
        if b not in skip
    ]
    if not jobs:
        return {}
    try:
        filled = fill_masks([(g, d) for _, _, g, d in jobs], vocab)
    except Exception as exc:  # the batch itself failed: each grammar answers alone instead
        log.warning("batched grammar masks failed (%s); computing them request by request", exc)
        return {}
    masks = {}
    for (b, guard, _, _), rows in zip(jobs, filled):
        if isinstance(rows, Exception):
            guard.fail(rows)
        else:
            masks[b] = rows
    return masks


def _unusable(rows: torch.Tensor) -> str | None:  # rows: [n, V], one request's processed rows
    """Why a request's processed rows cannot be sampled: its first row (always used) allows no
    token, or processing made NaN."""
    top = rows.amax(-1)  # [n]: NaN wherever a row holds one (the maximum propagates it)
    if bool(torch.isnan(top).any()):
        return "processing the logits produced NaN"
    first = float(top[0])  # no finite entry: the maximum is -inf, or +inf over no finite one
    if first == float("-inf") or (first == float("inf") and not bool(torch.isfinite(rows[0]).any())):
        return "no token is allowed at the next position"
    return None


def verify(
    logits: torch.Tensor,  # [T, V] float, T = sum(K_i + 1)
    requests: Sequence[VerifyRequest],  # B entries, in row order
) -> RejectionResult:
    """Accept / reject every request's drafts; the result comes back on the host (one
    device-to-host copy per step: the engine reads it request by request). A request whose
    processing failed is named in the result's `faults`; its verdict is void."""
    if all(r.sampling.greedy for r in requests):
        # One-hot p: the verdict is the argmax of each processed row; no probabilities needed.
        counts = _draft_counts(logits, requests)
        processed = process_rows(logits, requests, defer_greedy_grammars=True)
        argmax = grammar_argmax(processed, argmax_rows(processed.logits), requests)
        # greedy_verify walks host lists: the drafts stay on the host, the verdict comes back there
        verdict = greedy_verify(argmax, _flat_drafts(requests), torch.tensor(counts, dtype=torch.long))
        return replace(verdict, faults=processed.faults) if processed.faults else verdict
    inp = build_verify_inputs(logits, requests)
    verdict = rejection_sample(
        inp.target_probs,
        inp.draft_tokens,
        inp.draft_probs,
        inp.num_draft,
        inp.generators,
        draft_deterministic=inp.draft_deterministic,
    ).cpu()
    return replace(verdict, faults=inp.faults) if inp.faults else verdict
