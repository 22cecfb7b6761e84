"""Admission and batching: which requests run in the next step, and with how many tokens.

KV blocks are taken as tokens arrive, not reserved for a request's worst case. Each step the
running requests, oldest first, get the blocks for their decode (anchor + the drafts they may
verify) or their next prefill chunk; when the pool runs short, the most recently admitted
request is preempted: its blocks are freed and it goes back to the front of the queue, to
resume later by recomputing its prompt and the tokens it already generated (its output is
unchanged). A waiting request is admitted when the rest of its prompt fits the free blocks
after its cached prefix (prefix caching: those blocks are shared, not recomputed). Prompts
prefill in chunks under the per-step token budget, next to the running decodes.

With scheduling_policy "priority" (vLLM's), "oldest" and "most recent" read "best priority" and
"worst priority": the running requests are served in (priority, arrival) order, the last of
them is preempted first, and the waiting request admitted next has the lowest priority, aged by
its wait so nothing starves.

Fair slots (fcfs, `fair_slots`): slots are shared by tenant (a caller: its API key, or its
client address), and within a tenant by owner (an HTTP request's n choices are one owner). The
waiting request admitted next is the one whose tenant, then whose owner, holds the fewest
running slots (arrival order among equals). While one waits with every slot taken, a tenant
holding more than the waiting tenant's slots plus one gives a slot back (its largest owner's
newest), and within the waiting one's tenant so does an owner holding more than the waiting
owner's plus one: two requests of n=16 no longer keep a one-token chat waiting for their whole
length, and one key's many requests do not keep another key's waiting.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.metrics_sink import QueueWait, SlotShares
from dspark_serve.scheduler.request import Request, Status


@dataclass
class ScheduledBatch:
    """The requests that run in one step: decodes (anchor + drafts) and prefill chunks.

    admitted: requests admitted this step, with the prompt tokens their cached prefix covers.
    preempted: requests preempted this step (their KV is freed; their drafter state must be).
    waits: how long each admitted request waited in the queue (the per-key metrics).
    """

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk tokens)
    admitted: list[tuple[Request, int]] = field(default_factory=list)  # (request, cached tokens)
    preempted: list[Request] = field(default_factory=list)
    waits: list[QueueWait] = field(default_factory=list)  # the admitted ones' time in the queue

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [r for r, _ in self.prefills]

    def without_finished(self) -> ScheduledBatch:
        return ScheduledBatch(
            [r for r in self.decodes if not r.finished],
            [(r, n) for r, n in self.prefills if not r.finished],
            [(r, n) for r, n in self.admitted if not r.finished],
            self.preempted,
            self.waits,
        )

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """The waiting queue, the running set (in admission order) and their KV blocks."""

    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, slots given back to a waiting owner (fair slots)

    @property
    def by_priority(self) -> bool:
        return self.cfg.scheduling_policy == "priority"

    @property
    def fair(self) -> bool:
        return self.cfg.fair_slots and not self.by_priority

    def slots_held(self) -> Counter[str]:
        """Running slots by owner."""
        return Counter(r.slot_owner for r in self.running)

    def tenant_slots(self) -> Counter[str]:
        """Running slots by tenant."""
        return Counter(r.slot_tenant for r in self.running)

    def slot_shares(self) -> SlotShares:
        """Who holds the running slots, for the gauges."""
        n = self.cfg.max_num_seqs
        by_key = Counter(r.key_name for r in self.running)
        return SlotShares(
            self.num_fair_preemptions,
            max(self.slots_held().values(), default=0) / n,
            {k: v / n for k, v in by_key.items()},
        )

    def next_waiting(self) -> Request:
        """The request admitted next: the queue's head (fcfs: arrival order, preempted requests
        first; with fair slots the first of those whose owner holds the fewest slots), or by
        priority: the lowest priority less one for every `priority_aging_s` seconds since
        arrival (nothing starves), ties by arrival."""
        if not self.by_priority:
            if not self.fair:
                return self.waiting[0]
            tenants, owners = self.tenant_slots(), self.slots_held()
            # min keeps the first of equals
            return min(self.waiting, key=lambda r: (tenants[r.slot_tenant], owners[r.slot_owner]))
        now, aging = time.monotonic(), self.cfg.priority_aging_s
        return min(self.waiting, key=lambda r: (r.priority - (now - r.arrival_time) / aging, r.arrival_time))

    @property
    def reserved_blocks(self) -> int:
        """KV blocks requests hold now (cached blocks nobody holds count as free)."""
        return self.blocks.num_blocks - self.blocks.num_free_blocks

    @property
    def queue_full(self) -> bool:
        return len(self.waiting) >= self.cfg.max_waiting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request (the engine frees its blocks)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, r: Request, batch: ScheduledBatch) -> None:
        self.running.remove(r)
        self.blocks.free(r.request_id)
        r.status = Status.WAITING
        r.num_computed = 0
        r.num_preemptions += 1
        r.queued_at = time.monotonic()
        self.num_preemptions += 1
        self.waiting.appendleft(r)
        batch.preempted.append(r)

    def schedule(
        self, draft_reserve: int = 0, lookahead: Callable[[Request], int] | None = None
    ) -> ScheduledBatch:
        """Batch every decode and as many prefill tokens as the budget leaves, then admit what
        fits. `draft_reserve` tokens per decode are kept out of the prefill budget for drafts;
        `lookahead(r)`: the most drafts decode `r` may verify this step (its KV is ensured)."""
        bm = self.blocks
        batch = ScheduledBatch()
        self._share_slots(batch)
        if self.by_priority:  # the best served first, the worst the one preempted (the last)
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        pending = 0  # blocks this step's appends will take from the pool
        debt = 0  # blocks the scheduled prompts still need after this step's chunks
        n_dec = sum(1 for r in self.running if r.status is Status.DECODE)
        budget = self.cfg.max_num_batched_tokens - n_dec * (1 + draft_reserve)
        i = 0
        while i < len(self.running):
            r = self.running[i]
            chunk = None
            if r.status is Status.DECODE:
                need = bm.extra_blocks_for(r.request_id, 1 + (lookahead(r) if lookahead else 0))
            else:
                chunk = min(r.num_prefill_tokens - r.num_computed, budget)
                if chunk <= 0:
                    i += 1
                    continue
                need = bm.extra_blocks_for(r.request_id, chunk)
            # Short of KV: the most recently admitted request gives its blocks back.
            while need > bm.num_free_blocks - pending and self.running[-1] is not r:
                self._preempt(self.running[-1], batch)
            if need > bm.num_free_blocks - pending:
                if chunk is None:  # the newest decode itself cannot grow: it waits
                    self._preempt(r, batch)
                    break
                room = (
                    (len(bm.table(r.request_id).blocks) if bm.has(r.request_id) else 0)
                    + bm.num_free_blocks
                    - pending
                )
                chunk = min(chunk, room * bm.block_size - bm.num_tokens(r.request_id))
                if chunk <= 0:
                    break
                need = bm.extra_blocks_for(r.request_id, chunk)
            pending += need
            if chunk is None:
                batch.decodes.append(r)
            else:
                batch.prefills.append((r, chunk))
                budget -= chunk
                debt += bm.extra_blocks_for(r.request_id, r.num_prefill_tokens - r.num_computed) - need
            i += 1
        if not batch.preempted:
            self._admit(batch, budget, pending, debt)
        return batch

    def _share_slots(self, batch: ScheduledBatch) -> None:
        """With fair slots, every slot taken and a request waiting: the running request that
        gives its slot back to it (`_fair_victim`), if any, is preempted (in the next step the
        waiting one is admitted first: its tenant or owner holds fewer)."""
        if not (self.fair and self.waiting and len(self.running) >= self.cfg.max_num_seqs):
            return
        victim = self._fair_victim(self.next_waiting())
        if victim is not None:
            self._preempt(victim, batch)
            self.num_fair_preemptions += 1

    def _fair_victim(self, waiting: Request) -> Request | None:
        """A tenant holding more than `waiting`'s tenant's slots plus one gives one back: the
        newest of its largest owner's. Else, within `waiting`'s tenant, an owner holding more
        than `waiting`'s owner's slots plus one gives back its newest. Else none."""
        tenants = self.tenant_slots()
        most = max(tenants.values())
        if most > tenants[waiting.slot_tenant] + 1:  # the newest of the largest tenants'
            tenant = next(r.slot_tenant for r in reversed(self.running) if tenants[r.slot_tenant] == most)
            pool = [r for r in self.running if r.slot_tenant == tenant]
            floor = -1  # any owner of that tenant: it gives back
        else:
            pool = [r for r in self.running if r.slot_tenant == waiting.slot_tenant]
            floor = sum(r.slot_owner == waiting.slot_owner for r in pool)
        owners = Counter(r.slot_owner for r in pool)
        top = max(owners.values(), default=0)
        if top <= floor + 1:
            return None
        return next(r for r in reversed(pool) if owners[r.slot_owner] == top)

    def _admit(self, batch: ScheduledBatch, budget: int, pending: int, debt: int) -> None:
        bm = self.blocks
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            r = self.next_waiting()
            ids = r.prefill_ids
            hit = bm.match_prefix(ids, len(ids) - 1)  # the last token is computed for logits
            # The rest of its prompt must fit what is free, after what the running prompts
            # still need; its output takes blocks as it comes (no worst-case reservation).
            need = bm.blocks_needed(len(ids)) - len(hit) + bm.free_blocks_taken_by(hit)
            if need > bm.num_free_blocks - pending - debt:
                break
            self.waiting.remove(r)
            batch.waits.append(QueueWait(r.key_name, time.monotonic() - r.queued_at))
            cached = bm.allocate_prefix(r.request_id, ids, len(ids) - 1)
            r.num_computed = cached
            r.status = Status.PREFILL
            self.running.append(r)
            batch.admitted.append((r, cached))
            chunk = min(len(ids) - cached, budget)
            take = bm.extra_blocks_for(r.request_id, chunk)
            pending += take
            debt += bm.extra_blocks_for(r.request_id, len(ids) - cached) - take
            batch.prefills.append((r, chunk))
            budget -= chunk
