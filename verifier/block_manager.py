"""Paged KV cache bookkeeping in plain Python (no torch): fixed-size blocks, one block table per
request, allocation, rollback and free. The model runner turns block tables into slot indices."""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has."""


@dataclass
class BlockTable:
    """The blocks holding one request's KV, in sequence order, and how many tokens are stored."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    """Owns the free list of `num_blocks` blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, BlockTable] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> BlockTable:
        return self._tables[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_tokens(self, request_id: str) -> int:
        t = self._tables.get(request_id)
        return 0 if t is None else t.num_tokens

    def extra_blocks_for(self, request_id: str, new_tokens: int) -> int:
        """Blocks that appending `new_tokens` to the request would take from the pool."""
        t = self._tables.get(request_id)
        have_tokens = 0 if t is None else t.num_tokens
        have_blocks = 0 if t is None else len(t.blocks)
        return max(0, self.blocks_needed(have_tokens + new_tokens) - have_blocks)

    def can_append(self, request_id: str, new_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks_for(request_id, new_tokens) + reserve <= len(self._free)

    # -- mutations -----------------------------------------------------------------------
    def append(self, request_id: str, new_tokens: int) -> list[int]:
        """Reserve slots for `new_tokens` more tokens; returns their slot indices in order."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens must be >= 0, got {new_tokens!r}")
        extra = self.extra_blocks_for(request_id, new_tokens)
        if extra > len(self._free):
            raise OutOfBlocks(f"need {extra} blocks, {len(self._free)} free")
        t = self._tables.setdefault(request_id, BlockTable())
        for _ in range(extra):
            t.blocks.append(self._free.pop())
        start = t.num_tokens
        t.num_tokens += new_tokens
        bs = self.block_size
        return [t.blocks[p // bs] * bs + p % bs for p in range(start, t.num_tokens)]

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll back: keep only the first `num_tokens` tokens; blocks past them return to the pool."""
        t = self._tables[request_id]
        if not (0 <= num_tokens <= t.num_tokens):
            raise ValueError(f"cannot truncate to {num_tokens!r} tokens (request has {t.num_tokens})")
        t.num_tokens = num_tokens
        keep = self.blocks_needed(num_tokens)
        while len(t.blocks) > keep:
            self._free.append(t.blocks.pop())

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (idempotent)."""
        t = self._tables.pop(request_id, None)
        if t is not None:
            self._free.extend(reversed(t.blocks))

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Slot indices of token positions [start, end) of a request."""
        t = self._tables[request_id]
        bs = self.block_size
        return [t.blocks[p // bs] * bs + p % bs for p in range(start, end)]
