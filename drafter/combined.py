"""Two drafters that complement each other: prompt lookup (n-gram) wins on code and repeated
text, the parallel DSpark drafter on free text. Each request's step uses one of them, or
neither: where DSpark's recent rounds on the request do not pay for their cost and lookup has
no match, the step is a plain one.

The choice must not look at this step's drafted tokens, nor at confidences computed from them:
that would bias sampled output (the Appendix A argument). It uses only quantities fixed before
any draft token of the step is sampled: the primary's recent acceptance on this request (an
exponential average of accepted tokens per verified round, weighed against what its proposal
costs beside lookup's), and prompt lookup's block, a deterministic function of the context:
whether it matches at all, and the acceptance its confidences expect (learned across requests
per length of the suffix matched: a one-token match is a far weaker sign than a four-token one;
a lookup drafter without confidences is judged by its recent acceptance on the request). A
fixed schedule sends every
`explore_every`-th round of a request to the other drafter, so both estimates stay current.
Where the engine verifies a branch (`DraftRequest.branch`, greedy requests only), a
lookup match rides beside a DSpark-led block (and, with `primary_branch`, DSpark's block beside
a lookup-led one); each drafter hears its own block's outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from dspark_serve.drafter.base import AcceptedContext, Drafter, DraftProposal, DraftRequest


@dataclass(frozen=True)
class CombinedConfig:
    """How the per-request choice between two drafters is made.

    decay: weight of the newest round in each drafter's running acceptance (0..1).
    prior: accepted tokens per round a drafter is credited with before it was tried.
    explore_every: every n-th decode step of a request tries the drafter not in favour.
    primary_floor: accepted tokens per round the primary must average on a request for its
        block to be worth drafting there; below it (and with no lookup match) the request drafts
        nothing that step, a plain step, but for the exploring ones. A round pays when its
        accepted drafts outweigh what drafting and the longer verification add to a step; on a
        small CPU that break-even is a fraction of a token per round, and the default sits just
        above it (the floors compared are in docs/training.md, "Serving the drafter").
    primary_cost: what a primary proposal adds to a step beyond prompt lookup's (nearly free),
        as a fraction of the step: with a lookup match, lookup is taken unless the primary's
        rounds make more tokens per unit of time, (1 + primary) > (1 + lookup) * (1 + cost)
        in accepted tokens per round. The default is the share of a plain decode step a DSpark
        proposal costs on a small CPU with the embedded model (bench/drafting_cost.py measures
        it); 0 compares acceptance alone (the costs compared are in docs/training.md).
    primary_branch: whether a step led by a lookup match also drafts the primary's block as
        the branch where the engine verifies one (`DraftRequest.branch`). A lookup
        match always rides beside a primary-led block (it costs nothing to find).
    """

    decay: float = 0.3
    prior: float = 1.0
    explore_every: int = 8
    primary_floor: float = 0.3
    primary_cost: float = 0.2
    primary_branch: bool = False

    def __post_init__(self) -> None:
        if not (0.0 < self.decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if self.prior < 0:
            raise ValueError(f"prior must be >= 0, got {self.prior!r}")
        if self.explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {self.explore_every!r}")
        if self.primary_floor < 0:
            raise ValueError(f"primary_floor must be >= 0, got {self.primary_floor!r}")
        if not self.primary_cost >= 0:  # NaN too
            raise ValueError(f"primary_cost must be >= 0, got {self.primary_cost!r}")


def expected_accepted(confidences: torch.Tensor) -> float:
    """confidences: [K] c_k = P(draft k accepted | drafts < k accepted) -> the expected number
    of drafts accepted, sum over k of c_1 ... c_k."""
    return float(torch.cumprod(confidences.double(), 0).sum()) if len(confidences) else 0.0


@dataclass
class _RequestChoice:
    """Per request: running accepted tokens per round of each drafter, and the last choice."""

    score: list[float]
    steps: int = 0
    last: int = -1


class CombinedDrafter:
    """`primary` (DSpark/DFlash) and `lookup` (n-gram) behind one Drafter interface."""

    online_confidence = True  # the n-gram side learns its confidences online
    decides_per_request = True  # drafts nothing for a request whose rounds do not pay

    def __init__(self, primary: Drafter, lookup: Drafter, config: CombinedConfig | None = None) -> None:
        self.config = config or CombinedConfig()
        self.drafters = (primary, lookup)
        self.name = f"{primary.name}+{lookup.name}"
        self.block_size = max(primary.block_size, lookup.block_size)
        self.tap_layers = tuple(primary.tap_layers)
        self.calibrator = primary.calibrator
        self._state: dict[str, _RequestChoice] = {}
        self.uses = [0, 0]  # request-steps each drafter proposed for (primary, lookup)

    def _choice(self, request_id: str) -> _RequestChoice:
        if request_id not in self._state:
            self._state[request_id] = _RequestChoice([self.config.prior, self.config.prior])
        return self._state[request_id]

    def choose(self, request_id: str, found: DraftProposal) -> int:
        """0 = primary, 1 = lookup, -1 = no draft this step, from this request's history and
        lookup's block `found` (its match, and its confidences where it has them: prompt
        lookup's follow the length of the suffix matched, fixed by the context alone)."""
        st = self._choice(request_id)
        st.steps += 1
        explore = st.steps % self.config.explore_every == 0
        primary_pays = st.score[0] >= self.config.primary_floor
        if not len(found):
            return 0 if (primary_pays or explore) else -1
        c = self.config.primary_cost
        est = st.score[1] if found.confidences is None else expected_accepted(found.confidences)
        best = 1 if ((1.0 + est) * (1.0 + c) >= 1.0 + st.score[0] or not primary_pays) else 0
        return 1 - best if explore else best

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        primary, lookup = self.drafters
        out: list[DraftProposal] = lookup.propose(requests)  # cheap: a suffix match per request
        use_primary = []
        for i, (r, p) in enumerate(zip(requests, out)):
            which = self.choose(r.request_id, p)
            self._state[r.request_id].last = which
            # Where the engine verifies a branch (r.branch), a lookup match and the
            # primary's block are both sent; the choice above only says which one leads.
            if which == 0 or (which == 1 and r.branch and self.config.primary_branch):
                use_primary.append(i)
            elif which < 0:
                out[i] = DraftProposal(tokens=torch.empty(0, dtype=torch.long))
        if use_primary:
            for i, p in zip(use_primary, primary.propose([requests[i] for i in use_primary])):
                found = out[i]
                if self._state[requests[i].request_id].last == 1:
                    out[i] = replace(found, branch=p.tokens if len(p) else None)
                elif requests[i].branch and len(found):
                    out[i] = replace(p, branch=found.tokens)
                else:
                    out[i] = p
        for r in requests:
            last = self._state[r.request_id].last
            if last >= 0:
                self.uses[last] += 1
        return out

    def observe(self, contexts: list[AcceptedContext]) -> None:
        for d in self.drafters:  # both keep complete contexts, whichever drafted
            d.observe(contexts)

    def observe_branch(self, request_id: str, proposed: int, accepted: int) -> None:
        """Feedback on the block that rode along as the branch (the drafter not leading)."""
        st = self._state.get(request_id)
        if st is None or st.last < 0 or proposed <= 0:
            return
        other = 1 - st.last
        d = self.config.decay
        st.score[other] = (1 - d) * st.score[other] + d * accepted
        self.drafters[other].observe_acceptance(request_id, proposed, accepted)

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        # the lookup absorbs nothing; what the primary would is an upper bound (requests
        # the lookup drafts for this step leave their context waiting)
        return self.drafters[0].catch_up_seconds(request_ids)

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        st = self._state.get(request_id)
        if st is None or st.last < 0 or proposed <= 0:
            return
        d = self.config.decay
        st.score[st.last] = (1 - d) * st.score[st.last] + d * accepted
        self.drafters[st.last].observe_acceptance(request_id, proposed, accepted)

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        for d in self.drafters:
            d.free(request_id)


def build_dspark_ngram(
    path: str,
    target_model: Any = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    online_calibration: bool = True,
    cuda_graphs: bool = False,
) -> CombinedDrafter:
    """The DSpark drafter at `path` and prompt lookup, chosen per request and step."""
    from dspark_serve.drafter.dspark import build_dspark
    from dspark_serve.drafter.ngram import build_ngram

    primary = build_dspark(path, target_model, block_size, device, dtype, online_calibration, cuda_graphs)
    return CombinedDrafter(primary, build_ngram(block_size=primary.block_size))
