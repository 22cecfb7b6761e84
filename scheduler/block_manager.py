"""Paged KV cache bookkeeping in plain Python (no torch): fixed-size blocks, one block table per
request, allocation, rollback and free, and automatic prefix caching. The model runner turns
block tables into slot indices.

Prefix caching: a block that holds `block_size` *committed* tokens of a request (never a
draft that verification may still roll back) gets a content hash chained over every block
before it (`commit`). Blocks are reference-counted, so several requests whose prompts share a
prefix hold the same physical blocks (`allocate_prefix`); a hashed block nobody holds stays in
the cache and counts as free, and is evicted least-recently-used only when an allocation finds
no empty block. A block in use is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from dspark_serve.verifier.forward import Segment


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has."""


@dataclass
class BlockTable:
    """The blocks holding one request's KV, in sequence order, and how many tokens are stored.

    hashes: the chained content hash of each of its leading full blocks of committed tokens."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters and the current cache occupancy.

    queries: prompt tokens looked up at admission; hits: of those, found in the cache.
    evictions: cached blocks whose content was dropped to make room.
    cached_blocks: blocks holding hashed content (in use or not); cached_free_blocks: of those,
        held by no request (they count as free)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    cached_blocks: int = 0
    cached_free_blocks: int = 0


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The content hash of one full block: its tokens and the hash of the block before it."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Owns `num_blocks` blocks of `block_size` token slots each: the empty ones, the cached ones
    nobody holds (LRU order) and each request's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Pop from the end: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; oldest first
        self._ref: list[int] = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._tables: dict[str, BlockTable] = {}
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); cached blocks nobody holds are free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def cached_free_usage(self) -> float:
        """Fraction of blocks that are cached and held by no request (0..1)."""
        return len(self._cached_free) / self.num_blocks

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.queries, self.hits, self.evictions, len(self._hash_of), len(self._cached_free)
        )

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def segment(self, request_id: str, token_ids: list[int], start_pos: int, logits_from: int) -> Segment:
        """The forward's segment of request_id's tokens from start_pos, over its block table (their
        slots already appended)."""
        return Segment(request_id, token_ids, start_pos, logits_from, self.table(request_id).blocks)

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
        return self.extra_blocks_for(request_id, new_tokens) + reserve <= self.num_free_blocks

    def match_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """The cached blocks holding the longest run of leading full blocks of `token_ids`
        (at most `max_tokens` tokens); changes nothing."""
        if not self.enable_caching:
            return []
        n = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs, parent, out = self.block_size, None, []
        for i in range(n // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            b = self._by_hash.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def free_blocks_taken_by(self, blocks: list[int]) -> int:
        """How many of these cached blocks would leave the free pool if a request took them."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    # -- mutations -----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # evict the least recently used cached block nobody holds
            b, _ = self._cached_free.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            self.evictions += 1
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] < 0:
            raise RuntimeError(f"block {b} released more often than taken")
        if self._ref[b] == 0:
            if b in self._hash_of:
                self._cached_free[b] = None  # most recently used end
            else:
                self._free.append(b)

    def allocate_prefix(self, request_id: str, token_ids: list[int], max_tokens: int) -> int:
        """Start a request's table with the cached blocks of its longest cached prefix (at most
        `max_tokens` tokens, whole blocks); returns the tokens whose KV it now shares. Counts
        `len(token_ids)` queried tokens and the hit tokens."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        if not self.enable_caching:
            return 0
        hit = self.match_prefix(token_ids, max_tokens)
        t = self._tables[request_id] = BlockTable()
        parent = None
        bs = self.block_size
        for i, b in enumerate(hit):
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1
            t.blocks.append(b)
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            t.hashes.append(parent)
        t.num_tokens = len(hit) * bs
        self.queries += len(token_ids)
        self.hits += t.num_tokens
        return t.num_tokens

    def commit(self, request_id: str, token_ids: list[int], num_committed: int) -> None:
        """`token_ids[:num_committed]` are the request's committed tokens, their KV written
        (never drafts awaiting verification): hash its newly completed full blocks so later
        requests can share them."""
        if not self.enable_caching:
            return
        t = self._tables.get(request_id)
        if t is None:
            return
        if num_committed > t.num_tokens:
            raise ValueError(
                f"request {request_id!r}: {num_committed} committed tokens but only {t.num_tokens} stored"
            )
        bs = self.block_size
        parent = t.hashes[-1] if t.hashes else None
        for i in range(len(t.hashes), num_committed // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            t.hashes.append(parent)
            b = t.blocks[i]
            # The same content computed twice (two requests prefilling one prefix at once):
            # the cache keeps the first copy; this block stays private and is freed plainly.
            if parent not in self._by_hash and b not in self._hash_of:
                self._by_hash[parent] = b
                self._hash_of[b] = parent

    def append(self, request_id: str, new_tokens: int) -> list[int]:
        """Reserve slots for `new_tokens` more tokens; returns their slot indices in order."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens must be >= 0, got {new_tokens!r}")
        extra = self.extra_blocks_for(request_id, new_tokens)
        if extra > self.num_free_blocks:
            raise OutOfBlocks(f"need {extra} blocks, {self.num_free_blocks} free")
        t = self._tables.setdefault(request_id, BlockTable())
        for _ in range(extra):
            t.blocks.append(self._take())
        start = t.num_tokens
        t.num_tokens += new_tokens
        bs = self.block_size
        return [t.blocks[p // bs] * bs + p % bs for p in range(start, t.num_tokens)]

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Start `child_id` as a copy of the parent's first `num_tokens` tokens (a second
        branch verified beside the parent's own drafts): it shares the parent's full blocks
        and gets a fresh block for a partial last one. Returns (source, destination) of that
        partial block, whose KV the caller copies; None when there is none."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        t = self._tables[parent_id]
        if not (0 <= num_tokens <= t.num_tokens):
            raise ValueError(f"cannot fork {num_tokens!r} tokens (request has {t.num_tokens})")
        full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        if partial and not self.num_free_blocks:
            raise OutOfBlocks("no free block for the fork's partial block")
        child = self._tables[child_id] = BlockTable(t.blocks[:full], num_tokens, t.hashes[:full])
        for b in child.blocks:
            self._ref[b] += 1
        if not partial:
            return None
        child.blocks.append(self._take())
        return t.blocks[full], child.blocks[-1]

    def adopt(self, parent_id: str, child_id: str) -> None:
        """The parent takes a fork's table (its branch won); the parent's own blocks past the
        shared ones return to the pool."""
        # the fork holds the parent's hashes already: nothing is committed between fork and adopt
        old = self._tables[parent_id]
        self._tables[parent_id] = self._tables.pop(child_id)
        for b in reversed(old.blocks):
            self._release(b)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll back: keep only the first `num_tokens` tokens; blocks past them return to the pool."""
        t = self._tables[request_id]
        if not (0 <= num_tokens <= t.num_tokens):
            raise ValueError(f"cannot truncate to {num_tokens!r} tokens (request has {t.num_tokens})")
        t.num_tokens = num_tokens
        keep = self.blocks_needed(num_tokens)
        del t.hashes[num_tokens // self.block_size :]
        while len(t.blocks) > keep:
            self._release(t.blocks.pop())

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks (idempotent). Its cached blocks stay cached; the
        tail goes first in eviction order."""
        t = self._tables.pop(request_id, None)
        if t is not None:
            for b in reversed(t.blocks):
                self._release(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached content hash (blocks in use stay with their requests)."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        for t in self._tables.values():
            t.hashes.clear()

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Slot indices of token positions [start, end) of a request."""
        t = self._tables[request_id]
        bs = self.block_size
        return [t.blocks[p // bs] * bs + p % bs for p in range(start, end)]
