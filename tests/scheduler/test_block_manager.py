import pytest

from dspark_serve.scheduler.block_manager import BlockManager, OutOfBlocks


def test_append_allocates_whole_blocks_and_maps_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    slots = bm.append("a", 6)
    assert len(slots) == 6 and len(set(slots)) == 6
    assert len(bm.table("a").blocks) == 2 and bm.num_free_blocks == 6
    # slots are contiguous within a block
    b0, b1 = bm.table("a").blocks
    assert slots == [b0 * 4 + i for i in range(4)] + [b1 * 4, b1 * 4 + 1]
    assert bm.append("a", 2) == [b1 * 4 + 2, b1 * 4 + 3]
    assert bm.num_free_blocks == 6  # still fits in block 2


def test_truncate_returns_blocks_and_free_is_idempotent():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.append("a", 13)
    assert bm.num_free_blocks == 4
    bm.truncate("a", 5)
    assert bm.num_tokens("a") == 5 and bm.num_free_blocks == 6
    bm.truncate("a", 0)
    assert bm.num_free_blocks == 8
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 8 and not bm.has("a")


def test_out_of_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.append("a", 4)
    with pytest.raises(OutOfBlocks):
        bm.append("b", 5)
    assert bm.num_free_blocks == 1 and not bm.has("b")
    assert bm.can_append("b", 4) and not bm.can_append("b", 5)


def test_requests_never_share_slots():
    bm = BlockManager(num_blocks=16, block_size=4)
    seen = set()
    for rid, n in [("a", 7), ("b", 9), ("c", 3)]:
        s = bm.append(rid, n)
        assert seen.isdisjoint(s)
        seen.update(s)
    bm.free("b")
    assert seen.isdisjoint(bm.append("d", 8)) is False or True  # reuse allowed after free
    assert bm.usage == pytest.approx(1 - bm.num_free_blocks / 16)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_sizes_rejected(bad):
    with pytest.raises(ValueError, match=str(bad)):
        BlockManager(num_blocks=bad, block_size=4)
    with pytest.raises(ValueError, match=str(bad)):
        BlockManager(num_blocks=4, block_size=bad)


def test_a_fork_shares_full_blocks_copies_the_partial_one_and_is_freed_or_adopted():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    ids = list(range(10))
    bm.append("a", 10)
    bm.commit("a", ids, 10)  # two full blocks hashed
    a0, a1, a2 = bm.table("a").blocks
    bm.append("a", 3)  # the parent's own drafts: positions 10..12, a fourth block
    own = list(bm.table("a").blocks)
    pair = bm.fork("a", "a/b", 10)
    c = bm.table("a/b")
    assert c.blocks[:2] == [a0, a1] and c.num_tokens == 10 and c.hashes == bm.table("a").hashes
    assert pair == (a2, c.blocks[2]) and c.blocks[2] not in (a0, a1, a2)  # copy a2's rows here
    assert bm.refcount(a0) == bm.refcount(a1) == 2 and bm.refcount(a2) == 1
    bm.append("a/b", 5)  # the branch's anchor + 4 drafts: positions 10..14, a block more
    assert bm.slots("a/b", 0, 8) == bm.slots("a", 0, 8)  # the same KV below the fork's block
    assert set(bm.slots("a/b", 10, 15)).isdisjoint(bm.slots("a", 0, 13))
    free = bm.num_free_blocks
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork("a", "a/b", 10)
    # dropped: everything the fork took comes back, the parent is untouched
    bm.free("a/b")
    assert bm.num_free_blocks == free + 2 and bm.table("a").blocks == own
    assert bm.refcount(a0) == 1
    # kept: the parent holds the fork's blocks, its own past the shared ones go back
    bm.fork("a", "a/b", 10)
    bm.append("a/b", 5)
    branch = bm.table("a/b").blocks
    bm.adopt("a", "a/b")
    assert not bm.has("a/b") and bm.table("a").blocks == branch and bm.num_tokens("a") == 15
    assert bm.refcount(a0) == 1 and bm.refcount(a2) == bm.refcount(own[3]) == 0
    bm.truncate("a", 12)
    bm.commit("a", ids + [10, 11], 12)
    assert len(bm.table("a").hashes) == 3
    bm.free("a")
    assert bm.num_free_blocks == 16


def test_a_fork_at_a_block_boundary_copies_nothing_and_needs_a_free_block_otherwise():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.append("a", 8)
    assert bm.fork("a", "a/b", 8) is None and bm.table("a/b").blocks == bm.table("a").blocks
    bm.free("a/b")
    bm.append("a", 2)  # all 3 blocks held
    with pytest.raises(OutOfBlocks):
        bm.fork("a", "a/b", 9)
    assert not bm.has("a/b") and bm.refcount(bm.table("a").blocks[0]) == 1
    with pytest.raises(ValueError, match="cannot fork"):
        bm.fork("a", "a/c", 11)
