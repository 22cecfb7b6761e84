"""Admission and batching: which requests run in the next step, and with how many tokens.

A request is admitted only when its worst-case KV (prompt + max_tokens) fits the blocks not yet
reserved, so a running request can never run out of KV (nothing is ever preempted). Prompts
prefill in chunks under the per-step token budget, next to the running decodes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.request import Request, Status
from verifier.block_manager import BlockManager


@dataclass
class ScheduledBatch:
    """The requests that run in one step: decodes (anchor + drafts) and prefill chunks."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk tokens)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [r for r, _ in self.prefills]

    def without_finished(self) -> "ScheduledBatch":
        return ScheduledBatch([r for r in self.decodes if not r.finished],
                              [(r, n) for r, n in self.prefills if not r.finished])

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """The waiting queue, the running set and the KV blocks reserved for it."""

    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved_blocks = 0

    @property
    def queue_full(self) -> bool:
        return len(self.waiting) >= self.cfg.max_waiting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request and release its reservation."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.reserved_blocks -= req.reserved_blocks

    def schedule(self, draft_reserve: int = 0) -> ScheduledBatch:
        """Admit what fits, then batch every decode and as many prefill tokens as the budget
        leaves; `draft_reserve` tokens per decode are kept free for the drafts it may verify."""
        self._admit()
        batch = ScheduledBatch(decodes=[r for r in self.running if r.status is Status.DECODE])
        budget = self.cfg.max_num_batched_tokens - len(batch.decodes) * (1 + draft_reserve)
        for r in self.running:
            if r.status is Status.PREFILL and budget > 0:
                chunk = min(len(r.prompt_ids) - r.num_computed, budget)
                batch.prefills.append((r, chunk))
                budget -= chunk
        return batch

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            need = self.blocks.blocks_needed(len(req.prompt_ids) + req.max_tokens)
            # Reserve the request's whole worst case up front: it can then never run out of
            # KV mid-way, so nothing is ever preempted and the process never over-commits.
            if self.reserved_blocks + need > self.blocks.num_blocks:
                break
            self.waiting.popleft()
            req.reserved_blocks = need
            self.reserved_blocks += need
            req.status = Status.PREFILL
            self.running.append(req)
