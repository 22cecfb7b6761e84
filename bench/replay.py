"""A drafter with a controlled acceptance rate, for measuring the engine on a real cost curve
without a trained drafter: it replays the target's own greedy continuation (recorded from a
plain run), corrupting each position with probability 1 - accept_rate, and reports
confidence = accept_rate at every position. Under greedy verification a replayed token is
accepted exactly when it was not corrupted, so the realised per-position acceptance is the
configured rate and the confidences are calibrated: the load-aware policy sees the truth.

Closer to a real drafter (`rates`, `confidence_noise`, `confidence_scale`): each request draws
its own acceptance from `rates` when it is first seen, and reports confidences that are noisy
(Gaussian noise on the logit) and miscalibrated (the logit scaled), so choosing lengths per
request is exercised. `load(n)`, when given, runs at every proposal of n requests: the suite puts
a real drafter's forward there, so its cost is in every speculative figure.

Registered as drafter "replay" (`build_drafter("replay", references=..., vocab_size=...)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark_serve.drafter.base import AcceptedContext, DraftProposal, DraftRequest
from dspark_serve.drafter.registry import register_drafter


@dataclass
class ReplayStats:
    """Verification outcomes since the last reset.

    tried: draft positions whose fate was decided (accepted ones plus the first rejection of
        each round); accepted: of those, accepted. diverged: requests whose output left the
        recorded continuation (numerics that differ between batch shapes can flip a near-tie).
    """

    tried: int = 0
    accepted: int = 0
    rounds: int = 0
    diverged: set[str] = field(default_factory=set)

    @property
    def rate(self) -> float | None:
        """Realised per-position acceptance: P(draft k accepted | drafts < k accepted)."""
        return self.accepted / self.tried if self.tried else None


class ReplayDrafter:
    """references: prompt token ids (as a tuple) -> the target's greedy continuation.
    vocab_size: corrupted tokens are (true + 1) mod vocab_size.
    block_size: tokens proposed per step (fewer near the end of the continuation).
    accept_rate: probability that a position is left uncorrupted, also its confidence.
    seed: the corruption RNG."""

    name = "replay"
    tap_layers: tuple[int, ...] = ()
    calibrator = None  # its confidences are exact by construction
    online_confidence = False

    def __init__(
        self,
        references: dict[tuple[int, ...], list[int]],
        vocab_size: int,
        block_size: int = 7,
        accept_rate: float = 0.8,
        seed: int = 0,
        rates: Sequence[float] = (),
        confidence_noise: float = 0.0,
        confidence_scale: float = 1.0,
        load: Callable[[int], object] | None = None,
    ) -> None:
        if any(not 0.0 < r < 1.0 for r in rates) or confidence_noise < 0 or confidence_scale <= 0:
            raise ValueError(
                f"rates must lie in (0, 1), confidence_noise >= 0 and confidence_scale > 0, got "
                f"{rates!r}, {confidence_noise!r}, {confidence_scale!r}"
            )
        self.rates, self.noise, self.scale, self.load = tuple(rates), confidence_noise, confidence_scale, load
        self._rate: dict[str, float] = {}
        if not (0.0 <= accept_rate <= 1.0):
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size!r}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size!r}")
        self.references = references
        self.vocab_size, self.block_size, self.accept_rate = vocab_size, block_size, accept_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.stats = ReplayStats()
        self._observed: dict[str, int] = {}
        self._checked: dict[str, int] = {}

    def reset_stats(self) -> ReplayStats:
        old, self.stats = self.stats, ReplayStats()
        return old

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        truths = []
        for r in requests:
            n0 = r.num_prompt_tokens
            ref = self.references.get(tuple(r.token_ids[:n0]), [])
            done = len(r.token_ids) - n0
            seen = self._checked.get(r.request_id, 0)
            if done > seen:
                if r.token_ids[n0 + seen :] != ref[seen:done]:
                    self.stats.diverged.add(r.request_id)
                self._checked[r.request_id] = done
            truths.append(ref[done : done + min(self.block_size, r.max_draft)])
        if self.load is not None:
            self.load(len(requests))
        # One draw for the whole batch: the drafter's own cost stays small next to the step.
        u = torch.rand(sum(map(len, truths)), generator=self.rng).tolist()
        out, i = [], 0
        for r, truth in zip(requests, truths):
            rate = self.rate_of(r.request_id)
            toks = [
                t if x < rate else (t + 1) % self.vocab_size for t, x in zip(truth, u[i : i + len(truth)])
            ]
            i += len(truth)
            out.append(
                DraftProposal(torch.tensor(toks, dtype=torch.long), None, self._confidences(rate, len(toks)))
            )
        return out

    def rate_of(self, request_id: str) -> float:
        """The request's acceptance: drawn from `rates` when first seen, else accept_rate."""
        if not self.rates:
            return self.accept_rate
        if request_id not in self._rate:
            pick = int(torch.randint(len(self.rates), (1,), generator=self.rng))
            self._rate[request_id] = self.rates[pick]
        return self._rate[request_id]

    def _confidences(self, rate: float, n: int) -> torch.Tensor:
        if self.noise == 0 and self.scale == 1.0:
            return torch.full((n,), rate)
        logit = math.log(rate / (1.0 - rate)) * self.scale
        z = logit + self.noise * torch.randn(n, generator=self.rng)
        return torch.sigmoid(z).clamp(0.01, 0.99)

    def observe(self, contexts: list[AcceptedContext]) -> None:
        for c in contexts:  # the engine must feed every kept token once, in order
            have = self._observed.get(c.request_id, 0)
            if c.start_pos != have:
                raise ValueError(
                    f"request {c.request_id!r}: context starts at {c.start_pos}, {have} positions observed"
                )
            self._observed[c.request_id] = have + len(c.token_ids)

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        if not (0 <= accepted <= proposed):
            raise ValueError(f"accepted {accepted} of {proposed} proposed")
        self.stats.rounds += 1
        self.stats.accepted += accepted
        self.stats.tried += accepted + (1 if accepted < proposed else 0)

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        return 0.0  # absorbs nothing

    def free(self, request_id: str) -> None:
        self._observed.pop(request_id, None)
        self._checked.pop(request_id, None)
        self._rate.pop(request_id, None)


@register_drafter("replay")
def build_replay(
    references: dict[tuple[int, ...], list[int]],
    vocab_size: int,
    block_size: int = 7,
    accept_rate: float = 0.8,
    seed: int = 0,
    rates: Sequence[float] = (),
    confidence_noise: float = 0.0,
    confidence_scale: float = 1.0,
    load: Callable[[int], object] | None = None,
) -> ReplayDrafter:
    """The replay drafter (see the module docstring)."""
    return ReplayDrafter(
        references, vocab_size, block_size, accept_rate, seed, rates, confidence_noise, confidence_scale, load
    )
