"""Tests that run Triton's kernels: on a GPU, or on the CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU and installs the fixed-order
`tl.dot` below).

Why the interpreter's own `tl.dot` is replaced: it is `np.matmul`, so a product's summation
order is whatever the BLAS kernel numpy loaded picks, and OpenBLAS's Haswell sgemm (the one every
AVX2-only CPU gets) sums a row's products differently depending on where the row sits in the
tile (its main and edge micro-kernels differ): the same row times the same [K, N] operand, in a
call of the same shape, gives other bits in row 0 than in row 6. A batch-invariance test run on
that emulation then fails for a reason that is not the kernel's. On a GPU every row of one
`tl.dot` is reduced by the same instruction sequence, so the emulation that proves the kernel's
property is one whose order depends on nothing but K: `fixed_order_dot` accumulates k = 0..K-1
one product at a time (each product rounded, then added: no fused multiply-add), in float32,
the same for every row and column of every call. It also reads bfloat16 operands as numbers
(the interpreter stores them as uint16 bit patterns, which `np.matmul` would multiply as
integers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dspark_serve.ops import triton_attention

# The dtypes the Triton kernels are tested in (a GPU serves bf16 or fp16; float32 checks the
# arithmetic at float32 tolerance).
each_dtype = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)


def needs_triton() -> None:
    """Skip the calling test where Triton can run nothing (not installed; a CPU without the
    interpreter)."""
    pytest.importorskip("triton")
    if not triton_attention.available():
        pytest.skip("Triton needs CUDA or its interpreter (TRITON_INTERPRET=1)")


def _as_float32(handle: Any) -> np.ndarray:
    """An interpreter tensor's values as float32 (bf16's uint16 patterns widened exactly)."""
    import triton.language as tl

    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc [..., M, N] float32 plus a [..., M, K] @ b [..., K, N], summed k = 0..K-1 in order for
    every output element: the result of a row depends on that row, b and acc alone."""
    out = acc.astype(np.float32, copy=True)
    for k in range(a.shape[-1]):
        out += a[..., k : k + 1] * b[..., k : k + 1, :]
    return out


def install_fixed_order_dot() -> bool:
    """Make the interpreter's `tl.dot` `fixed_order_dot` for float operands (integer dots keep the
    interpreter's exact integer matmul). False where Triton or its interpreter is absent."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_dot, "fixed_order", False):
        return builder is not None
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if not (a.dtype.scalar.is_floating() and b.dtype.scalar.is_floating()):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = fixed_order_dot(_as_float32(a), _as_float32(b), d.data)
        return interpreter.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    create_dot.fixed_order = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True
