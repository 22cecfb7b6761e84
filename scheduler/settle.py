"""Settle: the verdict applied to the engine's state, before any output is made.

Per decoding request: the longer accepted run of its block and its branch is kept, the KV of
rejected drafts rolled back, the committed tokens' full blocks offered to the prefix cache, the
drafter's feedback booked; per prefill: its progress, and a completed prompt's first token. A
request whose own input failed it this step (its logits processing or its grammar) touches
nothing: it is reported, to be failed alone after the others settled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_serve.drafter.base import AcceptedContext
from dspark_serve.ops.processors import GuardedConstraint
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.client import round_provenance
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink
from dspark_serve.scheduler.request import Request, Status
from dspark_serve.scheduler.scheduler import ScheduledBatch
from dspark_serve.scheduler.speculation import Speculation, StepProposal
from dspark_serve.scheduler.verify_step import Verification, VerifyStep
from dspark_serve.verifier.rejection import RejectionResult


@dataclass
class Committed:
    """What one request kept this step, before stop conditions cut it.

    tokens: the new tokens (accepted drafts + the target's own; the first token after a prompt).
    provenance: (kind, draft position) per token (`round_provenance`).
    decoding: it was a decode (not a completing prefill) this step.
    row: its request row in the step's verdict (where its logprobs are read).
    """

    request: Request
    tokens: list[int]
    provenance: list[tuple[str, int | None]]
    decoding: bool
    row: int


@dataclass
class Settled:
    """What each request kept, the contexts (tokens kept + their hidden states) for the drafter
    or the hidden-state capture, and the requests whose own input failed them (request, why)."""

    kept: list[Committed] = field(default_factory=list)
    contexts: list[AcceptedContext] = field(default_factory=list)
    faults: list[tuple[Request, str]] = field(default_factory=list)


def fault_of(r: Request, res: RejectionResult, row: int) -> str | None:
    """Why r's own input failed it this step (its processing at verdict row `row`, its grammar
    anywhere in the step), or None."""
    problem = res.faults.get(row)
    if problem is None and isinstance(r.constraint, GuardedConstraint) and r.constraint.error:
        problem = f"the grammar failed: {r.constraint.error}"
    return problem


@dataclass
class _Kept:
    """A decode's kept run: its drafts, verdict row, forward segment and accepted count."""

    drafts: list[int]
    row: int
    segment: int
    accepted: int
    verified: int


class Settler:
    def __init__(
        self, blocks: BlockManager, verify: VerifyStep, speculation: Speculation, metrics: EngineMetricsSink
    ) -> None:
        self.blocks, self.verify, self.speculation, self.metrics = blocks, verify, speculation, metrics

    def __call__(
        self, batch: ScheduledBatch, proposal: StepProposal, v: Verification, keep_context: bool
    ) -> Settled:
        out = Settled()
        for i, r in enumerate(batch.decodes):  # decodes are rows 0.. of the verdict
            self._decode(i, r, proposal, v, keep_context, out)
        self._prefills(batch, v, keep_context, out)
        return out

    def _decode(
        self, i: int, r: Request, proposal: StepProposal, v: Verification, keep_context: bool, out: Settled
    ) -> None:
        res = v.result
        assert res is not None  # decodes always get a verdict
        b = v.branches.get(i)
        problem = fault_of(r, res, i)
        if problem is not None:
            if b is not None:
                self.verify.close_branch(b.request_id)
            out.faults.append((r, problem))
            return
        first = res.accepted(i)
        k = _Kept(proposal.drafts(i).tolist(), i, i, first, proposal.lengths[i])
        branch_run = None
        if b is not None:  # the longer accepted run of two blocks is kept
            branch_run = (len(b.tokens), res.accepted(b.row))
            won = branch_run[1] > first
            if won:
                k = _Kept(b.tokens.tolist(), b.row, b.segment, branch_run[1], len(b.tokens))
            self.verify.close_branch(b.request_id, adopt_into=r.request_id if won else None)
            self.metrics.record_branch(won)
        accepted = k.drafts[: k.accepted]
        start = r.num_computed
        r.num_computed += 1 + k.accepted
        self.blocks.truncate(r.request_id, r.num_computed)  # roll back rejected drafts
        # only now are these tokens committed: their full blocks may enter the prefix cache
        self.blocks.commit(r.request_id, r.token_ids + accepted, r.num_computed)
        if keep_context:
            out.contexts.append(
                self._context(r.request_id, [r.output_ids[-1]] + accepted, start, v, k.segment)
            )
        booked = self.speculation.settle(r, proposal.lengths[i], first, branch_run)
        if booked is not None:
            self.metrics.record_round(*booked)
        speculating = self.speculation.speculating
        provenance = round_provenance(k.accepted, k.verified if speculating else 0)
        out.kept.append(Committed(r, res.tokens(k.row), provenance, True, k.row))

    @staticmethod
    def _context(
        request_id: str, tokens: list[int], start: int, v: Verification, segment: int
    ) -> AcceptedContext:
        """Tokens kept from `start` on, with their hidden states (forward segment `segment`)."""
        hidden = v.forward.hidden
        off = v.forward.token_offsets[segment]
        return AcceptedContext(
            request_id, tokens, start, None if hidden is None else hidden[off : off + len(tokens)]
        )

    def _prefills(self, batch: ScheduledBatch, v: Verification, keep_context: bool, out: Settled) -> None:
        """Prefill progress; a completed prompt's first token (its verdict rows follow the decodes')."""
        nd = len(batch.decodes)
        row = nd
        res = v.result
        for si, (r, n) in enumerate(batch.prefills):
            ids = r.prefill_ids
            done = r.num_computed + n == len(ids) and not r.output_ids
            problem = fault_of(r, res, row) if done and res is not None else None
            if problem is not None:
                out.faults.append((r, problem))
                row += 1
                continue
            if keep_context:
                chunk = ids[r.num_computed : r.num_computed + n]
                out.contexts.append(self._context(r.request_id, chunk, r.num_computed, v, nd + si))
            r.num_computed += n
            self.blocks.commit(r.request_id, ids, r.num_computed)
            if r.num_computed == len(ids):
                r.status = Status.DECODE
                if done:  # completed a prompt: its first token was sampled
                    assert res is not None
                    out.kept.append(Committed(r, res.tokens(row)[:1], round_provenance(0, 0), False, row))
                    row += 1
