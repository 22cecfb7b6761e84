"""Prefix caching through the engine: greedy outputs are identical (float32) with and without it,
with every drafter and the dspark policy, for requests that share a prefix, diverge inside a
block, arrive while the first is still prefilling, or resend a whole conversation; the
drafter's first proposal after a cache hit equals the one without the cache; every block comes
back; a preempted request's output is unchanged."""

from __future__ import annotations

import pytest
import torch

from dspark_serve.drafter.base import DraftRequest
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request, Status
from tests.helpers import ByteTokenizer, runner_for, tiny_model
from tests.scheduler.test_speculative import random_dspark

GREEDY = SamplingParams(temperature=0.0)


def make(model, name, path, caching, policy="dspark", num_blocks=256, budget=24):
    dr = None
    if name == "ngram":
        dr = build_drafter("ngram", block_size=4)
    elif name != "none":
        dr = build_drafter(name, path=str(path), target_model=model)
    cfg = SchedulerConfig(
        verify_policy=policy if dr is not None else "auto",
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    return Engine(
        runner_for(model, num_blocks=num_blocks), ByteTokenizer(), cfg, max_model_len=512, drafter=dr
    )


def scenario(engine) -> dict[str, list[int]]:
    """A: a prompt that prefills in chunks; B arrives while A is still prefilling and shares
    its first blocks; C diverges from A inside a block; D repeats A's prompt exactly; E comes
    after A finished and resends A's prompt, A's answer and a new turn."""
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()
    system = rnd(30)
    a = system + rnd(9)
    reqs = {"A": Request("A", a, GREEDY, max_tokens=14, ignore_eos=True)}
    later = {
        1: [Request("B", system[:16] + rnd(7), GREEDY, max_tokens=12, ignore_eos=True)],
        4: [
            Request("C", a[:22] + rnd(5), GREEDY, max_tokens=12, ignore_eos=True),
            Request("D", list(a), GREEDY, max_tokens=10, ignore_eos=True),
        ],
    }
    engine.add_request(reqs["A"])
    step = 0
    e_added = False
    while engine.has_work() or not e_added:
        for r in later.get(step, []):
            engine.add_request(r)
            reqs[r.request_id] = r
        if reqs["A"].finished and not e_added:
            e = Request("E", a + reqs["A"].output_ids + rnd(6), GREEDY, max_tokens=10, ignore_eos=True)
            engine.add_request(e)
            reqs["E"] = e
            e_added = True
        engine.step()
        step += 1
        assert step < 500
    return {k: r.output_ids for k, r in reqs.items()}


def all_free(engine) -> bool:
    b = engine.blocks
    return (
        b.num_free_blocks == b.num_blocks
        and not engine.running
        and not engine.waiting
        and all(b.refcount(i) == 0 for i in range(b.num_blocks))
    )


@pytest.mark.parametrize("name", ["none", "ngram", "dspark", "dflash", "dspark+ngram"])
def test_greedy_outputs_identical_with_and_without_caching(tmp_path, name):
    model = tiny_model("qwen3")
    path = (
        random_dspark(model, tmp_path, markov_rank=0 if name == "dflash" else 8)
        if "dspark" in name or name == "dflash"
        else None
    )
    outs = {}
    for caching in (False, True):
        eng = make(model, name, path, caching)
        outs[caching] = scenario(eng)
        assert all_free(eng)
        st = eng.blocks.stats()
        if caching:
            # B shares 4 blocks, C 5 (it diverges inside the 6th), D 9, E A's prompt + answer
            assert st.hits >= 16 + 20 + 36 + 48, st
            assert st.cached_free_blocks == st.cached_blocks > 0
        else:
            assert st.hits == 0 and st.cached_blocks == 0
    assert outs[True] == outs[False]
    assert {k: len(v) for k, v in outs[True].items()} == {"A": 14, "B": 12, "C": 12, "D": 10, "E": 10}


def _draft_view(engine, r: Request) -> DraftRequest:
    return DraftRequest(
        r.request_id, r.token_ids, len(r.prompt_ids), r.sampling, r.generator, engine.drafter.block_size
    )


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_first_proposal_after_a_hit_equals_the_one_without_cache(tmp_path, name):
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path, markov_rank=0 if name == "dflash" else 8)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (26,), generator=g).tolist()
    results = {}
    for caching in (False, True):
        eng = make(model, name, path, caching, policy="static:4")
        first = Request("first", shared + [1, 2, 3], GREEDY, max_tokens=6, ignore_eos=True)
        eng.add_request(first)
        while eng.has_work():
            eng.step()
        second = Request("second", shared + [9, 8, 7, 6, 5], GREEDY, max_tokens=8, ignore_eos=True)
        eng.add_request(second)
        read = []
        rows_of = eng.taps.rows_of
        eng.taps.rows_of = lambda *a: read.append(a) or rows_of(*a)
        while second.status is not Status.DECODE:
            eng.step()
        assert read == []  # the cached prefix's rows are not copied out at admission
        eng.taps.rows_of = rows_of
        hits = eng.blocks.stats().hits
        assert (hits == 24) if caching else (hits == 0)
        dr = eng.drafter
        # with the cache on, what waits for the next draft is positions in its tap rows, not copies
        pending = dr._pending["second"].hidden
        assert pending and all(isinstance(h, torch.Tensor) != caching for h in pending)
        prop = dr.propose([_draft_view(eng, second)])[0]
        kv, _ = dr.cache.gather([dr.cache.slot("second")])
        results[caching] = (prop, kv, second.output_ids[:1])
    (p0, kv0, t0), (p1, kv1, t1) = results[False], results[True]
    assert t0 == t1
    assert torch.equal(p0.tokens, p1.tokens) and len(p1.tokens) > 0
    if p0.confidences is not None:
        assert torch.allclose(p0.confidences, p1.confidences, atol=1e-5)
    # the drafter's whole context (every prompt position) is the same, cached or recomputed
    assert kv0[0][0].shape == kv1[0][0].shape and kv1[0][0].shape[1] == 31
    for (k0, v0), (k1, v1) in zip(kv0, kv1):
        assert torch.allclose(k0, k1, atol=1e-5) and torch.allclose(v0, v1, atol=1e-5)


def test_eviction_under_pressure_keeps_outputs_and_never_takes_blocks_in_use(tmp_path):
    """A pool so small that cached blocks are evicted (and requests preempted) all the time:
    outputs equal those of a pool where nothing is ever preempted or evicted."""
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path)
    outs = {}
    for caching, num_blocks in ((False, 256), (False, 24), (True, 24)):
        eng = make(model, "dspark", path, caching, num_blocks=num_blocks, budget=32)
        g = torch.Generator().manual_seed(5)
        system = torch.randint(0, 256, (17,), generator=g).tolist()
        reqs = [
            Request(
                f"r{i}",
                system + torch.randint(0, 256, (3 + i,), generator=g).tolist(),
                GREEDY,
                max_tokens=24,
                ignore_eos=True,
            )
            for i in range(6)
        ]
        blocks = eng.blocks
        orig_take = blocks._take

        def take_checked():
            held = {b for t in blocks._tables.values() for b in t.blocks}
            b = orig_take()
            assert b not in held, f"block {b} handed out while a request holds it"
            return b

        blocks._take = take_checked
        for r in reqs[:3]:
            eng.add_request(r)
        step = 0
        while eng.has_work() or step < 6:
            if step == 5:
                for r in reqs[3:]:
                    eng.add_request(r)
            eng.step()
            step += 1
        outs[caching, num_blocks] = [r.output_ids for r in reqs]
        assert all_free(eng)
        if caching:
            assert blocks.stats().evictions > 0 and blocks.stats().hits > 0
        assert (eng.scheduler.num_preemptions > 0) == (num_blocks == 24)
    assert outs[True, 24] == outs[False, 24] == outs[False, 256]
    assert all(len(o) == 24 for o in outs[True, 24])


@pytest.mark.parametrize("name", ["none", "ngram"])
def test_seeded_sampling_output_is_unchanged_by_preemption(name):
    """Same seed, same output: with a pool so small that requests are preempted (and resume by
    recomputing) and with one where nothing is."""
    model = tiny_model("llama")
    outs = {}
    for num_blocks in (256, 20):
        eng = make(model, name, None, True, policy="static:3", num_blocks=num_blocks, budget=64)
        g = torch.Generator().manual_seed(2)
        reqs = [
            Request(
                f"s{i}",
                torch.randint(0, 256, (18,), generator=g).tolist(),
                SamplingParams(temperature=1.0, seed=40 + i),
                max_tokens=22,
                ignore_eos=True,
            )
            for i in range(4)
        ]
        for r in reqs:
            eng.add_request(r)
        while eng.has_work():
            eng.step()
        outs[num_blocks] = [r.output_ids for r in reqs]
        assert (eng.scheduler.num_preemptions > 0) == (num_blocks == 20)
        assert all_free(eng)
    assert outs[20] == outs[256]
    assert all(len(o) == 22 for o in outs[20])


def test_prefix_caching_flag_and_config_validation():
    from dspark_serve.server.cli import resolve

    assert resolve([])[2].enable_prefix_caching is True  # on by default
    assert resolve(["--no-enable-prefix-caching"])[2].enable_prefix_caching is False
    with pytest.raises(ValueError, match="'yes'"):
        SchedulerConfig(enable_prefix_caching="yes")
    model = tiny_model("llama")
    eng = make(model, "none", None, False)
    assert not eng.blocks.enable_caching
    eng.set_prefix_caching(True)
    assert eng.blocks.enable_caching


def test_aborts_of_requests_sharing_blocks_return_every_reference(tmp_path):
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path)
    eng = make(model, "dspark", path, True, budget=16)
    g = torch.Generator().manual_seed(9)
    system = torch.randint(0, 256, (24,), generator=g).tolist()
    first = Request("first", system + [1, 2], GREEDY, max_tokens=30, ignore_eos=True)
    eng.add_request(first)
    while first.status is not Status.DECODE:
        eng.step()
    others = [
        Request(f"o{i}", system + [3 + i] * (6 + 5 * i), GREEDY, max_tokens=30, ignore_eos=True)
        for i in range(3)
    ]
    for r in others:
        eng.add_request(r)
    eng.step()
    blocks = eng.blocks
    shared = blocks.table("first").blocks[:6]
    assert all(blocks.refcount(b) >= 2 for b in shared)  # the others hold them too
    eng.abort("o2")  # still prefilling
    eng.step()
    eng.step()
    eng.abort("first")  # decoding; its blocks stay shared
    assert all(blocks.refcount(b) >= 1 for b in shared)
    eng.abort("o0")
    while eng.has_work():
        eng.step()
    assert others[1].finish_reason == "length" and len(others[1].output_ids) == 30
    assert all_free(eng) and blocks.stats().cached_free_blocks > 0


def test_a_forks_copied_block_keeps_its_tap_rows():
    """`TapCache.copy_block` beside the KV copy of a fork's partial block: the shared positions
    read back the rows their parent stored (a branch that wins is adopted with them)."""
    from dspark_serve.drafter.base import AcceptedContext
    from dspark_serve.scheduler.block_manager import BlockManager
    from dspark_serve.scheduler.prefix import TapCache

    bm = BlockManager(num_blocks=8, block_size=4)
    taps = TapCache(bm, torch.device("cpu"))
    taps.copy_block(0, 1)  # nothing stored yet: nothing to do
    bm.append("a", 6)
    hidden = torch.randn(6, 3)
    taps.write([AcceptedContext("a", list(range(6)), 0, hidden)])
    src, dst = bm.fork("a", "a/b", 6)
    taps.copy_block(src, dst)
    torch.testing.assert_close(taps.rows_of("a/b", 0, 6), hidden)  # 4 shared + 2 copied
    bm.adopt("a", "a/b")
    torch.testing.assert_close(taps.rows_of("a", 0, 6), hidden)


def test_a_steps_whole_forward_is_stored_in_one_copy():
    """`TapCache.write` with the forward's rows and slots: every row lands at its slot (a
    rejected draft's too, harmless: its position is written again before any read), the kept
    contexts are marked stored and read back as computed, exactly as the per-context gather
    stores them; a context whose request holds no blocks is left as it was."""
    from dspark_serve.drafter.base import AcceptedContext
    from dspark_serve.scheduler.block_manager import BlockManager
    from dspark_serve.scheduler.prefix import TapCache

    def step(whole: bool):
        bm = BlockManager(num_blocks=8, block_size=4)
        taps = TapCache(bm, torch.device("cpu"))
        g = torch.Generator().manual_seed(3)
        bm.append("a", 5)  # a 5-token prefill chunk
        bm.append("b", 3)  # b: anchor + 2 drafts; one draft kept
        rows = torch.randn(8, 6, generator=g)
        slots = torch.tensor(bm.slots("a", 0, 5) + bm.slots("b", 0, 3))
        ctxs = [
            AcceptedContext("a", list(range(5)), 0, rows[:5]),
            AcceptedContext("b", [7, 8], 0, rows[5:7]),
            AcceptedContext("gone", [1], 0, rows[7:]),
        ]
        bm.truncate("b", 2)  # the verdict rolls b's rejected draft back before storing
        out = taps.write(ctxs, rows, slots) if whole else taps.write(ctxs)
        assert [c.stored is taps for c in out] == [True, True, False]
        return taps.rows_of("a", 0, 5), taps.rows_of("b", 0, 2), rows

    (a1, b1, rows), (a0, b0, _) = step(whole=True), step(whole=False)
    assert torch.equal(a1, rows[:5]) and torch.equal(b1, rows[5:7])
    assert torch.equal(a1, a0) and torch.equal(b1, b0)


def test_plain_decoding_between_drafting_runs_keeps_the_tap_rows_buffer(tmp_path):
    """A benchmark alternates plain and drafting arms on one engine: the tap rows' buffer (a row
    per KV slot used) survives the plain arm, so the next drafting run does not allocate and
    fault it in anew, and that run's output is the one a fresh engine makes."""
    model = tiny_model("qwen3")
    path = random_dspark(model, tmp_path, markov_rank=8)
    fresh = make(model, "dspark", path, caching=True)
    want = scenario(fresh)
    eng = make(model, "dspark", path, caching=True)
    scenario(eng)
    rows = eng.taps.rows
    assert rows is not None
    eng.set_policy("none")
    assert eng.taps.rows is rows and eng.tap_layers == ()
    scenario(eng)  # plain: nothing tapped, nothing written
    eng.set_policy("dspark")
    assert eng.taps.rows is rows
    assert scenario(eng) == want
    assert all_free(eng)
    # an engine whose drafter taps nothing keeps nothing
    plain = make(model, "ngram", None, caching=True)
    scenario(plain)
    plain.set_policy("none")
    assert plain.taps.rows is None
