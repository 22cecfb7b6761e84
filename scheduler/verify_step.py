"""Verify: the step's one flat target forward and the verdict on it.

Every decoding request contributes a segment of its anchor + the drafts it verifies, every
prefill its chunk, and each branch (a second draft block verified for a decoding request) a
segment over a fork of its request's block table; their KV slots are reserved in the scheduler's
block allocator before the forward, so a failed allocation never leaves half a forward. Then
rejection sampling over the flat logits (`verifier/verify.py`) gives the verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark_serve.ops.processors import TokenContext, needs_processing
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink
from dspark_serve.scheduler.prefix import TapCache
from dspark_serve.scheduler.request import Request
from dspark_serve.scheduler.scheduler import ScheduledBatch
from dspark_serve.scheduler.speculation import StepProposal
from dspark_serve.verifier.model_runner import ForwardOutput, ModelRunner, Segment
from dspark_serve.verifier.rejection import RejectionResult
from dspark_serve.verifier.verify import VerifyRequest, verify


@dataclass(frozen=True)
class Branch:
    """A second draft block verified for one decoding request, over a fork of its block table.

    request_id: the fork's id in the block allocator.
    tokens: [M] int64, its drafts.
    segment: its segment's index in the forward; row: its request row in the verdict.
    """

    request_id: str
    tokens: torch.Tensor
    segment: int
    row: int


@dataclass
class Verification:
    """The target's verdict for one step.

    forward: the flat forward's logits and hidden states.
    result: rejection sampling's verdict; its requests are the decodes, then the prefills that
        completed their prompt, then the branches (None when only partial prefill chunks ran).
    branches: per decode index with a branch, where its segment and verdict row are.
    forward_seconds: how long the target forward took (the step's overhead is the rest).
    """

    forward: ForwardOutput
    result: RejectionResult | None
    branches: dict[int, Branch] = field(default_factory=dict)
    forward_seconds: float = 0.0


class ForwardClock:
    """Times the target forward: the wall clock on a CPU; on CUDA, events recorded around the
    forward's launches and read once the step's verdict has come back (it waits for the forward
    anyway), so timing adds no synchronisation of its own."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.t1 = self.t0
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.start.record()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()  # already complete after a verdict; else the step's one wait
            return float(self.start.elapsed_time(self.end)) / 1e3
        return self.t1 - self.t0


def token_context(r: Request) -> TokenContext | None:
    """What r's penalties, logit bias and grammar read (None when it has none)."""
    ctx = TokenContext(r.prompt_ids, r.output_ids, r.constraint)
    return ctx if needs_processing(r.sampling, ctx) else None


class VerifyStep:
    def __init__(
        self, runner: ModelRunner, blocks: BlockManager, taps: TapCache, metrics: EngineMetricsSink
    ) -> None:
        self.runner, self.blocks, self.taps, self.metrics = runner, blocks, taps, metrics
        # block tables forked for branches this step; adopted or freed when it settles
        self.open_branches: list[str] = []

    def __call__(
        self, batch: ScheduledBatch, proposal: StepProposal, tap_layers: tuple[int, ...]
    ) -> Verification:
        segments: list[Segment] = []
        checks: list[VerifyRequest] = []
        self._decodes(batch, proposal, segments, checks)
        self._prefills(batch, segments, checks)
        branches = self._fork_branches(batch, proposal, segments, checks)
        clock = ForwardClock(self.runner.device)
        fwd = self.runner.forward(segments, tap_layers)
        clock.stop()
        result = verify(fwd.logits, checks) if checks else None
        took = clock.seconds()  # after the verdict's read: the forward has run by then
        self.metrics.record_forward(sum(len(s.token_ids) for s in segments), took)
        return Verification(fwd, result, branches if checks else {}, forward_seconds=took)

    def _segment(self, request_id: str, tokens: list[int], start: int, logits_from: int) -> Segment:
        """Reserve the tokens' KV slots, then the segment over the request's block table."""
        self.blocks.append(request_id, len(tokens))
        return self.blocks.segment(request_id, tokens, start, logits_from)

    def _decodes(
        self,
        batch: ScheduledBatch,
        proposal: StepProposal,
        segments: list[Segment],
        checks: list[VerifyRequest],
    ) -> None:
        for i, r in enumerate(batch.decodes):
            drafts = proposal.drafts(i)
            toks = [r.output_ids[-1]] + drafts.tolist()
            segments.append(self._segment(r.request_id, toks, r.num_computed, 0))
            position = len(r.output_ids)  # a seeded request samples keyed by position
            checks.append(
                VerifyRequest(
                    r.sampling, r.generator, drafts, proposal.draft_probs(i), token_context(r), position
                )
            )

    def _prefills(self, batch: ScheduledBatch, segments: list[Segment], checks: list[VerifyRequest]) -> None:
        for r, n in batch.prefills:
            # A resumed (preempted) request recomputes its prompt and output but the last
            # token, which it already has: it samples nothing.
            done = r.num_computed + n == r.num_prefill_tokens and not r.output_ids
            chunk = r.prefill_ids[r.num_computed : r.num_computed + n]
            segments.append(self._segment(r.request_id, chunk, r.num_computed, n - 1 if done else n))
            if done:  # its last prompt row samples the first token
                none = torch.empty(0, dtype=torch.long)
                checks.append(
                    VerifyRequest(r.sampling, r.generator, none, None, token_context(r), len(r.output_ids))
                )

    def _fork_branches(
        self,
        batch: ScheduledBatch,
        proposal: StepProposal,
        segments: list[Segment],
        checks: list[VerifyRequest],
    ) -> dict[int, Branch]:
        """A segment and a verdict row of their own for each branch: a fork of the request's
        block table from its anchor on (`BlockManager.fork`), after everything else."""
        blocks = self.blocks
        out: dict[int, Branch] = {}
        for i, r in enumerate(batch.decodes):
            alt = proposal.branch(i)
            if alt is None:
                continue
            bid = f"{r.request_id}\x00branch"
            n = r.num_computed
            need = blocks.blocks_needed(n + 1 + len(alt)) - n // blocks.block_size
            if need > blocks.num_free_blocks:
                continue
            pair = blocks.fork(r.request_id, bid, n)
            self.open_branches.append(bid)
            if pair is not None:  # the shared positions of its partial block: KV and tap rows
                self.runner.copy_kv_block(*pair)
                self.taps.copy_block(*pair)
            out[i] = Branch(bid, alt, len(segments), len(checks))
            segments.append(self._segment(bid, [r.output_ids[-1]] + alt.tolist(), n, 0))
            checks.append(VerifyRequest(r.sampling, r.generator, alt, None, None))
        return out

    def close_branch(self, branch_id: str, adopt_into: str | None = None) -> None:
        """A branch settled: its table adopted by its request (its run was kept) or freed."""
        if adopt_into is not None:
            self.blocks.adopt(adopt_into, branch_id)
        else:
            self.blocks.free(branch_id)
        self.open_branches.remove(branch_id)

    def free_open_branches(self) -> None:
        """A failed step: every fork it made goes back to the pool."""
        for bid in self.open_branches:
            self.blocks.free(bid)
        self.open_branches.clear()
