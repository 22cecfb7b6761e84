"""Propose: what each decoding request sends to verification this step.

One component owns the drafter, the draft gate (does drafting pay at this load?), the
verification-length policy, the draft headroom, and their special cases (seeded sampled
requests draft greedily: their rows are judged by keyed samples, `verifier/verify.py`;
online-confidence drafters explore on a fixed schedule). Each
step it returns one `StepProposal`: a draft block per decoding request and how many of its
drafts the target verifies. Everything it decides is fixed before, or independent of, the
drafted tokens' values, so verification stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dspark_serve.drafter.base import AcceptedContext, Drafter, DraftProposal, DraftRequest
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.correction import CostCorrection
from dspark_serve.scheduler.gate import DraftGate, GateConfig
from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.overhead import StepOverhead
from dspark_serve.scheduler.policy import CostTable, Policy, PolicyDecision, PolicyInput, parse_policy
from dspark_serve.scheduler.request import Request, Status

# Used only when no profile was measured (tests, policies that ignore cost): SPS flat to 8
# tokens, then falling as on a compute-bound machine.
DEFAULT_COST = CostTable((1, 8, 64, 512), (100.0, 100.0, 40.0, 6.0))


def heading_for(decoding: int, others: int, prefills: bool) -> int:
    """The requests a step's load level counts (the level its drafting is judged at): the
    decoding ones, and where the step prefills, those prefilling or waiting too (`others`),
    which decode within a few steps."""
    return decoding + (others if prefills else 0)


@dataclass
class StepProposal:
    """The speculation side of one step, for the decoding requests in batch order.

    proposals: one DraftProposal per decoding request (possibly empty blocks).
    lengths: drafts each request verifies (<= len(proposals[i])).
        A proposal's branch (`DraftProposal.branch`: a second draft block from the same
        anchor), where one is kept, is verified whole.
    drafting: the draft gate let this step draft.
    decision: what the policy decided (None when no request decodes).
    """

    proposals: list[DraftProposal]
    lengths: list[int]
    drafting: bool = True
    decision: PolicyDecision | None = None

    def branch(self, i: int) -> torch.Tensor | None:  # [M] int64 or None
        """Request i's branch: a second draft block verified beside `drafts(i)` from the same
        anchor (the engine's `Branch`), or None."""
        return self.proposals[i].branch

    def drafts(self, i: int) -> torch.Tensor:  # [lengths[i]] int64
        """The draft tokens request i sends to verification."""
        return self.proposals[i].tokens[: self.lengths[i]]

    def draft_probs(self, i: int) -> torch.Tensor | None:  # [lengths[i], V] or None
        p = self.proposals[i].probs
        return None if p is None else p[: self.lengths[i]]


@dataclass
class Drafts:
    """This step's draft blocks, one per decoding request in batch order (empty blocks where
    the gate closed the step: drafting False)."""

    proposals: list[DraftProposal]
    drafting: bool


def no_drafts(n: int) -> list[DraftProposal]:
    return [DraftProposal(tokens=torch.empty(0, dtype=torch.long)) for _ in range(n)]


def _draft_sampling(sp: SamplingParams, rule: str) -> SamplingParams:
    """What the drafter drafts a request with (`SchedulerConfig.draft_rule`). Its processing
    (penalties, bias, grammar) always stays. A seeded sampled request keeps a draft only where it
    equals the target's keyed sample, which it does with probability p(draft), so its drafts are
    the drafter's most likely tokens (p(argmax q) beats the sum of p q of sampled drafts wherever
    q is near p). An unseeded one drafts from q at its own temperature ("sampled": kept with
    probability min(1, p/q)) or, "argmax", the drafter's most likely tokens with q one-hot on them
    (kept with probability p(draft), the rest drawn from p without it): lossless either way."""
    if sp.greedy or (sp.seed is None and rule == "sampled"):
        return sp
    return replace(sp, temperature=0.0)


class Speculation:
    """Drafter + draft gate + verification-length policy, behind one `propose` call."""

    def __init__(
        self,
        drafter: Drafter | None,
        cfg: SchedulerConfig,
        max_model_len: int,
        cost_table: CostTable | None = None,
    ) -> None:
        self.drafter = drafter
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.correction = CostCorrection()  # the table as measured while serving
        self.cost_table = cost_table
        self.overhead = StepOverhead()
        self.priced_overhead: float | None = None  # what the last step's lengths were priced with
        self._drafted_last = False
        self._gate: DraftGate | None = None
        policy = cfg.verify_policy
        if policy == "auto":
            policy = "dspark" if drafter is not None else "none"
        self.use_policy(policy)

    @property
    def cost_table(self) -> CostTable | None:
        """The profiled table (None: none was measured)."""
        return self._cost_table

    @cost_table.setter
    def cost_table(self, table: CostTable | None) -> None:
        self._cost_table = table
        # what the policy prices with: the profile (or a default), corrected as measured; built
        # once here, not every step
        self.priced_table = replace(table or DEFAULT_COST, correction=self.correction.factor)

    def use_table(self, table: CostTable) -> None:
        """A newly measured table takes over (the full one after the provisional,
        `scheduler/idle_profile.py`): the online correction starts afresh, since what it learned
        was the old table's error."""
        self.correction = CostCorrection()
        self.cost_table = table

    def use_policy(self, spec: str) -> None:
        self.policy: Policy = parse_policy(spec)
        # The load-aware policy also decides whether drafting pays at all (scheduler/gate.py).
        # What the gate learned is about this drafter on this machine, not about the policy:
        # it is kept across policy switches.
        on = self.drafter is not None and self.cfg.draft_gate and self.policy.name == "dspark"
        if on and self._gate is None:
            # With a profiled cost table the gate predicts drafting's gain at a load it has not
            # measured from one it has (what verification costs there is on the table, as
            # corrected by the forwards measured since: the policy's prices).
            has_table = self.cost_table is not None
            price = (lambda b, n: 1.0 / self.priced_table.sps(b, n)) if has_table else None
            self._gate = DraftGate(GateConfig(price=price))
        self.gate = self._gate if on else None

    @property
    def _drafting(self) -> Drafter | None:
        """The drafter when speculating (one is loaded and the policy is not `none`), else None."""
        return self.drafter if self.policy.name != "none" else None

    @property
    def speculating(self) -> bool:
        """A drafter is loaded and the policy may verify drafts (policy `none` = plain decoding)."""
        return self._drafting is not None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter absorbs (empty when not speculating)."""
        d = self._drafting
        return tuple(d.tap_layers) if d is not None else ()

    def draft_reserve(self, running: list[Request], waiting: int = 0) -> int:
        """Tokens per decoding request the scheduler leaves free for drafts the policy may admit.
        None where the gate runs this step's load level plain: the reserve only shrinks the
        prefill chunks, and a step that prefills drafts only in the level's favoured mode, so a
        reserve there would cost prefill steps for drafts never made. The level is the one
        `draft` will read: where the step may prefill (a request prefilling, or `waiting` to be
        admitted), it counts those requests too."""
        d = self._drafting
        if d is None:
            return 0
        if self.gate is not None:
            decoding = sum(1 for r in running if r.status is Status.DECODE)
            others = len(running) - decoding + waiting
            v = self.gate.favoured(heading_for(decoding, others, others > 0))
            if v is None or not v[0]:
                return 0
        return min(2, d.block_size)

    # -- propose -------------------------------------------------------------------------------
    def draft(self, decodes: list[Request], load: LoadState | None) -> Drafts:
        """Draft for every decoding request, where the draft gate lets this step draft.
        load: the engine's load this step (the gate reads its level)."""
        if not decodes:
            return Drafts([], drafting=False)
        # One decoding request: a drafter that already decides per request whether its drafts pay
        # (the combined drafter drafts nothing where its rounds do not) is not second-guessed by
        # the gate, whose load-level verdict would carry one request's text over to the next.
        own_choice = len(decodes) == 1 and getattr(self.drafter, "decides_per_request", False)
        # A step that also prefills is not measured by the gate: it drafts only when drafting
        # is the level's favoured mode, never as an exploration (drafting there pays for the
        # drafter's catch-up on every request's kept context, and the step teaches nothing).
        # Its level counts the requests still prefilling and those queued behind them, which
        # decode within a few steps: while many ramp up, drafting for the first few would pay
        # that catch-up for contexts that stop drafting once all of them decode at a level
        # where drafting loses (many requests arriving at once are admitted a few a step).
        prefilling = load is not None and load.prefill_tokens > 0
        soon = heading_for(len(decodes), load.num_prefilling + load.num_waiting if load else 0, prefilling)
        drafting = self.gate is None or own_choice
        if not drafting:
            assert self.gate is not None and self.drafter is not None
            catch_up = None if prefilling else self.drafter.catch_up_seconds([r.request_id for r in decodes])
            drafting = self.gate.should_draft(soon, explore=not prefilling, catch_up=catch_up)
        proposals = self._draft(decodes, branches=not prefilling) if drafting else no_drafts(len(decodes))
        return Drafts(proposals, drafting)

    def choose_lengths(
        self, decodes: list[Request], drafts: Drafts, room: int, load: LoadState | None
    ) -> StepProposal:
        """How many of its drafts each decoding request verifies (the policy), and which
        branches fit beside them.

        room: tokens the forward can still take beyond one anchor per decode (the step's token
            budget minus prefill chunks and anchors): a hard cap on the drafts verified.
        load: the engine's load this step (the policy reads it)."""
        if not decodes:
            return StepProposal([], [])
        proposals = drafts.proposals
        lengths, decision = self._choose_lengths(decodes, proposals, room, load)
        self._trim_branches(proposals, lengths, min(self.cfg.branch_rows, room + len(decodes)))
        return StepProposal(proposals, lengths, drafts.drafting, decision)

    @staticmethod
    def _trim_branches(proposals: list[DraftProposal], lengths: list[int], cap: int) -> None:
        """Branches ride only within the nearly-free rows: each keeps what fits in `cap`
        verified rows after every request's anchor and verified drafts (and the branches
        before it), its own anchor row included; one that does not fit is dropped."""
        rows = sum(1 + n for n in lengths)
        for i, p in enumerate(proposals):
            if p.branch is not None:
                keep = min(len(p.branch), cap - rows - 1)  # its anchor row + its drafts
                proposals[i] = replace(p, branch=p.branch[:keep] if keep > 0 else None)
                rows += 1 + keep if keep > 0 else 0

    def lookahead(self, r: Request) -> int:
        """The most drafts `r` may verify this step (fixed before drafting; the scheduler makes
        sure their KV fits)."""
        return self._max_draft(r) if self.speculating else 0

    def _max_draft(self, r: Request) -> int:
        assert self.drafter is not None
        cap = min(
            self.drafter.block_size,
            r.max_tokens - len(r.output_ids) - 1,
            self.max_model_len - r.num_tokens - 1,
        )
        if self.policy.max_length is not None:  # static:k never verifies more than k
            cap = min(cap, self.policy.max_length)
        if self.policy.name == "dspark" and self.cfg.draft_headroom and r.last_budget is not None:
            # Skip positions the policy will not admit: it gave this request `last_budget`
            # drafts a step ago, and load moves slowly. Fixed before any draft of this step
            # is sampled, so it cannot bias the output.
            cap = min(cap, r.last_budget + self.cfg.draft_headroom)
        return max(0, cap)

    def _draft(self, decodes: list[Request], branches: bool = False) -> list[DraftProposal]:
        """branches: greedy requests may get a branch (`DraftRequest.branch`) where every
        request's full block and a branch's anchor and first draft fit in `branch_rows`
        verified rows (`propose` trims branches to the rows left)."""
        proposals = no_drafts(len(decodes))
        if not self.speculating or not decodes:
            return proposals
        assert self.drafter is not None
        branching = branches and (1 + self.drafter.block_size) * len(decodes) + 2 <= self.cfg.branch_rows
        views = [
            DraftRequest(
                r.request_id,
                r.token_ids,
                len(r.prompt_ids),
                _draft_sampling(r.sampling, self.cfg.draft_rule),
                r.generator,
                self._max_draft(r),
                r.constraint,
                branching and r.sampling.greedy and r.constraint is None and not r.sampling.penalized,
                r.sampling,
            )
            for r in decodes
        ]
        todo = [i for i, v in enumerate(views) if v.max_draft > 0]
        if todo and self.drafter is not None:
            for i, p in zip(todo, self.drafter.propose([views[i] for i in todo])):
                proposals[i] = p
        return proposals

    def _choose_lengths(
        self, decodes: list[Request], proposals: list[DraftProposal], room: int, load: LoadState | None
    ) -> tuple[list[int], PolicyDecision]:
        # The forward's token budget is a hard cap. It is applied to the per-request maxima
        # *before* the policy, from quantities that do not depend on the drafted tokens, so
        # which drafts get verified stays causal (no bias).
        caps = [len(p) for p in proposals]
        if sum(caps) > room:
            share, extra = divmod(max(room, 0), len(caps))
            caps = [min(c, share + (i < extra)) for i, c in enumerate(caps)]
        inp = PolicyInput(
            confidences=[p.confidences for p in proposals], max_lengths=caps, weights=self._weights(decodes)
        )
        table = self.priced_table
        overhead = self.overhead.seconds(len(decodes)) if self.cfg.price_overhead else None
        if overhead:
            table = replace(table, overhead_seconds=overhead)
        self.priced_overhead = overhead or None
        decision = self.policy(inp, table, load or LoadState(len(decodes)))
        lengths = list(decision.lengths)
        for r, p, n in zip(decodes, proposals, lengths):
            if len(p):  # a step the gate kept plain says nothing about the budget
                r.last_budget = n
        if self.drafter is not None and self.drafter.online_confidence and self.policy.name != "none":
            # Exploration on a fixed schedule: it depends on the step count only, never on the
            # drafted tokens, so it cannot bias the output.
            for i, r in enumerate(decodes):
                if caps[i] > 0 and r.spec.steps % self.cfg.explore_every == 0:
                    lengths[i] = max(lengths[i], 1)
        return lengths, decision

    def _weights(self, decodes: list[Request]) -> list[float] | None:
        """Scheduling by priority: each request's weight in the budget choice, 1 for the best
        priority in the step and half for each level worse (at most 8 levels down)."""
        if self.cfg.scheduling_policy != "priority" or not decodes:
            return None
        best = min(r.priority for r in decodes)
        return [0.5 ** min(r.priority - best, 8) for r in decodes]

    # -- after verification ----------------------------------------------------------------------
    def settle(
        self, r: Request, verified: int, accepted: int, branch: tuple[int, int] | None = None
    ) -> tuple[int, int] | None:
        """Book one decode step of `r` that verified `verified` drafts and kept `accepted`
        (and, with a branch, `branch` = its verified and accepted drafts; the round counts the
        block whose run was kept, the first on a tie). Returns the round's (verified,
        accepted), or None when no draft was verified."""
        r.spec.steps += 1
        d = self._drafting
        if d is None:
            return None
        if verified > 0:
            d.observe_acceptance(r.request_id, verified, accepted)
        if branch is not None and branch[0] > 0:
            feedback = getattr(d, "observe_branch", None)
            if feedback is not None:
                feedback(r.request_id, *branch)
            if branch[1] > accepted or verified <= 0:
                verified, accepted = branch
        if verified <= 0:
            return None
        r.spec.rounds += 1
        r.spec.drafted += verified
        r.spec.accepted += accepted
        return verified, accepted

    def observe(self, contexts: list[AcceptedContext]) -> None:
        """The drafter absorbs what the target kept (only when it drafts)."""
        d = self._drafting
        if contexts and d is not None:
            d.observe(contexts)

    def record_step(
        self,
        proposal: StepProposal,
        num_decodes: int,
        has_prefills: bool,
        decode_tokens: int,
        seconds: float,
        forward_seconds: float,
    ) -> None:
        """Teach the gate how fast this step was (pure decode steps only: a prefill chunk would
        dominate the time), and the overhead estimate what the step spent besides the forward
        (drafting steps that follow a drafting step: the first after plain ones also absorbs
        the context they kept)."""
        pure = num_decodes > 0 and not has_prefills
        rows = num_decodes + sum(proposal.lengths)
        if pure:  # what the profile predicted for this forward, against what it took
            predicted = 1.0 / (self.cost_table or DEFAULT_COST).profiled_sps(rows, num_decodes)
            self.correction.record(rows, num_decodes, predicted, forward_seconds)
        if self.gate is not None and pure:
            self.gate.record(num_decodes, proposal.drafting, decode_tokens, seconds, rows)
        if pure and proposal.drafting and self._drafted_last:
            self.overhead.record(num_decodes, seconds, forward_seconds)
        self._drafted_last = proposal.drafting

    def free(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.free(request_id)
