"""The Triton paged-attention kernel against a float64 dense reference, on random layouts.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) with the suite's fixed-order `tl.dot` (tests/triton_interpreter.py), in bf16,
fp16 and float32 (IEEE products, so float32 parity is claimed at float32 tolerance)."""

from __future__ import annotations

import random

import pytest
import torch

from dspark_serve.ops import triton_attention as ta
from dspark_serve.ops.triton_launch import tile_shape
from tests.helpers import dense_attention
from tests.triton_interpreter import each_dtype, needs_triton

needs_triton()

DEVICE = "cuda" if torch.cuda.is_available() and not ta.interpreted() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def random_step(rng, dtype, H, Hkv, D, block_size, qlens):
    """A step of segments with query counts `qlens` at random context lengths, each on blocks
    scattered over a pool full of garbage -> (q, k_cache, v_cache, segments, per-segment keys)."""
    starts = [
        rng.choice([0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 45]) for _ in qlens
    ]
    nblk = [-(-(s + n) // block_size) for s, n in zip(starts, qlens)]
    pool = list(range(sum(nblk) + 5))
    rng.shuffle(pool)
    tables, at = [], 0
    for nb in nblk:
        tables.append(pool[at : at + nb])
        at += nb
    width = max(max(nblk), 1)
    slots = len(pool) * block_size
    kc = torch.randn(Hkv, slots, D, dtype=dtype)  # garbage where no segment has keys
    vc = torch.randn(Hkv, slots, D, dtype=dtype)
    keys = []
    for s, n, table in zip(starts, qlens, tables):
        ctx = s + n
        pos = torch.arange(ctx)
        slot = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        keys.append((kc[:, slot].transpose(0, 1), vc[:, slot].transpose(0, 1)))
    T = sum(qlens)
    q = torch.randn(T, H, D, dtype=dtype)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(
        len(qlens), width
    )
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    segs = ta.VarlenSegments(
        cu_q=cu.to(DEVICE),
        starts=torch.tensor(starts, dtype=torch.int32).to(DEVICE),
        table=table.to(DEVICE),
        num_tokens=T,
        max_query_len=max(qlens),
    )
    return q, kc, vc, segs, starts, keys


LAYOUTS = [
    # (H, Hkv, D, block size, query counts): decode, verify, prefill chunks, mixed, empty segments
    (4, 4, 16, 16, [1, 1, 1]),
    (8, 2, 32, 16, [8, 1, 3, 8]),
    (6, 2, 24, 4, [0, 5, 1, 0, 2]),  # a group of 3, head dim not a power of two, empty queries
    (8, 1, 16, 1, [17, 1]),  # one kv head; one-slot blocks
    (4, 2, 64, 8, [40, 2, 7]),  # a prefill chunk beside verify blocks (the tall tile)
    (2, 2, 16, 32, [1]),
]


@each_dtype
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_kernel_matches_dense_reference(layout, dtype):
    H, Hkv, D, bs, qlens = LAYOUTS[layout]
    rng = random.Random(layout)
    torch.manual_seed(layout)
    q, kc, vc, segs, starts, keys = random_step(rng, dtype, H, Hkv, D, bs, qlens)
    scale = D**-0.5
    out = torch.full_like(q, float("nan")).to(DEVICE)
    ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), out, segs, bs, scale)
    out = out.cpu()
    row = 0
    for n, st, (k, v) in zip(qlens, starts, keys):
        if n:
            want = dense_attention(q[row : row + n], k, v, st, scale)
            got = out[row : row + n].reshape(n, -1).double()
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype])
        row += n


def test_rows_outside_the_step_are_untouched():
    """The kernel writes exactly the step's rows: a padded out buffer keeps its sentinel."""
    rng = random.Random(9)
    q, kc, vc, segs, _, _ = random_step(rng, torch.float32, 4, 2, 16, 4, [3, 1])
    out = torch.full((8, 4, 16), 7.0)
    ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), out.to(DEVICE)[:4], segs, 4, 0.25)
    assert torch.equal(out[4:], torch.full((4, 4, 16), 7.0))


def test_a_broken_mask_is_caught():
    """The reference check can fail: a step whose positions are shifted by one (every query
    sees one key too many) does not match."""
    rng = random.Random(3)
    q, kc, vc, segs, starts, keys = random_step(rng, torch.float32, 4, 2, 16, 4, [4])
    shifted = ta.VarlenSegments(segs.cu_q, segs.starts + 1, segs.table, segs.num_tokens, segs.max_query_len)
    out = torch.empty_like(q).to(DEVICE)
    ta.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), out, shifted, 4, 0.25)
    want = dense_attention(q, *keys[0], starts[0], 0.25)
    assert not torch.allclose(out.cpu().reshape(len(q), -1).double(), want, atol=1e-3)


def test_tile_shapes():
    assert tile_shape(4, 1) == (16, 4)  # decode: 4 heads of one kv head, 4 tokens a tile
    assert tile_shape(4, 4) == (16, 4)  # a verify block fits the small tile
    assert tile_shape(4, 8) == (64, 16)  # longer: the tall tile
    assert tile_shape(3, 1) == (16, 5)  # a group of 3: 5 tokens, the 16th row unused
    assert tile_shape(32, 1) == (32, 1)
    with pytest.raises(ValueError, match="multiple"):
        q = torch.zeros(1, 3, 16)
        ta.paged_attention(q, torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), q, None, 4, 1.0)  # type: ignore[arg-type]


@each_dtype
def test_fused_elementwise_kernels_match_torch(dtype):
    """add + RMSNorm, SiLU-mul and rotary with the K/V write against torch's ops (float64)."""
    torch.manual_seed(4)
    tol = TOLERANCE[dtype] * 5
    E = ta.TritonElementwise(num_heads=4, num_kv_heads=2, head_dim=16)
    T, d = 5, 48
    h, delta, w = (
        torch.randn(T, d, dtype=dtype),
        torch.randn(T, d, dtype=dtype),
        torch.rand(d, dtype=dtype) + 0.5,
    )
    h0 = h.clone()
    hd, out = h.to(DEVICE), None
    out = E.add_rmsnorm(hd, delta.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    s = (h0.double() + delta.double()).to(dtype).double()  # the add rounds to the dtype, as torch's
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(hd.cpu(), s.to(dtype))  # h updated in place
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol * 10)
    first = E.add_rmsnorm(h0.to(DEVICE), None, w.to(DEVICE), 1e-6).cpu()  # no residual: the norm
    x = h0.double()
    torch.testing.assert_close(
        first.double(),
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(),
        rtol=0,
        atol=tol * 10,
    )

    gu = torch.randn(T, 2 * 40, dtype=dtype)
    g, u = gu.double().chunk(2, dim=-1)
    torch.testing.assert_close(
        E.silu_mul(gu.to(DEVICE)).cpu().double(), torch.nn.functional.silu(g) * u, rtol=0, atol=tol * 10
    )

    q, k, v = (
        torch.randn(T, 4, 16, dtype=dtype),
        torch.randn(T, 2, 16, dtype=dtype),
        torch.randn(T, 2, 16, dtype=dtype),
    )
    ang = torch.rand(T, 8, dtype=torch.float64) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)  # rotate_half's sign folded in
    kc, vc = torch.zeros(2, 12, 16, dtype=dtype), torch.zeros(2, 12, 16, dtype=dtype)
    slots = torch.tensor([7, 0, 11, 3, 5])
    qd, kcd, vcd = q.clone().to(DEVICE), kc.clone().to(DEVICE), vc.clone().to(DEVICE)
    E(
        qd,
        k.to(DEVICE),
        v.to(DEVICE),
        cos.to(dtype).to(DEVICE),
        sin.to(dtype).to(DEVICE),
        slots.to(DEVICE),
        kcd,
        vcd,
    )
    c, s_ = cos.to(dtype).double()[:, None], sin.to(dtype).double()[:, None]
    rot = lambda x: x.double() * c + torch.roll(x.double(), 8, dims=-1) * s_
    torch.testing.assert_close(qd.cpu().double(), rot(q), rtol=0, atol=tol * 10)
    torch.testing.assert_close(kcd.cpu()[:, slots].transpose(0, 1).double(), rot(k), rtol=0, atol=tol * 10)
    assert torch.equal(vcd.cpu()[:, slots].transpose(0, 1), v)
    untouched = [i for i in range(12) if i not in slots.tolist()]
    assert not kcd.cpu()[:, untouched].any() and not vcd.cpu()[:, untouched].any()
