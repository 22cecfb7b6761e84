"""The drafter's context for a cached prefix: the target's tap hidden states of every token whose
KV sits in the paged cache, stored beside it (one row per KV slot).

When a prompt's leading blocks come from the prefix cache their forward is skipped, so the
hidden states the drafter (DSpark/DFlash: `drafter.observe`) or the hidden-state capture needs
for those tokens are read from here instead. A row is written in the step whose verdict kept
its token (prefill chunks and accepted drafts only), exactly when the block manager may hash
its block, so every cached block has its rows. Rolled-back drafts never get a row.
"""

from __future__ import annotations

import torch

from dspark_serve.drafter.base import AcceptedContext
from dspark_serve.scheduler.block_manager import BlockManager


class TapCache:
    """[slots, width] hidden rows, allocated on the first write (engines with no tap layers, or
    with prefix caching off, never allocate it) and grown with the highest KV slot used."""

    def __init__(self, blocks: BlockManager, device: torch.device) -> None:
        self.blocks = blocks
        self.device = device
        self.rows: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.numel() * self.rows.element_size()

    def write(
        self,
        contexts: list[AcceptedContext],
        rows: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> list[AcceptedContext]:
        """Store the hidden rows of the kept tokens at their KV slots. -> the contexts, those
        stored marked so (`stored`: the drafter may read them back instead of copying).

        rows, slots: the step's whole forward, its tap rows [T, m*d] and each row's KV slot [T]
        (`ForwardOutput.hidden / .slots`): stored as they are in one copy, the rows of drafts
        the verdict rejected included (their slots are written again before any read, as their
        K/V is), instead of gathered per context (one copy is cheaper than a gather per request)."""
        has = self.blocks.has
        keep = [c.hidden is not None and bool(c.token_ids) and has(c.request_id) for c in contexts]
        out = [
            AcceptedContext(c.request_id, c.token_ids, c.start_pos, c.hidden, stored=self) if k else c
            for c, k in zip(contexts, keep)
        ]
        if rows is not None and slots is not None:
            if any(keep):
                self._store(rows, slots)
            return out
        kept = [c for c, k in zip(contexts, keep) if k]
        if not kept:
            return out
        at: list[int] = []
        for c in kept:
            at += self.blocks.slots(c.request_id, c.start_pos, c.start_pos + len(c.token_ids))
        hidden = [c.hidden for c in kept if c.hidden is not None]
        h = hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # a prefill chunk alone: no copy
        self._store(h, torch.tensor(at, device=h.device))
        return out

    def _store(self, h: torch.Tensor, slots: torch.Tensor) -> None:
        """rows h [n, m*d] at KV slots [n]."""
        if self.rows is not None and (self.rows.shape[1] != h.shape[1] or self.rows.dtype != h.dtype):
            self.rows = None
        # Grown by doubling up to the highest slot written (low blocks are handed out first),
        # so the memory follows the KV actually used, not the pool's size.
        self._room(int(slots.max()) + 1, h).index_copy_(0, slots.to(h.device), h)

    def _room(self, need: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer, grown (by doubling) to hold at least `need` rows like `like`'s."""
        have = 0 if self.rows is None else self.rows.shape[0]
        if need > have:
            cap = min(max(need, 2 * have, 1024), self.blocks.num_blocks * self.blocks.block_size)
            # empty, not zeros: a row is read only for a cached block, which had its rows written
            grown = torch.empty(cap, like.shape[1], device=like.device, dtype=like.dtype)
            if self.rows is not None:
                grown[:have] = self.rows
            self.rows = grown
        assert self.rows is not None
        return self.rows

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's rows (beside `ModelRunner.copy_kv_block`: a fork's partial block keeps
        the rows of the positions it shares with its parent)."""
        if self.rows is None:
            return
        bs = self.blocks.block_size
        if (src + 1) * bs > self.rows.shape[0]:  # nothing was ever stored there
            return
        rows = self._room((dst + 1) * bs, self.rows)
        rows[dst * bs : (dst + 1) * bs] = rows[src * bs : (src + 1) * bs]

    def rows_of(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """The stored rows of a request's positions start .. end - 1 (`TapRows`)."""
        assert self.rows is not None, "no tap rows stored yet"
        slots = torch.tensor(self.blocks.slots(request_id, start, end), device=self.rows.device)
        # index_select: torch's advanced indexing (rows[slots]) is far slower on a CPU for a
        # few wide rows
        return self.rows.index_select(0, slots)

    def context(
        self, request_id: str, token_ids: list[int], num_cached: int, copy: bool = False
    ) -> AcceptedContext:
        """The context of a request's first `num_cached` tokens (shared cached blocks): their
        rows stay here (`stored`; a drafter reads them back when it absorbs them), copied out
        into `hidden` only where asked (`copy`: a reader that keeps no positions); no rows at
        all where nothing was ever stored (no tap layers)."""
        ids = list(token_ids[:num_cached])
        if self.rows is None:
            return AcceptedContext(request_id, ids, 0, None)
        hidden = self.rows_of(request_id, 0, num_cached) if copy else None
        return AcceptedContext(request_id, ids, 0, hidden, stored=self)

    def reset(self, keep: bool = False) -> None:
        """Forget every row. keep: hold on to the buffer (the engine will store rows of the same
        width again): no row is read before its slot is written anew, so its old contents are
        harmless, and the buffer need not be allocated and grown again (it is large: a row per
        KV slot used)."""
        if not keep:
            self.rows = None
