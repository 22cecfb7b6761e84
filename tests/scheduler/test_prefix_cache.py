"""Prefix caching in the block manager (plain Python, no torch)."""

import random

import pytest

from dspark_serve.scheduler.block_manager import BlockManager, OutOfBlocks, chain_hash


def _run(bm: BlockManager, rid: str, tokens: list[int], hit_limit: int | None = None) -> int:
    """Admit `tokens` as a prompt: share the cached prefix, allocate the rest, commit it all."""
    hit = bm.allocate_prefix(rid, tokens, len(tokens) - 1 if hit_limit is None else hit_limit)
    bm.append(rid, len(tokens) - hit)
    bm.commit(rid, tokens, len(tokens))
    return hit


def _all_free(bm: BlockManager) -> bool:
    return bm.num_free_blocks == bm.num_blocks and all(bm.refcount(b) == 0 for b in range(bm.num_blocks))


def test_shared_prefix_is_shared_by_reference_and_counted_once():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert _run(bm, "a", a) == 0
    b = a[:8] + [50, 51, 52]  # shares the 2 full blocks
    assert _run(bm, "b", b) == 8
    ta, tb = bm.table("a"), bm.table("b")
    assert ta.blocks[:2] == tb.blocks[:2] and ta.blocks[2] != tb.blocks[2]
    assert [bm.refcount(x) for x in ta.blocks[:2]] == [2, 2]
    assert bm.num_free_blocks == 16 - 4  # 2 shared + 1 private each
    s = bm.stats()
    assert (s.queries, s.hits, s.cached_blocks) == (21, 8, 2)


def test_divergence_mid_block_shares_only_whole_blocks_before_it():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = list(range(12))
    _run(bm, "a", a)
    b = a[:6] + [99] * 6  # diverges inside block 1
    assert _run(bm, "b", b) == 4
    assert bm.table("b").blocks[0] == bm.table("a").blocks[0]
    assert bm.table("b").blocks[1] != bm.table("a").blocks[1]


def test_the_chain_makes_a_block_depend_on_everything_before_it():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    _run(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # same second block, different first block: no hit at all
    assert _run(bm, "b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert chain_hash(None, [5, 6, 7, 8]) != chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_hit_limit_keeps_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = list(range(8))
    _run(bm, "a", a)
    bm.free("a")
    # the whole prompt is cached, but the last block must be recomputed for the logits
    assert bm.allocate_prefix("b", a, len(a) - 1) == 4


def test_uncommitted_tokens_are_never_hashed():
    """Draft KV past the committed length is written then rolled back: it never enters the cache."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    prompt = [1, 2, 3, 4, 5, 6]
    bm.append("a", 6)
    bm.commit("a", prompt, 6)
    drafts = [7, 8, 9, 10, 11]
    bm.append("a", 1 + len(drafts))  # anchor + drafts: fills block 1, opens block 2
    bm.commit("a", prompt + [6] + drafts, 7)  # only the anchor's KV was kept
    bm.truncate("a", 7)
    assert bm.stats().cached_blocks == 1  # block 0 only: block 1 holds 3 committed tokens
    assert bm.match_prefix(prompt + [6] + drafts) == [bm.table("a").blocks[0]]


def test_refcounts_return_to_zero_after_requests_end_and_after_aborts():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4, enable_caching=True)
    system = [rng.randrange(100) for _ in range(13)]
    live: list[str] = []
    for i in range(60):
        rid = f"r{i}"
        toks = system + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
        hit = bm.allocate_prefix(rid, toks, len(toks) - 1)
        # a partial prefill (abort mid-way) or a whole one
        n = len(toks) - hit if rng.random() < 0.7 else rng.randrange(len(toks) - hit + 1)
        if not bm.can_append(rid, n):
            bm.free(rid)
            continue
        bm.append(rid, n)
        bm.commit(rid, toks, hit + n)
        live.append(rid)
        if len(live) > 5:
            bm.free(live.pop(rng.randrange(len(live))))
    for rid in live:
        bm.free(rid)
    assert _all_free(bm)
    assert bm.stats().cached_free_blocks == bm.stats().cached_blocks > 0
    assert bm.usage == 0.0 and bm.cached_free_usage > 0


def test_eviction_is_lru_and_never_takes_a_block_in_use():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    _run(bm, "held", [1, 2, 3, 4])  # 2 blocks, stays in use
    _run(bm, "old", [5, 6, 7, 8])
    bm.free("old")
    _run(bm, "new", [9, 10, 11, 12])
    bm.free("new")
    held = set(bm.table("held").blocks)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 4
    # 2 free-with-content blocks from "old" are the oldest: evicted first
    bm.append("x", 4)
    assert held.isdisjoint(bm.table("x").blocks)
    assert bm.stats().evictions == 2
    assert bm.match_prefix([5, 6, 7, 8]) == [] and len(bm.match_prefix([9, 10, 11, 12])) == 2
    bm.append("y", 4)
    assert held.isdisjoint(bm.table("y").blocks) and bm.stats().evictions == 4
    with pytest.raises(OutOfBlocks):
        bm.append("z", 1)  # only held blocks remain
    assert bm.match_prefix([1, 2, 3, 4]) == bm.table("held").blocks


def test_a_hit_on_a_cached_free_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    _run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.num_free_blocks == 4
    blocks = bm.match_prefix([1, 2, 3, 4, 9])
    assert bm.free_blocks_taken_by(blocks) == 2
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 9], 4) == 4
    assert bm.num_free_blocks == 2 and bm.num_cached_free_blocks == 0


def test_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2)
    _run(bm, "a", [1, 2, 3, 4, 5])
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5], 4) == 0
    assert bm.stats().cached_blocks == 0


def test_reset_forgets_content_but_not_tables():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    _run(bm, "a", [1, 2, 3, 4, 5])
    _run(bm, "b", [7, 8, 9])
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [] and bm.stats().cached_blocks == 0
    assert bm.num_free_blocks == 8 - 3
    bm.free("a")
    assert _all_free(bm)
