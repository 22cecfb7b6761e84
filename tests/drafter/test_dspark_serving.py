"""The batched serving path (per-request context KV cache, one padded forward for all
requests) equals the training forward on the same data; sampling, truncation, factories."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from dspark_serve.drafter.base import AcceptedContext, DraftRequest
from dspark_serve.drafter.dspark import ContextKVCache, DraftContexts, DSparkDrafter, DSparkDrafterConfig
from dspark_serve.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
from dspark_serve.drafter.dspark_model.fast import FastDraftBackbone
from dspark_serve.drafter.dspark_model.graphs import DraftBucket, GraphedBlock
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.cpu_kernels import load_kernels
from dspark_serve.ops.sampling import probs_from_logits
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.verifier.cuda_graphs import EagerReplay
from tests.triton_interpreter import needs_triton

GREEDY = SamplingParams(temperature=0.0)
V, D, BS = 120, 48, 4


def tiny_model(head_type="vanilla", seed=0) -> DSparkModel:
    torch.manual_seed(seed)
    cfg = DSparkConfig(
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=64,
        vocab_size=V,
        block_size=BS,
        target_layer_ids=(-1, 1, 3),
        mask_token_id=V - 1,
        num_target_layers=4,
        rope_theta=10000.0,
        markov_rank=8,
        markov_head_type=head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    model = DSparkModel(cfg).double()
    with torch.no_grad():  # non-trivial norms / Markov weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        model.markov_head.markov_w2.weight.mul_(20.0)
    return model.eval()


FAST_KINDS = pytest.mark.parametrize(
    "fast",
    [False, "copy", "in-place", "triton", "graphs"],
    ids=["modules", "fast-backbone", "fast-in-place", "fast-triton", "fast-triton-graphs"],
)  # triton: the CUDA path, here under Triton's interpreter; graphs: its block pass over the
# static, padded buffers a CUDA graph replays (`EagerReplay` standing in for the capture)


def make_drafter(model, capacity=4, fast=False) -> DSparkDrafter:
    """fast: serve through the fused backbone (what bf16 on a CPU picks): "copy" attends over a
    gathered copy of the context (here in float64), "in-place" reads the context pools through
    the C kernel (float32: the kernel's dtypes are float32 and bf16), "triton" through the
    Triton kernels CUDA runs (here under the interpreter, float32), "graphs" as "triton" with
    the block pass replayed from static buffers (`GraphedBlock`)."""
    dr = DSparkDrafter(model, DSparkDrafterConfig(initial_capacity=capacity), "dspark")
    if fast:
        dr.backbone = FastDraftBackbone(model, kernels="triton" if fast in ("triton", "graphs") else "c")
        if fast == "copy":
            dr.backbone._kernels = None
        else:
            assert dr.backbone.reads_pools_in_place
    if fast == "graphs":
        dr.graphs = GraphedBlock(dr.backbone, EagerReplay())
        dr.contexts = DraftContexts(model, "dspark", capacity, scratch=True)
        dr.cache = dr.contexts.cache
    return dr


def model_for(fast):
    if fast == "in-place" and load_kernels() is None:
        pytest.skip("the in-place drafter attention needs the C kernels (a C compiler)")
    if fast in ("triton", "graphs"):
        needs_triton()
    return tiny_model().float() if fast in ("in-place", "triton", "graphs") else tiny_model()


def tol(fast) -> dict:
    """The modules' RMSNorm computes in float32 whatever the dtype (Qwen3RMSNorm's maths), the
    fast backbone's in the input dtype, so in float64 the two agree to ~1e-7, not to rounding;
    a wrong mask, head mapping or rotary sign would be off by orders of magnitude more. The
    in-place paths run in float32 against the float32 modules."""
    if fast in ("in-place", "triton", "graphs"):
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 1e-5, "atol": 1e-5} if fast else {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("capacity", [4, 6])  # 6: the in-place reads take 2-position blocks
@FAST_KINDS
def test_batched_serving_equals_training_forward(fast, capacity):
    model = model_for(fast)
    dt = next(model.parameters()).dtype
    dr = make_drafter(model, capacity=capacity, fast=fast)  # forces capacity doubling and slot growth
    g = torch.Generator().manual_seed(1)
    lengths = [3, 11, 7, 1, 9]  # context positions before each request's final anchor
    seq = max(lengths) + 1
    hidden = torch.randn(len(lengths), seq, 3 * D, generator=g, dtype=torch.float64).to(dt)
    ids = torch.randint(0, V - 1, (len(lengths), seq), generator=g)
    # Each request is observed in uneven chunks; a draft block is taken at every stage.
    stages: dict[int, list[int]] = {0: [2, 3], 1: [4, 9, 11], 2: [7], 3: [], 4: [1, 5, 9]}
    got: dict[tuple[int, int], torch.Tensor] = {}
    cached = [0] * len(lengths)
    for step in range(3):
        ctxs, reqs = [], []
        for r, points in stages.items():
            if step < len(points):
                end = points[step]
                ctxs.append(
                    AcceptedContext(
                        f"r{r}", ids[r, cached[r] : end].tolist(), cached[r], hidden[r, cached[r] : end]
                    )
                )
                cached[r] = end
                reqs.append((r, end))
            elif step == 0:
                reqs.append((r, 0))  # never observed: empty context, anchor at 0
        dr.observe(ctxs)
        batch = [DraftRequest(f"r{r}", ids[r, : end + 1].tolist(), 1, GREEDY, None, 100) for r, end in reqs]
        out = dr.block_hidden(batch)
        for (r, end), h in zip(reqs, out):
            got[(r, end)] = h
    assert len(got) == 10
    # Training forward: every (request, anchor) pair as an anchor block.
    n = max(len(p) or 1 for p in stages.values())
    anchors = torch.zeros(len(lengths), n, dtype=torch.long)
    valid = torch.zeros(len(lengths), n, dtype=torch.bool)
    for r, points in stages.items():
        for j, a in enumerate(points or [0]):
            anchors[r, j], valid[r, j] = a, True
    train = model.forward_train(hidden, ids, anchors, valid)
    for (r, a), h in got.items():
        j = (stages[r] or [0]).index(a)
        torch.testing.assert_close(h, train[r, j], **tol(fast))


@FAST_KINDS
def test_rollback_overwrite_and_errors(fast):
    model = model_for(fast)
    dt = next(model.parameters()).dtype
    dr = make_drafter(model, fast=fast)
    g = torch.Generator().manual_seed(2)
    hid = torch.randn(1, 8, 3 * D, generator=g, dtype=torch.float64).to(dt)
    ids = torch.randint(0, V - 1, (1, 8), generator=g)
    dr.observe([AcceptedContext("a", ids[0, :5].tolist(), 0, torch.randn(5, 3 * D, dtype=dt))])
    # Re-observing from position 2 overwrites what was cached there (and drops the rest).
    dr.observe([AcceptedContext("a", ids[0, :2].tolist(), 0, hid[0, :2])])
    dr.observe([AcceptedContext("a", ids[0, 2:6].tolist(), 2, hid[0, 2:6])])
    req = DraftRequest("a", ids[0, :7].tolist(), 3, GREEDY, None, 100)
    train = model.forward_train(hid, ids, torch.tensor([[6]]), torch.tensor([[True]]))
    torch.testing.assert_close(dr.block_hidden([req])[0], train[0, 0], **tol(fast))
    with pytest.raises(ValueError, match="starts at 9"):
        dr.observe([AcceptedContext("a", [1], 9, hid[0, :1])])
    with pytest.raises(ValueError, match="holds 6 positions"):
        dr.propose([DraftRequest("a", ids[0, :5].tolist(), 3, GREEDY, None, 100)])
    with pytest.raises(ValueError, match="hidden states"):
        dr.observe([AcceptedContext("b", [1, 2], 0, None)])
    dr.free("a")
    with pytest.raises(ValueError, match="holds 0 positions"):
        dr.propose([req])


def test_context_is_absorbed_lazily_at_the_next_draft(monkeypatch):
    """Steps that do not draft only queue the kept tokens' tap states: nothing is projected
    until the request drafts, then everything pending goes in one batch, rollbacks included,
    and the block equals the training forward on the final sequence."""
    model = tiny_model()
    dr = make_drafter(model)
    g = torch.Generator().manual_seed(4)
    hid = torch.randn(1, 12, 3 * D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, 12), generator=g)
    train = model.forward_train(hid, ids, torch.tensor([[11]]), torch.tensor([[True]]))
    calls = []
    project = model.project_context
    monkeypatch.setattr(model, "project_context", lambda h: calls.append(h.shape[0]) or project(h))
    ctx = lambda a, b, h=None: AcceptedContext("a", ids[0, a:b].tolist(), a, hid[0, a:b] if h is None else h)
    dr.observe([ctx(0, 5)])  # a prompt chunk
    wrong = torch.cat([hid[0, 5:6], torch.randn(2, 3 * D, dtype=torch.float64)])
    dr.observe([ctx(5, 8, wrong)])  # an anchor and two drafts kept, then...
    dr.observe([ctx(6, 9)])  # ...rolled back to 6 and re-sent
    dr.observe([ctx(9, 10)])
    dr.observe([ctx(10, 11)])
    assert calls == [] and dr.cache.length("a") == 0  # no draft yet: no projection
    req = DraftRequest("a", ids[0, :12].tolist(), 3, GREEDY, None, 100)
    got = dr.block_hidden([req])[0]
    assert calls == [11] and dr.cache.length("a") == 11  # one batch, rolled-back rows replaced
    torch.testing.assert_close(got, train[0, 0], rtol=1e-10, atol=1e-10)
    # a rollback into what was already projected overwrites it, lazily as well
    dr.observe([ctx(9, 11)])
    assert calls == [11]
    torch.testing.assert_close(dr.block_hidden([req])[0], train[0, 0], rtol=1e-10, atol=1e-10)
    assert calls == [11, 2]
    with pytest.raises(ValueError, match="starts at 13"):
        dr.observe([AcceptedContext("a", [1], 13, hid[0, :1])])
    dr.observe([ctx(11, 12)])
    dr.free("a")  # pending states go with the request
    assert dr.cache.length("a") == 0 and "a" not in dr.contexts.pending


def test_in_place_block_absorbs_the_context_in_its_own_pass(monkeypatch):
    """Where the fast backbone reads the pools in place, pending context rides through the
    block's pass (its k / v with the block's rows) instead of a pass of its own: the same block
    and the same context K/V as absorbing first, bit for bit (float32: each row's sums run in
    one order however many rows share a call), for a batch with and without pending rows."""
    model = model_for("in-place")
    g = torch.Generator().manual_seed(8)
    hid = torch.randn(2, 12, 3 * D, generator=g)
    ids = torch.randint(0, V - 1, (2, 12), generator=g)
    fused, apart = make_drafter(model, fast="in-place"), make_drafter(model, fast="in-place")
    calls = []
    kv = fused.backbone.context_kv
    monkeypatch.setattr(fused.backbone, "context_kv", lambda *a: calls.append(1) or kv(*a))
    ctx = lambda r, a, b: AcceptedContext(f"r{r}", ids[r, a:b].tolist(), a, hid[r, a:b])

    def reqs(ends):
        return [DraftRequest(f"r{r}", ids[r, : e + 1].tolist(), 3, GREEDY, None, 100) for r, e in ends]

    for stage in ([ctx(0, 0, 5), ctx(1, 0, 9)], [ctx(0, 5, 7)], []):
        ends = [(0, 7 if len(stage) < 2 else 5), (1, 9)]
        for dr in (fused, apart):
            dr.observe(stage)
        apart._absorb(["r0", "r1"])
        a, b = fused.block_hidden(reqs(ends)), apart.block_hidden(reqs(ends))
        assert torch.equal(a, b)
        for layer in range(2):
            for pools in ("k", "v"):
                for r, e in ends:
                    s_f, s_a = fused.cache.slot(f"r{r}"), apart.cache.slot(f"r{r}")
                    got = getattr(fused.cache, pools)[layer][s_f, :e]
                    assert torch.equal(got, getattr(apart.cache, pools)[layer][s_a, :e])
    assert calls == []  # never a pass of its own
    assert fused.cache.length("r0") == 7 and fused.cache.length("r1") == 9


def test_graphed_block_pads_its_bucket_and_recaptures_when_the_pools_move(caplog):
    """The graphed block pass (static buffers, `EagerReplay` for the capture) equals the eager
    Triton pass: three requests padded to a bucket of four (the padding in the scratch slot,
    which no request is given), the same bucket replayed, every graph dropped and captured again
    once the pools have grown (the graphs read them by address), and a capture that fails or a
    spent budget leaving the eager pass to run."""
    model = model_for("graphs")
    g = torch.Generator().manual_seed(11)
    hid = torch.randn(3, 40, 3 * D, generator=g)
    ids = torch.randint(0, V - 1, (3, 40), generator=g)
    graphed, eager = (
        make_drafter(model, capacity=16, fast="graphs"),
        make_drafter(model, capacity=16, fast="triton"),
    )
    gb = graphed.graphs
    assert isinstance(gb, GraphedBlock)
    done = [0, 0, 0]

    def step(ends):
        ctx = [
            AcceptedContext(f"r{r}", ids[r, done[r] : e].tolist(), done[r], hid[r, done[r] : e])
            for r, e in enumerate(ends)
        ]
        for r, e in enumerate(ends):
            done[r] = e
        reqs = [
            DraftRequest(f"r{r}", ids[r, : e + 1].tolist(), 3, GREEDY, None, 100) for r, e in enumerate(ends)
        ]
        for dr in (graphed, eager):
            dr.observe(ctx)
        a, b = graphed.block_hidden(reqs), eager.block_hidden(reqs)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        scratch = graphed.cache.scratch_slot
        assert scratch == graphed.cache.num_slots - 1 and scratch not in graphed.cache.slot_of.values()

    step([3, 5, 2])
    assert list(gb.graphs) == [DraftBucket(4, BS)] and gb.replays == 1 and gb.captures == 1
    step([6, 9, 4])  # the same bucket, longer contexts
    assert gb.replays == 2 and gb.captures == 1 and gb.drops == 0
    step([30, 12, 8])  # past the capacity of 16: the pools double, the graph is captured again
    assert graphed.cache.capacity == 64 and gb.drops == 1 and gb.captures == 2 and gb.replays == 3
    with caplog.at_level(logging.WARNING):
        gb.graphs.clear()
        gb.capture = lambda fn: (_ for _ in ()).throw(RuntimeError("capture refused"))
        step([31, 13, 9])
    assert gb.graphs == {DraftBucket(4, BS): None} and gb.replays == 3 and "capture refused" in caplog.text
    gb.graphs.clear()
    gb.budget.spent_s = gb.budget.budget_s
    step([32, 14, 10])
    assert gb.graphs == {DraftBucket(4, BS): None} and gb.replays == 3


def test_graphed_proposal_runs_the_greedy_heads_in_its_graph():
    """All-greedy batches draft in one replay: the block pass and the heads (LM head, Markov
    walk, confidence logits) in the graph, the same tokens and confidences as the eager Triton
    drafter's proposal, trimmed blocks included; a batch with a sampled row replays the pass
    alone and samples eagerly."""
    model = model_for("graphs")
    g = torch.Generator().manual_seed(12)
    hid = torch.randn(3, 30, 3 * D, generator=g)
    ids = torch.randint(0, V - 1, (3, 30), generator=g)
    graphed, eager = (
        make_drafter(model, capacity=32, fast="graphs"),
        make_drafter(model, capacity=32, fast="triton"),
    )
    gb = graphed.graphs
    for dr in (graphed, eager):
        dr.observe([AcceptedContext(f"r{r}", ids[r, :20].tolist(), 0, hid[r, :20]) for r in range(3)])
    for max_draft in (2, BS):  # a trimmed block (3 positions), then the whole block
        reqs = [DraftRequest(f"r{r}", ids[r, :21].tolist(), 3, GREEDY, None, max_draft) for r in range(3)]
        got, want = graphed.propose(reqs), eager.propose(reqs)
        for a, b in zip(got, want):
            assert torch.equal(a.tokens, b.tokens) and a.probs is None
            torch.testing.assert_close(a.confidences, b.confidences, rtol=1e-4, atol=1e-4)
    assert {b for b, gr in gb.graphs.items() if gr is not None} == {
        DraftBucket(4, 3, heads=True),
        DraftBucket(4, BS, heads=True),
    }
    hot = SamplingParams(temperature=1.0)
    mixed = [DraftRequest(f"r{r}", ids[r, :21].tolist(), 3, GREEDY if r else hot, None, BS) for r in range(3)]
    before = gb.replays
    out = graphed.propose(mixed)
    assert gb.replays == before + 1 and DraftBucket(4, BS) in gb.graphs  # the pass alone
    assert out[0].probs is not None and out[1].probs is None


def test_context_cache_scratch_slot_is_never_a_requests():
    """With a scratch slot the last slot is kept back; growing doubles the requests' slots,
    hands the old scratch out and keeps the new last back (one slot beside a power of two, as
    the memory plan counts), and every request keeps its slot and its K/V."""
    cache = ContextKVCache(1, 1, 2, torch.device("cpu"), torch.float32, capacity=4, slots=1, scratch=True)
    assert cache.scratch_slot == 1
    first = cache.slot("a")
    cache.write(0, torch.tensor([first]), torch.tensor([0]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    others = [cache.slot(r) for r in "bcd"]  # 1 + 1 slots, then 2 + 1, then 4 + 1
    assert cache.num_slots == 5 and cache.scratch_slot == 4
    assert len({first, *others}) == 4 and 4 not in (first, *others) and 1 in others
    assert cache.k[0][first, 0].tolist() == [[1.0, 1.0]]
    plain = ContextKVCache(1, 1, 2, torch.device("cpu"), torch.float32, capacity=4, slots=2)
    assert plain.scratch_slot is None and sorted(plain.slot(r) for r in "ab") == [0, 1]


def test_a_large_catch_up_is_projected_apart_and_priced(monkeypatch):
    """More pending positions than `absorb_apart` are projected on their own (k / v only)
    before the block's pass: the same block and context K/V as riding in it, bit for bit
    (float32). Their cost per position is measured there, and `catch_up_seconds` prices what
    waits with it: unknown before any such projection, 0 with nothing pending, then in
    proportion to the positions waiting."""
    model = model_for("in-place")
    g = torch.Generator().manual_seed(9)
    hid = torch.randn(2, 12, 3 * D, generator=g)
    ids = torch.randint(0, V - 1, (2, 12), generator=g)
    apart, riding = make_drafter(model, fast="in-place"), make_drafter(model, fast="in-place")
    apart.config = DSparkDrafterConfig(initial_capacity=4, absorb_apart=8)
    calls = []
    kv = apart.backbone.context_kv
    monkeypatch.setattr(apart.backbone, "context_kv", lambda *a: calls.append(a[1].shape[0]) or kv(*a))
    ctx = lambda r, a, b: AcceptedContext(f"r{r}", ids[r, a:b].tolist(), a, hid[r, a:b])

    def reqs(ends):
        return [DraftRequest(f"r{r}", ids[r, : e + 1].tolist(), 3, GREEDY, None, 100) for r, e in ends]

    assert apart.catch_up_seconds(["r0", "r1"]) == 0.0
    for dr in (apart, riding):
        dr.observe([ctx(0, 0, 3), ctx(1, 0, 4)])
    assert apart.catch_up_seconds(["r0", "r1"]) is None  # nothing measured yet
    first = reqs([(0, 3), (1, 4)])
    assert torch.equal(apart.block_hidden(first), riding.block_hidden(first))
    assert calls == [] and apart.contexts.row_seconds is None  # 7 rows rode in the pass: not measured
    for dr in (apart, riding):
        dr.observe([ctx(0, 3, 9), ctx(1, 4, 10)])
    ends = [(0, 9), (1, 10)]
    assert torch.equal(apart.block_hidden(reqs(ends)), riding.block_hidden(reqs(ends)))
    assert calls == [12, 12]  # 12 rows, one pass per layer of their own
    for layer in range(2):
        for pools in ("k", "v"):
            for r, e in ends:
                got = getattr(apart.cache, pools)[layer][apart.cache.slot(f"r{r}"), :e]
                assert torch.equal(got, getattr(riding.cache, pools)[layer][riding.cache.slot(f"r{r}"), :e])
    per = apart.contexts.row_seconds
    assert per is not None and per > 0
    apart.observe([ctx(0, 9, 11)])
    assert apart.catch_up_seconds(["r0", "r1"]) == pytest.approx(2 * per)
    assert apart.catch_up_seconds(["r1"]) == 0.0
    with pytest.raises(ValueError, match="absorb_apart"):
        DSparkDrafterConfig(absorb_apart=-1)


def test_bf16_layers_in_one_c_call_equal_the_python_loop(monkeypatch):
    """bf16 on a CPU with the C kernels: the block's layers run as one C call (`DraftLayers`),
    the same kernels in the same order as the Python loop: the same block hidden states and the
    same context K/V, bit for bit, with and without pending context, for one and two requests;
    past the packed gemm's row limit the Python loop (and its oneDNN fallback) runs instead."""
    if load_kernels() is None:
        pytest.skip("the in-place drafter attention needs the C kernels (a C compiler)")
    # products of up to 64 rows in the packed gemm (every stage below), whatever the CPU's default
    monkeypatch.setattr("dspark_serve.ops.linear._gemm_rows_here", lambda: 64)
    model = tiny_model().to(torch.bfloat16)
    in_c, loop = make_drafter(model, fast="in-place"), make_drafter(model, fast="in-place")
    assert in_c.backbone._driver is not None
    loop.backbone._driver = None
    calls = []
    driver = in_c.backbone._driver
    counting = type(
        "Counting",
        (),
        {"max_rows": driver.max_rows, "__call__": lambda self, *a: calls.append(a[2].shape[0]) or driver(*a)},
    )()
    monkeypatch.setattr(in_c.backbone, "_driver", counting)
    g = torch.Generator().manual_seed(11)
    hid = torch.randn(2, 12, 3 * D, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, V - 1, (2, 12), generator=g)
    ctx = lambda r, a, b: AcceptedContext(f"r{r}", ids[r, a:b].tolist(), a, hid[r, a:b])

    def reqs(ends):
        return [DraftRequest(f"r{r}", ids[r, : e + 1].tolist(), 3, GREEDY, None, 100) for r, e in ends]

    for stage, ends in (
        ([ctx(0, 0, 5), ctx(1, 0, 9)], [(0, 5), (1, 9)]),
        ([ctx(0, 5, 7)], [(0, 7)]),
        ([], [(0, 7), (1, 9)]),
    ):
        for dr in (in_c, loop):
            dr.observe(stage)
        a, b = in_c.block_hidden(reqs(ends)), loop.block_hidden(reqs(ends))
        assert torch.equal(a, b)
        for layer in range(2):
            for pools in ("k", "v"):
                for r, e in ends:
                    got = getattr(in_c.cache, pools)[layer][in_c.cache.slot(f"r{r}"), : e + BS]
                    assert torch.equal(
                        got, getattr(loop.cache, pools)[layer][loop.cache.slot(f"r{r}"), : e + BS]
                    )
    assert calls == [2 * BS, BS, 2 * BS]  # every block went through the one call
    counting.max_rows = BS  # two requests' rows: more than the limit
    in_c.block_hidden(reqs([(0, 7), (1, 9)]))
    assert len(calls) == 3


def test_pending_states_are_bounded():
    model = tiny_model()
    dr = DSparkDrafter(model, DSparkDrafterConfig(initial_capacity=4, max_pending=4), "dspark")
    hid = torch.randn(6, 3 * D, dtype=torch.float64)
    for i in range(3):
        dr.observe([AcceptedContext("a", [1], i, hid[i : i + 1])])
    assert dr.cache.length("a") == 0
    dr.observe([AcceptedContext("a", [1], 3, hid[3:4])])  # the 4th pending position: projected
    assert dr.cache.length("a") == 4 and "a" not in dr.contexts.pending
    with pytest.raises(ValueError, match="max_pending"):
        DSparkDrafterConfig(max_pending=0)


class RowStore:
    """A TapRows: one request's tap states by position, as the engine's prefix cache keeps them."""

    def __init__(self, hidden):
        self.hidden, self.reads = hidden, []

    def rows_of(self, request_id, start, end):
        self.reads.append((request_id, start, end))
        return self.hidden[start:end]


def test_stored_context_waits_without_copies_or_bound(monkeypatch):
    """Contexts whose states the engine keeps readable (`stored`) are read back when absorbed:
    no copy waits, max_pending does not force a projection, rollbacks re-read what the store
    holds then, and the block equals the training forward; copies mixed in stay bounded."""
    model = tiny_model()
    dr = DSparkDrafter(model, DSparkDrafterConfig(initial_capacity=4, max_pending=4), "dspark")
    g = torch.Generator().manual_seed(6)
    hid = torch.randn(1, 12, 3 * D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, 12), generator=g)
    train = model.forward_train(hid, ids, torch.tensor([[11]]), torch.tensor([[True]]))
    store = RowStore(hid[0].clone())
    store.hidden[6:8] = 0.0  # drafts kept at first, then rolled back: the store held other rows
    ctx = lambda a, b: AcceptedContext("a", ids[0, a:b].tolist(), a, store.hidden[a:b], stored=store)
    dr.observe([ctx(0, 6)])  # more than max_pending, all stored: nothing projected
    dr.observe([ctx(6, 8)])
    store.hidden[6:8] = hid[0, 6:8]  # the target rolled back to 6 and kept other states there
    dr.observe([ctx(6, 9)])
    assert dr.cache.length("a") == 0 and store.reads == []
    assert all(not isinstance(h, torch.Tensor) for h in dr.contexts.pending["a"].hidden)  # no copies
    dr.observe([AcceptedContext("a", ids[0, 9:11].tolist(), 9, hid[0, 9:11])])  # copies: bounded...
    assert dr.cache.length("a") == 0 and dr.contexts.pending["a"].copied == 2
    req = DraftRequest("a", ids[0, :12].tolist(), 3, GREEDY, None, 100)
    got = dr.block_hidden([req])[0]
    assert dr.cache.length("a") == 11 and store.reads == [("a", 0, 6), ("a", 6, 9)]
    torch.testing.assert_close(got, train[0, 0], rtol=1e-10, atol=1e-10)
    for i in range(11, 15):  # ...4 copied positions projected at once
        dr.observe([AcceptedContext("a", [1], i, hid[0, :1])])
    assert dr.cache.length("a") == 15


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_propose_mixed_sampling_truncation(head_type):
    model = tiny_model(head_type)
    dr = make_drafter(model)
    g = torch.Generator().manual_seed(3)
    hid = torch.randn(3, 6, 3 * D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (3, 7), generator=g)
    dr.observe([AcceptedContext(f"r{i}", ids[i, :6].tolist(), 0, hid[i]) for i in range(3)])
    hot = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)

    def reqs(seed):
        return [
            DraftRequest("r0", ids[0].tolist(), 3, GREEDY, None, 2),
            DraftRequest("r1", ids[1].tolist(), 3, hot, torch.Generator().manual_seed(seed), 100),
            DraftRequest("r2", ids[2].tolist(), 3, GREEDY, None, 0),
        ]

    p0, p1, p2 = dr.propose(reqs(5))
    assert len(p0) == 2 and p0.probs is None and p0.confidences.shape == (2,)
    assert len(p2) == 0
    assert len(p1) == BS and p1.probs.shape == (BS, V) and p1.probs.dtype == torch.float32
    torch.testing.assert_close(p1.probs.sum(-1), torch.ones(BS))
    assert (p1.probs.gather(1, p1.tokens[:, None]) > 0).all()
    assert ((p1.probs > 0).sum(-1) <= 20).all()  # top-k applied to q as to p
    assert dr.propose(reqs(5))[1].tokens.tolist() == p1.tokens.tolist()  # seeded: reproducible
    # q_k is the processed distribution of the teacher-forced corrected logits.
    hidden = dr.block_hidden(reqs(5)[1:2])
    prev = torch.cat([ids[1, -1:], p1.tokens[:-1]])[None]
    logits = model.block_logits(hidden, prev)[0]
    q = probs_from_logits(logits, torch.full((BS,), 0.8), torch.full((BS,), 0.9), torch.full((BS,), 20))
    torch.testing.assert_close(p1.probs, q, rtol=1e-5, atol=1e-6)
    # Greedy drafts are the argmax of the corrected logits; confidences in (0, 1).
    hidden0 = dr.block_hidden(reqs(5)[:1])
    full = model.block_logits(hidden0, torch.cat([ids[0, -1:], p0.tokens, p0.tokens[-1:]])[None, :BS])[0]
    assert full[:2].argmax(-1).tolist() == p0.tokens.tolist()
    assert ((p0.confidences > 0) & (p0.confidences < 1)).all()
    # sample_block: greedy rows of a mixed batch carry a one-hot q; an all-greedy batch none.
    both = dr.block_hidden(reqs(5)[:2])
    base, anchors = model.lm_head(both), ids[:2, -1]
    blk = model.sample_block(base, anchors, [GREEDY, hot], [None, torch.Generator().manual_seed(5)], both)
    onehot = torch.nn.functional.one_hot(blk.tokens[0], V).float()
    assert torch.equal(blk.probs[0], onehot) and blk.tokens[1].tolist() == p1.tokens.tolist()
    assert model.sample_block(base, anchors, [GREEDY, GREEDY], [None, None], both).probs is None


@pytest.mark.parametrize("trim", [True, False])
def test_a_step_runs_only_the_block_positions_its_drafts_can_use(monkeypatch, trim):
    """With every request's max_draft at most 2, the block runs 3 positions (2 + one spare),
    and the drafts are the greedy argmax over that trimmed block; trim_block=False runs it whole."""
    model = tiny_model()
    dr = DSparkDrafter(model, DSparkDrafterConfig(initial_capacity=4, trim_block=trim), "dspark")
    g = torch.Generator().manual_seed(8)
    hid = torch.randn(2, 6, 3 * D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (2, 7), generator=g)
    dr.observe([AcceptedContext(f"r{i}", ids[i, :6].tolist(), 0, hid[i]) for i in range(2)])
    reqs = [DraftRequest(f"r{i}", ids[i].tolist(), 3, GREEDY, None, k) for i, k in ((0, 2), (1, 1))]
    shapes = []
    block_hidden = dr.block_hidden
    monkeypatch.setattr(dr, "block_hidden", lambda b, n=None: shapes.append(n) or block_hidden(b, n))
    p0, p1 = dr.propose(reqs)
    assert shapes == [3 if trim else None] and len(p0) == 2 and len(p1) == 1
    hidden = block_hidden(reqs, 3 if trim else None)
    assert hidden.shape[1] == (3 if trim else BS)
    logits = model.block_logits(hidden[:1, :2], torch.cat([ids[0, -1:], p0.tokens[:1]])[None])[0]
    assert logits.argmax(-1).tolist() == p0.tokens.tolist()


@pytest.mark.parametrize("truncated", [False, True])
def test_greedy_markov_walk_in_c_equals_the_torch_walk(truncated):
    """The all-greedy block in one C call: the same tokens and prev tokens as sample_block's
    torch loop, with and without a draft-to-target map; more rows than it takes fall back."""
    from dspark_serve.drafter.dspark_model.fast import GreedyMarkov
    from dspark_serve.drafter.dspark_model.sampling import sample_block

    lib = load_kernels()
    if lib is None:
        pytest.skip("the greedy walk needs the C kernels (a C compiler)")
    model = tiny_model().float()
    head = model.markov_head
    assert GreedyMarkov.applies(head, torch.float32, torch.device("cpu"))
    assert not GreedyMarkov.applies(head, torch.float64, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    Vd = 40 if truncated else V
    d2t = torch.randperm(V, generator=g)[:Vd] if truncated else None
    if truncated:  # the head writes draft-vocabulary logits
        head.markov_w2 = torch.nn.Linear(head.rank, Vd, bias=False)
        torch.nn.init.normal_(head.markov_w2.weight, std=3.0, generator=g)
    walk = GreedyMarkov(lib, head, d2t)
    to_target = (lambda t: t) if d2t is None else (lambda t: d2t[t])
    for b in (1, 2):
        base = torch.randn(b, BS, Vd, generator=g)
        anchor = torch.randint(0, V, (b,), generator=g)
        want = sample_block(base, anchor, [GREEDY] * b, [None] * b, head, to_target)
        got = sample_block(base, anchor, [GREEDY] * b, [None] * b, head, to_target, greedy=walk)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.prev_tokens, want.prev_tokens)
        assert got.probs is None
    assert walk(torch.randn(5, BS, Vd), torch.zeros(5, dtype=torch.long)) is None  # 5 rows: torch's
    # bf16: the walk runs in float32 over the (exactly upcast) weights and logits: the float32
    # walk's tokens
    half = copy.deepcopy(head).bfloat16()
    assert GreedyMarkov.applies(half, torch.bfloat16, torch.device("cpu"))
    walk16 = GreedyMarkov(lib, half, d2t)
    up = copy.deepcopy(half).float()
    base = torch.randn(2, BS, Vd, generator=g).bfloat16()
    anchor = torch.randint(0, V, (2,), generator=g)
    want = sample_block(base.float(), anchor, [GREEDY] * 2, [None] * 2, up, to_target)
    got = sample_block(base, anchor, [GREEDY] * 2, [None] * 2, half, to_target, greedy=walk16)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.prev_tokens, want.prev_tokens)
    dr = make_drafter(model)
    assert dr._greedy is not None  # a float32 drafter on a CPU with the kernels uses it


@pytest.mark.parametrize("truncated", [False, True])
def test_greedy_tail_in_one_c_call_equals_head_walk_and_confidence(truncated):
    """bf16 all-greedy blocks of a few rows: the LM head, the Markov walk and the confidence
    logits in one C call give the walk's tokens and prev tokens over the packed head's logits,
    bit for bit, and FastConfidence's logits to float32 rounding (the sum runs in C); a drafter
    uses it for greedy requests only, with the same drafts as without it."""
    from dspark_serve.drafter.dspark_model.fast import FastConfidence, GreedyMarkov, GreedyTail
    from dspark_serve.ops.linear import make_linear

    lib = load_kernels()
    if lib is None:
        pytest.skip("the greedy tail needs the C kernels (a C compiler)")
    model = tiny_model().bfloat16()
    g = torch.Generator().manual_seed(4)
    Vd = 40 if truncated else V
    d2t = torch.randperm(V, generator=g)[:Vd] if truncated else None
    head = model.markov_head
    if truncated:
        head.markov_w2 = torch.nn.Linear(head.rank, Vd, bias=False).bfloat16()
        torch.nn.init.normal_(head.markov_w2.weight, std=3.0, generator=g)
    lm = make_linear(torch.randn(Vd, D, generator=g).bfloat16(), None, "auto", "none", gemm_rows=64)
    walk, conf = GreedyMarkov(lib, head, d2t), FastConfidence(model)
    tail = GreedyTail(lib, lm, walk, conf)
    for b in (1, 3):
        hidden = torch.randn(b, BS, D, generator=g).bfloat16()
        anchors = torch.randint(0, V, (b,), generator=g)
        got = tail(hidden, anchors.tolist())
        assert got is not None
        base = lm(hidden.reshape(b * BS, D)).view(b, BS, Vd)
        tokens, prevs = walk(base, anchors)
        assert torch.equal(got[0], tokens) and torch.equal(got[1], prevs)
        torch.testing.assert_close(got[2], conf(hidden, prevs), rtol=1e-5, atol=1e-5)
    assert tail(torch.randn(5, BS, D).bfloat16(), [0] * 5) is None  # more rows than the walk takes

    # through the drafter: greedy requests take the tail, the same drafts as without it
    with_tail, without = make_drafter(tiny_model().bfloat16()), make_drafter(tiny_model().bfloat16())
    if with_tail._tail is None:
        pytest.skip("no packed bf16 LM head on this CPU")
    without._tail = None
    hid = torch.randn(9, 3 * D, generator=g).bfloat16()
    ids = list(range(1, 10))
    for dr in (with_tail, without):
        dr.observe([AcceptedContext("a", ids, 0, hid)])
    calls = []
    inner = with_tail._tail
    with_tail._tail = lambda h, a: calls.append(1) or inner(h, a)
    req = DraftRequest("a", ids + [3], 3, GREEDY, None, 100)
    p, q = with_tail.propose([req])[0], without.propose([req])[0]
    assert calls == [1] and torch.equal(p.tokens, q.tokens)
    torch.testing.assert_close(p.confidences, q.confidences, rtol=1e-4, atol=1e-4)
    hot = SamplingParams(temperature=0.8, seed=1)
    with_tail.propose([DraftRequest("a", ids + [3], 3, hot, torch.Generator().manual_seed(1), 100)])
    assert calls == [1]  # a sampled request draws through sample_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_markov_walk_over_a_wide_head(dtype):
    """A draft vocabulary of thousands (the shipped head's size class): the C walk's bias runs in
    groups of output blocks split across threads, the tail alone; its tokens are the torch
    walk's for one to four rows, and a head whose weights differ in dtype stays on torch."""
    from dspark_serve.drafter.dspark_model.fast import GreedyMarkov
    from dspark_serve.drafter.dspark_model.modules import MarkovHead
    from dspark_serve.drafter.dspark_model.sampling import sample_block

    lib = load_kernels()
    if lib is None:
        pytest.skip("the greedy walk needs the C kernels (a C compiler)")
    g = torch.Generator().manual_seed(3)
    vocab, Vd, K = 3000, 2100, 7  # 2100 = 131 blocks of 16 and a 4-row tail
    cfg = dataclasses.replace(tiny_model().config, vocab_size=vocab, markov_rank=64, draft_vocab_size=Vd)
    head = MarkovHead(cfg).to(dtype)
    with torch.no_grad():
        head.markov_w1.weight.normal_(generator=g)
        head.markov_w2.weight.normal_(std=0.5, generator=g)
    d2t = torch.randperm(vocab, generator=g)[:Vd]
    walk = GreedyMarkov(lib, head, d2t)
    up = copy.deepcopy(head).float()  # the walk's float32 maths over the exactly upcast weights
    for b in (1, 4):
        base = (torch.randn(b, K, Vd, generator=g) * 2).to(dtype)
        anchor = torch.randint(0, vocab, (b,), generator=g)
        want = sample_block(base.float(), anchor, [GREEDY] * b, [None] * b, up, lambda t: d2t[t])
        got = walk(base, anchor)
        assert got is not None
        assert torch.equal(got[0], want.tokens) and torch.equal(got[1], want.prev_tokens)
    mixed = copy.deepcopy(head)
    mixed.markov_w2.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    assert not GreedyMarkov.applies(mixed, dtype, torch.device("cpu"))


@pytest.mark.parametrize("with_markov", [True, False])
def test_fast_confidence_equals_the_head(with_markov):
    """The serving confidence logits (a per-token table for the Markov embedding's share, one
    small product for the hidden's) are the head's, float32 rounding apart; the bias is read
    live; a CPU drafter on the fast backbone uses them."""
    from dspark_serve.drafter.dspark_model.fast import FastConfidence

    model = tiny_model().float()
    if not with_markov:
        cfg = dataclasses.replace(model.config, confidence_head_with_markov=False)
        model = DSparkModel(cfg).eval()
    conf = FastConfidence(model)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, BS, D, generator=g)
    prev = torch.randint(0, V, (3, BS), generator=g)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conf(hidden, prev), model.confidence_logits(hidden, prev), **close)
    with torch.no_grad():
        model.confidence_head.proj.bias.add_(1.5)
    torch.testing.assert_close(conf(hidden, prev), model.confidence_logits(hidden, prev), **close)
    if load_kernels() is not None:
        dr = make_drafter(tiny_model().float())
        assert isinstance(dr.backbone, FastDraftBackbone) and dr.confidence.fast is not None


def test_factories_share_target_modules(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tcfg = Qwen3Config(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(tcfg).eval()
    cfg = DSparkConfig.for_target(
        tcfg,
        num_draft_layers=1,
        block_size=5,
        target_layer_ids=[0, 2],
        mask_token_id=V - 1,
        markov_rank=4,
        markov_head_type="gated",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    save_dspark(DSparkModel(cfg), str(tmp_path))
    dsp = build_drafter("dspark", path=str(tmp_path), target_model=target, block_size=3)
    assert dsp.name == "dspark" and dsp.block_size == 3 and dsp.tap_layers == (0, 2)
    assert dsp.model.embed_tokens is target.get_input_embeddings()
    assert dsp.model.lm_head is target.get_output_embeddings()
    assert dsp.model.markov_head is not None
    dfl = build_drafter("dflash", path=str(tmp_path), target_model=target)
    assert dfl.name == "dflash" and dfl.block_size == 5 and dfl.model.markov_head is None
    dsp.observe([AcceptedContext("x", [1, 2, 3], 0, torch.randn(3, 2 * D))])
    (prop,) = dsp.propose([DraftRequest("x", [1, 2, 3, 4], 2, GREEDY, None, 10)])
    assert prop.tokens.shape == (3,) and prop.confidences.shape == (3,)
    with pytest.raises(ValueError, match="exceeds"):
        build_drafter("dspark", path=str(tmp_path), target_model=target, block_size=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_on_cpu_runs_the_fast_backbone_and_matches_the_modules(monkeypatch, dtype):
    """On a CPU (float32 with the C kernels, bf16 with them or with oneDNN's bf16 linear): the
    layers run through the fused backbone (their modules left alone), the heads through packed
    linears; the same maths as the modules, rounding apart."""
    import copy

    import dspark_serve.drafter.dspark as dspark_mod
    from dspark_serve.drafter.dspark_model.fast import prepacked_linears_pay

    if not prepacked_linears_pay(dtype, torch.device("cpu")):
        pytest.skip(f"no packed {dtype} linear on this CPU (no C compiler, no oneDNN bf16)")
    model = tiny_model().to(dtype)
    plain_model = copy.deepcopy(model)
    fast = make_drafter(model)
    assert isinstance(fast.backbone, FastDraftBackbone)
    layer_linears = {id(m) for m in [*model.layers.modules(), model.fc]}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            assert isinstance(m.forward, dspark_mod._Packed) == (id(m) not in layer_linears)
    monkeypatch.setattr(dspark_mod, "_prepack_linears", lambda m, skip=(): None)
    monkeypatch.setattr(dspark_mod, "fast_backbone_applies", lambda m: False)
    plain = make_drafter(plain_model)
    assert plain.backbone is plain_model
    hid = torch.randn(9, 3 * D, generator=torch.Generator().manual_seed(5)).to(dtype)
    ids = list(range(1, 10))
    for dr in (fast, plain):
        dr.observe([AcceptedContext("a", ids, 0, hid)])
    req = DraftRequest("a", ids + [3], 3, GREEDY, None, 100)
    a, b = fast.block_hidden([req]).float(), plain.block_hidden([req]).float()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert len(fast.propose([req])[0]) == BS
