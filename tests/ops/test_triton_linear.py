"""The batch-invariant Triton linear (a GPU's products in a batch-invariant forward) and the
Triton attention's invariant tile shape: a row's outputs are the same bits whatever the row
count or the step, and close to torch's.

Without a GPU the kernels run under Triton's interpreter with the suite's fixed-order `tl.dot`
(tests/triton_interpreter.py: a row's sums do not depend on the BLAS kernel numpy loaded), in
bf16, fp16 and float32; a GPU run checks them on the hardware (bench/gpu_suite.py)."""

from __future__ import annotations

import random

import pytest
import torch

from dspark_serve.ops import triton_attention as ta
from dspark_serve.ops.triton_launch import tile_shape
from dspark_serve.ops.triton_linear import BLOCK_M, InvariantTritonLinear
from tests.ops.test_triton_attention import DEVICE, random_step
from tests.triton_interpreter import each_dtype, needs_triton

needs_triton()


@each_dtype
def test_rows_do_not_depend_on_the_row_count(dtype):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 80, generator=g) * 0.1).to(dtype).to(DEVICE)  # N and K not tile multiples
    b = torch.randn(96, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(2 * BLOCK_M + 3, 80, generator=g).to(dtype).to(DEVICE)
    lin, wide = InvariantTritonLinear(w, b), InvariantTritonLinear(w, b, float_out=True)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(6)])
    for M in (2, 5, BLOCK_M, BLOCK_M + 1, 2 * BLOCK_M + 3):
        assert torch.equal(lin(x[:M])[:6], alone[:M]), M
    # rows past the first tile: the same bits as in a call of their own
    assert torch.equal(lin(x)[BLOCK_M + 1 : BLOCK_M + 3], lin(x[BLOCK_M + 1 : BLOCK_M + 3]))
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lin(x).double(), ref, rtol=tol, atol=tol)
    out = wide(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4 if dtype == torch.float32 else 2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="batch-invariant"):
        lin(x[:, :40])


def test_attention_rows_in_the_invariant_tile_do_not_depend_on_the_step():
    """With one tile shape for every step, a verify block's rows are the decode steps' bits
    at their positions, alone or beside a prefill chunk."""
    rng = random.Random(4)
    torch.manual_seed(4)
    H, Hkv, D, bs = 8, 2, 32, 4
    q, kc, vc, segs, starts, _ = random_step(rng, torch.float32, H, Hkv, D, bs, [6])
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)

    def run(qs, cu, st, table, max_q):
        out = torch.full_like(qs, float("nan")).to(DEVICE)
        s = ta.VarlenSegments(
            cu_q=torch.tensor(cu, dtype=torch.int32).to(DEVICE),
            starts=torch.tensor(st, dtype=torch.int32).to(DEVICE),
            table=table.to(DEVICE),
            num_tokens=len(qs),
            max_query_len=max_q,
        )
        ta.paged_attention(qs.to(DEVICE), kc, vc, out, s, bs, D**-0.5, invariant=True)
        return out.cpu()

    table = segs.table.cpu()
    block = run(q, [0, 6], starts, table, 6)
    for i in range(6):
        assert torch.equal(run(q[i : i + 1], [0, 1], [starts[0] + i], table, 1), block[i : i + 1]), i
    long_q = torch.randn(20, H, D)  # a prefill chunk of 20 tokens: 5 blocks of the pool's own
    width = max(5, table.shape[1])
    wide = torch.zeros(2, width, dtype=torch.int32)
    wide[0, :5] = torch.arange(5, dtype=torch.int32)
    wide[1, : table.shape[1]] = table[0]
    assert kc.shape[1] >= 5 * bs  # every block the chunk's table names lies in the pool
    both = run(torch.cat([long_q, q]), [0, 20, 26], [0, starts[0]], wide, 20)
    assert torch.equal(both[20:], block)
    assert tile_shape(4, 1, invariant=True) == tile_shape(4, 64, invariant=True) == (64, 16)
