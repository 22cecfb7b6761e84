"""A drafter with a controlled acceptance rate, for measuring the engine on a real cost curve
without a trained drafter: it replays the target's own greedy continuation (recorded from a
plain run), corrupting each position with probability 1 - accept_rate, and reports
confidence = accept_rate at every position. Under greedy verification a replayed token is
accepted exactly when it was not corrupted, so the realised per-position acceptance is the
configured rate and the confidences are calibrated: the load-aware policy sees the truth.

Registered as drafter "replay" (`build_drafter("replay", references=..., vocab_size=...)`).
"""

from __future__ import annotations

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
    ) -> None:
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
        # One draw for the whole batch: the drafter's own cost stays small next to the step.
        keep = (torch.rand(sum(map(len, truths)), generator=self.rng) < self.accept_rate).tolist()
        conf = torch.full((self.block_size,), self.accept_rate)
        out, i = [], 0
        for truth in truths:
            toks = [t if k else (t + 1) % self.vocab_size for t, k in zip(truth, keep[i : i + len(truth)])]
            i += len(truth)
            out.append(DraftProposal(torch.tensor(toks, dtype=torch.long), None, conf[: len(toks)]))
        return out

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


@register_drafter("replay")
def build_replay(
    references: dict[tuple[int, ...], list[int]],
    vocab_size: int,
    block_size: int = 7,
    accept_rate: float = 0.8,
    seed: int = 0,
) -> ReplayDrafter:
    """The replay drafter (see the module docstring)."""
    return ReplayDrafter(references, vocab_size, block_size, accept_rate, seed)
