"""The Triton interpreter's `tl.dot` as the suite runs it (tests/triton_interpreter.py): summed
in one fixed order, so a row's bits never depend on where it sits in the tile or on the BLAS
kernel numpy loaded, and bf16 operands read as numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.triton_interpreter import fixed_order_dot, needs_triton


@pytest.mark.parametrize("shape", [(64, 32, 16), (64, 64, 64), (16, 80, 48)])
def test_a_rows_products_do_not_depend_on_its_place_in_the_tile(shape):
    M, K, N = shape
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    acc = rng.standard_normal((M, N)).astype(np.float32)
    full = fixed_order_dot(a, b, acc)
    for i in range(M):
        alone = np.zeros_like(a)
        alone[M - 1 - i] = a[i]  # the row elsewhere, its neighbours zero
        moved_acc = np.zeros_like(acc)
        moved_acc[M - 1 - i] = acc[i]
        assert np.array_equal(fixed_order_dot(alone, b, moved_acc)[M - 1 - i], full[i]), i
    ref = a.astype(np.float64) @ b.astype(np.float64) + acc
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-4)
    # batched operands ([..., M, K] @ [..., K, N]) sum the same way per batch entry
    both = fixed_order_dot(np.stack([a, a[::-1]]), np.stack([b, b]), np.stack([acc, acc[::-1]]))
    assert np.array_equal(both[0], full) and np.array_equal(both[1], full[::-1])


def test_the_interpreter_runs_the_fixed_order_dot_on_bf16_and_fp16():
    """A kernel's `tl.dot` under the interpreter: bf16 operands give their product (the stock
    interpreter multiplies bf16's stored bit patterns as integers), fp16 too, each row the bits
    of the fixed order."""
    needs_triton()
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the real tl.dot")
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpreterBuilder.create_dot, "fixed_order", False)

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(16, 32, generator=g).to(dtype)
        b = torch.randn(32, 16, generator=g).to(dtype)
        c = torch.empty(16, 16)
        dot_kernel[(1,)](a, b, c, 16, 32, 16)
        want = fixed_order_dot(a.float().numpy(), b.float().numpy(), np.zeros((16, 16), np.float32))
        assert np.array_equal(c.numpy(), want), dtype
        torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)
